"""Single-stream GPU time of every op of one training step, in the recorder's op order, and
the memory each op holds only while it runs; and what rebuilding a batch norm from its
statistics costs beside the op.

The step is captured into one CUDA graph with a timing event after every op that
:func:`tensile.record.record_step` counts (same filter, same order), and replayed: the
graph runs the ops back to back, so no host launch gap is counted. Eager timings of a
host-bound step are mostly such gaps, which is why a plan for a captured step
(:meth:`tensile.Scheduler.capture`) and the limit of a training step
(:mod:`experiments.limit`) use these times instead.

While that graph is captured, the allocator's peak around each op says what the op held
beyond its inputs and outputs: a workspace (cuDNN's for a convolution's backward, 16-32 MiB
on ResNet-50 at b=8-16 on the H200, at the step's peak). A plan that does not count it
peaks that much above its budget (:attr:`tensile.timeline.AccessTimeline.scratch`).
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nimble.capture import _event_gap_ms, replay_ms
from nimble.cudagraph import capture_graph
from nimble.graph import OpNode, TaskGraph

from .fused import batch_norm_act
from .graph import warmup_stream
from .record import is_counted
from .runtime import _BN_TRAINING, _batch_norm_apply
from .step import training_step
from .timeline import base_name

__all__ = ["OpProfile", "batch_norm_rerun_shares", "step_op_profile", "step_op_times_ms"]


class _EventAfterEachOp(TorchDispatchMode):
    """Records a timing event after every op the recorder counts (same filter, same order),
    on ``stream``: the capture's, where forward, backward (autograd runs a backward op on
    its forward op's stream) and the optimizer run.

    Not on the op's current stream: an op issued on a side stream (a streamed optimizer's
    copy on its host→device stream) would put its event on that stream, where it completes
    out of step with its neighbours'; the gaps around it, clamped at zero, then added up to
    twice the step (ResNet-50 with ``tensile.stream_optimizer``: 25.9 ms of op times for a
    12.8 ms step, and a TENSILE allowance twice what was asked). On the capture stream such
    an op takes no time, and the wait for its copy counts in the op that waits.
    """

    def __init__(self, stream: torch.cuda.Stream) -> None:
        super().__init__()
        self.stream = stream
        self.events: list[torch.cuda.Event] = []
        self.scratch: list[int] = []   # per counted op: bytes held only while it ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_counted(func):
            return func(*args, **(kwargs or {}))
        device = self.stream.device
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = func(*args, **(kwargs or {}))
        event = torch.cuda.Event(enable_timing=True, external=True)
        event.record(self.stream)
        self.events.append(event)
        held = max(before, torch.cuda.memory_allocated(device))
        self.scratch.append(max(torch.cuda.max_memory_allocated(device) - held, 0))
        return out


class _CpuTimeOfEachOp(TorchDispatchMode):
    """CPU runs: wall time of every counted op (the ops run synchronously there)."""

    def __init__(self) -> None:
        super().__init__()
        self.ms: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if is_counted(func):
            self.ms.append((time.perf_counter() - t0) * 1e3)
        return out


@dataclass(frozen=True)
class OpProfile:
    """Per counted op of one training step, in op order: ``op_ms``, its single-stream time;
    ``scratch``, ``{op: bytes}`` it held only while it ran, beyond its inputs and outputs
    (ops without are left out; empty on the CPU, whose allocator keeps no statistics)."""

    op_ms: list[float]
    scratch: dict[int, int]


def step_op_times_ms(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence,
                     loss_fn: Callable, repeats: int = 5) -> list[float]:
    """Single-stream GPU time (ms) of every counted op of one training step, in op order
    (:func:`step_op_profile`'s ``op_ms``)."""
    return step_op_profile(model, optimizer, batch, loss_fn, repeats).op_ms


def step_op_profile(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence,
                    loss_fn: Callable, repeats: int = 5) -> OpProfile:
    """Single-stream GPU time (ms) of every counted op of one training step, in op order, and
    the bytes each held only while it ran (module notes).

    The optimizer must be capturable (SGD; Adam with ``capturable=True`` or ``fused=True``):
    the step is captured into a CUDA graph, after a warm-up step on a side stream (as
    ``torch.cuda.graph`` requires). The capture resets the device's peak memory statistics
    (``torch.cuda.reset_peak_memory_stats``) around every op: a peak read across this call
    is lost. A model on the CPU gets each op's wall time instead (median over ``repeats``
    steps) and no scratch.
    """
    if next(model.parameters()).device.type == "cpu":
        runs = []
        for _ in range(repeats):
            with _CpuTimeOfEachOp() as mode:
                training_step(model, optimizer, batch, loss_fn)
            runs.append(mode.ms)
        return OpProfile([statistics.median(column) for column in zip(*runs)], {})
    side = warmup_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        training_step(model, optimizer, batch, loss_fn)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True, external=True)
    marks = _EventAfterEachOp(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph, stream=side):
        start.record()
        with marks:
            training_step(model, optimizer, batch, loss_fn)
    samples = []
    for _ in range(repeats):
        graph.replay()
        torch.cuda.synchronize()
        ends = [start, *marks.events]
        samples.append([a.elapsed_time(b) for a, b in zip(ends, ends[1:])])
    gap = _event_gap_ms(side)   # a graph cannot be captured on the default stream
    del graph
    return OpProfile([max(statistics.median(column) - gap, 0.0) for column in zip(*samples)],
                     {k: b for k, b in enumerate(marks.scratch) if b})


