"""Replay a :class:`~tensile.plan.Plan` on an :class:`~tensile.timeline.AccessTimeline`.

Independent of the planner's own bookkeeping on purpose: the property tests check the
planner's claims (peak, feasibility) against this replay. Resident bytes are counted
per op, conservatively:

* swapped transient tensor: gone from the first op that starts after both its copy-out
  has finished and it was released, up to and including ``in_issue_op`` (the copy-in
  allocates its device buffer when it is issued);
* cross-iteration swap: gone from op 0 of the (next) iteration up to ``in_issue_op``, or,
  when its copy-out runs past the iteration end, from the first op that starts after it;
* recomputed tensor: gone between ``release_after_op`` and ``before_op``, exclusive (or,
  rebuilt ahead, up to and including ``issue_op``); the inputs rebuilt only for it
  (``transient``) count once more during ``before_op``;
* source kept for a recompute (``kept``): resident past its last read, up to and
  including the latest ``before_op`` of the recomputes that keep it;
* an op's ``scratch`` (a workspace it holds only while it runs) counts during that op.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plan import Plan
from .timeline import ROLES, AccessTimeline

__all__ = ["SimResult", "simulate", "absent_ranges", "kept_ranges", "held_at"]


@dataclass
class SimResult:
    curve: np.ndarray  # resident bytes during each op
    peak: int
    peak_op: int


def absent_ranges(timeline: AccessTimeline, plan: Plan) -> dict[int, tuple[int, int]]:
    """Per planned tensor, the ops ``(lo, hi)`` (inclusive) during which it is off the device."""
    if plan.num_ops != timeline.num_ops:
        raise ValueError(f"the plan is for {plan.num_ops} ops, the timeline has "
                         f"{timeline.num_ops}")
    out: dict[int, tuple[int, int]] = {}
    for s in plan.swaps:
        _known(timeline, s.sid)
        if s.cross_iteration:   # gone from the next step's start, or from when a copy-out
            past_end = s.out_end_ms - timeline.iteration_ms   # that ran into it has finished
            lo = timeline.first_op_starting_at_or_after(past_end) if past_end > 1e-9 else 0
            out[s.sid] = (lo, s.in_issue_op)
        else:
            freed_at = max(s.out_end_ms, float(timeline.end[s.release_after_op]))
            out[s.sid] = (timeline.first_op_starting_at_or_after(freed_at), s.in_issue_op)
    for r in plan.recomputes:
        _known(timeline, r.sid)
        out[r.sid] = (r.release_after_op + 1, r.before_op - 1 if r.issue_op is None else r.issue_op)
    return out


def kept_ranges(timeline: AccessTimeline, recomputes) -> dict[int, tuple[int, int]]:
    """Per source kept for recomputes (``Recompute.kept``), the ops ``(lo, hi)`` (inclusive)
    it stays resident past its last read: to the latest ``before_op`` of those recomputes."""
    out: dict[int, tuple[int, int]] = {}
    for r in recomputes:
        for sid in r.kept:
            _known(timeline, sid)
            lo = timeline.vanilla_range(sid)[1] + 1
            out[sid] = (lo, max(out.get(sid, (lo, r.before_op))[1], r.before_op))
    return out


def simulate(timeline: AccessTimeline, plan: Plan | None = None) -> SimResult:
    """Resident bytes during every op with ``plan`` applied (``None``: vanilla)."""
    n = timeline.num_ops
    diff = np.zeros(n + 1, dtype=np.int64)   # the plan's changes to the vanilla curve
    for sid, (lo, hi) in (absent_ranges(timeline, plan) if plan is not None else {}).items():
        vlo, vhi = timeline.vanilla_range(sid)
        a, b = max(lo, vlo), min(hi, vhi)
        if a <= b:
            diff[a] -= timeline.tensors[sid].nbytes
            diff[b + 1] += timeline.tensors[sid].nbytes
    for sid, (lo, hi) in (kept_ranges(timeline, plan.recomputes) if plan is not None else {}).items():
        diff[lo] += timeline.tensors[sid].nbytes
        diff[hi + 1] -= timeline.tensors[sid].nbytes
    for r in plan.recomputes if plan is not None else []:
        if r.transient:   # inputs rebuilt only for this recompute, gone right after it
            extra = sum(timeline.tensors[s].nbytes for s in r.transient)
            diff[r.before_op] += extra
            diff[r.before_op + 1] -= extra
    curve = timeline.vanilla_curve() + np.cumsum(diff[:-1])
    k = int(np.argmax(curve)) if n else 0
    return SimResult(curve=curve, peak=int(curve[k]) if n else 0, peak_op=k)


def held_at(timeline: AccessTimeline, plan: Plan | None, op: int) -> dict[str, int]:
    """What is resident during ``op`` with ``plan`` applied (``None``: vanilla), in bytes per
    tensor role (every one of :data:`tensile.timeline.ROLES`; gradients are activations),
    plus ``workspace``: the op's ``scratch``. The values add up to :func:`simulate`'s curve
    at ``op`` (inputs rebuilt for one recompute alone count once more during it, as there):
    what a plan that misses its budget still holds at its peak."""
    if not 0 <= op < timeline.num_ops:
        raise ValueError(f"op: expected an index in [0, {timeline.num_ops}), got {op!r}")
    absent = absent_ranges(timeline, plan) if plan is not None else {}
    kept = kept_ranges(timeline, plan.recomputes) if plan is not None else {}
    held = dict.fromkeys(ROLES, 0)
    for sid, t in timeline.tensors.items():
        lo, hi = timeline.vanilla_range(sid)
        gone = sid in absent and absent[sid][0] <= op <= absent[sid][1]
        if (lo <= op <= hi and not gone) or (sid in kept and kept[sid][0] <= op <= kept[sid][1]):
            held[t.role] += t.nbytes
    for r in plan.recomputes if plan is not None else []:
        if r.before_op == op:   # inputs rebuilt for it alone: once more, as simulate counts them
            for sid in r.transient:
                held[timeline.tensors[sid].role] += timeline.tensors[sid].nbytes
    held["workspace"] = int(timeline.scratch.get(op, 0))
    return held


def _known(timeline: AccessTimeline, sid: int) -> None:
    if sid not in timeline.tensors:
        raise ValueError(f"the plan names storage {sid}, which the timeline does not have")
