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
  the cost of one event record (:func:`tensile.optimes.step_op_times_ms`).

Both run the step for real, so they update the model: analyse a copy.
"""
from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch import nn

from nimble.streams import critical_path
from tensile.optimes import step_op_times_ms
from tensile.record import record_step
from tensile.step import training_step

__all__ = ["step_limit", "step_op_times_ms", "cached_step_limit"]

OpTimes = Callable[[nn.Module, torch.optim.Optimizer, Sequence, Callable], list[float]]


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
