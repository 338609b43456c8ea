"""What cutting one large weight's update into row slices costs, each piece captured alone.

    python -m experiments.slice_cost --model vgg16 --batch 16 --slice-mb 32,64

``tensile.stream_optimizer(slice_mb=...)`` updates a large weight (VGG-16's fc6: 392 MiB) a
slice of rows at a time: each slice gets its own rows of the deferred weight gradient
(``grad_out[:, r0:r1].T @ input``, :mod:`tensile.defer`) and its own call of the optimizer's
``step``. The bytes are those of one update; what slicing adds comes per call: every row
product's and every kernel's ramp, and for foreach Adam with ``capturable=True`` the dozen
small kernels on its step counts that each call runs. This experiment times those pieces
alone on the model's largest ``nn.Linear`` weight, as the streamed step runs them (one CUDA
graph per case, replayed: CUDA events, ``--warmup`` replays, ``--iters`` timed):

- ``row_products``: the whole product, then the same rows one slice at a time. ``rows_equal``
  says whether the slices' rows are the whole product's bit for bit (the streamed step
  relies on it).
- ``adam`` / ``adam_fused``: Adam's update of the weight (foreach / fused, ``capturable=True``
  on CUDA) as one call, then one call per slice, each slice its own tensor and state.

Slices are cut as the streamed optimizer cuts them (:func:`tensile.streamed.row_slices`).
Rows go to ``<results>/<gpu>/slice_cost.csv``; the report prints them. ``--device cpu`` runs
the same cases uncaptured (no timing worth reading: tests and a dry run).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from nimble.cudagraph import capture_graph
from tensile.graph import warmup_stream
from tensile.streamed import row_slices

from .cli import model_list
from .env import environment, gpu_name, gpu_slug, host_load
from .models import build_model
from .store import append_table_row
from .timing import measure

REPO_ROOT = Path(__file__).resolve().parent.parent
MB = 2**20
CASES = ("row_products", "adam", "adam_fused")


def largest_linear(model: torch.nn.Module) -> tuple[str, torch.nn.Linear]:
    """The ``nn.Linear`` of ``model`` with the most weight elements, and its name."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer: nothing to slice")
    return max(linears, key=lambda nm: nm[1].weight.numel())


