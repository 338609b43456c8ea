"""One joint plan for several training jobs sharing one GPU (reference §3.6, §5, §6).

TENSILE summed the per-job peaks (as if every job peaked at the same moment) and gave
each job its own copy queue, so copies of different jobs could overlap on the bus. Here
all jobs live on **one shared timeline** with **one D2H and one H2D channel**.

The interleaving model (what "shared timeline" means):

* Jobs run concurrently; the GPU time-slices between them, so a job's ops take longer
  in wall-clock time than alone. Job ``j``'s iteration takes ``P_j`` ms of wall clock:
  its measured iteration time (``JobSpec.iter_ms``) or, before any measurement (cold
  start), the sum of its op times. Its ops are laid on the wall clock *proportionally*:
  op ``k`` gets ``op_ms[k] * P_j / sum(op_ms)``. When the job measured where its ops
  really started (``op_start_ms``, e.g. CUDA events relative to the iteration start),
  op ``k`` spans from its start to the next op's start instead (waits included).
* The joint timeline is one cycle of ``T = max_j P_j`` ms. A faster job repeats
  ``r_j = round(T / P_j)`` times per cycle and its iteration is rescaled to exactly
  ``T / r_j`` (so the cycle is periodic for every job; the rounding error is at most a
  factor 1.5 for jobs between one and two times faster, less for the others).
* Job ``j`` starts its iterations at phase ``phi_j`` in the cycle: from the iteration
  start times the jobs report on a clock they share (``time.monotonic()``, system-wide
  on Linux), relative to the slowest job's, modulo the job's period; ``0`` when either
  report is missing (all aligned: the worst case for identical jobs).
* Resident bytes at time ``t`` are the sum over jobs of the bytes job ``j`` holds during
  the op it is running at ``t``: a curve over the segments between all op boundaries of
  all jobs in the cycle. Its maximum is the joint peak (TENSILE's figure, the sum of
  per-job peaks, is reported next to it).
* A copy of job ``j`` placed at local time ``a`` occupies ``phi_j + a + k T / r_j`` (mod
  ``T``) for every repeat ``k``; no two copies ever overlap on a channel.

Limits: the phases are a snapshot. Jobs whose periods are not in a ratio of whole
numbers drift against each other, and over time every alignment occurs; the plan then
holds only while the measured alignment does (a drift re-plan refreshes it). A budget
with headroom, or no phase reports (all aligned), is the safe choice there.

Greedy peak shaving (as :mod:`tensile.planner`, one tensor per round) at the joint peak:
jobs are visited in **ascending weight** (ties: the job holding the most bytes at the
peak first). Within the lowest weight class that can help, a hidden swap is tried in
every job of the class before a recomputation (budget only) is; a job of higher weight
is touched only when no job of lower weight can lower the current peak at all. So a
higher weight keeps more of a job resident and away from recomputation and passive
swap-ins. Without a budget it stops when no hidden swap lowers the peak. A job may price
its swaps (``JobSpec.swap_cost_ms``, a captured step's joins, and ``swap_copy_share``):
under a budget the greedy then runs once more without those jobs' swaps and the cheaper
joint plan is kept.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from .plan import Plan
# The single-job planner's working state and channel are reused as they are; only the
# channels are swapped for views of the shared ones (see _JobChannel).
from .planner import (COPY_LATENCY_MS, EPS, CopyChannel, PlanState, check_max_overhead,
                      check_plan_args, check_swap_copy_share, check_swap_cost, with_first_uses)
from .simulate import simulate
from .timeline import AccessTimeline

__all__ = ["JobSpec", "JointPlan", "JointLayout", "check_budget_share", "layout_jobs", "plan_jobs",
           "simulate_joint"]


@dataclass
class JobSpec:
    """One job as the joint planner sees it.

    ``timeline.op_ms`` are the job's op times (estimated or measured). ``iter_ms`` is its
    measured wall-clock iteration time (``None``: the sum of op times), ``op_start_ms``
    the measured start of every op relative to the iteration start, ``iter_start_s``
    the start time of one iteration on a clock shared by all jobs (seconds).
    ``swap_cost_ms``: what each swap adds to the job's step beside its hidden copies (a
    captured step's joins: :data:`tensile.planner.CAPTURED_SWAP_COST_MS`), and
    ``swap_copy_share`` the share of its copies' own time it adds
    (:func:`tensile.planner.swap_price_ms`); they count in the job's estimated extra time,
    and under a budget :func:`plan_jobs` keeps the cheaper of the joint plans with and
    without such swaps.
    """

    job_id: str
    timeline: AccessTimeline
    weight: float = 1.0
    iter_ms: float | None = None
    op_start_ms: Sequence[float] | None = None
    iter_start_s: float | None = None
    allow_recompute: bool = True
    allow_cross_iteration: bool = True
    min_bytes: int = 1
    swap_cost_ms: float = 0.0
    swap_copy_share: float = 0.0


@dataclass
class JointLayout:
    """The jobs on one cycle: wall-clock timelines, repeats, phases, segment → op maps."""

    cycle_ms: float
    timelines: dict[str, AccessTimeline]   # op times stretched to wall clock
    periods: dict[str, float]              # T / repeats
    repeats: dict[str, int]
    phases: dict[str, float]               # in [0, period)
    bounds: np.ndarray                     # segment boundaries in [0, T], sorted
    seg_op: dict[str, np.ndarray]          # op each job runs during each segment

    def joint_curve(self, curves: Mapping[str, np.ndarray]) -> np.ndarray:
        """Sum over jobs of per-op resident bytes, per segment of the cycle."""
        total = np.zeros(len(self.bounds) - 1, dtype=np.int64)
        for j, ops in self.seg_op.items():
            total += curves[j][ops]
        return total

    def absolute(self, job_id: str, start: float, end: float) -> list[tuple[float, float]]:
        """Where a copy at local ``[start, end)`` of a job lies in the cycle (all repeats)."""
        out = []
        for k in range(self.repeats[job_id]):
            off = self.phases[job_id] + k * self.periods[job_id]
            out.extend(_wrap(start + off, end + off, self.cycle_ms))
        return out


@dataclass
class JointPlan:
    """Per-job plans and the joint figures.

    ``peak_before``/``peak_after``: simulated joint peak (bytes) without/with the plans;
    ``sum_of_peaks_before``/``_after``: TENSILE's figure, the sum of per-job peaks.
    Each job's :class:`Plan` carries its own peaks, the shared ``budget_bytes`` and the
    joint ``feasible``; its ms fields are on the job's wall-clock timeline.
    """

    plans: dict[str, Plan]
    layout: JointLayout
    budget_bytes: int | None
    peak_before: int
    peak_after: int
    sum_of_peaks_before: int
    sum_of_peaks_after: int
    feasible: bool
    planner_ms: float = 0.0
    weights: dict[str, float] = field(default_factory=dict)

    def channel_copies(self) -> dict[str, list[tuple[float, float, str, int]]]:
        """Every copy on the shared channels in the cycle: ``(start, end, job_id, sid)``."""
        out: dict[str, list[tuple[float, float, str, int]]] = {"d2h": [], "h2d": []}
        for j, p in self.plans.items():
            for s in p.swaps:
                for a, b in self.layout.absolute(j, s.out_start_ms, s.out_end_ms):
                    out["d2h"].append((a, b, j, s.sid))
                for a, b in self.layout.absolute(j, s.in_start_ms, s.in_end_ms):
                    out["h2d"].append((a, b, j, s.sid))
        return {k: sorted(v) for k, v in out.items()}

    def summary(self) -> str:
        mib = 1 << 20
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / mib:.1f} MiB"
        lines = [
            f"joint TENSILE plan for {len(self.plans)} jobs, cycle {self.layout.cycle_ms:.2f} ms",
            f"  joint peak {self.peak_before / mib:.1f} -> {self.peak_after / mib:.1f} MiB "
            f"(sum of job peaks {self.sum_of_peaks_before / mib:.1f} -> "
            f"{self.sum_of_peaks_after / mib:.1f} MiB), budget {budget}, feasible {self.feasible}",
        ]
        for j, p in self.plans.items():
            lines.append(f"  {j} (weight {self.weights.get(j, 1.0):g}, x{self.layout.repeats[j]}): "
                         f"{len(p.swaps)} swaps, {len(p.recomputes)} recomputes, "
                         f"peak {p.peak_before / mib:.1f} -> {p.peak_after / mib:.1f} MiB")
        lines.append(f"  planner {self.planner_ms:.1f} ms")
        return "\n".join(lines)


# ---------------------------------------------------------------------- layout
def layout_jobs(jobs: Sequence[JobSpec]) -> JointLayout:
    """Lay the jobs on one cycle (see the module docstring for the model)."""
    if not jobs:
        raise ValueError("no jobs to lay out")
    ids = [j.job_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"job ids must be unique, got {ids}")
    for j in jobs:
        if j.timeline.num_ops == 0:
            raise ValueError(f"job {j.job_id}: the timeline has no ops")
    spans = {j.job_id: _wall_spans(j) for j in jobs}
    raw = {jid: float(s.sum()) for jid, s in spans.items()}
    cycle = max(raw.values())
    slowest = max(jobs, key=lambda j: raw[j.job_id])
    repeats = {jid: max(1, int(round(cycle / p))) for jid, p in raw.items()}
    periods = {jid: cycle / repeats[jid] for jid in raw}
    timelines, phases = {}, {}
    for j in jobs:
        jid = j.job_id
        timelines[jid] = j.timeline.with_op_times(spans[jid] * (periods[jid] / raw[jid]))
        phase = 0.0
        if j.iter_start_s is not None and slowest.iter_start_s is not None:
            phase = (j.iter_start_s - slowest.iter_start_s) * 1e3
        phases[jid] = float(phase % periods[jid])

    cuts = [np.array([0.0, cycle])]
    for jid, tl in timelines.items():
        for k in range(repeats[jid]):
            cuts.append((tl.start + phases[jid] + k * periods[jid]) % cycle)
    bounds = np.unique(np.concatenate(cuts))
    bounds = bounds[np.concatenate(([True], np.diff(bounds) > EPS))]  # drop float-noise slivers
    bounds[-1] = cycle
    mids = (bounds[:-1] + bounds[1:]) / 2
    seg_op = {}
    for jid, tl in timelines.items():
        local = (mids - phases[jid]) % periods[jid]
        seg_op[jid] = np.minimum(np.searchsorted(tl.end, local, side="right"), tl.num_ops - 1)
    return JointLayout(cycle, timelines, periods, repeats, phases, bounds, seg_op)


def _wall_spans(job: JobSpec) -> np.ndarray:
    """Wall-clock ms of each op of a job (from op start to the next op's start)."""
    tl = job.timeline
    op_ms = np.asarray(tl.op_ms, dtype=np.float64)
    if job.op_start_ms is None:
        period = job.iter_ms if job.iter_ms is not None else float(op_ms.sum())
        _positive(period, f"job {job.job_id}: iter_ms")
        return op_ms * (period / float(op_ms.sum()))
    starts = np.asarray(job.op_start_ms, dtype=np.float64)
    if starts.shape != (tl.num_ops,):
        raise ValueError(f"job {job.job_id}: op_start_ms has {starts.size} entries, "
                         f"the timeline has {tl.num_ops} ops")
    if job.iter_ms is None:
        raise ValueError(f"job {job.job_id}: op_start_ms needs iter_ms (the end of the last op's span)")
    ends = np.append(starts[1:], job.iter_ms)
    if not (np.all(np.isfinite(starts)) and starts[0] >= 0 and np.all(np.diff(ends) >= 0)
            and ends[-1] > starts[-1] - EPS):
        raise ValueError(f"job {job.job_id}: op_start_ms must be finite, >= 0, non-decreasing "
                         f"and before iter_ms={job.iter_ms}")
    # Two ops starting at the same timer tick would get a zero span; timelines need > 0.
    return np.maximum(ends - starts, 1e-6)


def _positive(x: float, what: str) -> None:
    if not (isinstance(x, (int, float)) and np.isfinite(x) and x > 0):
        raise ValueError(f"{what} must be a positive finite number of ms, got {x!r}")


def check_budget_share(budget_bytes: int | None, budget_share: float | None) -> None:
    """A budget share is a number in (0, 1] and comes instead of a budget in bytes."""
    if budget_share is None:
        return
    if budget_bytes is not None:
        raise ValueError(f"give budget_bytes or budget_share, not both (got {budget_bytes!r} "
                         f"and {budget_share!r})")
    if isinstance(budget_share, bool) or not (isinstance(budget_share, (int, float))
                                              and 0 < budget_share <= 1):
        raise ValueError(f"budget_share must be a share of the joint peak in (0, 1], "
                         f"got {budget_share!r}")


def _wrap(start: float, end: float, cycle: float) -> list[tuple[float, float]]:
    """``[start, end)`` modulo ``cycle``, split where it crosses the cycle end."""
    if end - start >= cycle - EPS:
        return [(0.0, cycle)]
    s = start % cycle
    e = s + (end - start)
    return [(s, e)] if e <= cycle + EPS else [(s, cycle), (0.0, e - cycle)]


def _insert_merged(busy: list[tuple[float, float]], start: float, end: float) -> None:
    """Insert ``[start, end)`` into the sorted, pairwise disjoint ``busy``, merged with every
    interval it overlaps or comes within ``EPS`` of (``CopyChannel``'s searches need them
    disjoint)."""
    i = bisect.bisect_left(busy, (start,))   # the first interval starting at or after start
    if i and busy[i - 1][1] + EPS >= start:  # the one before reaches it
        i -= 1
        start, end = busy[i][0], max(end, busy[i][1])
    j = i
    while j < len(busy) and busy[j][0] <= end + EPS:
        end = max(end, busy[j][1])
        j += 1
    busy[i:j] = [(start, end)]


# ---------------------------------------------------------------------- shared channels
class _SharedChannel:
    """One copy direction of the GPU: busy intervals in ``[0, cycle)``, never overlapping."""

    def __init__(self, cycle: float) -> None:
        self.cycle = cycle
        self.busy: list[tuple[float, float]] = []

    def add(self, start: float, end: float) -> None:
        self.busy.extend(_wrap(start, end, self.cycle))


class _JobChannel:
    """A job's view of a shared channel, in the job's local ms (``CopyChannel``'s interface).

    A job with period ``P`` and phase ``phi`` sees every busy interval folded modulo
    ``P`` and shifted by ``-phi``: a local slot is free only if it is free in every
    repeat of the job in the cycle.
    """

    def __init__(self, shared: _SharedChannel, phase: float, period: float, repeats: int):
        self.shared, self.phase, self.period, self.repeats = shared, phase, period, repeats
        self._folded = CopyChannel(period)   # the shared intervals seen so far, folded
        self._seen = 0                       # how many of them (the shared list only grows)

    def _view(self) -> CopyChannel:
        """The folded channel, brought up to date with the intervals added since the last
        look (folding them all again at every look made a joint plan of three Inception-v4
        jobs spend 90 % of its time here)."""
        busy = self.shared.busy
        for s, e in busy[self._seen:]:
            for a, b in _wrap(s - self.phase, e - self.phase, self.period):
                _insert_merged(self._folded.busy, a, b)
        self._seen = len(busy)
        return self._folded

    def earliest(self, lo: float, hi: float, d: float) -> float | None:
        return self._view().earliest(lo, hi, d)

    def latest(self, lo: float, hi: float, d: float) -> float | None:
        return self._view().latest(lo, hi, d)

    def earliest_wrapping(self, lo: float, d: float, hi_next: float) -> float | None:
        return self._view().earliest_wrapping(lo, d, hi_next)

    def add(self, start: float, end: float) -> None:
        for k in range(self.repeats):
            off = self.phase + k * self.period
            self.shared.add(start + off, end + off)


# ---------------------------------------------------------------------- planner
def plan_jobs(
    jobs: Sequence[JobSpec],
    *,
    budget_bytes: int | None = None,
    budget_share: float | None = None,
    d2h_bw: float,
    h2d_bw: float,
    copy_latency_ms: float = COPY_LATENCY_MS,
    max_overhead: float = 0.0,
) -> JointPlan:
    """One joint plan for ``jobs`` on one GPU with one budget and shared copy channels.

    ``budget_bytes`` is for all jobs together (``None``: minimise the joint peak with
    hidden swaps, then with recomputation that adds at most ``max_overhead`` x each job's
    iteration time, as :func:`tensile.planner.plan`). ``budget_share`` (in (0, 1], instead
    of ``budget_bytes``) sets the budget to that share of the jobs' joint peak without
    plans, so the plan moves only what that cut needs, cheapest first, rather than every
    tensor it can hide; the plan's ``budget_bytes`` tells the bytes it came to.
    ``d2h_bw``/``h2d_bw`` are the GPU's copy bandwidths in bytes/s.
    """
    check_budget_share(budget_bytes, budget_share)
    check_plan_args(budget_bytes, d2h_bw, h2d_bw, copy_latency_ms, 1)
    check_max_overhead(max_overhead)
    for j in jobs:
        _positive(j.weight, f"job {j.job_id}: weight")
        if not isinstance(j.min_bytes, (int, np.integer)) or j.min_bytes < 1:
            raise ValueError(f"job {j.job_id}: min_bytes must be an int >= 1, got {j.min_bytes!r}")
        check_swap_cost(j.swap_cost_ms)
        check_swap_copy_share(j.swap_copy_share)
    t0 = time.perf_counter()
    lay = layout_jobs(jobs)
    spec = {j.job_id: j for j in jobs}
    peak_before = int(lay.joint_curve({jid: tl.vanilla_curve()
                                       for jid, tl in lay.timelines.items()}).max())
    if budget_share is not None:
        budget_bytes = max(1, int(budget_share * peak_before))

    args = (jobs, lay, budget_bytes, d2h_bw, h2d_bw, copy_latency_ms, max_overhead)
    states, mem = _joint_greedy(*args, no_swaps=frozenset())
    priced = frozenset(j.job_id for j in jobs if j.swap_cost_ms > 0 or j.swap_copy_share > 0)
    if budget_bytes is not None and priced and any(states[j].swaps for j in priced):
        # Under a budget a priced swap may cost more than the recomputes that would free
        # its bytes instead: plan again without those jobs' swaps, keep the cheaper plan.
        other = _joint_greedy(*args, no_swaps=priced)
        if _joint_rank(*other, jobs, budget_bytes) < _joint_rank(states, mem, jobs, budget_bytes):
            states, mem = other

    plans = {jid: _job_plan(states[jid], spec[jid], budget_bytes, d2h_bw, h2d_bw)
             for jid in states}
    # An independent replay must agree with the incremental bookkeeping.
    replay = simulate_joint(lay, plans)
    if not np.array_equal(replay, mem):
        raise AssertionError("joint planner bug: incremental memory curve differs from replay")
    peak_after = int(mem.max())
    feasible = budget_bytes is None or peak_after <= budget_bytes
    for p_ in plans.values():
        p_.feasible = feasible
    elapsed = (time.perf_counter() - t0) * 1e3
    for p_ in plans.values():
        p_.planner_ms = elapsed
    return JointPlan(
        plans=plans, layout=lay, budget_bytes=budget_bytes,
        peak_before=peak_before, peak_after=peak_after,
        sum_of_peaks_before=sum(p_.peak_before for p_ in plans.values()),
        sum_of_peaks_after=sum(p_.peak_after for p_ in plans.values()),
        feasible=feasible, planner_ms=elapsed,
        weights={j.job_id: float(j.weight) for j in jobs})


def _joint_greedy(jobs: Sequence[JobSpec], lay: JointLayout, budget_bytes: int | None,
                  d2h_bw: float, h2d_bw: float, copy_latency_ms: float, max_overhead: float,
                  no_swaps: frozenset[str]) -> tuple[dict[str, PlanState], np.ndarray]:
    """One run of the joint greedy peak shaving (the jobs in ``no_swaps`` only recompute):
    each job's planner state and the joint memory curve they make."""
    d2h, h2d = _SharedChannel(lay.cycle_ms), _SharedChannel(lay.cycle_ms)
    states: dict[str, PlanState] = {}
    for jid, tl in lay.timelines.items():
        st = PlanState(tl, d2h_bw, h2d_bw, copy_latency_ms)
        view = (lay.phases[jid], lay.periods[jid], lay.repeats[jid])
        st.d2h, st.h2d = _JobChannel(d2h, *view), _JobChannel(h2d, *view)
        st.reserve_transfers()   # its own copies, on the shared channels now
        states[jid] = st
    failed: dict[str, set[tuple[int, int]]] = {jid: set() for jid in states}
    classes = sorted({j.weight for j in jobs})
    mem = lay.joint_curve({jid: st.mem for jid, st in states.items()})
    while True:
        p = int(np.argmax(mem))
        if budget_bytes is not None and mem[p] <= budget_bytes:
            break
        if not _shave_once(p, classes, jobs, lay, states, failed, budget_bytes, max_overhead,
                           no_swaps):
            break
        mem = lay.joint_curve({jid: st.mem for jid, st in states.items()})
    return states, mem


def _joint_rank(states: dict[str, PlanState], mem: np.ndarray, jobs: Sequence[JobSpec],
                budget_bytes: int) -> tuple:
    """Sort key of joint plans under a budget, best first (as the single-job planner's):
    feasible, then (none feasible) the lower peak, then the weighted sum of the jobs'
    estimated extra time over their iterations, then fewer copies."""
    peak = int(mem.max())
    extra = sum(j.weight * states[j.job_id].extra_ms(j.swap_cost_ms, j.swap_copy_share)
                / states[j.job_id].tl.iteration_ms
                for j in jobs)
    return (peak > budget_bytes, 0 if peak <= budget_bytes else peak, extra,
            sum(len(st.swaps) for st in states.values()))


def _shave_once(p: int, classes: list[float], jobs: Sequence[JobSpec], lay: JointLayout,
                states: dict[str, PlanState], failed: dict[str, set[tuple[int, int]]],
                budget_bytes: int | None, max_overhead: float, no_swaps: frozenset[str]) -> bool:
    """Move one tensor off the device at joint segment ``p`` (weight rule: module doc);
    the jobs in ``no_swaps`` are not swapped from."""
    for w in classes:
        group = [j for j in jobs if j.weight == w]
        # Ops of each job at the peak; the job holding the most there goes first.
        at = {j.job_id: int(lay.seg_op[j.job_id][p]) for j in group}
        group.sort(key=lambda j: (-int(states[j.job_id].mem[at[j.job_id]]), j.job_id))
        for j in group:
            if j.job_id in no_swaps:
                continue
            if states[j.job_id].try_swap(at[j.job_id], j.allow_cross_iteration, j.min_bytes,
                                         failed[j.job_id]):
                return True
        for j in group:
            st = states[j.job_id]
            left = st.recompute_allowance_ms(budget_bytes, max_overhead)
            if j.allow_recompute and left > 0 and st.try_recompute(at[j.job_id], j.min_bytes, left):
                return True
    return False


def _job_plan(st: PlanState, job: JobSpec, budget: int | None, d2h_bw: float, h2d_bw: float) -> Plan:
    """The :class:`Plan` of one job from its planner state (as :func:`tensile.planner.plan`)."""
    tl = st.tl
    return Plan(
        num_ops=tl.num_ops, budget_bytes=budget,
        d2h_bytes_per_s=float(d2h_bw), h2d_bytes_per_s=float(h2d_bw),
        swaps=with_first_uses(tl, st.swaps, st.recomputes),
        recomputes=sorted(st.recomputes, key=lambda r: (r.before_op, r.sid)),
        peak_before=int(tl.vanilla_curve().max()), peak_after=int(st.mem.max()),
        est_overhead_ms=st.extra_ms(job.swap_cost_ms, job.swap_copy_share),
        iteration_ms=tl.iteration_ms)


def simulate_joint(layout: JointLayout, plans: Mapping[str, Plan | None]) -> np.ndarray:
    """Joint resident bytes per segment of the cycle with each job's plan replayed."""
    missing = set(layout.timelines) - set(plans)
    if missing:
        raise ValueError(f"no plan (or None) given for jobs {sorted(missing)}")
    curves = {jid: simulate(tl, plans[jid]).curve for jid, tl in layout.timelines.items()}
    return layout.joint_curve(curves)
