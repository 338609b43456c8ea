"""Baselines that stock PyTorch ships: eager, TorchScript, a plain CUDA graph, Inductor.

Inference callables run under ``torch.no_grad()``. Backends that replay a CUDA graph return
the graph's *static* output tensors: they are overwritten by the next call, so clone what
you keep (the same contract as ``torch.cuda.graph`` and Inductor's CUDA Graph Trees).
"""
from __future__ import annotations

import contextlib
import shutil
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from nimble.cudagraph import capture_graph, gc_paused

from .base import Availability, Backend, BackendUnavailable, register_backend

__all__ = [
    "EagerBackend",
    "TorchScriptBackend",
    "CudaGraphBackend",
    "CudaGraphChannelsLastBackend",
    "InductorBackend",
    "static_graph_fn",
    "WARMUP_ITERS",
    "JIT_FUSERS",
]

WARMUP_ITERS = 3  # before capture: cuDNN algorithm choice, lazy init, allocator warm-up


def _no_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under torch.no_grad() (inference rows must not build autograd graphs)."""

    def run(*inputs: Tensor) -> Any:
        with torch.no_grad():
            return fn(*inputs)

    return run


def static_graph_fn(graph: torch.cuda.CUDAGraph, static_inputs: tuple[Tensor, ...],
                    static_outputs: Any) -> Callable[..., Any]:
    """``fn(*inputs)``: copy inputs into the captured buffers, replay, return the static outputs.

    Inputs must have the captured shapes and dtypes; anything else is a ValueError (a
    graph replays fixed addresses and sizes, so a different shape would read garbage).
    """
    shapes = [(tuple(s.shape), s.dtype) for s in static_inputs]

    def run(*inputs: Tensor) -> Any:
        if len(inputs) != len(static_inputs):
            raise ValueError(f"expected {len(static_inputs)} inputs, got {len(inputs)}")
        for i, (x, s) in enumerate(zip(inputs, static_inputs)):
            if x.shape != s.shape or x.dtype != s.dtype:
                raise ValueError(f"input {i} must be {shapes[i]} as captured, got "
                                 f"{(tuple(x.shape), x.dtype)}")
            if x.data_ptr() != s.data_ptr():
                s.copy_(x)
        graph.replay()
        return static_outputs

    return run


class EagerBackend(Backend):
    """PyTorch as written: the model's own forward, op by op."""

    name = "eager"
    supports_training = True

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        model.train(training)
        return model if training else _no_grad(model)


# TorchScript fusers: "default" leaves PyTorch's settings alone (NNC on CUDA, no fusion on CPU);
# the others are torch.jit.fuser's names ("fuser1" = NNC, which needs an LLVM-enabled torch on CPU).
JIT_FUSERS: tuple[str, ...] = ("default", "none", "fuser0", "fuser1")

# torch.jit.fuser names left out, and why (torch 2.11-2.14).
_REFUSED_FUSERS = {
    "fuser2": "nvFuser is gone from TorchScript: torch.jit.fuser('fuser2') only turns every "
              "fuser off, or is refused by newer torch; use 'none'",
    "fuser3": "oneDNN Graph is CPU-only and failed inside freeze/optimize_for_inference here",
}

# name -> (can_fuse_on_cpu, can_fuse_on_gpu, texpr (NNC) enabled, profiling executor and graph
# optimisation forced on): the flags torch.jit.fuser(name) sets in torch 2.11-2.14 (and oneDNN
# Graph's llga flag off, as it sets too).
_FUSER_FLAGS: dict[str, tuple[bool, bool, bool, bool]] = {
    "none": (False, False, False, False),
    "fuser0": (True, True, False, False),   # legacy fuser
    "fuser1": (True, True, True, True),     # NNC (TensorExpr)
}


def check_jit_fuser(fuser: str) -> str:
    """``fuser`` if it is one of :data:`JIT_FUSERS`; ValueError naming them and ``fuser`` otherwise."""
    if fuser in JIT_FUSERS:
        return fuser
    why = f" ({fuser} left out: {_REFUSED_FUSERS[fuser]})" if fuser in _REFUSED_FUSERS else ""
    raise ValueError(f"torchscript fuser must be one of {', '.join(map(repr, JIT_FUSERS))}; "
                     f"got {fuser!r}{why}")