def _replayed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` captured as one CUDA graph, returned as its replay; on a CPU ``fn`` itself.
    Warmed up first (cuBLAS and the optimizer make their handles and state lazily, which a
    capture refuses), warm-ups and capture on TENSILE's one warm-up stream
    (:func:`tensile.graph.warmup_stream`: a fresh stream per case would leave a cuBLAS
    workspace behind each time)."""
    if device.type != "cuda":
        return fn
    side = warmup_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph, stream=side):
        fn()
    return graph.replay


def _row_products(grad_out: torch.Tensor, inp: torch.Tensor,
                  cuts: list[tuple[int, int]]) -> Callable[[], list[torch.Tensor]]:
    """The deferred weight gradient's rows, slice by slice, as :mod:`tensile.defer` makes
    them (one slice from 0 to all rows: the whole product)."""
    return lambda: [grad_out[:, r0:r1].t().mm(inp) for r0, r1 in cuts]


def _adam_calls(shape: tuple[int, int], cuts: list[tuple[int, int]], fused: bool,
                device: torch.device) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """Adam's update of a ``shape`` weight as one ``step`` call per slice of rows, each slice
    its own tensor with its own optimizer and state (made by one step here): the rows of
    one weight and one gradient, so the slices update as one call would. Returns the calls
    and the slices."""
    cuda = device.type == "cuda"
    grad = torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(0))
    optimizers = []
    for r0, r1 in cuts:   # each slice the weight's rows r0:r1 and their gradient
        piece = torch.zeros((r1 - r0) * shape[1], device=device, requires_grad=True)
        piece.grad = grad[r0:r1].flatten().clone()
        opt = torch.optim.Adam([piece], capturable=cuda, fused=fused or None, foreach=not fused)
        opt.step()
        optimizers.append(opt)

    def step() -> None:
        for opt in optimizers:
            opt.step()
    return step, [opt.param_groups[0]["params"][0] for opt in optimizers]


def measure_slices(shape: tuple[int, int], batch: int, slice_mbs: list[float], *,
                   device: str | torch.device = "cuda", warmup: int = 20,
                   iters: int = 100, progress: bool = True) -> list[dict]:
    """The rows of :func:`main` for a ``(rows, cols)`` fp32 weight fed ``batch`` inputs: each
    of :data:`CASES`, whole and in slices of about each of ``slice_mbs`` MiB."""
    device = torch.device(device)
    rows, cols = shape
    gen = torch.Generator(device=device).manual_seed(0)
    grad_out = torch.randn(batch, rows, device=device, generator=gen)
    inp = torch.randn(batch, cols, device=device, generator=gen)
    settings = [(None, [(0, rows)])] + [(mb, row_slices(rows, cols * 4, max(1, int(mb * MB))))
                                        for mb in slice_mbs]
    whole = grad_out.t().mm(inp)
    out = []
    todo = [(case, mb, cuts) for case in CASES for mb, cuts in settings]
    for case, mb, cuts in tqdm(todo, desc="slice costs", unit="case", disable=not progress):
        if case == "row_products":
            fn = _row_products(grad_out, inp, cuts)
            extra = {"rows_equal": bool(torch.equal(torch.cat(fn()), whole))}
        else:
            fn, _ = _adam_calls(shape, cuts, case == "adam_fused", device)
            extra = {"rows_equal": ""}
        timing = measure(_replayed(fn, device), (), warmup=warmup, iters=iters, device=device)
        out.append({"case": case, "slice_mb": "" if mb is None else mb, "slices": len(cuts),
                    "median_ms": timing.median_ms, "p10_ms": timing.p10_ms,
                    "p90_ms": timing.p90_ms, **extra})
        del fn
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _mib_list(text: str) -> list[float]:
    """``"32,64"`` -> ``[32.0, 64.0]`` (MiB > 0; an argparse ``type``)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"--slice-mb: expected comma-separated MiB > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=model_list, default=["vgg16"],
                        help="a model name (experiments.models)")
    parser.add_argument("--batch", type=int, default=16, help="batch size")
    parser.add_argument("--slice-mb", type=_mib_list, default=[32.0, 64.0],
                        help="slice sizes in MiB of weight, as stream_slice_mb")
    parser.add_argument("--iters", type=int, default=100, help="timed replays (>= 100 for the protocol)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed replays first")
    parser.add_argument("--device", default="cuda", help="cuda (timed) or cpu (a dry run)")
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="results folder")
    args = parser.parse_args(argv)
    if len(args.model) != 1:
        parser.error(f"--model: expected one model, got {args.model}")
    if args.batch < 1:
        parser.error(f"--batch: expected an int >= 1, got {args.batch}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (--device cpu: a dry run)")
    name = args.model[0]
    torch.backends.cuda.matmul.allow_tf32 = False   # the training sweeps' setting
    layer_name, layer = largest_linear(build_model(name))
    shape = tuple(layer.weight.shape)
    found = measure_slices(shape, args.batch, args.slice_mb, device=args.device,
                           warmup=args.warmup, iters=args.iters)
    out = Path(args.results) / gpu_slug(gpu_name(args.device)) / "slice_cost.csv"
    for row in found:
        append_table_row(out, {"model": name, "batch_size": args.batch, "layer_name": layer_name,
                               "weight_shape": "x".join(map(str, shape)), **row,
                               "iters": args.iters, **environment(args.device), **host_load()})
        size = "whole" if row["slice_mb"] == "" else f"{row['slices']} slices of {row['slice_mb']:g} MiB"
        print(f"{name} b{args.batch} {layer_name} {row['case']:12s} {size:22s} "
              f"{row['median_ms']:.3f} ms (p10/p90 {row['p10_ms']:.3f}/{row['p90_ms']:.3f})", flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
