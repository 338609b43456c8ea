"""When each row slice of a streamed optimizer updates in backward (``pace``).

    streamed = tensile.stream_optimizer(opt, groups=3, resident=3, slice_mb=32, slice_resident=7)
    training_step(model, opt, batch, loss_fn)              # creates the state
    tensile.tune_pace(streamed, model, batch, loss_fn)     # before the Scheduler is built

Why: by default (:mod:`tensile.streamed`) the slices whose state streams go one at a time,
due evenly over the hooks backward has still to fire, and the kept ones
(``slice_resident``) all at once when their gradient comes. Hooks are not time. On VGG-16 at
b=16 (the 70th session's snapshot, H100) the 7 kept slices' updates (3.4 ms) ran before any
streamed one, so no copy out began in backward's first 4.9 ms; and backward's conv5 hooks
come fast where its conv1-2 hooks come slowly, so the streamed updates bunched early (0.9 ms
apart against 1.25 ms of copy each way a slice) and the last came 2.5 ms before backward's
end, the ring's slots held over the step's peak (conv1_2's backward).

How: one step is timed (:func:`tensile.resident.step_marks`; in a CUDA graph for a
capturable optimizer): backward's own work between hooks, each slice's update, what is left
after the last hook. :func:`pace_slices` then replays the ring of :mod:`tensile.streamed` on
those times: its first ``prefetch + 1`` streamed slices copy in from backward's first
gradient, one host-to-device and one device-to-host channel, a slice's copy in waiting for the
copy out of the slot's last slice. A copy takes as long per byte as the slices' copies took in
the timed step (the median each way): both directions at once and beside backward's kernels,
which on a slow host is far from one way alone (an H100 host carried 54 GB/s one way alone and
31 GB/s device to host in the step, 71st session). At each hook a streamed slice goes as soon
as its state has landed, in the ring's order; while the next one is still on its way, a kept
slice goes instead (its update is work to fill the wait); else the rest waits for a later
hook. So the streamed slices go as early as the link brings them, and the ring empties early.
Without
timed copies (on the CPU) they take their bytes over the one-way bandwidth times
:data:`BOTH_WAYS` (both directions busy at once: 48.3 GB/s each way against 54.8-55.0 alone
on an H100, 70th session) plus the planner's latency.

The pace is fixed once chosen (:meth:`StreamedOptimizer.set_pace`): a captured graph and
TENSILE's recorded step keep the order of the step they saw, so it is not re-chosen from
step to step. The replay models the slices alone: every other group must keep its state on
the device (``resident`` = all of them), or their copies would share the ring and the link
unseen; :func:`tune_pace` refuses otherwise.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from torch import nn

from .estimate import measure_copy_bandwidth
from .planner import COPY_LATENCY_MS
from .resident import step_marks
from .streamed import StreamedOptimizer, _slot_bytes, spread_dues

__all__ = ["SliceTimes", "PaceResult", "pace_slices", "replay_pace", "spread_pace", "tune_pace",
           "BOTH_WAYS"]

# The share of a one-way copy's bandwidth each direction gets with both busy (H100, 70th
# session: 48.3 GB/s each way against 54.8-55.0 one way at a time).
BOTH_WAYS = 0.88
# A streamed slice whose state lands this little after the compute stream gets there
# still goes at that hook (ms).
_LAND_SLACK_MS = 0.02


@dataclass
class SliceTimes:
    """One step's times (ms) for the replay. Per hook, in backward's order: ``gaps_ms``,
    backward's own work before it (with the updates of groups other than slices made at
    it). ``tail_ms``: after the last hook to backward's end. Per slice, in the ring's
    order (the optimizer's groups): ``arrival``, the hook its gradient comes at; ``kept``,
    whether its state stays on the device; ``update_ms``; ``in_ms`` and ``out_ms``, its
    copies (0 for a kept slice)."""

    gaps_ms: list[float]
    tail_ms: float
    arrival: list[int]
    kept: list[bool]
    update_ms: list[float]
    in_ms: list[float]
    out_ms: list[float]

    def __post_init__(self) -> None:
        n = len(self.arrival)
        sizes = {k: len(getattr(self, k)) for k in ("kept", "update_ms", "in_ms", "out_ms")}
        if any(v != n for v in sizes.values()):
            raise ValueError(f"one entry per slice in every list: arrival has {n}, {sizes}")
        if not self.gaps_ms:
            raise ValueError("gaps_ms is empty: expected the work before each of backward's hooks")
        bad = [a for a in self.arrival if not 0 <= a < len(self.gaps_ms)]
        if bad:
            raise ValueError(f"arrival: expected hooks from 0 to {len(self.gaps_ms) - 1}, got {bad}")
        times = [*self.gaps_ms, self.tail_ms, *self.update_ms, *self.in_ms, *self.out_ms]
        if any(not t >= 0 for t in times):
            raise ValueError(f"times must be >= 0 ms, got {[t for t in times if not t >= 0]}")


@dataclass
class PaceResult:
    """A pace and its replay: ``due[i]``, slice ``i``'s (hook, rank); ``end_ms``, backward's
    end; ``wait_ms``, what the compute stream waited for copies in; ``ring_done_ms``, when
    the last copy out ends (0: nothing streams)."""

    due: list[tuple[int, int]]
    end_ms: float
    wait_ms: float
    ring_done_ms: float


class _Ring:
    """The ring's copies as the replay issues the streamed slices' updates, in order."""

    def __init__(self, times: SliceTimes, slots: int) -> None:
        self.times = times
        self.order = [i for i, k in enumerate(times.kept) if not k]   # the ring's order
        self.slots = slots
        self.land = [0.0] * len(self.order)   # when each one's state is on the device
        self.out_end = [0.0] * len(self.order)
        self.h2d = self.d2h = 0.0             # when each channel is next free
        self.next = 0                         # the next one to update
        for j in range(min(slots, len(self.order))):   # from backward's first gradient
            self._copy_in(j, 0.0)

    def _copy_in(self, j: int, ready: float) -> None:
        self.h2d = max(self.h2d, ready) + self.times.in_ms[self.order[j]]
        self.land[j] = self.h2d

    def pending(self) -> int | None:
        """The next streamed slice (its index), or None when all went."""
        return self.order[self.next] if self.next < len(self.order) else None

    def update(self, t: float) -> tuple[float, float]:
        """The next streamed slice updates with the compute stream at ``t``: returns when
        its update ends and how long the stream waited for its copy in."""
        j, i = self.next, self.order[self.next]
        wait = max(self.land[j] - t, 0.0)
        t = max(t, self.land[j]) + self.times.update_ms[i]
        self.d2h = max(self.d2h, t) + self.times.out_ms[i]
        self.out_end[j] = self.d2h
        if j + self.slots < len(self.order):   # its slot, once its copy out is done
            self._copy_in(j + self.slots, self.d2h)
        self.next += 1
        return t, wait


def pace_slices(times: SliceTimes, slots: int) -> PaceResult:
    """The pace of the module notes for a ring of ``slots`` (``prefetch + 1``) slots."""
    if slots < 1:
        raise ValueError(f"slots: expected >= 1 (prefetch + 1), got {slots!r}")
    ring, kept = _Ring(times, slots), deque()
    due: dict[int, tuple[int, int]] = {}
    t = wait = 0.0
    last = len(times.gaps_ms) - 1
    for h, gap in enumerate(times.gaps_ms):
        t += gap
        kept += [i for i, a in enumerate(times.arrival) if a == h and times.kept[i]]
        while True:
            i = ring.pending()
            ready = i is not None and times.arrival[i] <= h
            if ready and (ring.land[ring.next] <= t + _LAND_SLACK_MS or (h == last and not kept)):
                t, w = ring.update(t)
                wait += w
            elif kept:
                i = kept.popleft()
                t += times.update_ms[i]
            else:
                break
            due[i] = (h, len(due))
    return PaceResult([due[i] for i in range(len(times.arrival))], t + times.tail_ms,
                      wait, max(ring.out_end, default=0.0))


def replay_pace(times: SliceTimes, due: Sequence[tuple[int, int]], slots: int) -> PaceResult:
    """Replay the slices going at ``due`` (per slice: (hook, rank); a slice due before its
    gradient comes goes when it comes, as :class:`StreamedOptimizer` does). The streamed
    slices must go in the ring's order."""
    if len(due) != len(times.arrival):
        raise ValueError(f"due: expected one (hook, rank) per slice ({len(times.arrival)}), "
                         f"got {len(due)}")
    ring = _Ring(times, slots)
    order = sorted(range(len(due)), key=lambda i: (max(due[i][0], times.arrival[i]), due[i]))
    streamed = [i for i in order if not times.kept[i]]
    if streamed != ring.order:
        raise ValueError(f"the streamed slices must go in the ring's order {ring.order}, "
                         f"got {streamed}")
    at: dict[int, list[int]] = {}
    for i in order:
        at.setdefault(min(max(due[i][0], times.arrival[i]), len(times.gaps_ms) - 1), []).append(i)
    t = wait = 0.0
    for h, gap in enumerate(times.gaps_ms):
        t += gap
        for i in at.get(h, []):
            if times.kept[i]:
                t += times.update_ms[i]
            else:
                t, w = ring.update(t)
                wait += w
    return PaceResult(list(due), t + times.tail_ms, wait, max(ring.out_end, default=0.0))


def spread_pace(arrival: Sequence[int], kept: Sequence[bool], hooks: int) -> list[tuple[int, int]]:
    """The (hook, rank) at which :class:`StreamedOptimizer` updates each slice with no pace:
    kept ones when their gradient comes, streamed ones due evenly over the hooks left."""
    queue: list[int] = []
    dues: list[int] = []
    out: dict[int, tuple[int, int]] = {}
    for h in range(hooks):
        seen = h + 1
        came = [i for i, a in enumerate(arrival) if a == h]
        for i in came:
            if kept[i]:
                out[i] = (h, len(out))
        new = [i for i in came if not kept[i]]
        if new:
            queue += new
            dues = spread_dues(seen, hooks, len(queue))
        while queue and dues[0] <= seen:
            dues.pop(0)
            out[queue.pop(0)] = (h, len(out))
    for i in queue:   # left to step(): after backward's last hook
        out[i] = (hooks - 1, len(out))
    return [out[i] for i in range(len(arrival))]


def slice_times(streamed: StreamedOptimizer, marks: dict, h2d_bw: float, d2h_bw: float,
                latency_ms: float = COPY_LATENCY_MS, both_ways: float = BOTH_WAYS) -> SliceTimes:
    """:class:`SliceTimes` from one timed step's marks (:func:`tensile.resident.step_marks`,
    medians) and the link's one-way bandwidths (bytes/s)."""
    hooks = sorted(h for k, h in (m for m in marks if isinstance(m, tuple)) if k == "hook")
    if not hooks or hooks != list(range(len(hooks))):
        raise ValueError(f"the timed step has no consecutive hooks from 0: {hooks[:8]}...")
    slices = [g for g, grp in enumerate(streamed.groups) if grp.rows is not None]
    in_hook = {h: [g for g in slices if marks[("hook", h)] <= marks.get(g, -1.0)
                   <= marks[("hooked", h)]] for h in hooks}
    gaps = []
    for h in hooks:   # backward's work before the hook, and what the hook did but slices
        before = marks[("hook", h)] - marks[("hooked", h - 1)] if h else 0.0
        spent = marks[("hooked", h)] - marks[("hook", h)]
        sliced = sum(marks[("ran", g)] - marks[g] for g in in_hook[h])
        gaps.append(max(before, 0.0) + max(spent - sliced, 0.0))
    tail = max(marks.get("finish", marks[("hooked", hooks[-1])]) - marks[("hooked", hooks[-1])], 0.0)
    # the copies as the timed step made them, both ways at once and beside backward's kernels
    # (on a slow host far slower than one way alone: an H100 host carried 54 GB/s one way
    # and 31 GB/s device to host in the step, 71st session); else the link's bandwidth
    rate = {way: _copy_ms_per_byte(streamed, marks, slices, way) for way in ("in", "out")}
    arrival, kept, update, cin, cout = [], [], [], [], []
    for g in slices:
        grp = streamed.groups[g]
        if g not in marks or ("ran", g) not in marks:
            raise ValueError(f"slice {g} did not update in the timed step's backward")
        arrival.append(streamed._arrived[id(grp.params[0])])
        kept.append(not grp.streams)
        update.append(max(marks[("ran", g)] - marks[("run", g)], 0.0))
        nbytes = _slot_bytes(grp)   # 0 for a kept slice
        cin.append(nbytes and (nbytes * rate["in"] if rate["in"] is not None
                               else latency_ms + nbytes * 1e3 / (h2d_bw * both_ways)))
        cout.append(nbytes and (nbytes * rate["out"] if rate["out"] is not None
                                else latency_ms + nbytes * 1e3 / (d2h_bw * both_ways)))
    return SliceTimes(gaps, tail, arrival, kept, update, cin, cout)


def _copy_ms_per_byte(streamed: StreamedOptimizer, marks: dict, slices: list[int],
                      way: str) -> float | None:
    """The median ms per byte of the streamed slices' copies ``way`` ("in", "out") in the
    timed step's marks; None when it has none (a CPU run, or no streamed slice)."""
    rates = sorted((marks[(way + "_end", g)] - marks[(way, g)]) / nbytes
                   for g in slices if (way, g) in marks and (way + "_end", g) in marks
                   and (nbytes := _slot_bytes(streamed.groups[g])) > 0)   # 0: kept
    if not rates or not streamed.cuda:
        return None
    return rates[len(rates) // 2]


def tune_pace(streamed: StreamedOptimizer, model: nn.Module, batch: Sequence,
              loss_fn: Callable | None, *, h2d_bw: float | None = None,
              d2h_bw: float | None = None, latency_ms: float = COPY_LATENCY_MS,
              both_ways: float = BOTH_WAYS, repeats: int = 3) -> dict:
    """Time one step of ``streamed`` (median of ``repeats``; they do not train), choose the
    pace of the module notes and set it. The optimizer must have its state (one step run)
    and every group but the slices their state on the device. Bandwidths are measured
    unless given (bytes/s). Returns (and keeps as ``streamed.paced``) the replay's figures
    for the pace and for the default spread."""
    if not any(g.rows is not None for g in streamed.groups):
        raise ValueError("tune_pace paces row slices: the optimizer has none (stream it with "
                         "slice_mb)")
    others = [g for g in streamed._streamed_groups() if streamed.groups[g].rows is None]
    if others:
        raise ValueError(f"tune_pace models the slices' copies alone: groups {others} stream "
                         f"their state too; keep every other group resident (resident="
                         f"{len(streamed._whole)})")
    if not any(streamed.optimizer.state.get(p) for g in streamed.groups for p in g.params):
        raise ValueError("the optimizer has no state yet: run one training step first")
    streamed.set_pace(None)   # timed as the default spreads them
    runs = step_marks(streamed, model, batch, loss_fn, repeats)
    keys = set.intersection(*(set(m) for m, _ in runs))
    marks = {k: sorted(m[k] for m, _ in runs)[len(runs) // 2] for k in keys}
    if h2d_bw is None or d2h_bw is None:
        d, h = measure_copy_bandwidth(streamed.device)
        d2h_bw, h2d_bw = d2h_bw or d, h2d_bw or h
    slices = [g for g, grp in enumerate(streamed.groups) if grp.rows is not None]
    times = slice_times(streamed, marks, h2d_bw, d2h_bw, latency_ms, both_ways)
    slots = streamed.prefetch + 1
    paced = pace_slices(times, slots)
    spread = replay_pace(times, spread_pace(times.arrival, times.kept, len(times.gaps_ms)), slots)
    streamed.set_pace(dict(zip(slices, paced.due)))
    timed = {way: _copy_ms_per_byte(streamed, marks, slices, way) for way in ("in", "out")}
    streamed.paced = {"hooks": [d[0] for d in paced.due],
                      # the copies' rates in the timed step (GB/s; None: the link's, see notes)
                      **{f"copy_{way}_gbps": round(1e-6 / r, 2) if r else None
                         for way, r in timed.items()},
                      **{f"{name}_{k}": round(getattr(r, f"{k}_ms"), 3)
                         for name, r in (("paced", paced), ("spread", spread))
                         for k in ("end", "wait", "ring_done")}}
    return streamed.paced
