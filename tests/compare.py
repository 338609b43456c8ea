"""How the tests compare a fast path's outputs with eager PyTorch's."""
import torch

from experiments.models import example_input


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b``, in float64 (an all-zero ``b`` counts as tiny)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def assert_matches_eager(fast, model, name: str, batch: int, tol: float, seeds: int = 2) -> None:
    """``fast`` on fresh NCHW inputs of model ``name`` equals ``model`` in eager mode: same
    shape, relative error under ``tol``, for every seed (each a new input)."""
    for seed in range(seeds):
        torch.manual_seed(seed)
        x = example_input(name, batch, "cuda").normal_()
        with torch.no_grad():
            ref = model(x)
        out = fast(x)
        assert out.shape == ref.shape, (name, batch, seed)
        assert rel_err(out, ref) < tol, (name, batch, seed)
