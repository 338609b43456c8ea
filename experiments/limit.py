"""The limit of a training step: the "distance to the limit" of issue 8's training rows.

The limit is the heaviest dependency path through one training step (forward, loss,
backward, optimizer), each op weighted by its single-stream GPU time: no stream schedule
can run the step faster. (Inference rows get theirs from Nimble's own task graph,
``baselines.nimble_backend.distance_to_limit``; a training capture has no such graph of
its backward.)

* The dependencies come from TENSILE's recorder (:func:`tensile.record.record_step`): the
  ops of the step and the storages each reads and writes (read-after-write, and in-place
  writes after reads and writes).
* The op times come from one CUDA graph of the same step on one stream, with a timing
  event after every op: the graph runs the ops back to back, so no host launch gap is
  counted (eager timings at CIFAR sizes are mostly gaps). Median over a few replays, less
  the cost of one event record.

Both run the step for real, so they update the model: analyse a copy.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nimble.capture import _event_gap_ms
from nimble.streams import critical_path
from tensile.record import is_counted, record_step
from tensile.step import training_step

__all__ = ["step_limit", "step_op_times_ms", "cached_step_limit"]

OpTimes = Callable[[nn.Module, torch.optim.Optimizer, Sequence, Callable], list[float]]


class _EventAfterEachOp(TorchDispatchMode):
    """Records a timing event after every op the recorder counts (same filter, same order)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[torch.cuda.Event] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_counted(func):
            event = torch.cuda.Event(enable_timing=True, external=True)
            event.record()      # backward ops run on their forward op's stream: the capture's
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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        training_step(model, optimizer, batch, loss_fn)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True, external=True)
    marks = _EventAfterEachOp()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        start.record()
        with marks:
            training_step(model, optimizer, batch, loss_fn)
    samples = []
    for _ in range(repeats):
        graph.replay()
        torch.cuda.synchronize()
        ends = [start, *marks.events]
        samples.append([a.elapsed_time(b) for a, b in zip(ends, ends[1:])])
    gap = _event_gap_ms(torch.cuda.Stream())   # a graph cannot be captured on the default stream
    del graph
    return [max(statistics.median(column) - gap, 0.0) for column in zip(*samples)]


def step_limit(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence,
               loss_fn: Callable, median_ms: float,
               op_times: OpTimes = step_op_times_ms) -> dict:
    """``critical_path_ms`` (the limit), ``kernel_sum_ms`` and ``over_critical_path``
    (``median_ms`` / limit) of one training step of ``model``; it trains ``model``.

    ``op_times(model, optimizer, batch, loss_fn)`` gives the op times (default: the GPU
    profile above); a step whose op count differs from the recorded one is refused.
    """
    training_step(model, optimizer, batch, loss_fn)   # optimizer state exists: ops repeat
    recording = record_step(model, optimizer, batch, loss_fn)
    graph = recording.graph
    times = op_times(model, optimizer, batch, loss_fn)
    if len(times) != graph.num_nodes:
        raise RuntimeError(f"the timed step ran {len(times)} ops, the recorded one "
                           f"{graph.num_nodes}: the step is not the same every time")
    critical, _ = critical_path(graph.num_nodes, graph.edges, times)
    return {"critical_path_ms": round(critical, 4), "kernel_sum_ms": round(sum(times), 4),
            "over_critical_path": round(median_ms / critical, 3) if critical > 0 else None}


_CACHE: dict[tuple, tuple[float, float] | str] = {}   # per process: (critical, sum) or the error


def cached_step_limit(key: tuple, model: nn.Module,
                      make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                      batch: Sequence, loss_fn: Callable, median_ms: float) -> dict:
    """:func:`step_limit` for a row: computed on a copy of ``model`` once per ``key`` in a
    process (the limit is the model's and the batch's, not a backend's), and a failure is
    noted (``limit_error``), not raised: an analysis must not lose the row it annotates."""
    if key not in _CACHE:
        twin = copy.deepcopy(model).train()
        try:
            got = step_limit(twin, make_optimizer(twin), batch, loss_fn, median_ms)
            _CACHE[key] = (got["critical_path_ms"], got["kernel_sum_ms"])
        except Exception as e:  # noqa: BLE001 - see the docstring
            _CACHE[key] = f"{type(e).__name__}: {e}"[:300]
        del twin
    cached = _CACHE[key]
    if isinstance(cached, str):
        return {"limit_error": cached}
    critical, total = cached
    return {"critical_path_ms": critical, "kernel_sum_ms": total,
            "over_critical_path": round(median_ms / critical, 3) if critical > 0 else None}
