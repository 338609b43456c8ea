"""TENSILE's greedy peak shaving (reference §6), pure Python on an access timeline.

Each round:

1. find the op ``p`` with the most resident bytes (the peak);
2. **swap**: walk the tensors resident at ``p`` from the largest down and take the first
   one whose copies fit fully hidden: the device→host copy in the *earliest* free slot
   of the D2H channel after its last write and before ``p`` starts, the host→device
   copy in the *latest* free slot of the H2D channel after ``p`` ends and before the
   access that needs it. Activations move in their forward→backward gap; parameters and
   optimizer state move across the iteration boundary (out after their update, in
   before their first use in the next iteration);
3. **recompute** (with a budget, or within ``max_overhead`` without one, when no swap
   fits): among resident activations whose producer (and the in-place ops that updated
   them after it, see :func:`recompute_of`) read only tensors that stay resident and
   unmodified until the backward access, take the one with the most bytes freed per ms
   of recomputation;
4. commit one tensor, update the memory curve, repeat.

It stops when the budget is met, or, without a budget, when neither a hidden swap nor a
recomputation within the allowance lowers the current peak. Where recomputation may run,
the rounds run four times (swaps first or not; a recompute's dropped inputs rebuilt for it
alone or not), and twice more with swaps of everything but what the best plan without swaps
rebuilds from, and the best plan is kept (:func:`plan`). Where a budget is out of every
run's reach, the rounds run once more seeded with the swaps of the relaxation that
:mod:`tensile.bound` solves (:func:`_guided_runs`); where it is still unmet, a local search
adds or drops one swapped tensor at a time before the rounds, from no swaps and from the
relaxation's (:func:`_swap_search`). ``swap_search="always"`` runs both where the budget
is met, too, for a cheaper plan. ``max_overhead=0`` (the default) minimises the peak at
(simulated) zero extra time, as TENSILE does; a small allowance buys much more:
recomputing cheap activations (batch norm and ReLU outputs) frees memory that copies
could not move in time.
Each direction is one channel whose busy intervals never overlap; the step's own copies (a
streamed optimizer's state, ``AccessTimeline.transfers``) hold their intervals before any
swap is placed. Failed placements are remembered per (tensor, peak op): channels only fill
up, so a copy that did not fit once never fits later.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from .plan import Plan, Recompute, Swap
from .simulate import kept_ranges, simulate
from .timeline import CROSS_ITERATION_ROLES, AccessTimeline, base_name

if TYPE_CHECKING:   # the bound builds on this module's rebuilds
    from .bound import PlanBound

__all__ = ["plan", "swap_price_ms", "COPY_LATENCY_MS", "CAPTURED_SWAP_COST_MS"]

EPS = 1e-9
# What every planned copy costs beyond bytes / bandwidth (ms): the default of the planner,
# tensile.Scheduler, the scheduler process and the experiments.
COPY_LATENCY_MS = 0.01
# What one swap costs the compute stream of a captured step (ms), its copies hidden or not:
# its copy-out and copy-in each join the compute stream (the release waits for the copy-out,
# the use for the copy-in). On the H200, Inception-v4 at b=16 with 37-38 swaps ran 0.72-0.83
# ms over its priced rebuilds where the same job's swap-free plan ran at its price (twenty-
# ninth session, results/h200/README.md): about 0.02 ms a swap. tensile_graph plans with it.
CAPTURED_SWAP_COST_MS = 0.02


def swap_price_ms(nbytes: int, d2h_bw: float, h2d_bw: float, swap_cost_ms: float = 0.0,
                  swap_copy_share: float = 0.0) -> float:
    """What one swap of ``nbytes`` adds to the step in a plan's price (ms), its copies hidden:
    ``swap_cost_ms``, plus ``swap_copy_share`` of its copies' own time (``nbytes`` over each
    bandwidth, bytes/s: out and in)."""
    return swap_cost_ms + swap_copy_share * 1e3 * nbytes * (1.0 / d2h_bw + 1.0 / h2d_bw)


def plan(
    timeline: AccessTimeline,
    *,
    budget_bytes: int | None = None,
    d2h_bw: float,
    h2d_bw: float,
    allow_recompute: bool = True,
    allow_cross_iteration: bool = True,
    copy_latency_ms: float = COPY_LATENCY_MS,
    min_bytes: int = 1,
    max_overhead: float = 0.0,
    allow_swaps: bool = True,
    rebuild_ahead: float = 0.0,
    swap_cost_ms: float = 0.0,
    swap_copy_share: float = 0.0,
    swap_search: str = "unmet",
) -> Plan:
    """Plan swaps and recomputation for one iteration.

    ``d2h_bw``/``h2d_bw`` are copy bandwidths in bytes/s (measured, see
    :func:`tensile.estimate.measure_copy_bandwidth`); every copy also costs
    ``copy_latency_ms``. Tensors smaller than ``min_bytes`` are never moved.
    ``budget_bytes=None`` minimises the peak with hidden swaps, then with recomputation
    that adds at most ``max_overhead`` x the iteration time (0: none). With a budget,
    ``max_overhead`` is not used: recomputation goes as far as the budget needs.
    ``allow_swaps=False`` plans recomputation only (a plan whose copies would wait on channels
    the step itself keeps busy, say a streamed optimizer's). ``rebuild_ahead`` > 0: then
    issue rebuilds that many times their own rerun time before backward needs them, on a
    side stream, where the memory allows (:func:`schedule_ahead`); 0: on demand.
    ``swap_cost_ms``: what each swap adds to the step beside its hidden copies (a captured
    step's joins: :data:`CAPTURED_SWAP_COST_MS`); it counts in the plan's estimated extra
    time, so the plan kept is the cheapest with it. 0 (default): swaps are free once hidden,
    as TENSILE prices them. ``swap_copy_share``: what share of its copies' own time (bytes
    over bandwidth, out and in) each swap adds beside that (:func:`swap_price_ms`), so that
    a swap of many bytes competes with the rebuilds it spares at what it costs the step
    although hidden; 0 (default): nothing. Captured swap plans ran over their price by
    such a share, but one that depends on the model and the GPU (the price-gap table of
    ``experiments.report``): on the H200 DenseNet-121 10 %, Inception-v3 and -v4 6 %,
    ResNet-50 2 %; on an H100 DenseNet-121 3 %, while Inception-v4's swap plans ran a
    median 0.06 ms over their price there (under 1 %). With 0.04 DenseNet-121's plan drops
    its swaps and ran 0.2 ms faster on an H100; Inception-v4's keeps fewer and showed no
    gain there (sixty-fourth session, ``results/h100-80gb-hbm3/README.md``): no one value
    serves every job, so none is the default.
    ``swap_search``: when to run the greedy rounds seeded with the swaps of the bound's
    relaxation (:func:`_guided_runs`) and then search for the set of tensors swapped before
    the rounds (:func:`_swap_search`): ``"unmet"`` (default) where no plan so far meets the
    budget; ``"always"`` also where one does, for a cheaper plan (each try is a whole greedy
    run: seconds in all on ResNet-50, about a minute on Inception-v4, on a
    laptop); ``"never"``.
    Every peak counts the workspaces ops hold while they run (``timeline.scratch``).
    """
    check_plan_args(budget_bytes, d2h_bw, h2d_bw, copy_latency_ms, min_bytes)
    check_swap_search(swap_search)
    check_swap_cost(swap_cost_ms)
    check_swap_copy_share(swap_copy_share)
    check_max_overhead(max_overhead)
    check_rebuild_ahead(rebuild_ahead)
    t0 = time.perf_counter()
    best = _best_plan(timeline, budget_bytes, d2h_bw=d2h_bw, h2d_bw=h2d_bw,
                      allow_recompute=allow_recompute, allow_cross_iteration=allow_cross_iteration,
                      copy_latency_ms=copy_latency_ms, min_bytes=min_bytes,
                      max_overhead=max_overhead, allow_swaps=allow_swaps,
                      swap_cost_ms=swap_cost_ms, swap_copy_share=swap_copy_share,
                      swap_search=swap_search)
    if rebuild_ahead:
        schedule_ahead(timeline, best, rebuild_ahead)
    best.planner_ms = (time.perf_counter() - t0) * 1e3
    return best


def _best_plan(timeline: AccessTimeline, budget_bytes: int | None, *, d2h_bw: float,
               h2d_bw: float, allow_recompute: bool, allow_cross_iteration: bool,
               copy_latency_ms: float, min_bytes: int, max_overhead: float, allow_swaps: bool,
               swap_cost_ms: float, swap_copy_share: float, swap_search: str) -> Plan:
    """The best of the greedy runs :func:`plan` makes (its comments), before rebuilds are
    scheduled ahead."""
    args = (timeline, budget_bytes, d2h_bw, h2d_bw, allow_recompute, allow_cross_iteration,
            copy_latency_ms, min_bytes, max_overhead, swap_cost_ms, swap_copy_share)

    def run(**kw) -> Plan:   # one greedy run, reverse-deleted (a plan without recomputes stays)
        return keep_what_fits(timeline, _greedy(*args, **kw))
    runs = [run(allow_swaps=allow_swaps, transient=True)]
    if allow_recompute and (budget_bytes is not None or max_overhead > 0):
        # Swaps first is TENSILE's order, but a swapped tensor cannot feed a recompute and
        # is back (in memory) before its use: where recomputation may do the work, a plan
        # without swaps can peak lower. Rebuilding an input for one recompute alone keeps
        # memory down but spends allowance that other recomputes could use. So plan four
        # ways: swaps first or not, such one-off rebuilds or not.
        for swaps, transient in ((True, False), (False, True), (False, False)):
            if (swaps and not allow_swaps) or (swaps, transient) == (allow_swaps, True):
                continue   # swaps not allowed, or the first run already is this one
            runs.append(run(allow_swaps=swaps, transient=transient))
        no_swaps = min((r for r in runs if not r.swaps), key=lambda r: _rank(r, budget_bytes))
        if allow_swaps and no_swaps.recomputes:
            # Then twice more, swapping anything but what the best plan without swaps
            # rebuilds from: swapping such a tensor early forces costlier rebuilds later.
            # Inception-v4 at checkpointing's peak on the H200: 1.09 ms of rebuilds where
            # the four runs above price 1.58 (a snapshot of the twenty-third session).
            keep = frozenset(_rebuild_inputs(no_swaps))
            runs += [run(allow_swaps=True, transient=t, no_swap=keep) for t in (True, False)]
    # The best: feasible, then the lower peak, then less extra time (swaps priced in).
    best = min(runs, key=lambda r: _rank(r, budget_bytes))

    def searching(p: Plan) -> bool:   # swap_search's rule for the search and seeded runs
        return allow_swaps and allow_recompute and (
            swap_search == "always" or (swap_search == "unmet" and not p.feasible))
    relaxed = None
    if searching(best) and budget_bytes is not None:
        from .bound import extra_time_bound   # the bound builds on this module's rebuilds
        relaxed = extra_time_bound(timeline, budget_bytes, d2h_bw=d2h_bw, h2d_bw=h2d_bw,
                                   min_bytes=min_bytes, copy_latency_ms=copy_latency_ms,
                                   swap_cost_ms=swap_cost_ms, swap_copy_share=swap_copy_share)
        best = min([best] + _guided_runs(run, timeline, relaxed),
                   key=lambda r: _rank(r, budget_bytes))
    if searching(best) and best.recomputes:
        # Where the budget is out of reach, the plan's own peak may be a rebuild's: a
        # tensor rebuilt in backward with the chain of inputs it needs (ResNet-50's first
        # stage, 171 MB rebuilt at once for one 49 MB tensor). Swapping a few large tensors
        # for their whole gap, and planning the rest by recomputation, can reach lower than
        # either alone (ResNet-50 at b=16 on the H200: 540 -> 492 MB, a snapshot of the
        # forty-third session; VGG-16 at the authors' MSR: 2214 -> 2189 MiB, within its
        # budget). Where the budget is met, the same search may find a cheaper plan
        # (ResNet-50 at the authors' MSR: 1.16 -> 0.89 ms priced, from no swaps), but each
        # try is a whole greedy run (half a second on Inception-v4): only with
        # swap_search="always". It starts from no swaps and from the relaxation's.
        starts, until = [()], {}
        if relaxed is not None:
            until = _backs_by(relaxed, GUIDE_SHARES[0])
            starts.append(_relaxed_swaps(timeline, relaxed, GUIDE_SHARES[0]))
        best = _swap_search(run, timeline, best, budget_bytes, min_bytes, starts, until)
    return best


# :func:`_guided_runs`: seeded with what the relaxation swaps at least this much of, each
# share in turn (a greedy run's copies pack the channel less tightly than the relaxation's:
# with fewer seeds, those left can be back in time more often).
GUIDE_SHARES = (0.5, 0.9)


def _guided_runs(run, tl: AccessTimeline, relaxed: PlanBound) -> list[Plan]:
    """Greedy runs that first swap what the linear relaxation of the bound swaps
    (``relaxed``, :func:`tensile.bound.extra_time_bound`: at least a share in
    :data:`GUIDE_SHARES` of a tensor), each back by the first rebuild that reads it where
    the relaxation rebuilds that reader, then plan the rest (with further swaps or not; a
    recompute's dropped inputs rebuilt for it alone or not). The greedy rounds shave the
    peak of the moment, and a tensor swapped early there keeps the rebuilds that read it
    out of reach; the relaxation weighs every peak at once. Inception-v4 at checkpointing's
    peak on the H200 (a snapshot of 2026-12-02, b=16): the relaxation swaps the stem's
    largest outputs and rebuilds the rest, priced 0.88 ms where the greedy runs price
    1.59; seeded with the 13 it swaps nearly whole, a greedy run plans it for 0.93. Empty
    where the relaxation swaps nothing."""
    runs, seen = [], set()
    for share in GUIDE_SHARES:
        pre = _relaxed_swaps(tl, relaxed, share)
        if not pre or pre in seen:
            continue
        seen.add(pre)
        until = _backs_by(relaxed, share)
        runs += [run(allow_swaps=swaps, transient=transient, pre_swaps=pre, swap_until=until)
                 for swaps in (False, True) for transient in (True, False)]
    return runs


def _relaxed_swaps(tl: AccessTimeline, relaxed: PlanBound, share: float) -> tuple[int, ...]:
    """The activations ``relaxed`` swaps at least ``share`` of, in forward order."""
    return _in_forward_order(tl, (sid for sid, z in relaxed.swapped.items() if z >= share))


def _in_forward_order(tl: AccessTimeline, sids) -> tuple[int, ...]:
    """Activations ``sids`` by the start of their forward-to-backward gap (the order in
    which ``pre_swaps`` are placed on the channels)."""
    return tuple(sorted(sids, key=lambda sid: (tl.backward_gap(sid)[0], sid)))


def _backs_by(relaxed: PlanBound, share: float) -> dict[int, int]:
    """sid -> the op by which a swap of it must be back: that of the first rebuild reading
    it, where ``relaxed`` rebuilds that reader at least ``share``."""
    return {sid: op for sid, (op, reader) in relaxed.first_reader.items()
            if relaxed.rebuilt.get(reader, 0.0) >= share}


# The search of :func:`_swap_search`: at most this many rounds from each start, each trying
# this many tensors (the largest activations whose gap spans memory over the target).
SWAP_SEARCH_ROUNDS = 4
SWAP_SEARCH_WIDTH = 10


def _swap_search(run, tl: AccessTimeline, best: Plan, budget_bytes: int | None, min_bytes: int,
                 starts: list[tuple[int, ...]], until: dict[int, int]) -> Plan:
    """Local search over the set of activations swapped for their whole gap before the
    greedy rounds plan the rest by recomputation (``run`` with ``pre_swaps``). From each
    set in ``starts``, each round tries dropping each tensor of the set and adding each of
    the :data:`SWAP_SEARCH_WIDTH` candidates (:func:`_search_candidates`), and keeps the
    best try if it ranks above the current one (:func:`_rank`); it stops at the first round
    that brings nothing, or after :data:`SWAP_SEARCH_ROUNDS`. A swap in ``until`` is back
    by that op (a rebuild there reads it). Each start runs both ways of rebuilding a
    recompute's dropped inputs and keeps the better for its rounds. Returns the best plan
    seen (``best`` if none beat it)."""
    candidates = _search_candidates(tl, budget_bytes if budget_bytes is not None
                                    else best.peak_after, min_bytes)[:SWAP_SEARCH_WIDTH]

    def swapped(p: Plan) -> frozenset[int]:   # those of a try that fitted on the channels
        return frozenset(s.sid for s in p.swaps)
    # a whole greedy run per try: tens of seconds on Inception-v4 (shown on a terminal)
    with tqdm(desc="TENSILE swap search", unit="plan", disable=None, leave=False) as bar:
        def attempt(chosen: frozenset[int], transient: bool) -> Plan:
            bar.update()
            return run(allow_swaps=False, transient=transient,
                       pre_swaps=_in_forward_order(tl, chosen), swap_until=until)
        for start in starts:
            current, transient = min(((attempt(frozenset(start), t), t) for t in (True, False)),
                                     key=lambda x: _rank(x[0], budget_bytes))
            for _ in range(SWAP_SEARCH_ROUNDS):
                chosen = swapped(current)
                tries = [attempt(chosen ^ {sid}, transient)
                         for sid in sorted(chosen) + [c for c in candidates if c not in chosen]]
                if not tries:
                    break
                p = min(tries, key=lambda r: (_rank(r, budget_bytes), sorted(swapped(r))))
                if _rank(p, budget_bytes) >= _rank(current, budget_bytes):
                    break
                current = p
            best = min(best, current, key=lambda r: _rank(r, budget_bytes))
    return best


def _search_candidates(tl: AccessTimeline, target: int, min_bytes: int) -> list[int]:
    """Swappable activations of at least ``min_bytes`` whose forward-to-backward gap spans
    an op where the unplanned step holds more than ``target`` bytes, largest first."""
    over = np.flatnonzero(tl.vanilla_curve() > target)
    out = []
    for sid, t in tl.tensors.items():
        if not t.swappable or t.persistent or t.nbytes < min_bytes:
            continue
        gap = tl.backward_gap(sid)
        if gap is not None and np.any((over > gap[0]) & (over < gap[1])):
            out.append(sid)
    return sorted(out, key=lambda s: (-tl.tensors[s].nbytes, s))


def keep_what_fits(tl: AccessTimeline, p: Plan) -> Plan:
    """``p`` without the recomputes it does not need: the greedy rounds drop whole tensors
    at the peak of the moment, so the last ones often take the memory below the budget by
    more than a tensor, and a drop made early may be covered by later ones. Costliest
    first, a recompute that no other one reads (as a source, or rebuilt for it alone) is
    taken out again where the memory (:func:`simulate`) stays within the budget (without
    one, or when the budget is not met: within the plan's own peak). Repeated until none
    can go. A reverse-delete pass, as for greedy set covers; it only removes work."""
    cap = p.budget_bytes if p.budget_bytes is not None and p.feasible else p.peak_after

    def read(recomputes: list[Recompute]) -> set[int]:   # what other rebuilds need back
        return {s for r in recomputes for s in [*r.sources, *r.transient]}
    kept = list(p.recomputes)
    removed = True
    while removed:
        removed = False
        needed = read(kept)
        for r in sorted(kept, key=lambda r: (-r.cost_ms, r.sid)):
            if r.sid in needed:
                continue
            trial = [q for q in kept if q is not r]
            if simulate(tl, replace(p, recomputes=trial)).peak <= cap:
                kept, removed, needed = trial, True, read(trial)
    if len(kept) == len(p.recomputes):
        return p
    gone = sum(r.cost_ms for r in p.recomputes if r not in kept)   # the swaps' price stays
    # a rebuild may hold memory of its own (inputs rebuilt for it alone): without it the
    # peak may even fall, below a budget the plan missed
    peak = simulate(tl, replace(p, recomputes=kept)).peak
    return replace(p, recomputes=kept, swaps=with_first_uses(tl, p.swaps, kept), peak_after=peak,
                   feasible=p.budget_bytes is None or peak <= p.budget_bytes,
                   est_overhead_ms=float(p.est_overhead_ms - gone))


def schedule_ahead(tl: AccessTimeline, p: Plan, lead: float) -> None:
    """Rebuild ``p``'s recomputes ahead of need, in place: each issued ``lead`` times its
    rerun time before its ``before_op`` (``Recompute.issue_op``), or as early after that as
    the memory allows, on a side stream, so that the rerun overlaps the compute stream's
    backward kernels instead of delaying them (a rebuild reruns forward ops: batch-norm
    applies, bandwidth-bound, overlap well with convolution gradients, compute-bound).

    A rebuild goes ahead with the dropped sources rebuilt inside it (those due at the same
    op: :meth:`PlanState._early_rebuilds` put them there), as one group, at one op. It
    stays on demand if one of them rebuilds an input for itself alone (``transient``) or
    reads a swapped tensor, or if a dropped source outside the group is not back by then.
    The group is resident from its ``issue_op`` on, and never above the plan's own peak
    (``p.peak_after``). Groups are placed in the order backward needs them, so a later
    group finds its sources' places decided."""
    curve = simulate(tl, p).curve
    swapped = {sw.sid for sw in p.swaps}
    by_sid = {r.sid: r for r in p.recomputes}
    done: set[int] = set()
    for r in sorted(p.recomputes, key=lambda r: (r.before_op, -r.sid)):
        group, todo = {}, [r]
        while todo:                       # r and the dropped sources rebuilt inside it
            q = todo.pop()
            group[q.sid] = q
            todo += [by_sid[x] for x in q.sources if x in by_sid and x not in group
                     and by_sid[x].before_op == r.before_op]
        if done & set(group):
            continue                      # part of a group placed before
        members = list(group.values())
        outside = [by_sid[x] for q in members for x in q.sources if x in by_sid and x not in group]
        if any(q.transient for q in members) or swapped & {x for q in members for x in q.sources}:
            continue
        # the latest op that ends ``lead`` x the reruns before the group is needed, not
        # before its release or before the dropped sources it reads are back
        rerun = sum(_rerun_ms(tl, q.producer_op, q.then_ops) for q in members)
        want = float(tl.start[r.before_op]) - lead * rerun
        e = max([int(np.searchsorted(tl.end, want + EPS, side="right")) - 1]
                + [q.release_after_op + 1 for q in members]
                + [x.before_op if x.issue_op is None else x.issue_op for x in outside])
        # ... or later, so that the ops between it and the use stay within the peak
        nbytes = sum(q.nbytes for q in members)
        over = np.nonzero(curve[e + 1:r.before_op] + nbytes > p.peak_after)[0]
        if len(over):
            e += int(over[-1]) + 1
        if e >= r.before_op - 1:
            continue                      # no op left to overlap: on demand
        for q in members:
            q.issue_op = e
        curve[e + 1:r.before_op] += nbytes
        done |= set(group)


def _nonneg_number(x) -> bool:
    """A finite int or float >= 0 (not a bool)."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and 0 <= x < float("inf")


def check_rebuild_ahead(lead) -> None:
    if not _nonneg_number(lead):
        raise ValueError(f"rebuild_ahead must be a number of rerun times >= 0 (0: on demand), "
                         f"got {lead!r}")


def _rebuild_inputs(p: Plan) -> set[int]:
    """The storages ``p``'s recomputes read: their sources, the tensors rebuilt for them
    alone and those kept for them."""
    return {s for r in p.recomputes for s in [*r.sources, *r.transient, *r.kept]}


def _rank(p: Plan, budget_bytes: int | None) -> tuple:
    """Sort key of plans, best first: feasible, then (no budget, or none met) the lower
    peak, then less extra time, then fewer copies."""
    return (not p.feasible, p.peak_after if budget_bytes is None or not p.feasible else 0,
            p.est_overhead_ms, len(p.swaps))


def _greedy(timeline: AccessTimeline, budget_bytes: int | None, d2h_bw: float, h2d_bw: float,
            allow_recompute: bool, allow_cross_iteration: bool, copy_latency_ms: float,
            min_bytes: int, max_overhead: float, swap_cost_ms: float, swap_copy_share: float,
            allow_swaps: bool, transient: bool = True, no_swap: frozenset[int] = frozenset(),
            pre_swaps: tuple[int, ...] = (), swap_until: dict[int, int] | None = None) -> Plan:
    """One run of the greedy peak shaving (the module docstring); ``allow_swaps=False``:
    recomputation only; ``transient=False``: a recompute's dropped inputs are always rebuilt
    early and kept (see :meth:`PlanState.try_recompute`); ``no_swap``: storages never
    swapped (they may still be rebuilt); ``swap_cost_ms``, ``swap_copy_share``: each swap's
    price (:func:`plan`);
    ``pre_swaps``: activations swapped for their whole gap before the rounds start, where
    they fit (:meth:`PlanState.swap_whole_gap`), each back by its op in ``swap_until`` where
    it has one (other entries there are not used)."""
    st = PlanState(timeline, d2h_bw, h2d_bw, copy_latency_ms)
    st.transient_ok = transient
    st.no_swap = no_swap
    peak_before = int(st.mem.max()) if timeline.num_ops else 0
    for sid in pre_swaps:
        st.swap_whole_gap(sid, (swap_until or {}).get(sid))
    failed: set[tuple[int, int]] = set()
    while timeline.num_ops:
        p = int(np.argmax(st.mem))
        if budget_bytes is not None and st.mem[p] <= budget_bytes:
            break
        if allow_swaps and st.try_swap(p, allow_cross_iteration, min_bytes, failed):
            continue
        if not allow_recompute or not st.try_recompute(
                p, min_bytes, st.recompute_allowance_ms(budget_bytes, max_overhead)):
            break
    peak_after = int(st.mem.max()) if timeline.num_ops else 0
    result = Plan(
        num_ops=timeline.num_ops,
        budget_bytes=budget_bytes,
        d2h_bytes_per_s=float(d2h_bw),
        h2d_bytes_per_s=float(h2d_bw),
        swaps=with_first_uses(timeline, st.swaps, st.recomputes),
        recomputes=sorted(st.recomputes, key=lambda r: (r.before_op, r.sid)),
        peak_before=peak_before,
        peak_after=peak_after,
        feasible=budget_bytes is None or peak_after <= budget_bytes,
        est_overhead_ms=st.extra_ms(swap_cost_ms, swap_copy_share),
        iteration_ms=timeline.iteration_ms,
    )
    # The incremental curve and an independent replay must agree; if not, the
    # planner's bookkeeping is wrong and its claims cannot be trusted.
    replay = simulate(timeline, result)
    if not np.array_equal(replay.curve, st.mem):
        raise AssertionError("TENSILE planner bug: incremental memory curve differs from replay")
    return result


def with_first_uses(tl: AccessTimeline, swaps: list[Swap],
                    recomputes: list[Recompute]) -> list[Swap]:
    """``swaps`` in the order of their copy-outs, each one's ``use_op`` the first op after
    its copy-in is issued that reads it: a rebuild in ``recomputes`` (its own sources, or
    those of one rebuilt for it alone) or its backward access. A swap placed to be back for
    a rebuild (``swap_until``) that the plan does not make is needed later; one placed for
    its backward access may feed a rebuild before it."""
    rebuilt = {r.sid: r for r in recomputes}

    def first_use(s: Swap) -> Swap:
        if s.cross_iteration:
            return s
        readers = [r.before_op for r in recomputes if r.before_op > s.in_issue_op
                   and any(s.sid in q.sources for q in [r] + [rebuilt[t] for t in r.transient])]
        first = min(readers + [tl.backward_gap(s.sid)[1]])
        return s if first == s.use_op else replace(s, use_op=first)
    return sorted(map(first_use, swaps), key=lambda s: (s.out_issue_op, s.out_start_ms, s.sid))


def transfer_intervals(tl: AccessTimeline, d2h_bw: float, h2d_bw: float,
                       latency: float) -> dict[str, list[tuple[float, float]]]:
    """When the step's own copies (``tl.transfers``: a streamed optimizer's state) keep each
    channel busy, ``{"d2h": [(start, end), ...], "h2d": [...]}`` in ms: each copy starts when
    its op is issued or when the channel's previous one of them ends (a stream runs its
    copies in order) and takes bytes / bandwidth (bytes/s) plus ``latency``; kept inside the
    iteration (the channel is full to its end either way)."""
    out: dict[str, list[tuple[float, float]]] = {"d2h": [], "h2d": []}
    last = {"h2d": 0.0, "d2h": 0.0}
    cycle = tl.iteration_ms
    for op, direction, nbytes in tl.transfers:
        per_byte = 1e3 / (h2d_bw if direction == "h2d" else d2h_bw)
        start = max(float(tl.start[op]), last[direction])
        if start >= cycle - EPS:
            continue   # the channel is busy to the iteration's end already
        last[direction] = start + nbytes * per_byte + latency
        out[direction].append((start, min(last[direction], cycle)))
    return out


class CopyChannel:
    """One copy direction: sorted, pairwise disjoint busy intervals ``[start, end)`` in ms.

    ``cycle`` is the iteration length: the channel repeats every iteration, so a copy that
    runs past ``cycle`` occupies the start of the next one (:meth:`add` folds it there).
    """

    def __init__(self, cycle: float | None = None) -> None:
        self.busy: list[tuple[float, float]] = []
        self.cycle = cycle

    def earliest(self, lo: float, hi: float, d: float) -> float | None:
        """Earliest start ``>= lo`` of a free slot of length ``d`` ending by ``hi``."""
        t = lo
        for s, e in self.busy:
            if e <= t + EPS:
                continue
            if s >= t + d - EPS:
                break
            t = e
        return t if t + d <= hi + EPS else None

    def latest(self, lo: float, hi: float, d: float) -> float | None:
        """Latest start of a free slot of length ``d`` inside ``[lo, hi]``."""
        t = hi  # candidate end of the slot
        for s, e in reversed(self.busy):
            if s >= t - EPS:
                continue
            if e <= t - d + EPS:
                break
            t = s
        return t - d if t - d >= lo - EPS else None

    def earliest_wrapping(self, lo: float, d: float, hi_next: float) -> float | None:
        """Earliest start ``>= lo`` of a copy of length ``d`` that runs past the end of the
        iteration (``cycle``) and is done by ``hi_next`` in the next one, on this channel
        unrolled over two iterations. None if it would fit before the end (then
        :meth:`earliest` places it) or no such slot is free."""
        unrolled = CopyChannel()
        unrolled.busy = self.busy + [(s + self.cycle, e + self.cycle) for s, e in self.busy]
        a = unrolled.earliest(lo, self.cycle + hi_next, d)
        return a if a is not None and a + d > self.cycle + EPS else None

    def add(self, start: float, end: float) -> None:
        if self.cycle is not None and end > self.cycle + EPS:   # runs into the next iteration
            if start < self.cycle:
                bisect.insort(self.busy, (start, self.cycle))
            bisect.insort(self.busy, (max(0.0, start - self.cycle), end - self.cycle))
            return
        bisect.insort(self.busy, (start, end))


class PlanState:
    """The planner's working state: memory curve, channels, committed actions."""

    def __init__(self, tl: AccessTimeline, d2h_bw: float, h2d_bw: float, latency: float):
        self.tl = tl
        self.bandwidths = (d2h_bw, h2d_bw)
        self.d2h_ms_per_byte = 1e3 / d2h_bw
        self.h2d_ms_per_byte = 1e3 / h2d_bw
        self.latency = latency
        self.mem = tl.vanilla_curve()
        self.sids = np.array(sorted(tl.tensors), dtype=np.int64)
        info = [tl.tensors[int(s)] for s in self.sids]
        self.nbytes = np.array([t.nbytes for t in info], dtype=np.int64)
        rng = [tl.vanilla_range(t.sid) for t in info]
        self.vlo = np.array([r[0] for r in rng], dtype=np.int64)
        self.vhi = np.array([r[1] for r in rng], dtype=np.int64)
        self.movable = np.array([t.swappable for t in info], dtype=bool)
        self.free = np.ones(len(info), dtype=bool)  # neither moved nor pinned as a source
        self.pinned = np.zeros(len(info), dtype=bool)  # a source of recomputes, not moved
        self.moved: set[int] = set()  # swapped or recomputed
        self.rebuilt: dict[int, Recompute] = {}  # recomputed: sid -> its recompute
        self.dependents: dict[int, list[Recompute]] = {}  # sid -> the recomputes reading it
        self.rebuilt_for: dict[int, list[Recompute]] = {}  # sid -> recomputes it is transient in
        self.row = {int(s): i for i, s in enumerate(self.sids)}
        self.d2h, self.h2d = CopyChannel(tl.iteration_ms), CopyChannel(tl.iteration_ms)
        self.swaps: list[Swap] = []
        self.recomputes: list[Recompute] = []
        self.recompute_ms = 0.0   # the recomputes' cost so far
        self.transient_ok = True  # may rebuild a recompute's dropped inputs for it alone
        self.no_swap: frozenset[int] = frozenset()   # never swapped (see plan())
        self.gaps: dict[int, tuple[int, int] | None] = {}   # backward_gap, asked once
        self.rerun_ops: dict[int, tuple | None] = {}        # recompute_of's cache
        self.score_bounds: dict[int, float] = {}           # _score_bound's, asked once
        self.kept_hi: dict[int, int] = {}   # sources kept for recomputes: sid -> last op kept
        # swapped activations: sid -> an op after which a rebuild may read it, its copy-in
        # issued (:func:`recompute_of`) and done by the rebuild's start (:meth:`_add_swap`)
        self.back_by: dict[int, int] = {}
        self.reserve_transfers()

    def extra_ms(self, swap_cost_ms: float, swap_copy_share: float) -> float:
        """The plan's estimated extra time so far: its rebuilds' rerun time and each swap's
        price (:func:`swap_price_ms`)."""
        return float(sum(r.cost_ms for r in self.recomputes)) + sum(
            swap_price_ms(s.nbytes, *self.bandwidths, swap_cost_ms, swap_copy_share)
            for s in self.swaps)

    def reserve_transfers(self) -> None:
        """Mark the step's own copies (``tl.transfers``: a streamed optimizer's state) busy on
        their channels (:func:`transfer_intervals`). The plan's copies then go around them.
        Call again after replacing the channels (the joint planner does)."""
        busy = transfer_intervals(self.tl, *self.bandwidths, self.latency)
        for direction, channel in (("d2h", self.d2h), ("h2d", self.h2d)):
            for start, end in busy[direction]:
                channel.add(start, end)

    # -------------------------------------------------------------- helpers
    def resident_candidates(self, p: int, min_bytes: int, pinned_too: bool = False) -> list[int]:
        """Movable, untouched tensors resident at op ``p``, largest first (``pinned_too``:
        also those pinned as sources of recomputes)."""
        untouched = self.free | (pinned_too & self.pinned)
        ok = (self.vlo <= p) & (p <= self.vhi) & self.movable & untouched & (self.nbytes >= min_bytes)
        idx = np.nonzero(ok)[0]
        order = np.lexsort((self.sids[idx], -self.nbytes[idx]))
        return self.sids[idx[order]].tolist()   # Python ints, as the callers' sets hold

    def commit(self, sid: int, lo: int, hi: int) -> None:
        self.mem[lo:hi + 1] -= self.tl.tensors[sid].nbytes
        self.free[self.row[sid]] = False
        self.moved.add(sid)

    # -------------------------------------------------------------- swaps
    def try_swap(self, p: int, allow_cross: bool, min_bytes: int,
                 failed: set[tuple[int, int]]) -> bool:
        for sid in self.resident_candidates(p, min_bytes):
            if (sid, p) in failed or sid in self.no_swap:
                continue
            t = self.tl.tensors[sid]
            if t.persistent:
                placed = self._place_cross(sid, p) if allow_cross and t.role in CROSS_ITERATION_ROLES else None
            else:
                placed = self._place_transient(sid, p)
            if placed is None:
                failed.add((sid, p))
                continue
            self._add_swap(*placed)
            return True
        return False

    def swap_whole_gap(self, sid: int, until: int | None = None) -> bool:
        """Swap activation ``sid`` for as much of its forward-to-backward gap as the channels
        allow: out as early as possible, back in just in time for its backward use (or, if
        the H2D channel is busy then, around the current peak). ``until``: back by that op
        instead, an earlier one in the gap (a rebuild there reads it). False where it fits
        neither way."""
        tl = self.tl
        gap = tl.backward_gap(sid)
        if gap is None:
            return False
        use = gap[1] if until is None else until - 1   # as _place_transient
        d_in = self._durations(tl.tensors[sid].nbytes)[1]
        just_in_time = min(tl.last_op_ending_by(float(tl.start[use]) - d_in) - 1, use - 1)
        for p in (just_in_time, int(np.argmax(self.mem))):
            placed = self._place_transient(sid, p, until) if gap[0] < p < use else None
            if placed is not None:
                self._add_swap(*placed)
                return True
        return False

    def _add_swap(self, swap: Swap, lo: int, hi: int) -> None:
        """Book ``swap``'s copies on their channels and its absence (ops ``lo``..``hi``)."""
        self.d2h.add(swap.out_start_ms, swap.out_end_ms)
        self.h2d.add(swap.in_start_ms, swap.in_end_ms)
        self.swaps.append(swap)
        if not swap.cross_iteration:
            # A rebuild runs when backward unpacks what it rebuilds, at the start of its op,
            # and may read the tensor from an op whose start the copy-in has ended by: a
            # later one would wait on the copy, which no price counts. And not before the
            # second op after the copy-in's issue (:func:`recompute_of`).
            done = self.tl.first_op_starting_at_or_after(swap.in_end_ms - EPS)
            self.back_by[swap.sid] = max(swap.in_issue_op + 1, done - 1)
        self.commit(swap.sid, lo, hi)

    def _durations(self, nbytes: int) -> tuple[float, float]:
        return (self.latency + nbytes * self.d2h_ms_per_byte,
                self.latency + nbytes * self.h2d_ms_per_byte)

    def _place_transient(self, sid: int, p: int,
                         until: int | None = None) -> tuple[Swap, int, int] | None:
        """Swap an activation out in its forward→backward gap around op ``p``, back by its
        backward use (or by op ``until``, earlier in the gap)."""
        tl, t = self.tl, self.tl.tensors[sid]
        gap = tl.backward_gap(sid)
        if gap is None or not gap[0] < p < gap[1]:
            return None
        i, j = gap
        deadline = j
        if until is not None:
            # Back one op early: the runtime runs the copy-in's issue at its op's last hook,
            # which may come after the reader's unpack (that starts the rebuild) at the same op.
            if not (p < until - 1 and until <= j):
                return None
            j, deadline = until, until - 1
        w = tl.last_write_at_or_before(sid, i)
        d_out, d_in = self._durations(t.nbytes)
        # Out: as early as possible once the data is final; done before p starts.
        a = self.d2h.earliest(float(tl.end[w]), float(tl.start[p]), d_out)
        if a is None:
            return None
        # In: as late as possible after p, done before the access that needs it.
        c = self.h2d.latest(float(tl.end[p]), float(tl.start[deadline]), d_in)
        if c is None:
            return None
        k_out, k_in = tl.last_op_ending_by(a), tl.last_op_ending_by(c)
        lo = tl.first_op_starting_at_or_after(max(a + d_out, float(tl.end[max(i, k_out)])))
        # Dropped after the op the copy-out should end in, not right after the last read:
        # the memory counts as free from op lo either way, and in a CUDA graph a release
        # makes the compute stream wait for the copy-out (runtime notes), which an earlier
        # release would turn into a stall of the copy's whole length.
        swap = Swap(sid=sid, nbytes=t.nbytes, cross_iteration=False,
                    out_issue_op=k_out, out_start_ms=a, out_end_ms=a + d_out,
                    release_after_op=lo - 1, in_issue_op=k_in, in_start_ms=c,
                    in_end_ms=c + d_in, use_op=j)
        return swap, lo, k_in

    def _place_cross(self, sid: int, p: int) -> tuple[Swap, int, int] | None:
        """Swap a parameter / optimizer state out after its update, in before next use."""
        tl, t = self.tl, self.tl.tensors[sid]
        nb = t.needed_by if t.needed_by is not None else t.first
        if not p < nb:
            return None
        d_out, d_in = self._durations(t.nbytes)
        # Out: after the last access. The runtime drops the device copy when the next step
        # starts, and record_stream keeps the block from reuse until the copy has read it:
        # a copy done by the iteration end frees the tensor from op 0 on; one that runs into
        # the next iteration (optimizer state updated at the very end) frees it when it ends.
        T, lo = tl.iteration_ms, 0
        a = self.d2h.earliest(float(tl.end[t.last]), T, d_out)
        if a is None:
            a = self.d2h.earliest_wrapping(float(tl.end[t.last]), d_out, float(tl.start[p]))
            if a is None:
                return None
            lo = tl.first_op_starting_at_or_after(a + d_out - T)
        c = self.h2d.latest(float(tl.end[p]), float(tl.start[nb]), d_in)
        if c is None:
            return None
        k_in = tl.last_op_ending_by(c)
        swap = Swap(sid=sid, nbytes=t.nbytes, cross_iteration=True,
                    out_issue_op=tl.last_op_ending_by(a), out_start_ms=a,
                    out_end_ms=a + d_out, release_after_op=tl.num_ops - 1,
                    in_issue_op=k_in, in_start_ms=c, in_end_ms=c + d_in, use_op=nb)
        return swap, lo, k_in

    # -------------------------------------------------------------- recompute
    def recompute_allowance_ms(self, budget_bytes: int | None, max_overhead: float) -> float:
        """What one more recomputation may cost: anything under a budget (the budget rules),
        else what is left of ``max_overhead`` x the iteration time."""
        if budget_bytes is not None:
            return float("inf")
        return max_overhead * self.tl.iteration_ms - self.recompute_ms

    def try_recompute(self, p: int, min_bytes: int, max_cost_ms: float = float("inf")) -> bool:
        """Drop the resident activation with the most bytes freed per ms of recompute,
        among those whose recomputation costs at most ``max_cost_ms``; or a group of them
        that keep the same sources (:meth:`_best_group`), if that frees more per ms."""
        tl = self.tl
        best: tuple[float, list[Recompute]] | None = None
        sharing: list[Recompute] = []   # would free nothing alone: all they drop, they keep
        for sid in self.resident_candidates(p, min_bytes, pinned_too=True):
            gap = self.gaps.get(sid, False)
            if gap is False:
                gap = self.gaps[sid] = tl.backward_gap(sid)
            if tl.tensors[sid].persistent or gap is None or not gap[0] < p < gap[1]:
                continue
            if best is not None and self._score_bound(sid, gap[0]) <= best[0]:
                continue   # cannot beat the best so far (nor join a group: see there)
            # a source of recomputes already planned must be back (rebuilt) before theirs
            j = min([gap[1]] + [self._rebuilt_by(d) for d in self.dependents.get(sid, [])])
            if not p < j:
                continue
            r = recompute_of(tl, sid, gap[0], j, self.moved, self.rebuilt, self.rerun_ops,
                             keep_sources=True, back_by=self.back_by)
            if r is None or not self._swaps_back_for(r):
                continue
            added = self._kept_added(r)
            net = r.nbytes - sum(nb for _, lo, hi, nb in added if lo <= p <= hi)
            if net <= 0:
                if added and not self._not_back_by(r) and r.cost_ms <= max_cost_ms + EPS:
                    sharing.append(r)
                continue
            if not self._affordable(r, p, max_cost_ms, added):
                continue
            score = net / max(r.cost_ms, EPS)   # a rerun may cost (nearly) nothing
            if best is None or score > best[0]:
                best = (score, [r])
        group = self._best_group(sharing, p, max_cost_ms)
        if group is not None and (best is None or group[0] > best[0]):
            best = group
        if best is None:
            return False
        for r in best[1]:
            self._commit_recompute(r)
        return True

    def _score_bound(self, sid: int, i: int) -> float:
        """The most bytes per ms that recomputing ``sid`` (dropped after op ``i``) could
        score in :meth:`try_recompute`: all its bytes freed, at its own rerun's time (a
        rebuild only adds to both). Infinite where the bound cannot skip it: a tensor
        that may keep a forward-only source (a concatenation's parts) may free nothing
        alone and still belong to a group (:meth:`_best_group`). Asked once per tensor."""
        bound = self.score_bounds.get(sid)
        if bound is None:
            tl = self.tl
            ops = _cached_rerun_ops(tl, sid, i, self.rerun_ops)
            if ops is None:
                bound = -float("inf")   # recompute_of: none
            elif any(not tl.tensors[src].persistent and tl.backward_gap(src) is None
                     for src in ops[3]):
                bound = float("inf")
            else:
                bound = tl.tensors[sid].nbytes / max(_rerun_ms(tl, ops[0], ops[1]), EPS)
            self.score_bounds[sid] = bound
        return bound

    def _best_group(self, sharing: list[Recompute], p: int,
                    max_cost_ms: float) -> tuple[float, list[Recompute]] | None:
        """Recomputes that each keep as much as they drop can free memory together when
        they keep the same sources: a DenseNet block's concatenations all join the block's
        input and its layers' new features, so keeping those once lets every concatenation
        go (memory-efficient DenseNet). Groups by shared kept sources; per group, the
        cheapest bytes first within ``max_cost_ms``; the group's score (bytes freed at
        ``p`` per ms) if it lowers the peak, for the best group."""
        root: dict[int, int] = {}

        def find(x: int) -> int:
            while root.setdefault(x, x) != x:
                x = root[x]
            return x

        for r in sharing:
            for src in r.kept[1:]:
                root[find(src)] = find(r.kept[0])
        groups: dict[int, list[Recompute]] = {}
        for r in sharing:
            groups.setdefault(find(r.kept[0]), []).append(r)
        best = None
        for members in groups.values():
            dropped = {r.sid for r in members}
            members = [r for r in members if not dropped & set(r.sources)]  # no chains here
            members.sort(key=lambda r: (-r.nbytes / max(r.cost_ms, EPS), r.sid))
            chosen, cost = [], 0.0
            for r in members:
                if cost + r.cost_ms <= max_cost_ms + EPS:
                    chosen.append(r)
                    cost += r.cost_ms
            if len(chosen) < 2:
                continue
            lowered = self._group_curve(chosen, p)
            if lowered is None:
                continue
            score = lowered / max(cost, EPS)
            if best is None or score > best[0]:
                best = (score, chosen)
        return best

    def _group_curve(self, group: list[Recompute], p: int) -> int | None:
        """Bytes ``group`` frees at ``p``, with the sources it keeps counted once; None if
        the memory it changes would not stay below the current peak."""
        lo, delta = self._kept_delta(group)
        hi = lo + len(delta) - 1
        changed = delta != 0
        if not changed.any() or not lo <= p <= hi or delta[p - lo] >= 0:
            return None
        if int((self.mem[lo:hi + 1] + delta)[changed].max()) >= int(self.mem[p]):
            return None
        return int(-delta[p - lo])

    def _kept_delta(self, group: list[Recompute]) -> tuple[int, np.ndarray]:
        """How the memory curve would change with ``group`` dropped and the sources they
        keep kept (each once, to the latest rebuild that needs it, beyond what earlier
        recomputes keep it for): ``(first op, change per op up to the last rebuild)``."""
        ends: dict[int, int] = {}
        for r in group:
            for src in r.kept:
                ends[src] = max(ends.get(src, -1), r.before_op)
        starts = {s: self.kept_hi.get(s, self.tl.vanilla_range(s)[1]) + 1 for s in ends}
        lo = min([r.release_after_op + 1 for r in group] + list(starts.values()))
        delta = np.zeros(max(r.before_op for r in group) - lo + 1, dtype=np.int64)
        for src, end in ends.items():
            if starts[src] <= end:
                delta[starts[src] - lo:end - lo + 1] += self.tl.tensors[src].nbytes
        for r in group:
            a, b = r.release_after_op + 1, r.before_op - 1
            if a <= b:
                delta[a - lo:b - lo + 1] -= r.nbytes
        return lo, delta

    def _commit_recompute(self, r: Recompute) -> None:
        """Add ``r`` to the plan and the memory curve."""
        for src, lo, hi, nb in self._kept_added(r):
            self.mem[lo:hi + 1] += nb
            self.kept_hi[src] = hi
        self.recomputes.append(r)
        self.rebuilt[r.sid] = r
        self.recompute_ms += r.cost_ms
        self.commit(r.sid, r.release_after_op + 1, r.before_op - 1)
        self.pinned[self.row[r.sid]] = False
        if r.transient:   # rebuilt for r alone, then dropped again
            self.mem[r.before_op] += sum(self.rebuilt[s].nbytes for s in r.transient)
            for s in r.transient:
                self.rebuilt_for.setdefault(s, []).append(r)
        else:
            for first, old in self._early_rebuilds(r):
                # a dropped source is rebuilt first, and then stays until its own use
                self.mem[r.before_op:old] += first.nbytes
                first.before_op = r.before_op
                if first.transient:  # they are rebuilt early too (in the same list): kept
                    self.mem[old] -= sum(self.rebuilt[s].nbytes for s in first.transient)
                    saved = sum(self._chain_ms(self.rebuilt[s]) for s in first.transient)
                    first.cost_ms -= saved
                    self.recompute_ms -= saved
                    first.transient = []
            self._shorten_kept()
        for src in r.sources:
            self.dependents.setdefault(src, []).append(r)
            if src not in self.moved:  # never swapped: they must be there for the recompute
                self.free[self.row[src]] = False
                self.pinned[self.row[src]] = True

    def _kept_added(self, r: Recompute) -> list[tuple[int, int, int, int]]:
        """The memory that keeping ``r``'s ``kept`` sources adds: (sid, first op, last op,
        bytes) beyond what earlier recomputes keep them for already."""
        out = []
        for src in r.kept:
            lo = self.kept_hi.get(src, self.tl.vanilla_range(src)[1]) + 1
            if lo <= r.before_op:
                out.append((src, lo, r.before_op, self.tl.tensors[src].nbytes))
        return out

    def _shorten_kept(self) -> None:
        """Recomputes rebuilt earlier now (``_early_rebuilds``) need their kept sources
        for less long: give that memory back, as :func:`simulate` counts it."""
        for src, (_, hi) in kept_ranges(self.tl, self.recomputes).items():
            old = self.kept_hi[src]
            if hi < old:
                self.mem[hi + 1:old + 1] -= self.tl.tensors[src].nbytes
                self.kept_hi[src] = hi

    def _kept_below(self, r: Recompute, p: int, added: list) -> bool:
        """With ``r``'s sources kept (``added``) and ``r`` dropped, does the memory from the
        first kept op to its rebuild stay below the current peak at ``p``? Else keeping only
        moves it."""
        if not added:
            return True
        lo, delta = self._kept_delta([r])
        a = min(x[1] for x in added)
        return int((self.mem[a:r.before_op + 1] + delta[a - lo:]).max()) < int(self.mem[p])

    def _affordable(self, r: Recompute, p: int, max_cost_ms: float, added: list) -> bool:
        """Can ``r`` lower the peak at ``p`` within ``max_cost_ms``? Its sources that are
        recomputed but not back by its ``before_op`` are rebuilt for it alone (``r`` then
        lists them as ``transient`` and pays for them) if that fits the allowance and the
        momentary memory stays below the peak, else rebuilt early and kept until their
        own use, if the memory they add stays below the peak. Sources it keeps past their
        last read (``added``, :meth:`_kept_below`) must leave the memory below the peak too."""
        if not self._kept_below(r, p, added):
            return False
        later = self._not_back_by(r)
        if later and self.transient_ok:
            cost = r.cost_ms + sum(self._chain_ms(q) for q in later)
            extra = sum(q.nbytes for q in later) + sum(a[3] for a in added)
            if cost <= max_cost_ms + EPS and int(self.mem[r.before_op]) + extra < int(self.mem[p]):
                r.cost_ms, r.transient = cost, sorted(q.sid for q in later)
                return True
        return r.cost_ms <= max_cost_ms + EPS and self._keeps_below(r, p)

    def _rebuilt_by(self, d: Recompute) -> int:
        """The first op by which ``d``'s rebuild reads its sources: its own ``before_op``,
        or earlier where a recompute rebuilds it for itself alone (``transient``)."""
        return min([d.before_op] + [r.before_op for r in self.rebuilt_for.get(d.sid, [])
                                    if d.sid in r.transient])

    def _not_back_by(self, r: Recompute) -> list[Recompute]:
        """The recomputed tensors ``r``'s rebuild reads, directly or through them, whose
        own rebuild comes after ``r``'s."""
        found: dict[int, Recompute] = {}
        todo = list(r.sources)
        while todo:
            q = self.rebuilt.get(todo.pop())
            if q is not None and q.before_op > r.before_op and q.sid not in found:
                found[q.sid] = q
                todo.extend(q.sources)
        return list(found.values())

    def _swaps_back_for(self, r: Recompute) -> bool:
        """Are the swapped tensors that ``r``'s rebuild reads back by its ``before_op``, those
        read by the recomputes rebuilt with it (:meth:`_not_back_by`) included? Each copy-in
        must be issued before an earlier op and done by then (``back_by``,
        :func:`recompute_of`)."""
        return all(self.back_by[src] < r.before_op for q in [r] + self._not_back_by(r)
                   for src in q.sources if src in self.back_by)

    def _chain_ms(self, q: Recompute) -> float:
        """The time of ``q``'s own rerun ops (its producer and in-place updates)."""
        return _rerun_ms(self.tl, q.producer_op, q.then_ops)

    def _early_rebuilds(self, r: Recompute) -> list[tuple[Recompute, int]]:
        """The recomputed tensors ``r`` reads (directly or through them) that must now be
        rebuilt earlier, by its ``before_op``: (their recompute, their ``before_op`` now)."""
        return [(q, q.before_op) for q in self._not_back_by(r)]

    def _keeps_below(self, r: Recompute, p: int) -> bool:
        """Would the memory that sources rebuilt early add (they stay from ``r``'s rebuild
        to their own use) stay below the current peak at ``p``? Else ``r`` only moves it."""
        early = self._early_rebuilds(r)
        if not early:
            return True
        end = max(old for _, old in early)
        added = np.zeros(end - r.before_op, dtype=np.int64)
        for src, old in early:
            added[:old - r.before_op] += src.nbytes
        return int((self.mem[r.before_op:end] + added).max()) < int(self.mem[p])


# Batch-norm ops update their running statistics in training mode, and their output does
# not depend on them: a recompute reruns them on scratch copies of those statistics.
SCRATCH_OK = frozenset({"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm",
                        "_native_batch_norm_legit", "_batch_norm_with_update"})


def recompute_of(tl: AccessTimeline, sid: int, i: int, j: int, moved: set[int],
                 rebuilt: dict[int, Recompute] | None = None,
                 cache: dict[int, tuple | None] | None = None,
                 keep_sources: bool = False,
                 back_by: dict[int, int] | None = None) -> Recompute | None:
    """How to rebuild activation ``sid``, dropped after op ``i``, before op ``j``; None
    where the runtime cannot.

    The rebuild reruns the producer, then the in-place ops that updated the tensor in
    forward (a batch norm's output that ``ReLU(inplace=True)`` overwrote, a residual
    ``add_``): each reads the tensor as it was. No rerun op may draw random numbers or
    write anything else, except a batch norm's running statistics, which the rerun
    updates in scratch copies. Every other input must be unmodified until op ``j`` and
    resident then: not ``moved``, or itself recomputed (in ``rebuilt``), in which case
    it is rebuilt first, by op ``j`` (the caller decides whether it then stays until its
    own use or is rebuilt for this recompute alone, :meth:`PlanState._affordable`), or
    swapped with its copy-in issued before an op earlier than ``j`` (``back_by``: sid -> that
    op; the runtime issues a copy-in at its op's last hook, which may come after the
    reader's unpack, and waits for the copy before the rebuild reads it; the planner also
    has the copy done by then, :meth:`PlanState._add_swap`).
    Chains of recomputes rebuild a run of layers from one kept tensor, as activation
    checkpointing does. ``keep_sources``: an input that the step reads only in forward
    and is done with before op ``j`` may be kept until then (``Recompute.kept``; the
    caller counts its memory): a concatenation is rebuilt from the small tensors it
    joined (DenseNet, Inception), as memory-efficient DenseNet does. ``cache`` keeps
    what does not change between calls for one ``sid`` and ``i`` (a planner's rounds
    ask again and again).
    """
    ops = _cached_rerun_ops(tl, sid, i, cache) if cache is not None else _rerun_ops(tl, sid, i)
    if ops is None:
        return None
    prod, then, scratch, sources = ops
    kept = []
    for src in sources:
        s = tl.tensors[src]
        gone = src in moved and (rebuilt is None or src not in rebuilt) \
            and not (back_by is not None and back_by.get(src, j) < j)
        if gone or any(prod < w <= j for w in s.writes):
            return None                   # it would not be there, unchanged, at op j
        if not s.persistent and tl.vanilla_range(src)[1] < j:   # gone before op j
            if not keep_sources or src in moved or tl.backward_gap(src) is not None:
                return None
            kept.append(src)              # kept until the rebuild (forward-only tensors)
    return Recompute(sid=sid, nbytes=tl.tensors[sid].nbytes, producer_op=prod, release_after_op=i,
                     before_op=j, cost_ms=_rerun_ms(tl, prod, then),
                     sources=list(sources), then_ops=list(then), scratch=list(scratch),
                     kept=kept)


def _rerun_ms(tl: AccessTimeline, producer: int, then: list[int]) -> float:
    """The time of rerunning ``producer`` and then the in-place ops ``then`` (each op at its
    ``tl.rerun_share`` of its time where given)."""
    return float(sum(tl.op_ms[k] * tl.rerun_share.get(k, 1.0) for k in [producer, *then]))


def _cached_rerun_ops(tl: AccessTimeline, sid: int, i: int,
                      cache: dict[int, tuple | None]) -> tuple | None:
    """:func:`_rerun_ops`, kept in ``cache`` by ``sid`` (for one ``i`` per ``sid``)."""
    if sid not in cache:
        cache[sid] = _rerun_ops(tl, sid, i)
    return cache[sid]


def _rerun_ops(tl: AccessTimeline, sid: int, i: int) -> tuple | None:
    """The part of :func:`recompute_of` that depends on the timeline alone: (producer,
    in-place updates, scratch storages, sources), or None where no rerun can rebuild it."""
    t = tl.tensors[sid]
    prod, then = t.writes[0], t.writes[1:]
    if any(k > i for k in then):
        return None                       # written again after its last forward access
    chain = [prod, *then]
    if any(tl.random[k] for k in chain):
        return None
    scratch = [s for s in tl.writes[prod]
               if s != sid and (tl.tensors[s].persistent or tl.tensors[s].writes[0] != prod)]
    if scratch and base_name(tl.names[prod]) not in SCRATCH_OK:
        return None                       # a side effect that a rerun would repeat
    if any(s != sid for k in then for s in tl.writes[k]):
        return None
    sources = list(dict.fromkeys(r for k in chain for r in tl.reads[k]
                                 if r != sid and r not in scratch))
    return prod, then, scratch, sources


SWAP_SEARCH = ("unmet", "always", "never")


def check_swap_search(swap_search) -> None:
    if swap_search not in SWAP_SEARCH:
        raise ValueError(f"swap_search: expected one of {', '.join(map(repr, SWAP_SEARCH))}; "
                         f"got {swap_search!r}")


def check_swap_cost(swap_cost_ms) -> None:
    if not _nonneg_number(swap_cost_ms):
        raise ValueError(f"swap_cost_ms must be a number of ms >= 0 (0: swaps free once "
                         f"hidden), got {swap_cost_ms!r}")


def check_swap_copy_share(swap_copy_share) -> None:
    if not _nonneg_number(swap_copy_share) or swap_copy_share > 1:
        raise ValueError(f"swap_copy_share must be a share of a swap's copy time in [0, 1] "
                         f"(0: hidden copies cost the step nothing), got {swap_copy_share!r}")


def check_max_overhead(max_overhead) -> None:
    if not _nonneg_number(max_overhead):
        raise ValueError(f"max_overhead must be a fraction of the iteration time >= 0, "
                         f"got {max_overhead!r}")


def check_copy_latency(latency) -> None:
    if not (isinstance(latency, (int, float)) and latency >= 0):
        raise ValueError(f"copy_latency_ms must be >= 0, got {latency!r}")


def check_plan_args(budget, d2h_bw, h2d_bw, latency, min_bytes) -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, np.integer))
                               or budget <= 0):
        raise ValueError(f"budget_bytes must be a positive int or None, got {budget!r}")
    for name, bw in (("d2h_bw", d2h_bw), ("h2d_bw", h2d_bw)):
        if not (isinstance(bw, (int, float)) and bw > 0 and np.isfinite(bw)):
            raise ValueError(f"{name} must be a positive number of bytes/s, got {bw!r}")
    check_copy_latency(latency)
    if not isinstance(min_bytes, (int, np.integer)) or min_bytes < 1:
        raise ValueError(f"min_bytes must be an int >= 1, got {min_bytes!r}")