@contextlib.contextmanager
def jit_fuser(name: str) -> Iterator[None]:
    """Run the block with TorchScript's fuser ``name`` ("default": settings left as they are).

    Sets the same flags as ``torch.jit.fuser(name)`` and restores them after, but skips its
    calls to the removed nvFuser's setters: those print three C++ warnings per use and cost
    ~10 us, too much for a context entered around every timed call.
    """
    if name == "default":
        yield
        return
    cpu, gpu, texpr, profiling = _FUSER_FLAGS[check_jit_fuser(name)]
    C = torch._C
    old = (C._jit_can_fuse_on_cpu(), C._jit_can_fuse_on_gpu(), C._jit_texpr_fuser_enabled(),
           C._jit_llga_enabled())
    if profiling:
        old_executor = C._jit_set_profiling_executor(True)
        old_optimize = C._get_graph_executor_optimize(True)  # sets, returns the old value
    C._jit_override_can_fuse_on_cpu(cpu)
    C._jit_override_can_fuse_on_gpu(gpu)
    C._jit_set_texpr_fuser_enabled(texpr)
    C._jit_set_llga_enabled(False)
    try:
        yield
    finally:
        if profiling:
            C._jit_set_profiling_executor(old_executor)
            C._get_graph_executor_optimize(old_optimize)
        C._jit_override_can_fuse_on_cpu(old[0])
        C._jit_override_can_fuse_on_gpu(old[1])
        C._jit_set_texpr_fuser_enabled(old[2])
        C._jit_set_llga_enabled(old[3])


class TorchScriptBackend(Backend):
    """The Nimble paper's TorchScript baseline: trace + freeze + optimize_for_inference.

    TorchScript is deprecated in PyTorch 2.x (FutureWarnings, silenced here) but still runs.
    ``fuser`` (one of :data:`JIT_FUSERS`) picks the fusion pass of the profiling executor;
    "default" keeps PyTorch's. Anything else is applied around tracing, the warm-up runs and
    every call of the returned function, since the executor may re-specialise on any call.
    On CUDA, NNC (the default) stalled on DenseNet-121's second run; "none" avoids it.
    """

    name = "torchscript"

    def __init__(self, fuser: str = "default"):
        self.fuser = check_jit_fuser(fuser)

    def version(self) -> str:
        base = super().version()
        return base if self.fuser == "default" else f"{base} (torchscript fuser={self.fuser})"

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        self._refuse_training(training)
        model.eval()
        with torch.no_grad(), warnings.catch_warnings(), jit_fuser(self.fuser):
            warnings.simplefilter("ignore", FutureWarning)
            traced = torch.jit.trace(model, example_inputs)
            frozen = torch.jit.freeze(traced)
            optimized = torch.jit.optimize_for_inference(frozen)
            # The profiling executor specialises on the first runs: do them here, not timed.
            for _ in range(WARMUP_ITERS):
                optimized(*example_inputs)
        if self.fuser == "default":
            return _no_grad(optimized)
        fuser = self.fuser

        def run(*inputs: Tensor) -> Any:
            with torch.no_grad(), jit_fuser(fuser):
                return optimized(*inputs)

        return run


class CudaGraphBackend(Backend):
    """What PyTorch ships: the whole forward captured into one CUDA graph on one stream.

    Inference: warm up on a side stream, capture, then each call copies the inputs into
    static buffers and replays. Training: ``torch.cuda.make_graphed_callables`` (forward
    and backward graphs inside an autograd.Function; the caller's loss and optimizer stay
    eager).
    """

    name = "cudagraph"
    supports_training = True
    needs_cuda = True
    channels_last = False   # "cudagraph-cl": whole-step only, the layout ablation of nimble-cl

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        if self.channels_last:
            raise BackendUnavailable(f"{self.name} is for whole-step training only "
                                     "(experiment.mode=whole-step)")
        if example_inputs[0].device.type != "cuda":
            raise BackendUnavailable("cudagraph needs CUDA inputs")
        if training:
            model.train()
            sample = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in example_inputs)
            with gc_paused():
                return torch.cuda.make_graphed_callables(model, sample, num_warmup_iters=WARMUP_ITERS)
        model.eval()
        static_inputs = tuple(x.detach().clone() for x in example_inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(WARMUP_ITERS):
                model(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), capture_graph(graph):  # captures on its own side stream
            static_outputs = model(*static_inputs)
        return static_graph_fn(graph, static_inputs, static_outputs)

    def prepare_step(self, model: nn.Module, example_inputs: tuple[Tensor, Tensor],
                     loss_fn: Callable[[Any, Tensor], Tensor],
                     optimizer: torch.optim.Optimizer) -> Callable[[Tensor, Tensor], Tensor]:
        """PyTorch's documented whole-network capture: forward, loss, backward and
        ``optimizer.step()`` in one graph on one stream (warm-up steps train the model).

        Returns ``step(x, y) -> loss`` (a static tensor overwritten by the next call).
        With ``channels_last`` the model is converted to NHWC in place (the optimizer keeps
        its parameter objects) and the static input is NHWC.
        """
        x, y = (t.detach().clone() for t in example_inputs)
        if self.channels_last:
            model.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        model.train()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_ITERS):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                optimizer.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)   # grads are allocated inside the graph
        with capture_graph(graph):
            static_loss = loss_fn(model(x), y)
            static_loss.backward()
            optimizer.step()

        def step(inputs: Tensor, target: Tensor) -> Tensor:
            x.copy_(inputs)
            y.copy_(target)
            graph.replay()
            return static_loss
        return step


