"""How many of a streamed optimizer's groups keep their state on the device (``resident``).

    streamed = tensile.stream_optimizer(opt, groups=16, resident=16)  # nothing streamed yet
    training_step(model, opt, batch, loss_fn)                         # creates the state
    k = tensile.tune_resident(streamed, model, batch, loss_fn, max_overhead=0.05, jobs=2)

Why: :func:`tensile.stream_optimizer` copies each group's state in before its update and out
after it, beside backward's kernels. The first groups backward updates come during its
short start, faster than the copies can carry them, and the compute stream waits (ResNet-50
at b=16: 0.39 of its step with nothing resident, 0.13 with four groups resident). How many
to keep depends on the model, the batch, the link's bandwidth and how many jobs share it, so
it was a knob (``stream_resident``) set by hand per model. Here it is chosen.

How: one step is timed with every group resident (no copies, so no waits): when backward
starts and when each group's update starts, on the GPU (a CUDA graph of the step when the
optimizer is capturable, so no host gaps count; timing events otherwise; wall time on the
CPU). :func:`streaming_delay_ms` then replays the ring of :mod:`tensile.streamed` on those
times for ``k`` resident groups: ``prefetch + 1`` slots, one host→device and one
device→host channel, a group's copy-in waiting for the copy-out of the slot's previous
group, its update for its copy-in, the step's end for the last copy-out. It returns how much
later the step ends. :func:`choose_resident` takes the fewest resident groups whose delay is
within ``max_overhead`` of the step. The replay leaves out what the copies cost beside the
kernels (on the H200 at b=16 it predicted 0.2-0.3 ms where the captured step took 1-2 ms
longer; 0.95 ms of that on Inception-v4 was the ring waiting for the copy out of a slot too
small for the next group, which the ring no longer does), so :func:`tune_resident` then times
the captured step with that choice and, if it is over, bisects towards all resident, timing
each candidate.

``jobs``: that many jobs stream at the same time over one link and share it evenly, so each
copy takes ``jobs`` times as long. Their kernels are taken not to slow each other (as under
MPS, where several small jobs' kernels run side by side). Under time slicing every job's
step stretches too, and this is pessimistic: it keeps more groups resident than needed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from nimble.capture import _event_gap_ms
from nimble.training import is_capturable, step_state_kept

from .estimate import measure_copy_bandwidth
from .graph import GraphStep, warmup_stream
from .planner import COPY_LATENCY_MS
from .step import training_step
from .streamed import StreamedOptimizer, _streamed_key, stream_optimizer

__all__ = ["UpdateTimes", "measure_update_times", "streaming_delay_ms", "choose_resident",
           "tune_resident", "install_streamed", "AUTO", "DEFAULT_STREAM_OVERHEAD"]

AUTO = "auto"   # resident="auto": install_streamed chooses (tune_resident)
# The delay the streaming may add by default, a fraction of the step.
DEFAULT_STREAM_OVERHEAD = 0.05


@dataclass
class UpdateTimes:
    """One step with every group resident, in ms from its start: when backward's first
    gradient came (``begin_ms``), when each group's update started (``update_ms``, by group),
    when the step ended (``step_ms``); ``group_bytes``: each group's streamed state bytes."""

    begin_ms: float
    update_ms: list[float]
    step_ms: float
    group_bytes: list[int]

    def __post_init__(self) -> None:
        if len(self.update_ms) != len(self.group_bytes):
            raise ValueError(f"update_ms has {len(self.update_ms)} groups, group_bytes "
                             f"{len(self.group_bytes)}: one entry per group in both")
        if any(b < 0 for b in self.group_bytes):
            raise ValueError(f"group_bytes must be >= 0, got {self.group_bytes}")
        if not 0 <= self.begin_ms <= min(self.update_ms, default=self.begin_ms) \
                or max(self.update_ms, default=0.0) > self.step_ms:
            raise ValueError(f"expected 0 <= begin_ms <= every update_ms <= step_ms; got "
                             f"begin {self.begin_ms}, updates {self.update_ms}, step {self.step_ms}")


