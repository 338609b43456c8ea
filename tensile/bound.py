"""How little extra time any plan can cost: a lower bound for a memory budget.

    bound = extra_time_bound(timeline, budget_bytes, d2h_bw=50e9, h2d_bw=50e9)
    bound.extra_ms          # no plan of these moves fits the budget for less (None: none fits)

The planner (:mod:`tensile.planner`) is greedy: it says what one plan costs, not whether
another costs less. This module answers the second question for the moves the runtime
makes within one iteration (a captured step's, ``allow_cross_iteration=False``): an
activation dropped in its forward→backward gap (:meth:`AccessTimeline.backward_gap`) and
rebuilt by rerunning the ops that wrote it, or swapped out and back in that gap.

It solves the linear relaxation of choosing those moves. Per activation ``s`` with a gap
``(i, j)``, ``x_s`` (rebuilt: away for the whole gap) lies in ``[0, 1]``. Between two gap
ends the activations spanning an op do not change; per such segment, at its op ``p`` of
largest excess, ``y_sp`` says ``s`` is swapped out there (``y_sp <= z_s``: swapped at
all; ``x_s + z_s <= 1``: a tensor is rebuilt or swapped, not both), and those moves free
at least the excess: ``sum nbytes_s (x_s + y_sp) >= curve[p] - budget``. A
swap away at ``p`` was copied out after ``s`` was last written (``w_s``) and before ``p``
starts, and is copied back in after ``p`` ends and before backward reads it (``j_s``),
each copy taking ``latency + nbytes_s / bw`` on its channel, one copy at a time. So for
any time ``L`` the copies out of those written after it fit the channel's free time in
``[L, start[p]]``, and for any ``R`` the copies in of those read by it fit the free time in
``[end[p], R]`` (a few such windows per row, :func:`_cut_points`): free of what the step's
own copies keep the channel busy then (``tl.transfers``, a streamed optimizer's state, as
the planner places them: :func:`tensile.planner.transfer_intervals`). A rebuild reads its
inputs when backward first needs it (op ``j_s``): where an input ``u`` is itself moved and
needed later (``j_s < j_u``), it is back by then unless it is rebuilt once more for that
rebuild alone. So ``u`` frees ``[j_s, j_u)`` only through ``w_up <= x_u + y_up`` with
``w_up <= 1 - x_s + t_u``, ``t_u`` costing a second rebuild (for the earliest such ``s``).
The objective is the rebuilds' rerun time and each swap's price, ``sum cost_s (x_s + t_s)
+ price_s * z_s``, each swap priced as the planner prices it
(:func:`tensile.planner.swap_price_ms`). Every plan of the planner's moves
is a solution, and a costlier one: its rebuilds also keep their other inputs resident (the
program takes an input the step no longer holds, such as a residual branch's batch-norm
output, as free), and its copies keep fixed windows (a property test checks the planner's
priced plans against it on random timelines). So no plan fits ``budget`` for less than
``extra_ms``; how far the greedy plan's estimate lies above it is what a better planner
could still win. Both are in the timeline's own op times: a bound on the planner's model,
not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from .planner import (_rerun_ms, _rerun_ops, check_copy_latency, check_swap_copy_share,
                      check_swap_cost, swap_price_ms, transfer_intervals)
from .timeline import AccessTimeline

__all__ = ["PlanBound", "extra_time_bound"]

WINDOWS = 4   # copy windows per channel per memory row (:func:`_cut_points`)


@dataclass(frozen=True)
class PlanBound:
    """The bound for one budget: ``extra_ms`` (None when not even every move together
    fits the budget), the budget and the peak without a plan (bytes), the activations
    that may move (``movable``, of which ``rebuildable`` can be rebuilt) and whether
    swaps were allowed. The relaxation's own solution, where it has one: per activation,
    how much of it is ``rebuilt`` (``x_s``) and ``swapped`` (``z_s``), and ``first_reader``:
    ``(op, sid)`` of the first activation rebuilt from it before its own backward use (a
    swap must be back by that op where the reader is rebuilt). A guide for a planner
    (:func:`tensile.planner.plan`'s seeded runs), not a plan."""

    budget_bytes: int
    peak_bytes: int
    extra_ms: float | None
    movable: int
    rebuildable: int
    swaps: bool
    rebuilt: dict[int, float] = field(default_factory=dict)
    swapped: dict[int, float] = field(default_factory=dict)
    first_reader: dict[int, tuple[int, int]] = field(default_factory=dict)


def extra_time_bound(tl: AccessTimeline, budget_bytes: int, *, d2h_bw: float | None = None,
                     h2d_bw: float | None = None, min_bytes: int = 1, copy_latency_ms: float = 0.0,
                     swap_cost_ms: float = 0.0, swap_copy_share: float = 0.0) -> PlanBound:
    """The least extra time (ms, the timeline's op times) that any within-iteration plan of
    rebuilds and swaps needs to keep ``tl`` at or under ``budget_bytes`` (module notes).
    Swaps count only with both bandwidths (bytes/s) given; each copy takes
    ``copy_latency_ms`` on its channel besides its bytes, and each swap costs
    ``swap_cost_ms`` and ``swap_copy_share`` of its copies' time, as
    :func:`tensile.planner.plan` prices them (the same arguments); activations smaller
    than ``min_bytes`` never move, as there. With the planner's own arguments, no plan it
    makes is priced (``est_overhead_ms``) below ``extra_ms``."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)) \
            or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    swaps = d2h_bw is not None and h2d_bw is not None
    for name, bw in (("d2h_bw", d2h_bw), ("h2d_bw", h2d_bw)):
        if bw is not None and not (isinstance(bw, (int, float)) and 0 < bw < float("inf")):
            raise ValueError(f"{name} must be a positive number of bytes/s or None, got {bw!r}")
    check_copy_latency(copy_latency_ms)
    check_swap_cost(swap_cost_ms)
    check_swap_copy_share(swap_copy_share)
    curve = tl.vanilla_curve()
    peak = int(curve.max()) if len(curve) else 0
    excess = curve - budget_bytes
    moves = _moves(tl, min_bytes)
    rebuildable = sum(m.cost is not None for m in moves)
    result = PlanBound(budget_bytes=int(budget_bytes), peak_bytes=peak, extra_ms=0.0,
                       movable=len(moves), rebuildable=rebuildable, swaps=swaps)
    if peak <= budget_bytes:
        return result
    if not moves:
        return PlanBound(**{**result.__dict__, "extra_ms": None})
    solved = _solve(tl, excess, moves, swaps, d2h_bw, h2d_bw, copy_latency_ms,
                    (swap_cost_ms, swap_copy_share))
    if solved is None:
        return PlanBound(**{**result.__dict__, "extra_ms": None})
    extra_ms, values = solved

    def share(kind: str) -> dict[int, float]:
        return {m.sid: float(values[(kind, k)]) for k, m in enumerate(moves) if (kind, k) in values}
    readers = {m.sid: (m.split, moves[m.dependent].sid) for m in moves if m.split is not None}
    return PlanBound(**{**result.__dict__, "extra_ms": extra_ms, "rebuilt": share("x"),
                        "swapped": share("z"), "first_reader": readers})


@dataclass(frozen=True)
class _Move:
    """An activation the runtime may move: its gap ``(i, j)``, rebuild ms (None: it cannot
    be rebuilt), the storages its rebuild reads, and ``split``: the backward use of the
    first activation rebuilt from it before its own use (None: none), after which it must
    be back on the device for that rebuild."""

    sid: int
    nbytes: int
    i: int
    j: int
    cost: float | None
    sources: tuple[int, ...]
    split: int | None = None
    dependent: int | None = None     # the index of that activation's move


def _moves(tl: AccessTimeline, min_bytes: int) -> list[_Move]:
    """Each activation the runtime may move (as :meth:`PlanState.resident_candidates`)."""
    out = []
    for sid, t in tl.tensors.items():
        if t.persistent or not t.swappable or t.nbytes < min_bytes:
            continue                        # as the planner's candidates
        gap = tl.backward_gap(sid)
        if gap is None:
            continue
        i, j = gap
        ops = _rerun_ops(tl, sid, i)
        out.append(_Move(sid, t.nbytes, i, j, None if ops is None else _rerun_ms(tl, ops[0], ops[1]),
                         () if ops is None else tuple(ops[3])))
    index = {m.sid: k for k, m in enumerate(out)}
    for k, m in enumerate(out):             # rebuilding m reads its sources at m.j
        for src in m.sources:
            u = out[index[src]] if src in index else None
            if u is not None and m.cost is not None and u.i < m.j < u.j \
                    and (u.split is None or m.j < u.split):
                out[index[src]] = _Move(u.sid, u.nbytes, u.i, u.j, u.cost, u.sources, m.j, k)
    return out


def _solve(tl: AccessTimeline, excess: np.ndarray, moves: list[_Move], swaps: bool,
           d2h_bw: float | None, h2d_bw: float | None, latency_ms: float,
           swap_price: tuple[float, float]) -> tuple[float, dict[tuple, float]] | None:
    """The linear program of the module notes: its optimum and each variable's value (by
    its key: ``("x", move)``, ...); None when it has no solution. ``swap_price``: the
    planner's ``(swap_cost_ms, swap_copy_share)``."""
    n = tl.num_ops
    # Between two gap ends (and splits) the moves spanning an op do not change: one memory
    # row per such segment, at its op of largest excess (``p``).
    cuts = sorted({0, n} | {m.i + 1 for m in moves} | {m.j for m in moves})
    segments = [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b and excess[a:b].max() > 0]
    cols: dict[tuple, int] = {}
    cost: list[float] = []

    def col(key: tuple, price: float = 0.0) -> int:
        if key not in cols:
            cols[key] = len(cost)
            cost.append(price)
        return cols[key]
    rows, entries, rhs = 0, ([], [], []), []

    def add_row(terms: list[tuple[int, float]], bound: float) -> None:
        nonlocal rows
        for c, v in terms:
            entries[0].append(rows)
            entries[1].append(c)
            entries[2].append(v)
        rhs.append(bound)
        rows += 1
    for k, m in enumerate(moves):
        if m.cost is not None:
            col(("x", k), m.cost)           # rebuilt
            if m.split is not None:
                col(("t", k), m.cost)       # rebuilt once more, for its dependent alone
        if swaps:
            col(("z", k), swap_price_ms(m.nbytes, d2h_bw, h2d_bw, *swap_price))   # swapped at all
            if ("x", k) in cols:            # x + z <= 1: a tensor moves one way
                add_row([(cols[("x", k)], 1.0), (cols[("z", k)], 1.0)], 1.0)
    # the channels' time the step's own copies (a streamed optimizer's) leave to swaps
    busy = transfer_intervals(tl, d2h_bw, h2d_bw, latency_ms) if swaps else {"d2h": [], "h2d": []}
    written = {k: float(tl.end[tl.last_write_at_or_before(m.sid, m.i)]) for k, m in enumerate(moves)}
    for s, (a, b) in enumerate(segments):
        p = a + int(np.argmax(excess[a:b]))
        freed, out = [], []
        for k, m in enumerate(moves):
            if not (m.i < a and b <= m.j):
                continue
            gone = [cols[("x", k)]] if ("x", k) in cols else []
            if swaps:                       # swapped out and not yet back at p
                y = col(("y", k, s))
                add_row([(y, 1.0), (cols[("z", k)], -1.0)], 0.0)
                gone.append(y)
                out.append((k, y))
            if m.split is not None and a >= m.split:
                w = col(("w", k, s))        # still away after the split: w <= x + y and
                add_row([(w, 1.0)] + [(c, -1.0) for c in gone], 0.0)   # w <= 1 - x_dep + t
                dep = [(cols[("x", m.dependent)], 1.0)] if ("x", m.dependent) in cols else []
                again = [(cols[("t", k)], -1.0)] if ("t", k) in cols else []
                add_row([(w, 1.0)] + dep + again, 1.0)
                freed.append((w, -float(m.nbytes)))
            else:
                freed += [(c, -float(m.nbytes)) for c in gone]
        if not freed:
            return None                     # nothing can free memory at these ops
        add_row(freed, -float(excess[p]))   # the bytes away >= the excess
        # Away at p: copied out after it was written and before p starts, copied back in
        # after p ends and before backward reads it. Each window's copies share a channel.
        for since in _cut_points([written[k] for k, _ in out]):
            add_row([(y, moves[k].nbytes + latency_ms * d2h_bw / 1e3) for k, y in out
                     if written[k] >= since],
                    d2h_bw * _free_ms(busy["d2h"], since, float(tl.start[p])) / 1e3)
        for until in _cut_points([float(tl.start[moves[k].j]) for k, _ in out]):
            add_row([(y, moves[k].nbytes + latency_ms * h2d_bw / 1e3) for k, y in out
                     if float(tl.start[moves[k].j]) <= until],
                    h2d_bw * _free_ms(busy["h2d"], float(tl.end[p]), until) / 1e3)
    a_ub = coo_matrix((entries[2], (entries[0], entries[1])), shape=(rows, len(cost))).tocsr()
    res = linprog(np.asarray(cost), A_ub=a_ub, b_ub=np.asarray(rhs), bounds=(0.0, 1.0), method="highs")
    if res.status != 0:
        return None
    return float(res.fun), {key: float(res.x[c]) for key, c in cols.items()}


def _cut_points(times: list[float], most: int = WINDOWS) -> list[float]:
    """Up to ``most`` of ``times``, spread from the least to the greatest (each a window's
    edge: any subset of windows gives a valid row, a few give nearly all the tightening)."""
    ordered = sorted(set(times))
    picks = np.unique(np.linspace(0, len(ordered) - 1, min(most, len(ordered))).round().astype(int))
    return [ordered[i] for i in picks]


def _free_ms(busy: list[tuple[float, float]], lo: float, hi: float) -> float:
    """How much of ``[lo, hi]`` (ms) the intervals ``busy`` leave free."""
    taken = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in busy)
    return max(0.0, hi - lo - taken)