class CudaGraphChannelsLastBackend(CudaGraphBackend):
    """The plain whole-step graph with the model in channels-last: what layout alone gives,
    beside ``nimble-cl`` (layout and streams)."""

    name = "cudagraph-cl"
    channels_last = True


def _cpp_compiler() -> str | None:
    """The C++ compiler Inductor would use on CPU, or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # private; may move
        return get_cpp_compiler()
    except Exception:
        return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


class InductorBackend(Backend):
    """``torch.compile`` with Inductor: mode None (default), "reduce-overhead" (CUDA Graph
    Trees) or "max-autotune" (autotuned templates + CUDA graphs).

    prepare compiles and runs the compiled function WARMUP_ITERS times, so the compile
    time (and, for the CUDA-graph modes, the warm-up and recording runs) lands in
    ``prepare_s``. Inductor's on-disk caches make a second compile of the same model
    faster: compile times are those of the cache state at the time, which the row's
    ``extra.compile_cache`` names (:func:`compile_cache_use`).
    """

    supports_training = True

    def __init__(self, mode: str | None = None):
        if mode not in (None, "reduce-overhead", "max-autotune"):
            raise ValueError(f"mode must be None, 'reduce-overhead' or 'max-autotune', got {mode!r}")
        self.mode = mode
        self.name = {None: "inductor", "reduce-overhead": "inductor-cudagraphs",
                     "max-autotune": "inductor-max-autotune"}[mode]
        self.needs_cuda = mode is not None  # both non-default modes are CUDA-graph modes

    def _check(self, device: torch.device) -> Availability:
        if device.type == "cpu" and _cpp_compiler() is None:
            return Availability(False, "Inductor on CPU needs a C++ compiler (g++/clang++) on PATH")
        return Availability(True)

    def version(self) -> str:
        return f"torch {torch.__version__} (torch.compile mode={self.mode or 'default'})"

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        model.train(training)
        compiled = torch.compile(model, mode=self.mode, dynamic=False)
        graphs = self.mode is not None

        def run(*inputs: Tensor) -> Any:
            if graphs:
                # Marks an iteration boundary for CUDA Graph Trees, so outputs of the previous
                # call may be overwritten instead of raising "accessing tensor output of
                # CUDAGraphs that has been overwritten" in training loops.
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(*inputs)

        fn = run if training else _no_grad(run)
        before = dict(_inductor_counters())
        for _ in range(WARMUP_ITERS):  # compile, then (graph modes) warm up, record, replay
            out = fn(*example_inputs)
            if training:
                _backward_once(out)
        if training:
            model.zero_grad(set_to_none=True)
        fn.extra = compile_cache_use(before, _inductor_counters())
        return fn


def _inductor_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters   # private module; the counters are what logs print
    return dict(counters["inductor"])


def compile_cache_use(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """What Inductor's on-disk caches did during one prepare, for the row's ``extra``: FX-graph
    cache hits and misses, autotuning benchmarks run, and ``compile_cache`` = "warm" (every graph
    came from the cache: ``prepare_s`` is not a cold compile time), "cold" or "mixed"."""
    delta = {k: after.get(k, 0) - before.get(k, 0)
             for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "select_algorithm_autotune")}
    hits, misses = delta["fxgraph_cache_hit"], delta["fxgraph_cache_miss"]
    state = "warm" if hits and not misses else "cold" if misses and not hits else "mixed" if hits else "not used"
    return {"fxgraph_cache_hits": hits, "fxgraph_cache_misses": misses,
            "autotune_benchmarks": delta["select_algorithm_autotune"], "compile_cache": state}


def _backward_once(out: Any) -> None:
    """Backward through the sum of the output tensors, so the compiled backward is built
    inside prepare rather than in the first timed iteration."""
    if isinstance(out, dict):
        out = list(out.values())
    tensors = [out] if isinstance(out, Tensor) else [t for t in out if isinstance(t, Tensor)]
    grads = [t.float().sum() for t in tensors if t.requires_grad]
    if grads:
        torch.stack(grads).sum().backward()


def _inductor_reduce_overhead() -> InductorBackend:
    return InductorBackend("reduce-overhead")


def _inductor_max_autotune() -> InductorBackend:
    return InductorBackend("max-autotune")


register_backend("eager", EagerBackend)
register_backend("torchscript", TorchScriptBackend)
register_backend("cudagraph", CudaGraphBackend)
register_backend("cudagraph-cl", CudaGraphChannelsLastBackend)
register_backend("inductor", InductorBackend)
register_backend("inductor-cudagraphs", _inductor_reduce_overhead)
register_backend("inductor-max-autotune", _inductor_max_autotune)