def streaming_delay_ms(times: UpdateTimes, resident: int, *, prefetch: int,
                       h2d_bw: float, d2h_bw: float, latency_ms: float = COPY_LATENCY_MS,
                       jobs: int = 1) -> float:
    """How much later the step of ``times`` ends when the groups from ``resident`` on are
    streamed through ``prefetch + 1`` slots over links of ``h2d_bw``/``d2h_bw`` bytes/s,
    shared evenly by ``jobs`` jobs (see the module notes)."""
    if jobs < 1 or prefetch < 1:
        raise ValueError(f"jobs and prefetch must be >= 1, got jobs={jobs}, prefetch={prefetch}")
    if h2d_bw <= 0 or d2h_bw <= 0:
        raise ValueError(f"bandwidths must be > 0 bytes/s, got h2d {h2d_bw}, d2h {d2h_bw}")
    h2d_ms, d2h_ms = jobs * 1e3 / h2d_bw, jobs * 1e3 / d2h_bw   # ms per byte
    streamed = [g for g in range(resident, len(times.group_bytes)) if times.group_bytes[g]]
    slots = prefetch + 1
    shift = 0.0                    # how late the compute stream runs now
    h2d_free = d2h_free = 0.0      # when each channel's last copy ends
    updated: list[float] = []      # per streamed group: its update's start
    out_end: list[float] = []      # per streamed group: its copy-out's end
    for j, g in enumerate(streamed):
        nbytes = times.group_bytes[g]
        # the first slots fill at backward's start; later a slot is refilled once the
        # update of its previous group was issued and that group's copy-out is done
        issued = times.begin_ms + shift if j < slots else max(updated[j - slots], out_end[j - slots])
        in_end = max(issued, h2d_free) + latency_ms + nbytes * h2d_ms
        h2d_free = in_end
        start = max(times.update_ms[g] + shift, in_end)
        shift = start - times.update_ms[g]
        updated.append(start)
        d2h_free = max(start, d2h_free) + latency_ms + nbytes * d2h_ms
        out_end.append(d2h_free)
    end = max([times.step_ms + shift, *out_end])   # the step waits for its last copies out
    return end - times.step_ms


def choose_resident(times: UpdateTimes, *, prefetch: int, max_overhead: float,
                    h2d_bw: float, d2h_bw: float, latency_ms: float = COPY_LATENCY_MS,
                    jobs: int = 1) -> int:
    """The fewest resident groups (backward's first) whose streaming delays the step by at
    most ``max_overhead`` of it; every group (nothing streamed) when none does."""
    if not 0 <= max_overhead < 1:
        raise ValueError(f"max_overhead must be a fraction of the step in [0, 1), got {max_overhead!r}")
    allowed = max_overhead * times.step_ms
    for k in range(len(times.group_bytes) + 1):
        if streaming_delay_ms(times, k, prefetch=prefetch, h2d_bw=h2d_bw, d2h_bw=d2h_bw,
                              latency_ms=latency_ms, jobs=jobs) <= allowed + 1e-9:
            return k
    return len(times.group_bytes)   # unreachable: k = all streams nothing