def batch_norm_rerun_shares(graph: TaskGraph, device: torch.device | str,
                            repeats: int = 10, share: float | None = None) -> dict[int, float]:
    """``{op: share}`` for every forward training-mode batch norm of ``graph``: the time of
    rebuilding its output from the batch statistics it returned (what a recompute runs with
    ``Scheduler(..., batch_norm_from_stats=True)``) as a share of the time of the op itself,
    for :attr:`tensile.timeline.AccessTimeline.rerun_share`. Where the next ops on the output
    are a residual ``add_`` and/or a ``relu_`` (``out += identity``, ``ReLU(inplace=True)``),
    the rebuild is the fused one (:func:`tensile.fused.batch_norm_act`) and they get share 0:
    they rerun inside it.

    Both are measured on ``device``, once per distinct input shape, dtype and fused ops, on
    random data: on CUDA each as a CUDA graph of at least ``repeats`` calls (a captured step
    runs them back to back), elsewhere by wall time (median of ``repeats``). Each is timed
    as a step finds its input: the op on one input, which stays in the L2 cache between
    calls as the convolution that just wrote it leaves it in a forward pass; the rebuild on
    the next of enough copies that none is still cached (:func:`cold_copies`), as backward
    finds a tensor written long before. (Timed both warm, the 23 rebuilds of a ResNet-50 plan
    were priced at 0.250 ms and ran 0.287 ms in the step; both cold, the shares came out
    lower still: the op slows down more.) A shape that does not fit in memory now is left
    out: the planner then prices its recompute at the whole op. ``share``: give every batch
    norm that share instead of timing any (a step recorded on the CPU, priced at a share the
    GPU measured: :mod:`experiments.tensile_bounds`).
    """
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    device = torch.device(device)
    measured: dict[tuple, float | None] = {}
    shares = {}
    for node in graph.nodes:
        key = _batch_norm_key(node)
        if key is None:
            continue
        joined = _joined_after(graph, node)
        key = (*key, tuple(name for _, name in joined))
        if key not in measured:
            try:
                measured[key] = share if share is not None else _apply_share(*key, device, repeats)
            except torch.OutOfMemoryError:
                measured[key] = None
        if measured[key] is not None:
            shares[node.index] = measured[key]
            shares.update({k: 0.0 for k, _ in joined})
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return shares


