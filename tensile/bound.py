"""How little extra time any plan can cost: a lower bound for a memory budget.

    bound = extra_time_bound(timeline, budget_bytes, d2h_bw=50e9, h2d_bw=50e9)
    bound.extra_ms          # no plan of these moves fits the budget for less (None: none fits)

The planner (:mod:`tensile.planner`) is greedy: it says what one plan costs, not whether
another costs less. This module answers the second question for the moves the runtime
makes within one iteration (a captured step's, ``allow_cross_iteration=False``): an
activation dropped in its forward→backward gap (:meth:`AccessTimeline.backward_gap`) and
rebuilt by rerunning the ops that wrote it, or swapped out and back in that gap.

It solves the linear relaxation of choosing those moves. Per activation ``s`` with a gap
``(i, j)``, ``x_s`` (rebuilt) and ``y_s`` (swapped) lie in ``[0, 1]``, ``x_s + y_s <= 1``.
At every op ``p`` whose resident bytes without a plan exceed the budget, the moves whose
gap spans ``p`` free at least the excess: ``sum nbytes_s (x_s + y_s) >= curve[p] - budget``.
What is swapped out at ``p`` was copied out since the step began and goes back in before
it ends: ``sum nbytes_s y_s <= d2h_bw * start[p]`` and ``<= h2d_bw * (T - end[p])``. The
objective is the rebuilds' rerun time, ``sum cost_s x_s`` (swaps cost nothing). Every real
plan is a solution, and a costlier one: its rebuilds also need their inputs resident (the
bound takes them as free), free memory only for part of the gap, and its copies share
two channels with latencies and fixed windows. So no plan fits ``budget`` for less than
``extra_ms``; how far the greedy plan's estimate lies above it is what a better planner
could still win. Both are in the timeline's own op times: a bound on the planner's
model, not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from .planner import _rerun_ms, _rerun_ops
from .timeline import AccessTimeline

__all__ = ["PlanBound", "extra_time_bound"]


@dataclass(frozen=True)
class PlanBound:
    """The bound for one budget: ``extra_ms`` (None when not even every move together
    fits the budget), the budget and the peak without a plan (bytes), the activations
    that may move (``movable``, of which ``rebuildable`` can be rebuilt) and whether
    swaps were allowed."""

    budget_bytes: int
    peak_bytes: int
    extra_ms: float | None
    movable: int
    rebuildable: int
    swaps: bool


def extra_time_bound(tl: AccessTimeline, budget_bytes: int, *, d2h_bw: float | None = None,
                     h2d_bw: float | None = None, min_bytes: int = 1) -> PlanBound:
    """The least extra time (ms, the timeline's op times) that any within-iteration plan of
    rebuilds and swaps needs to keep ``tl`` at or under ``budget_bytes`` (module notes).
    Swaps count only with both bandwidths (bytes/s) given; activations smaller than
    ``min_bytes`` never move, as in :func:`tensile.planner.plan`."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)) \
            or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    swaps = d2h_bw is not None and h2d_bw is not None
    for name, bw in (("d2h_bw", d2h_bw), ("h2d_bw", h2d_bw)):
        if bw is not None and not (isinstance(bw, (int, float)) and 0 < bw < float("inf")):
            raise ValueError(f"{name} must be a positive number of bytes/s or None, got {bw!r}")
    curve = tl.vanilla_curve()
    peak = int(curve.max()) if len(curve) else 0
    excess = curve - budget_bytes
    moves = _moves(tl, min_bytes)
    rebuildable = sum(cost is not None for *_, cost in moves)
    result = PlanBound(budget_bytes=int(budget_bytes), peak_bytes=peak, extra_ms=0.0,
                       movable=len(moves), rebuildable=rebuildable, swaps=swaps)
    if peak <= budget_bytes:
        return result
    if not moves:
        return PlanBound(**{**result.__dict__, "extra_ms": None})
    return PlanBound(**{**result.__dict__,
                        "extra_ms": _solve(tl, excess, moves, swaps, d2h_bw, h2d_bw)})


def _moves(tl: AccessTimeline, min_bytes: int) -> list[tuple[int, int, int, int, float | None]]:
    """Each activation the runtime may move (as :meth:`PlanState.resident_candidates`):
    (sid, bytes, gap start i, gap end j, rebuild ms or None where it cannot be rebuilt)."""
    out = []
    for sid, t in tl.tensors.items():
        if t.persistent or not t.swappable or t.nbytes < min_bytes:
            continue                        # as the planner's candidates
        gap = tl.backward_gap(sid)
        if gap is None:
            continue
        i, j = gap
        ops = _rerun_ops(tl, sid, i)
        out.append((sid, t.nbytes, i, j, None if ops is None else _rerun_ms(tl, ops[0], ops[1])))
    return out


def _solve(tl: AccessTimeline, excess: np.ndarray, moves: list, swaps: bool,
           d2h_bw: float | None, h2d_bw: float | None) -> float | None:
    """The linear program of the module notes; None when it has no solution."""
    n = tl.num_ops
    # Between two gap ends the moves spanning an op do not change: one memory row per such
    # segment (its largest excess) and one pair of bandwidth rows (its first op's start,
    # its last op's end: the tightest of the segment's ops).
    cuts = sorted({0, n} | {i + 1 for _, _, i, _, _ in moves} | {j for _, _, _, j, _ in moves})
    segments = [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b and excess[a:b].max() > 0]
    # variables: x (rebuild) for the rebuildable moves, then y (swap) for every move
    xs = [k for k, m in enumerate(moves) if m[4] is not None]
    ys = list(range(len(moves))) if swaps else []
    nx = len(xs)
    col_x = {k: c for c, k in enumerate(xs)}
    col_y = {k: nx + c for c, k in enumerate(ys)}
    rows, cols, vals, rhs = [], [], [], []

    def add_row(entries: list[tuple[int, float]], bound: float) -> None:
        r = len(rhs)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        rhs.append(bound)

    spans = [(k, m[1], m[2], m[3]) for k, m in enumerate(moves)]
    T = tl.iteration_ms
    for a, b in segments:
        inside = [(k, nb) for k, nb, i, j in spans if i < a and b - 1 < j]
        need = float(excess[a:b].max())
        freed = [(col_x[k], -float(nb)) for k, nb in inside if k in col_x]
        freed += [(col_y[k], -float(nb)) for k, nb in inside if k in col_y]
        if not freed:
            return None                     # nothing can free memory at these ops
        add_row(freed, -need)               # sum nbytes (x + y) >= excess
        if swaps:
            out = [(col_y[k], float(nb)) for k, nb in inside]
            add_row(out, d2h_bw * float(tl.start[a]) / 1e3)
            add_row(out, h2d_bw * (T - float(tl.end[b - 1])) / 1e3)
    for k in range(len(moves)):             # x + y <= 1
        both = [(c, 1.0) for c in (col_x.get(k), col_y.get(k)) if c is not None]
        if len(both) == 2:
            add_row(both, 1.0)
    nvar = nx + len(ys)
    cost = np.zeros(nvar)
    cost[:nx] = [moves[k][4] for k in xs]
    a_ub = coo_matrix((vals, (rows, cols)), shape=(len(rhs), nvar)).tocsr()
    res = linprog(cost, A_ub=a_ub, b_ub=np.asarray(rhs), bounds=(0.0, 1.0), method="highs")
    return float(res.fun) if res.status == 0 else None