def measure_update_times(streamed: StreamedOptimizer, model: nn.Module, batch: Sequence,
                         loss_fn: Callable | None, repeats: int = 5) -> UpdateTimes:
    """Time one training step with every group of ``streamed`` resident (median of
    ``repeats``): see the module notes. The timed steps do not train (model, optimizer state
    and the RNG are put back). The optimizer's state must exist (run one step first)."""
    if streamed.resident != len(streamed.groups):
        raise ValueError(f"measure with every group resident (resident={len(streamed.groups)}), "
                         f"got resident={streamed.resident}: a streamed group's copies would "
                         "count in the times")
    if not any(streamed.optimizer.state.get(p) for g in streamed.groups for p in g.params):
        raise ValueError("the optimizer has no state yet: run one training step first")
    group_bytes = [sum(v.numel() * v.element_size() for p in g.params
                       for key, v in streamed.optimizer.state.get(p, {}).items()
                       if _streamed_key(p, key, v))   # what home_state would stream
                   for g in streamed.groups]
    runs = [_ordered(marks, len(streamed.groups), end)
            for marks, end in step_marks(streamed, model, batch, loss_fn, repeats)]
    med = [sorted(col)[len(col) // 2] for col in zip(*runs)]
    begin, *updates, end = med
    updates = [max(u, begin) for u in updates]
    return UpdateTimes(begin, updates, max(end, *updates, begin), group_bytes)


def tune_resident(streamed: StreamedOptimizer, model: nn.Module, batch: Sequence,
                  loss_fn: Callable | None, *, max_overhead: float = DEFAULT_STREAM_OVERHEAD, jobs: int = 1,
                  h2d_bw: float | None = None, d2h_bw: float | None = None,
                  latency_ms: float = COPY_LATENCY_MS, verify: bool = True) -> int:
    """Measure, choose and set ``streamed``'s resident groups; returns how many stay.
    ``streamed`` must have every group resident and the optimizer its state (one step run).
    Bandwidths are measured unless given (bytes/s).

    ``verify`` (CUDA, capturable optimizer): the choice is then checked on the GPU. The
    captured step is timed with it and with every group resident; when the streaming costs
    more than allowed (the ring's replay leaves out what copies cost beside the kernels:
    on the H200 at b=16, 1-2 ms a step where it predicted 0.2-0.3), a bisection between it
    and all groups finds the fewest resident groups that fit, each candidate timed the same
    way. It only ever keeps more groups than the replay chose. ``streamed.tuned`` records
    the choice, the replay's and the measured delays."""
    if any(g.rows is not None for g in streamed.groups):
        raise ValueError("tune_resident times whole groups: a streamed optimizer with slices "
                         "(slice_mb) takes a number of resident groups instead")
    times = measure_update_times(streamed, model, batch, loss_fn)
    if h2d_bw is None or d2h_bw is None:
        d, h = measure_copy_bandwidth(streamed.device)
        d2h_bw, h2d_bw = d2h_bw or d, h2d_bw or h
        if streamed.cuda:
            torch.cuda.empty_cache()
    link = dict(prefetch=streamed.prefetch, h2d_bw=h2d_bw, d2h_bw=d2h_bw, latency_ms=latency_ms,
                jobs=jobs)
    chosen = k = choose_resident(times, max_overhead=max_overhead, **link)
    measured: dict[int, float] = {}
    if verify and streamed.cuda and is_capturable(streamed.optimizer) and k < len(streamed.groups):
        k, base_ms, measured = _verified(streamed, model, batch, loss_fn, k, max_overhead)
    streamed.set_resident(k)
    streamed.tuned = {"resident": k, "jobs": jobs, "max_overhead": max_overhead,
                      "step_ms": round(times.step_ms, 3),
                      "delay_ms": round(streaming_delay_ms(times, k, **link), 3),
                      "streamed_mb": round(sum(times.group_bytes[k:]) / 2**20, 1),
                      **({"replay_chose": chosen, "captured_step_ms": round(base_ms, 3),
                          "measured_delay_ms": {str(j): round(d, 3) for j, d in measured.items()}}
                         if measured else {})}
    return k


def _verified(streamed: StreamedOptimizer, model: nn.Module, batch: Sequence,
              loss_fn: Callable | None, k: int,
              max_overhead: float) -> tuple[int, float, dict[int, float]]:
    """The fewest resident groups from ``k`` on whose captured step is at most
    ``max_overhead`` slower than with all resident (bisection; all resident fits by
    definition); that step's time, and the delay measured for each candidate (ms)."""
    every = len(streamed.groups)
    base = _captured_step_ms(streamed, model, batch, loss_fn)    # all resident now
    measured: dict[int, float] = {}

    def fits(j: int) -> bool:
        streamed.set_resident(j)
        measured[j] = _captured_step_ms(streamed, model, batch, loss_fn) - base
        return measured[j] <= max_overhead * base

    if not fits(k):
        lo, hi = k + 1, every
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        k = lo
    streamed.set_resident(every)   # the caller sets the choice
    return k, base, measured


def install_streamed(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence,
                     loss_fn: Callable | None, *, groups: int, prefetch: int,
                     resident: int | str = 0, max_overhead: float = DEFAULT_STREAM_OVERHEAD, jobs: int = 1,
                     h2d_bw: float | None = None, d2h_bw: float | None = None,
                     update_chunk_mb: float | None = None,
                     slice_mb: float | None = None, slice_resident: int = 0,
                     pace: bool = False) -> StreamedOptimizer:
    """:func:`tensile.stream_optimizer` with ``resident`` a number of groups, or ``"auto"``:
    then every group starts resident, one training step creates the optimizer's state
    (it trains: a warm-up step), and :func:`tune_resident` chooses within ``max_overhead``
    for ``jobs`` jobs sharing the link. ``pace`` (with ``slice_mb``): one training step
    creates the state and :func:`tensile.tune_pace` times when the slices go. Install it
    before building a Scheduler."""
    if pace and slice_mb is None:
        raise ValueError("pace times when row slices update: it needs slice_mb, which makes them")
    if resident != AUTO:
        if isinstance(resident, str):
            raise ValueError(f"resident: expected a number of groups or {AUTO!r}, got {resident!r}")
        streamed = stream_optimizer(optimizer, groups, prefetch, resident, update_chunk_mb,
                                    slice_mb, slice_resident)
        if pace:
            from .pace import tune_pace   # here: tensile.pace builds on this module
            training_step(model, optimizer, batch, loss_fn)
            tune_pace(streamed, model, batch, loss_fn, h2d_bw=h2d_bw, d2h_bw=d2h_bw)
        return streamed
    if slice_mb is not None:
        raise ValueError(f"resident={AUTO!r} times whole groups: it cannot go with slice_mb "
                         f"({slice_mb!r}); give a number of resident groups")
    streamed = stream_optimizer(optimizer, groups, prefetch, groups, update_chunk_mb)
    training_step(model, optimizer, batch, loss_fn)
    tune_resident(streamed, model, batch, loss_fn, max_overhead=max_overhead, jobs=jobs,
                  h2d_bw=h2d_bw, d2h_bw=d2h_bw)
    return streamed


# --------------------------------------------------------------------------- timing

def step_marks(streamed: StreamedOptimizer, model: nn.Module, batch: Sequence,
               loss_fn: Callable | None, repeats: int) -> list[tuple[dict, float]]:
    """``repeats`` timed training steps of ``streamed`` as it is set now, each as the ms from
    the step's start at which it reached each of its marks (``StreamedOptimizer._marks``:
    "begin", each group's update, what :mod:`tensile.pace` reads) and at which it ended: in
    one CUDA graph of the step (capturable optimizer: no host gaps count), with timing
    events (CUDA otherwise) or wall time (CPU). The steps do not train (model, optimizer
    state and the RNG are put back)."""
    with step_state_kept(model, streamed.optimizer):
        if not streamed.cuda:
            return [_cpu_marks(streamed, model, batch, loss_fn) for _ in range(repeats)]
        if is_capturable(streamed.optimizer):
            return _graph_marks(streamed, model, batch, loss_fn, repeats)
        return [_event_marks(streamed, model, batch, loss_fn) for _ in range(repeats)]


def _cpu_marks(streamed, model, batch, loss_fn) -> tuple[dict, float]:
    """The marks and the end: wall ms from the step's start (CPU ops are synchronous)."""
    marks: dict = {}
    t0 = time.perf_counter()
    streamed._marks = lambda what: marks.setdefault(what, (time.perf_counter() - t0) * 1e3)
    try:
        training_step(model, streamed.optimizer, batch, loss_fn)
    finally:
        streamed._marks = None
    return marks, (time.perf_counter() - t0) * 1e3


def _event_marks(streamed, model, batch, loss_fn) -> tuple[dict, float]:
    """As :func:`_cpu_marks`, with CUDA timing events on the current stream."""
    stream = torch.cuda.current_stream(streamed.device)
    events: dict = {}

    def mark(what):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        events.setdefault(what, e)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    streamed._marks = mark
    try:
        start.record(stream)
        training_step(model, streamed.optimizer, batch, loss_fn)
        end.record(stream)
    finally:
        streamed._marks = None
    torch.cuda.synchronize(streamed.device)
    return {k: start.elapsed_time(e) for k, e in events.items()}, start.elapsed_time(end)


def _captured_step_ms(streamed, model, batch, loss_fn) -> float:
    """Replay time (ms) of the step captured as ``streamed`` is set now
    (:meth:`tensile.GraphStep.replay_ms`, which puts the state back)."""
    graph = GraphStep(lambda b, capturing: training_step(model, streamed.optimizer, b, loss_fn),
                      batch, model, streamed.optimizer)
    ms = graph.replay_ms(5, rounds=4)   # the quietest round: other processes may share the GPU
    del graph
    torch.cuda.empty_cache()   # the graph's private pool
    return ms


def _graph_marks(streamed, model, batch, loss_fn, repeats: int) -> list[tuple[dict, float]]:
    """As :func:`_event_marks`, inside one CUDA graph of the step (:class:`tensile.GraphStep`),
    replayed ``repeats`` times (the graph runs its kernels back to back: no host gaps count)."""
    events: dict = {}
    start = torch.cuda.Event(enable_timing=True, external=True)
    end = torch.cuda.Event(enable_timing=True, external=True)

    def mark(what):
        e = torch.cuda.Event(enable_timing=True, external=True)
        e.record(torch.cuda.current_stream(streamed.device))
        events.setdefault(what, e)

    def step(b, capturing):   # the warm-up runs plain; the capture records the marks
        if not capturing:
            return training_step(model, streamed.optimizer, b, loss_fn)
        start.record()
        streamed._marks = mark
        try:
            loss = training_step(model, streamed.optimizer, b, loss_fn)
        finally:
            streamed._marks = None
        end.record()
        return loss
    graph = GraphStep(step, batch, model, streamed.optimizer)
    gap = _event_gap_ms(warmup_stream(streamed.device))   # the stream GraphStep captures on
    runs = []
    for _ in range(repeats):
        graph.graph.replay()
        torch.cuda.synchronize(streamed.device)
        runs.append(({k: max(start.elapsed_time(e) - gap, 0.0) for k, e in events.items()},
                     start.elapsed_time(end)))
    del graph
    return runs


def _ordered(marks: dict, groups: int, end: float) -> list[float]:
    """``[begin, update of group 0, ..., update of group groups - 1, end]``; a group backward
    did not update (no gradient) counts as updated at the end."""
    return [marks.get("begin", 0.0), *(marks.get(g, end) for g in range(groups)), end]
