"""Per-convolution kernel selection: cuDNN or PyTorch's own CUDA kernels (the paper's pass).

The original Nimble timed every ``Conv2d`` of an inference model twice before capture, once
through cuDNN and once through PyTorch's native kernels (im2col + GEMM, or the dedicated
depthwise kernel), and made the faster one that module's forward. At batch 1, small and
depthwise convolutions are where cuDNN's choice is not always the fastest.

How, here:

1. One eager run under ``no_grad`` records the input of every ``nn.Conv2d`` (forward
   pre-hooks). A module called more than once, and dilated convolutions (the paper kept
   those on cuDNN; PyTorch's dilated fallback is slow), stay on cuDNN untimed.
2. Convolutions with the same signature (input shape, strides, dtype, weight shape,
   stride, padding, groups) share one timing: NAS cells repeat the same conv many times.
3. Both candidates are timed by ``timer`` (default :func:`race_calls`: each captured once
   as a CUDA graph of 20 back-to-back calls, the two replayed in turns over three rounds
   under CUDA events, the median per candidate). Native wins only when faster by more than ``margin``, so timing noise does
   not move kernels away from cuDNN.
4. A winning module becomes a :class:`NativeConv2d`, whose forward runs with cuDNN
   disabled (:func:`cudnn_disabled`). The flag is read on the host when ATen picks the
   kernel, so it holds under the trace, the scheduled pre-run and the graph capture alike.
   The module tree is unchanged; the input model is not touched (the pass works on a copy).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .cudagraph import capture_graph
from .trace import as_tuple

__all__ = ["ConvChoice", "NativeConv2d", "select_conv_kernels", "cudnn_disabled", "race_calls",
           "summarize"]


@dataclass
class ConvChoice:
    """The decision for one convolution signature (``count`` modules share it)."""

    signature: str
    count: int
    cudnn_ms: float | None       # per call; None when not timed (kept on cuDNN untimed)
    native_ms: float | None
    native: bool                  # True: these modules run PyTorch's native kernel
    reason: str = ""

    @property
    def speedup(self) -> float | None:
        """cuDNN's time over native's (above 1: native is faster)."""
        if not self.cudnn_ms or not self.native_ms:
            return None
        return self.cudnn_ms / self.native_ms


@contextlib.contextmanager
def cudnn_disabled() -> Iterator[None]:
    """Run the block with cuDNN disabled (PyTorch's native kernels), then restore the flag.

    Only ``torch.backends.cudnn.enabled`` changes: ``torch.backends.cudnn.flags`` would reset
    benchmark, determinism and TF32 to its own defaults too.
    """
    previous = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = previous


def _signature(conv: nn.Conv2d, x: torch.Tensor) -> str:
    return (f"in={tuple(x.shape)}/{tuple(x.stride())} {x.dtype} w={tuple(conv.weight.shape)} "
            f"stride={conv.stride} pad={conv.padding} dil={conv.dilation} groups={conv.groups} "
            f"bias={conv.bias is not None} mode={conv.padding_mode}")


def _graph_of_calls(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (warmed up outside capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):        # warm-up outside capture: cuDNN's algorithm search
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        for _ in range(calls):
            fn()
    return graph


def race_calls(first: Callable[[], Any], second: Callable[[], Any], calls: int = 20,
               rounds: int = 3, replays: int = 10) -> tuple[float, float]:
    """ms per call of two zero-argument callables, each captured once as a CUDA graph of
    ``calls`` back-to-back calls (the paper's method: launch overhead out, as it will be in
    the captured model), the two graphs replayed in turns (:func:`nimble.capture.race_graphs`)."""
    from .capture import race_graphs, release_graph   # capture imports this module

    graphs = [_graph_of_calls(first, calls), _graph_of_calls(second, calls)]
    t_first, t_second = race_graphs(*graphs, rounds, replays)
    for graph in graphs:
        release_graph(graph)
    return t_first / calls, t_second / calls


def _time_both(conv: nn.Conv2d, x: torch.Tensor,
               timer: Callable[[Callable[[], Any], Callable[[], Any]], tuple[float, float]],
               ) -> tuple[float, float]:
    """Per-call ms of ``conv(x)`` through cuDNN and through the native kernels."""
    def with_cudnn():
        return conv._conv_forward(x, conv.weight, conv.bias)

    def native():
        with cudnn_disabled():
            return conv._conv_forward(x, conv.weight, conv.bias)

    return timer(with_cudnn, native)


class NativeConv2d(nn.Conv2d):
    """A ``Conv2d`` that runs with cuDNN disabled: PyTorch's native CUDA kernels.

    The pass turns a plain ``nn.Conv2d`` into this class in place (``__class__``), so the
    module keeps its parameters, its place in the tree and its state-dict keys, and a copy
    of the model (``copy.deepcopy``, pickling) keeps the choice.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        with cudnn_disabled():
            return super().forward(input)


def select_conv_kernels(model: nn.Module, example_inputs, *,
                        timer: Callable[[Callable[[], Any], Callable[[], Any]],
                                        tuple[float, float]] | None = None,
                        margin: float = 0.03) -> tuple[nn.Module, list[ConvChoice]]:
    """Return a copy of ``model`` whose ``Conv2d`` modules each run the faster of cuDNN and
    PyTorch's native kernels for the shapes of ``example_inputs``, and the decisions.

    Args:
        model: an inference model (eval mode) on the device of ``example_inputs``.
        example_inputs: a tensor or tuple of tensors shaped as the calls will be.
        timer: ms per call of two zero-argument callables (cuDNN's, native's); default
            :func:`race_calls` (CUDA). Tests pass their own.
        margin: native must be faster than cuDNN by more than this fraction to be chosen.
    """
    if model.training:
        raise ValueError("conv kernel selection is for inference: call model.eval() first "
                         "(a training step's backward kernels are not timed)")
    if not margin >= 0:
        raise ValueError(f"margin must be a fraction >= 0, got {margin!r}")
    if timer is None:
        if not torch.cuda.is_available():
            raise RuntimeError("conv kernel selection times CUDA kernels; no CUDA device")
        timer = race_calls
    model = copy.deepcopy(model)
    inputs = as_tuple(example_inputs)
    calls: dict[nn.Conv2d, list[str]] = {}      # module -> the signature of each call
    first_input: dict[str, torch.Tensor] = {}   # one input per signature (not per call)

    def record_input(mod, args):
        sig = _signature(mod, args[0])
        calls.setdefault(mod, []).append(sig)
        if sig not in first_input:
            first_input[sig] = args[0].detach().clone()

    hooks = [m.register_forward_pre_hook(record_input)
             for m in model.modules() if type(m) is nn.Conv2d]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()

    # Modules that are reused or dilated get groups of their own: they stay on cuDNN
    # untimed, and must not hold back a plain conv of the same signature.
    groups: dict[str, list[nn.Conv2d]] = {}
    untimed: dict[str, str] = {}
    for conv, sigs in calls.items():
        sig = sigs[0]
        if len(sigs) > 1:
            sig = f"{sig} [reused]"
            untimed[sig] = f"called {len(sigs)} times per forward"
        elif any(d != 1 for d in conv.dilation):
            untimed[sig] = "dilated (kept on cuDNN, as the paper did)"
        groups.setdefault(sig, []).append(conv)

    choices = []
    with torch.no_grad():
        for sig, convs in groups.items():
            if sig in untimed:
                choices.append(ConvChoice(sig, len(convs), None, None, False, untimed[sig]))
                continue
            cudnn_ms, native_ms = _time_both(convs[0], first_input[sig], timer)
            native = native_ms * (1 + margin) < cudnn_ms
            if native:
                for conv in convs:
                    conv.__class__ = NativeConv2d
            choices.append(ConvChoice(sig, len(convs), cudnn_ms, native_ms, native))
    return model, choices


def summarize(choices: list[ConvChoice]) -> str:
    """One line for ``PrepareStats.notes``: how many convolutions left cuDNN, and the gain."""
    total = sum(c.count for c in choices)
    native = [c for c in choices if c.native]
    moved = sum(c.count for c in native)
    saved = sum(c.count * (c.cudnn_ms - c.native_ms) for c in native)
    return (f"conv selection: {moved} of {total} Conv2d run PyTorch's native kernels "
            f"({len(native)} of {len(choices)} signatures), {saved * 1e3:.1f} us per call "
            "less than cuDNN by the per-conv timings")
