"""Single-stream GPU time of every op of one training step, in the recorder's op order.

The step is captured into one CUDA graph with a timing event after every op that
:func:`tensile.record.record_step` counts (same filter, same order), and replayed: the
graph runs the ops back to back, so no host launch gap is counted. Eager timings of a
host-bound step are mostly such gaps, which is why a plan for a captured step
(:meth:`tensile.Scheduler.capture`) and the limit of a training step
(:mod:`experiments.limit`) use these times instead.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nimble.capture import _event_gap_ms

from .graph import warmup_stream
from .record import is_counted
from .step import training_step

__all__ = ["step_op_times_ms"]


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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_counted(func):
            event = torch.cuda.Event(enable_timing=True, external=True)
            event.record(self.stream)
            self.events.append(event)
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


def step_op_times_ms(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence,
                     loss_fn: Callable, repeats: int = 5) -> list[float]:
    """Single-stream GPU time (ms) of every counted op of one training step, in op order.

    The optimizer must be capturable (SGD; Adam with ``capturable=True``): the step is
    captured into a CUDA graph, after a warm-up step on a side stream (as
    ``torch.cuda.graph`` requires). A model on the CPU gets each op's wall time instead
    (median over ``repeats`` steps).
    """
    if next(model.parameters()).device.type == "cpu":
        runs = []
        for _ in range(repeats):
            with _CpuTimeOfEachOp() as mode:
                training_step(model, optimizer, batch, loss_fn)
            runs.append(mode.ms)
        return [statistics.median(column) for column in zip(*runs)]
    side = warmup_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        training_step(model, optimizer, batch, loss_fn)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True, external=True)
    marks = _EventAfterEachOp(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
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
    return [max(statistics.median(column) - gap, 0.0) for column in zip(*samples)]