def _batch_norm_key(node: OpNode) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(input shape, dtype) of a forward training-mode batch norm, else None (eval mode
    returns no batch statistics: its saved mean is empty)."""
    if node.phase != "forward" or base_name(node.name) not in _BN_TRAINING:
        return None
    if not node.input_shapes or len(node.output_shapes) < 3:
        return None
    shape = tuple(node.input_shapes[0])
    if len(shape) < 2 or tuple(node.output_shapes[0]) != shape \
            or tuple(node.output_shapes[1]) != (shape[1],):
        return None
    dtype = getattr(torch, node.input_dtypes[0].removeprefix("torch."), None)
    return (shape, dtype) if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _joined_after(graph: TaskGraph, node: OpNode) -> list[tuple[int, str]]:
    """The in-place ops right after batch norm ``node`` that its fused rebuild runs too, as
    the runtime joins them (:func:`tensile.runtime._joined`): ``[(index, "add_")]`` for a
    residual add of a tensor of the same shape, then ``(index, "relu_")``; each must be the
    next op to touch the output, and write nothing else."""
    joined: list[tuple[int, str]] = []
    out = set(node.writes)
    for later in graph.nodes[node.index + 1:]:
        if not out & (set(later.reads) | set(later.writes)):
            continue
        name = base_name(later.name)
        alone = set(later.writes) <= out
        same_shape = later.input_shapes[:2] == [node.input_shapes[0]] * 2
        if name == "add_" and not joined and alone and same_shape:
            joined.append((later.index, name))
            continue
        if name == "relu_" and alone:
            joined.append((later.index, name))
        break
    return joined


def _apply_share(shape: tuple[int, ...], dtype: torch.dtype, joined: tuple[str, ...],
                 device: torch.device, repeats: int) -> float:
    """Time of the rebuild (:func:`tensile.runtime._batch_norm_apply`, or
    :func:`tensile.fused.batch_norm_act` with the ``joined`` in-place ops) over the batch
    norm's own, at ``shape``; at least 1e-3 (no rerun is free)."""
    eps, c = 1e-5, shape[1]
    itemsize = torch.empty((), dtype=dtype).element_size()
    touched = math.prod(shape) * itemsize * (2 if "add_" in joined else 1)
    copies = cold_copies(touched, _l2_bytes(device))
    xs = [torch.randn(shape, dtype=dtype, device=device) for _ in range(copies)]
    residuals = [torch.randn_like(x) for x in xs] if "add_" in joined else [None] * copies
    weight, bias = torch.ones(c, dtype=dtype, device=device), torch.zeros(c, dtype=dtype, device=device)
    running = [torch.zeros(c, dtype=dtype, device=device), torch.ones(c, dtype=dtype, device=device)]
    turn = itertools.cycle(range(copies))   # each rebuild on the next copy: its input cold

    def op():   # the op a training-mode nn.BatchNorm runs (cuDNN's on CUDA), its input warm
        return torch.ops.aten._batch_norm_with_update(xs[0], weight, bias, *running, 0.1, eps)

    _, mean, invstd, _ = op()

    def apply():
        i = next(turn)
        if not joined:
            return _batch_norm_apply(xs[i], weight, bias, mean, invstd, eps)
        return batch_norm_act(xs[i], weight, bias, mean, invstd, eps, residual=residuals[i],
                              relu="relu_" in joined)

    calls = max(repeats, copies)
    op_ms, apply_ms = (_graph_ms(f, calls) if device.type == "cuda" else _wall_ms(f, repeats)
                       for f in (op, apply))
    return max(1e-3, apply_ms / op_ms) if op_ms > 0 else 1.0


def cold_copies(nbytes: int, l2_bytes: int, most: int = 64) -> int:
    """How many copies of an op's inputs (``nbytes`` together) a timing loop cycles through
    so that each call finds its inputs out of an ``l2_bytes`` L2 cache, as in a training
    step, where other tensors passed through the cache since they were written: enough to
    fill the cache twice over, at least 2, at most ``most`` (tiny inputs stay cached, as
    they may in a step); 1 without a cache (``l2_bytes`` 0: the CPU's timing)."""
    if l2_bytes <= 0 or nbytes <= 0:
        return 1
    return max(2, min(most, math.ceil(2 * l2_bytes / nbytes)))


def _l2_bytes(device: torch.device) -> int:
    """The L2 cache of a CUDA ``device`` in bytes (0 elsewhere)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 64 * 2**20)   # older builds: assume 64 MiB


def _graph_ms(fn: Callable[[], object], repeats: int) -> float:
    """GPU time of one call of ``fn``: a CUDA graph of ``repeats`` calls, replayed
    (:func:`nimble.capture.replay_ms`)."""
    side = warmup_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                            # lazy init (cuDNN handles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph, stream=side):
        for _ in range(repeats):
            fn()
    ms = replay_ms(graph, 3) / repeats
    del graph
    return ms


def _wall_ms(fn: Callable[[], object], repeats: int) -> float:
    """Wall time (ms) of one call of ``fn``, median of ``repeats`` after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
