"""TENSILE planner: property tests on random training-like timelines, plus small cases."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensile.plan import Plan, Recompute, Swap
import tensile.planner
from tensile import PlanningSnapshot
from tensile.planner import CAPTURED_SWAP_COST_MS, COPY_LATENCY_MS, _greedy, plan, swap_price_ms
from tensile.simulate import absent_ranges, held_at, kept_ranges, simulate
from tensile.timeline import CROSS_ITERATION_ROLES, AccessTimeline

EPS = 1e-6
MB = 1 << 20


# --------------------------------------------------------------------------- random timelines
@st.composite
def timelines(draw):
    """A random iteration: forward, loss, backward, optimizer, with the usual tensor kinds."""
    n_fwd = draw(st.integers(2, 10))
    n_bwd = draw(st.integers(2, 10))
    n_opt = draw(st.integers(1, 5))
    phases = ["forward"] * n_fwd + ["loss"] + ["backward"] * n_bwd + ["optimizer"] * n_opt
    n = len(phases)
    fwd = range(0, n_fwd)
    bwd = range(n_fwd + 1, n_fwd + 1 + n_bwd)
    opt = range(n_fwd + 1 + n_bwd, n)
    reads = [set() for _ in range(n)]
    writes = [set() for _ in range(n)]
    sizes, roles, needed = {}, {}, {}
    sid = 0
    size = st.integers(1, 4 * MB)

    def new(role, nbytes):
        nonlocal sid
        sid += 1
        sizes[sid] = nbytes
        if role != "activation":
            roles[sid] = role
        return sid

    x = new("input", draw(size))
    reads[0].add(x)
    for _ in range(draw(st.integers(1, 4))):  # parameters with optimizer state
        p = new("param", draw(size))
        use = draw(st.sampled_from(fwd))
        reads[use].add(p)
        reads[draw(st.sampled_from(bwd))].add(p)
        up = draw(st.sampled_from(opt))
        reads[up].add(p)
        writes[up].add(p)
        needed[p] = draw(st.integers(0, use))
        s = new("opt_state", draw(size))
        at = draw(st.sampled_from(opt))
        reads[at].add(s)
        writes[at].add(s)
        g = new("activation", draw(size))  # its gradient: made in backward, read by the update
        writes[draw(st.sampled_from(bwd))].add(g)
        reads[draw(st.sampled_from(opt))].add(g)
    for _ in range(draw(st.integers(1, 14))):  # activations
        a = new("activation", draw(size))
        prod = draw(st.sampled_from(fwd))
        writes[prod].add(a)
        if draw(st.booleans()):  # an input of the producer, so recomputation has sources
            reads[prod].add(x)
        for _ in range(draw(st.integers(0, 2))):
            later = [k for k in fwd if k > prod]
            if later:
                reads[draw(st.sampled_from(later))].add(a)
        for _ in range(draw(st.integers(0, 2))):
            reads[draw(st.sampled_from(bwd))].add(a)
        if draw(st.integers(0, 5)) == 0:  # an occasional in-place update in forward
            later = [k for k in fwd if k > prod]
            if later:
                k = draw(st.sampled_from(later))
                reads[k].add(a)
                writes[k].add(a)
    ops = [(f"op{k}", phases[k], draw(st.floats(0.05, 5.0)), sorted(reads[k]), sorted(writes[k]))
           for k in range(n)]
    random_ops = {k for k in fwd if draw(st.integers(0, 6)) == 0}
    scratch = {k: draw(size) for k in range(n) if draw(st.integers(0, 5)) == 0}  # workspaces
    touched = {}   # activation -> its accesses
    for k in range(n):
        for a in reads[k] | writes[k]:
            if a not in roles:
                touched.setdefault(a, []).append(k)
    held_to, forward_hold = {}, {}
    for a, acc in sorted(touched.items()):
        if draw(st.integers(0, 3)) == 0:   # still referenced after its last access
            held_to[a] = draw(st.integers(acc[-1], n - 1))
        if acc[0] <= n_fwd and draw(st.integers(0, 3)) == 0:   # the input of a forward call
            forward_hold[a] = draw(st.integers(acc[0], n_fwd))
    transfers = sorted((draw(st.sampled_from(bwd)), draw(st.sampled_from(("h2d", "d2h"))),
                        draw(size)) for _ in range(draw(st.integers(0, 3))))  # a streamed optimizer's
    return AccessTimeline.from_ops(ops, sizes, roles, needed_by=needed, random_ops=random_ops,
                                   scratch=scratch, held_to=held_to, forward_hold=forward_hold,
                                   transfers=transfers)


bandwidths = st.floats(1e7, 1e11)


# --------------------------------------------------------------------------- checks
def check_plan(tl: AccessTimeline, p: Plan, max_overhead: float = 0.0) -> None:
    """Every invariant a plan must satisfy on its timeline."""
    sim = simulate(tl, p)
    assert sim.peak == p.peak_after
    assert p.peak_before == int(tl.vanilla_curve().max())
    assert p.peak_after <= p.peak_before
    if p.budget_bytes is not None:
        assert p.feasible == (sim.peak <= p.budget_bytes)
    else:   # no budget: recomputation only within the allowance
        assert p.feasible and p.est_overhead_ms <= max_overhead * tl.iteration_ms + EPS
        assert bool(p.recomputes) <= (max_overhead > 0)

    moved = [s.sid for s in p.swaps] + [r.sid for r in p.recomputes]
    assert len(moved) == len(set(moved)), "a tensor is planned twice"
    for s in p.swaps:
        check_swap(tl, s, p)
    for r in p.recomputes:
        check_recompute(tl, r, p)
    for intervals in ([(s.out_start_ms, s.out_end_ms) for s in p.swaps],
                      [(s.in_start_ms, s.in_end_ms) for s in p.swaps]):
        intervals = sorted(folded(intervals, tl.iteration_ms))
        for (a0, a1), (b0, b1) in zip(intervals, intervals[1:]):
            assert b0 >= a1 - EPS, f"copies overlap on one channel: {(a0, a1)} and {(b0, b1)}"
    assert Plan.from_json(p.to_json()) == p


def folded(intervals: list[tuple[float, float]], cycle: float) -> list[tuple[float, float]]:
    """Copy intervals on a channel that repeats every ``cycle`` ms, split at its end."""
    out = []
    for a, b in intervals:
        if a >= cycle - EPS:                        # wholly in the next iteration
            out.append((a - cycle, b - cycle))
        else:
            out += [(a, min(b, cycle))] + ([(0.0, b - cycle)] if b > cycle + EPS else [])
    return out


def check_swap(tl: AccessTimeline, s: Swap, p: Plan) -> None:
    t = tl.tensors[s.sid]
    assert t.swappable
    assert s.out_end_ms > s.out_start_ms >= tl.end[s.out_issue_op] - EPS
    assert s.in_end_ms > s.in_start_ms
    if s.in_issue_op >= 0:
        assert s.in_start_ms >= tl.end[s.in_issue_op] - EPS
    assert s.in_issue_op < s.use_op, "swap-in issued at or after the access that needs it"
    assert s.in_end_ms <= tl.start[s.use_op] + EPS, "swap-in overlaps the access that needs it"
    if s.cross_iteration:
        assert t.role in CROSS_ITERATION_ROLES, f"cross-iteration swap of a {t.role}"
        assert s.out_start_ms >= tl.end[t.last] - EPS, "copied out before its last update"
        assert s.out_end_ms - s.out_start_ms < tl.iteration_ms
        past_end = s.out_end_ms - tl.iteration_ms      # a copy-out that ran into the next step
        if past_end > EPS:
            assert s.in_start_ms >= past_end - EPS, "copied back in before the copy-out ended"
        assert s.use_op <= t.first
    else:
        assert not t.persistent
        assert s.in_start_ms >= s.out_end_ms - EPS
        before = [a for a in t.accesses if a < s.use_op]
        assert s.release_after_op >= before[-1], "released before its last read"
        assert s.release_after_op >= (t.forward_hold or 0), "released while forward code holds it"
        assert not [a for a in t.accesses if s.release_after_op < a < s.use_op]
        last_write = max(w for w in t.writes if w <= s.release_after_op)
        assert s.out_start_ms >= tl.end[last_write] - EPS, "copied out before its last write"
        # back for its next access, or for a rebuild before an earlier op that reads it
        assert s.use_op in t.accesses or s.use_op in rebuilds_reading(p, s.sid)
        # use_op is the first that reads it back: no rebuild reads it while it is away, or
        # waits on its copy-in (no price counts such a wait)
        assert all(k < s.release_after_op or k >= s.use_op for k in rebuilds_reading(p, s.sid))
        # dropped once its copy-out should be done: a captured step's wait for it stalls nothing
        assert tl.start[s.release_after_op + 1] >= s.out_end_ms - EPS, "released before its copy-out ends"


def rebuilds_reading(p: Plan, sid: int) -> set[int]:
    """The ops before which ``p`` reruns an op that reads ``sid`` (a recompute, or one
    rebuilt for it alone)."""
    rebuilt = {q.sid: q for q in p.recomputes}
    return {r.before_op for r in p.recomputes
            if any(sid in q.sources for q in [r] + [rebuilt[s] for s in r.transient])}


def check_recompute(tl: AccessTimeline, r: Recompute, p: Plan) -> None:
    t = tl.tensors[r.sid]
    chain = [r.producer_op, *r.then_ops]
    assert not t.persistent and t.writes == chain, "the rerun ops are not the tensor's writes"
    assert all(k <= r.release_after_op for k in r.then_ops), "updated in place after its release"
    assert all(tl.writes[k] == [r.sid] for k in r.then_ops), "an in-place update writes more"
    assert not any(tl.random[k] for k in chain)
    rebuilt = {q.sid: q for q in p.recomputes}
    chains = [chain] + [[rebuilt[s].producer_op, *rebuilt[s].then_ops] for s in r.transient]
    # each rerun op costs its share of its time (all of it unless rerun_share says)
    assert r.cost_ms == pytest.approx(sum(tl.op_ms[k] * tl.rerun_share.get(k, 1.0)
                                          for c in chains for k in c))
    assert r.scratch == [s for s in tl.writes[r.producer_op]
                         if s != r.sid and (tl.tensors[s].persistent or tl.tensors[s].writes[0] != r.producer_op)]
    before = [a for a in t.accesses if a < r.before_op]
    assert r.release_after_op >= before[-1], "released before its last read"
    assert r.release_after_op >= (t.forward_hold or 0), "released while forward code holds it"
    assert not [a for a in t.accesses if r.release_after_op < a < r.before_op]
    assert r.before_op <= tl.backward_gap(r.sid)[1]
    swapped = {s.sid: s for s in p.swaps}
    assert set(r.transient) <= set(rebuilt)   # rebuilt for r alone, dropped again after
    for q in [r] + [rebuilt[s] for s in r.transient]:
        for src in q.sources:     # every input of a rebuild at r.before_op is there then
            if src in rebuilt:
                assert rebuilt[src].before_op <= r.before_op or src in r.transient, \
                    "a source is rebuilt after its reader"
            elif src in swapped:  # copied back in, issued before an earlier op
                assert swapped[src].in_issue_op + 1 < r.before_op, "a rebuild source is swapped then"
    assert set(r.kept) <= set(r.sources)
    kept_to = kept_ranges(tl, p.recomputes)
    for src in r.sources:
        st_ = tl.tensors[src]
        if src in swapped:  # copied back in for the rebuild, issued before an earlier op
            assert swapped[src].in_issue_op + 1 < r.before_op, "a recompute source is swapped then"
        if src in r.kept:   # done with in forward, kept (and counted) until the rebuild
            gone = tl.vanilla_range(src)[1]   # its last access, or where the step lets it go
            assert not st_.persistent and gone < r.before_op and src not in rebuilt
            assert tl.backward_gap(src) is None
            assert kept_to[src] == (gone + 1, kept_to[src][1]) and kept_to[src][1] >= r.before_op
        else:
            assert tl.vanilla_range(src)[1] >= r.before_op, "source freed before the recompute"
        assert not [w for w in st_.writes if r.producer_op < w <= r.before_op]


# --------------------------------------------------------------------------- properties
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tl=timelines(), d2h=bandwidths, h2d=bandwidths, frac=st.floats(0.05, 1.0),
       use_budget=st.booleans(), recompute=st.booleans(), cross=st.booleans())
def test_plan_invariants(tl, d2h, h2d, frac, use_budget, recompute, cross):
    budget = max(1, int(frac * tl.vanilla_curve().max())) if use_budget else None
    p = plan(tl, budget_bytes=budget, d2h_bw=d2h, h2d_bw=h2d, allow_recompute=recompute,
             allow_cross_iteration=cross)
    check_plan(tl, p)
    if not cross:
        assert not any(s.cross_iteration for s in p.swaps)
    if not recompute:
        assert not p.recomputes


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tl=timelines(), bw=bandwidths, overhead=st.floats(0.0, 0.5))
def test_an_overhead_allowance_only_lowers_the_peak_and_stays_within_it(tl, bw, overhead):
    swaps_only = plan(tl, d2h_bw=bw, h2d_bw=bw)
    p = plan(tl, d2h_bw=bw, h2d_bw=bw, max_overhead=overhead)
    check_plan(tl, p, max_overhead=overhead)
    assert sum(r.cost_ms for r in p.recomputes) <= overhead * tl.iteration_ms + EPS
    if not p.recomputes:   # the greedy made the same choices: the same plan
        assert p.peak_after == swaps_only.peak_after


@settings(max_examples=80, deadline=None)
@given(tl=timelines(), bw=bandwidths, frac=st.floats(0.0, 1.0))
def test_reachable_budget_is_met(tl, bw, frac):
    """A budget between the no-budget plan's peak and the vanilla peak is always met."""
    free = plan(tl, d2h_bw=bw, h2d_bw=bw)
    budget = max(1, free.peak_after + int(frac * (free.peak_before - free.peak_after)))
    p = plan(tl, budget_bytes=budget, d2h_bw=bw, h2d_bw=bw)
    assert p.feasible and simulate(tl, p).peak <= budget
    check_plan(tl, p)


@settings(max_examples=80, deadline=None)
@given(tl=timelines(), bw=st.floats(1e3, 1e6), frac=st.floats(0.3, 1.0))
def test_recompute_plans_when_swaps_cannot_hide(tl, bw, frac):
    """Slow copies: the budget is chased by recomputation, whose plans stay valid."""
    budget = max(1, int(frac * tl.vanilla_curve().max()))
    p = plan(tl, budget_bytes=budget, d2h_bw=bw, h2d_bw=bw, allow_cross_iteration=False)
    check_plan(tl, p)
    rebuilt = {r.sid: r for r in p.recomputes}
    assert p.est_overhead_ms == pytest.approx(
        sum(tl.op_ms[k] for r in p.recomputes for q in [r, *(rebuilt[s] for s in r.transient)]
            for k in [q.producer_op, *q.then_ops]))


@settings(max_examples=60, deadline=None)
@given(tl=timelines(), bw=st.floats(1e3, 1e6), frac=st.floats(0.3, 1.0))
def test_no_recompute_of_a_plan_could_be_left_out(tl, bw, frac):
    """After the reverse-delete pass (keep_what_fits) every recompute that no other one reads
    is needed: without it the memory would pass the budget (where the budget is not met:
    the plan's peak)."""
    budget = max(1, int(frac * tl.vanilla_curve().max()))
    p = plan(tl, budget_bytes=budget, d2h_bw=bw, h2d_bw=bw, allow_cross_iteration=False)
    cap = budget if p.feasible else p.peak_after
    read = {s for r in p.recomputes for s in [*r.sources, *r.transient]}
    for r in p.recomputes:
        if r.sid not in read:
            fewer = dataclasses.replace(p, recomputes=[q for q in p.recomputes if q is not r])
            assert simulate(tl, fewer).peak > cap


def _chain(n: int = 8) -> AccessTimeline:
    """n layers, each writing a 4 MB activation that its backward reads again."""
    fwd = [(f"layer{k}", "forward", 1.0, [100 + k - 1] if k else [1], [100 + k]) for k in range(n)]
    bwd = [(f"layer{k}_bwd", "backward", 1.0, [100 + k, 200 + k + 1] if k < n - 1 else [100 + k],
            [200 + k]) for k in reversed(range(n))]
    sizes = {1: MB, **{100 + k: 4 * MB for k in range(n)}, **{200 + k: MB for k in range(n)}}
    return AccessTimeline.from_ops(fwd + bwd, sizes, {1: "input"})


def test_keep_what_fits_gives_back_what_a_higher_budget_does_not_need():
    from tensile.planner import keep_what_fits
    tl = _chain()
    peak = simulate(tl).peak
    tight = plan(tl, budget_bytes=int(peak * 0.55), d2h_bw=1e3, h2d_bw=1e3, allow_cross_iteration=False)
    assert tight.feasible and len(tight.recomputes) >= 2
    roomy = dataclasses.replace(tight, budget_bytes=int(peak * 0.9))
    fewer = keep_what_fits(tl, roomy)
    assert len(fewer.recomputes) < len(tight.recomputes)
    assert {r.sid for r in fewer.recomputes} < {r.sid for r in tight.recomputes}
    assert simulate(tl, fewer).peak == fewer.peak_after <= roomy.budget_bytes
    assert fewer.est_overhead_ms == pytest.approx(sum(r.cost_ms for r in fewer.recomputes))
    assert fewer.est_overhead_ms < tight.est_overhead_ms
    assert keep_what_fits(tl, tight) is tight       # nothing to give back at its own budget


@settings(max_examples=60, deadline=None)
@given(tl=timelines(), bw=bandwidths, overhead=st.floats(0.01, 0.5))
def test_the_plan_is_the_best_of_swaps_first_or_not_and_transient_rebuilds_or_not(tl, bw, overhead):
    args = (tl, None, bw, bw, True, True, 0.01, 1, overhead, 0.0, 0.0)
    runs = [_greedy(*args, allow_swaps=s, transient=t) for s in (True, False) for t in (True, False)]
    assert not runs[2].swaps and not runs[3].swaps
    assert not any(r.transient for r in runs[1].recomputes + runs[3].recomputes)
    no_swaps = min(runs[2:], key=lambda r: tensile.planner._rank(r, None))
    if no_swaps.recomputes:   # and swaps of all but what that plan rebuilds from
        keep = frozenset(tensile.planner._rebuild_inputs(no_swaps))
        around = [_greedy(*args, allow_swaps=True, transient=t, no_swap=keep) for t in (True, False)]
        assert not {s.sid for r in around for s in r.swaps} & keep
        runs += around
    p = plan(tl, d2h_bw=bw, h2d_bw=bw, max_overhead=overhead)
    assert p.peak_after == min(r.peak_after for r in runs)
    check_plan(tl, p, max_overhead=overhead)


@st.composite
def chains(draw):
    """A chain of layers, each reading the one before (as _chain, with random sizes and
    times): drops whose rebuilds read other drops, the case of one-off rebuilds."""
    n = draw(st.integers(5, 14))
    ms = st.floats(0.1, 3.0)
    fwd = [(f"layer{k}", "forward", draw(ms), [100 + k - 1] if k else [1], [100 + k])
           for k in range(n)]
    bwd = [(f"layer{k}_bwd", "backward", draw(ms),
            [100 + k, 200 + k + 1] if k < n - 1 else [100 + k], [200 + k]) for k in reversed(range(n))]
    sizes = {1: MB, **{100 + k: draw(st.sampled_from([1, 2, 4, 8])) * MB for k in range(n)},
             **{200 + k: MB for k in range(n)}}
    return AccessTimeline.from_ops(fwd + bwd, sizes, {1: "input"})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tl=chains(), frac=st.floats(0.2, 0.9), swaps=st.booleans(), transient=st.booleans())
def test_every_greedy_run_is_a_valid_plan_not_only_the_one_kept(tl, frac, swaps, transient):
    """plan() keeps the best of several greedy runs; each must be valid on its own. A run with
    one-off rebuilds once dropped an input of such a rebuild until after it (b6e7886)."""
    budget = max(1, int(frac * tl.vanilla_curve().max()))
    r = _greedy(tl, budget, 1e3, 1e3, True, False, 0.01, 1, 0.0, 0.0, 0.0, allow_swaps=swaps,
                transient=transient)
    check_plan(tl, r)
    check_plan(tl, tensile.planner.keep_what_fits(tl, r))


SNAPSHOTS = Path(__file__).resolve().parents[1] / "results" / "h200"


def test_swaps_around_rebuilds_and_a_swaps_price_on_inception_v4_at_checkpointings_peak():
    # The planning inputs of an H200 job (twenty-third session): Inception-v4 at b=16 under
    # the budget that brought its captured step to checkpoint_graph's peak, planned there
    # without swaps (1.58 ms of rebuilds). With swaps the four greedy runs found nothing
    # cheaper than rebuilds alone; swapping only what those rebuilds do not read does.
    snap = PlanningSnapshot.load(SNAPSHOTS / "snapshot_tensile_inception_v4_b16_tensile_graph_match_peak_"
                                 "checkpoint_graph_copy_latency_ms_0.1_allow_swaps_false_bn_from_stats"
                                 "_20261201T075526.json.gz")
    captured = dict(allow_cross_iteration=False)   # as tensile_graph plans (the file has no options)
    alone = snap.replan(allow_swaps=False, **captured)
    free = snap.replan(allow_swaps=True, **captured)
    assert alone.feasible and free.feasible and len(free.swaps) > 20
    assert free.est_overhead_ms < 0.75 * alone.est_overhead_ms
    check_plan(snap.timeline, free)
    # Priced as a captured step's swaps ran on the GPU (tensile_graph's default), those
    # swaps cost more than the rebuilds they spare: the swap-free plan is kept.
    priced = snap.replan(allow_swaps=True, swap_cost_ms=CAPTURED_SWAP_COST_MS, **captured)
    assert not priced.swaps and priced.est_overhead_ms == pytest.approx(alone.est_overhead_ms)
    # and a plan's estimate is its rebuilds plus its swaps' price
    assert free.est_overhead_ms == pytest.approx(sum(r.cost_ms for r in free.recomputes))
    few = snap.replan(allow_swaps=True, swap_cost_ms=0.001, **captured)
    assert few.est_overhead_ms == pytest.approx(sum(r.cost_ms for r in few.recomputes)
                                                + 0.001 * len(few.swaps))


H100_SNAPSHOTS = SNAPSHOTS.parent / "h100-80gb-hbm3"


def test_a_swap_priced_by_its_bytes_gives_way_to_rebuilds_on_densenet121():
    # An H100 job of the sixty-third session: DenseNet-121 at b=16 planned to the TENSILE
    # authors' MSR by the committed sweep (swap_search="always"), which found 5 swaps of
    # 220 MiB in all, priced 0.07 ms under rebuilds alone; the step paid 0.3 ms more for
    # them than that. Priced at 4 % of their copies' time, they cost more than the rebuilds
    # they spare: the plan keeps none, and is priced at its rebuilds.
    snap = PlanningSnapshot.load(H100_SNAPSHOTS / "snapshot_tensile_densenet121_b16_tensile_graph_match_"
                                 "msr_0.76_copy_latency_ms_0.1_bn_from_stats_swap_search_always_"
                                 "20261206T065211.json.gz")
    assert len(snap.plan.swaps) == 5 and snap.options.get("swap_copy_share", 0.0) == 0.0
    priced = snap.replan(swap_copy_share=0.04)
    assert priced.feasible and not priced.swaps
    assert priced.est_overhead_ms == pytest.approx(sum(r.cost_ms for r in priced.recomputes))
    # the saved plan, priced so, would cost more than the one kept
    saved = snap.plan.est_overhead_ms + sum(swap_price_ms(s.nbytes, snap.d2h_bw, snap.h2d_bw, 0.0, 0.04)
                                            for s in snap.plan.swaps)
    assert priced.est_overhead_ms < saved


def test_a_plans_estimate_prices_each_swap_by_its_bytes():
    """est_overhead_ms = the rebuilds + per swap ``swap_cost_ms`` + ``swap_copy_share`` of
    its copies' time (bytes over each bandwidth)."""
    tl = _simple()
    kw = dict(d2h_bw=1e11, h2d_bw=2e11, allow_recompute=False)
    free = plan(tl, **kw)
    assert free.swaps and free.est_overhead_ms == 0.0
    p = plan(tl, swap_cost_ms=0.01, swap_copy_share=0.05, **kw)
    assert [s.sid for s in p.swaps] == [s.sid for s in free.swaps]   # no budget: nothing to trade
    assert p.est_overhead_ms == pytest.approx(sum(0.01 + 0.05 * 1e3 * s.nbytes * (1 / 1e11 + 1 / 2e11)
                                                  for s in p.swaps))


RESNET50_STREAMED = ("snapshot_tensile_resnet50_b16_tensile_graph_match_msr_0.671_copy_latency_ms_0.1_"
                     "bn_from_stats_stream_optimizer_16_stream_prefetch_2_stream_resident_4_"
                     "20261202T190042.json.gz")


def test_a_swap_across_a_rebuilds_peak_reaches_budgets_recomputation_alone_cannot():
    # ResNet-50 at b=16 with Adam's state streamed (an H200 job, 43e7864): recomputation
    # alone bottoms out at 539.8 MiB, the peak of one rebuild that brings back five tensors
    # of the first stage (171 MiB) for a 49 MiB one; the greedy runs that swap first get
    # stuck higher (the forward is 3.4 ms, too short to copy much out before its peak).
    snap = PlanningSnapshot.load(SNAPSHOTS / RESNET50_STREAMED)
    tl = snap.timeline
    args = (tl, int(516.7 * MB), snap.d2h_bw, snap.h2d_bw, True, False, snap.copy_latency_ms,
            snap.min_bytes, 0.0, CAPTURED_SWAP_COST_MS, 0.0)
    runs = [_greedy(*args, allow_swaps=s, transient=t) for s in (True, False) for t in (True, False)]
    assert min(r.peak_after for r in runs) > 539 * MB
    # With one first-stage tensor swapped for its whole gap, the rest recomputed, the
    # budget (the one the H200 run missed) is met.
    p = snap.replan(budget_bytes=int(516.7 * MB))
    assert p.feasible and 1 <= len(p.swaps) <= tensile.planner.SWAP_SEARCH_ROUNDS
    check_plan(tl, p)
    # every swap keeps off the channel time of the streamed optimizer's own copies
    own = tensile.planner.PlanState(tl, snap.d2h_bw, snap.h2d_bw, snap.copy_latency_ms)
    for s in p.swaps:
        for lo, hi, busy in ((s.out_start_ms, s.out_end_ms, own.d2h.busy),
                             (s.in_start_ms, s.in_end_ms, own.h2d.busy)):
            assert all(hi <= a + EPS or lo >= b - EPS for a, b in busy)
    # Below what it reaches, the plan still says so, and peaks lower than before.
    low = snap.replan(budget_bytes=int(480 * MB))
    assert not low.feasible and low.peak_after < 500 * MB and low.swaps
    check_plan(tl, low)
    # A budget recomputation alone meets is planned as before: no search, no swap.
    assert not snap.replan(budget_bytes=int(540 * MB)).swaps
    # swap_search="never": the greedy runs alone, the budget missed as before
    assert snap.replan(budget_bytes=int(516.7 * MB), swap_search="never").peak_after > 539 * MB


def test_the_search_across_peaks_runs_where_swapping_first_came_closest_too():
    # VGG-16 at b=16 planned to the TENSILE authors' MSR with Adam's state streamed (an
    # H200 job, a64a8d3): the greedy runs that swap first get closest (2214 MiB) and miss
    # the budget (2191 MiB); the search, once run only where recomputation alone came
    # closest, meets it with one swap across the peak.
    snap = PlanningSnapshot.load(SNAPSHOTS / "snapshot_tensile_vgg16_b16_tensile_graph_match_msr_0.326_"
                                 "copy_latency_ms_0.1_bn_from_stats_stream_optimizer_16_stream_prefetch_2_"
                                 "stream_resident_4_20261204T163947.json.gz")
    greedy = snap.replan(swap_search="never")
    assert not greedy.feasible and greedy.swaps
    p = snap.replan()
    check_plan(snap.timeline, p)
    assert p.feasible and simulate(snap.timeline, p).peak <= snap.budget_bytes
    assert 1 <= len(p.swaps) <= tensile.planner.SWAP_SEARCH_ROUNDS


def test_swap_search_always_finds_a_cheaper_plan_where_the_budget_is_met():
    # ResNet-50 at b=16 planned to checkpoint_graph's peak (an H200 job, twenty-sixth
    # session's snapshot): the greedy runs meet the budget; searching anyway finds a plan
    # priced about 0.1 ms less, within the same budget.
    snap = PlanningSnapshot.load(SNAPSHOTS / "snapshot_tensile_resnet50_b16_tensile_graph_match_peak_"
                                 "checkpoint_graph_copy_latency_ms_0.1_bn_from_stats_20261202T094414.json.gz")
    met = snap.replan()
    cheaper = snap.replan(swap_search="always")
    assert met.feasible and cheaper.feasible
    assert cheaper.est_overhead_ms < met.est_overhead_ms - 0.05
    check_plan(snap.timeline, cheaper)
    assert snap.replan(swap_search="never").same_actions(met)   # met: no search by default


def test_the_relaxations_swaps_seed_a_plan_the_greedy_runs_and_their_search_miss():
    # ResNet-50 at b=16 planned to checkpoint_graph's peak (the snapshot above). The bound's
    # relaxation swaps three tensors and brings the stem's output back early, for the
    # rebuild that reads it; greedy runs seeded with those swaps plan what the greedy runs
    # (0.58 ms) and their search across peaks (0.48) do not: 0.46.
    from tensile.bound import extra_time_bound
    snap = PlanningSnapshot.load(SNAPSHOTS / "snapshot_tensile_resnet50_b16_tensile_graph_match_peak_"
                                 "checkpoint_graph_copy_latency_ms_0.1_bn_from_stats_20261202T094414.json.gz")
    tl, budget = snap.timeline, snap.budget_bytes
    bound_args = dict(d2h_bw=snap.d2h_bw, h2d_bw=snap.h2d_bw, min_bytes=snap.min_bytes,
                      copy_latency_ms=snap.copy_latency_ms, swap_cost_ms=snap.options["swap_cost_ms"])
    relaxed = extra_time_bound(tl, budget, **bound_args)
    seeded = {sid for sid, z in relaxed.swapped.items() if z >= min(tensile.planner.GUIDE_SHARES)}
    args = (tl, budget, snap.d2h_bw, snap.h2d_bw, True, False, snap.copy_latency_ms,
            snap.min_bytes, 0.0, snap.options["swap_cost_ms"], 0.0)
    guided = tensile.planner._guided_runs(lambda **kw: tensile.planner.keep_what_fits(tl, _greedy(*args, **kw)),
                                          tl, relaxed)
    assert len(guided) in (4, 8) and seeded
    for p in guided:
        check_plan(tl, p)
        assert {s.sid for s in p.swaps} & seeded
        if p.feasible:
            assert p.est_overhead_ms >= relaxed.extra_ms - EPS
    # a seeded swap is back for the rebuild that reads it, before its own backward use
    assert any(s.use_op not in tl.tensors[s.sid].accesses and s.use_op in rebuilds_reading(p, s.sid)
               for p in guided for s in p.swaps)
    best = min(p.est_overhead_ms for p in guided if p.feasible)
    greedy = snap.replan(swap_search="never")
    assert greedy.feasible and best < greedy.est_overhead_ms - 0.1
    searched = snap.replan(swap_search="always")      # the search, and the seeded runs
    assert searched.feasible and searched.est_overhead_ms <= best + EPS


def test_the_swap_search_adds_and_drops_swaps_from_none_and_from_the_relaxations():
    # ResNet-50 at b=16 with Adam's state streamed, planned to the TENSILE authors' MSR (an
    # H200 job, 99a02be, with what the step holds counted). The greedy runs miss the budget;
    # the seeded runs miss it too (604 MiB); the search from the relaxation's five swaps
    # drops some of them and meets it; from no swaps it adds three and meets it for less
    # than the runs before this search did (1.16 ms priced, forty-eighth session).
    snap = PlanningSnapshot.load(SNAPSHOTS / "snapshot_tensile_resnet50_b16_tensile_graph_match_msr_0.671_"
                                 "copy_latency_ms_0.1_bn_from_stats_stream_optimizer_16_stream_prefetch_2_"
                                 "stream_resident_4_20261204T204545.json.gz")
    from tensile.bound import extra_time_bound
    tl, budget = snap.timeline, snap.budget_bytes
    swap_cost = snap.options["swap_cost_ms"]
    relaxed = extra_time_bound(tl, budget, d2h_bw=snap.d2h_bw, h2d_bw=snap.h2d_bw,
                               min_bytes=snap.min_bytes, copy_latency_ms=snap.copy_latency_ms,
                               swap_cost_ms=swap_cost)
    args = (tl, budget, snap.d2h_bw, snap.h2d_bw, True, True, snap.copy_latency_ms,
            snap.min_bytes, 0.0, swap_cost, 0.0)

    def run(**kw):
        return tensile.planner.keep_what_fits(tl, _greedy(*args, **kw))
    assert not any(p.feasible for p in tensile.planner._guided_runs(run, tl, relaxed))
    seeds = tensile.planner._relaxed_swaps(tl, relaxed, tensile.planner.GUIDE_SHARES[0])
    until = tensile.planner._backs_by(relaxed, tensile.planner.GUIDE_SHARES[0])
    unmet = run(allow_swaps=False, transient=True)
    assert not unmet.feasible
    from_seeds = tensile.planner._swap_search(run, tl, unmet, budget, snap.min_bytes, [seeds], until)
    check_plan(tl, from_seeds)
    assert from_seeds.feasible and set(seeds) - {s.sid for s in from_seeds.swaps}
    from_none = tensile.planner._swap_search(run, tl, unmet, budget, snap.min_bytes, [()], until)
    check_plan(tl, from_none)
    assert from_none.feasible and 1 <= len(from_none.swaps) <= tensile.planner.SWAP_SEARCH_ROUNDS
    assert from_none.est_overhead_ms < 0.95 < 1.1 < snap.plan.est_overhead_ms
    assert from_none.est_overhead_ms >= relaxed.extra_ms - EPS
    # replan() runs both where the budget is unmet, and keeps the cheaper
    p = snap.replan()
    check_plan(tl, p)
    assert p.feasible and simulate(tl, p).peak <= budget
    assert p.est_overhead_ms <= min(from_seeds.est_overhead_ms, from_none.est_overhead_ms) + EPS


def test_a_whole_gap_swap_goes_out_after_the_last_write_and_back_just_in_time():
    tl = _simple()
    st = tensile.planner.PlanState(tl, 1e10, 1e10, 0.0)
    assert st.swap_whole_gap(11)
    (s,) = st.swaps
    assert s.out_start_ms == pytest.approx(tl.end[1])   # right after relu writes it
    assert s.in_end_ms <= tl.start[5] + EPS and s.use_op == 5
    assert st.mem[3] == tl.vanilla_curve()[3] - 4 * MB   # gone across the loss, the peak
    assert not st.swap_whole_gap(12)   # fc's output: read by loss right away, no gap
    # the channel busy from the forward on: no slot to copy out
    busy = tensile.planner.PlanState(tl, 1e10, 1e10, 0.0)
    busy.d2h.add(0.0, tl.iteration_ms)
    assert not busy.swap_whole_gap(11) and not busy.swaps


@settings(max_examples=60, deadline=None)
@given(tl=timelines(), bw=bandwidths)
def test_budget_met_when_vanilla_fits(tl, bw):
    peak = int(tl.vanilla_curve().max())
    p = plan(tl, budget_bytes=peak, d2h_bw=bw, h2d_bw=bw)
    assert p.feasible and not p.swaps and not p.recomputes


@settings(max_examples=60, deadline=None)
@given(tl=timelines(), bw=bandwidths)
def test_no_budget_shaves_as_far_as_hidden_swaps_go(tl, bw):
    """Without a budget the planner shaves until no hidden swap helps: the same peak as a
    swap-only plan chasing an unreachable budget."""
    free = plan(tl, d2h_bw=bw, h2d_bw=bw)
    budgeted = plan(tl, budget_bytes=1, d2h_bw=bw, h2d_bw=bw, allow_recompute=False)
    assert free.peak_after == budgeted.peak_after
    assert not budgeted.feasible or budgeted.peak_after <= 1


# --------------------------------------------------------------------------- small cases
def _simple(opt_tail_ms: float = 0.1) -> AccessTimeline:
    """conv → relu → fc → loss → backward x4 → adam; relu's output 11 waits for backward."""
    ops = [
        ("conv", "forward", 1.0, [1, 2], [10]),
        ("relu", "forward", 1.0, [10], [11]),
        ("fc", "forward", 4.0, [11, 3], [12]),
        ("loss", "loss", 1.0, [12], [13, 16]),  # 16: a big scratch tensor, the peak
        ("loss_bwd", "backward", 2.0, [13], [17]),
        ("fc_bwd", "backward", 4.0, [17, 11, 3], [14, 20]),
        ("relu_bwd", "backward", 1.0, [14, 11], [15]),
        ("conv_bwd", "backward", 1.0, [15, 1, 2], [21]),
        ("adam_state", "optimizer", 0.1, [4, 20, 21], [4]),
        ("adam_param", "optimizer", opt_tail_ms, [2, 3, 20, 21], [2, 3]),
    ]
    sizes = {1: MB, 2: MB, 3: MB, 4: 8 * MB, 10: 4 * MB, 11: 4 * MB, 12: MB, 13: 4,
             14: 4 * MB, 15: 4 * MB, 16: 16 * MB, 17: MB, 20: MB, 21: MB}
    roles = {1: "input", 2: "param", 3: "param", 4: "opt_state"}
    return AccessTimeline.from_ops(ops, sizes, roles, needed_by={2: 0, 3: 1})


def test_an_ops_workspace_is_planned_for_where_it_makes_the_peak():
    """A workspace (``scratch``) on the step's peak op: the budget the step meets without
    it needs a plan with it, and the plan's peak counts it."""
    plain = _simple()                              # peaks at 32 MiB during the loss op
    tl = plain.with_scratch({3: 2 * MB, 6: MB})    # 34 MiB there; relu's 4 MiB output can go
    budget = int(plain.vanilla_curve().max())
    assert int(tl.vanilla_curve().max()) == budget + 2 * MB
    kw = dict(d2h_bw=1e10, h2d_bw=1e10, allow_cross_iteration=False)
    met = plan(plain, budget_bytes=budget, **kw)
    assert met.feasible and not met.swaps and not met.recomputes
    p = plan(tl, budget_bytes=budget, **kw)
    check_plan(tl, p)
    assert p.feasible and (p.swaps or p.recomputes)
    assert [s.sid for s in p.swaps] == [11] and not p.recomputes
    assert p.peak_after == simulate(tl, p).curve[3] <= budget and p.peak_before == budget + 2 * MB


def test_where_workspaces_make_the_peaks_the_swap_search_meets_the_budget():
    # ResNet-50 at b=16 with its optimizer streamed, planned with the workspaces measured on
    # the H200 (78 MiB at a late backward convolution; forty-sixth session's snapshot). The
    # greedy runs shave those peaks first, with long rebuild chains, and stop at 662 MiB;
    # the swap search meets 530 MiB with them for less than the 1.02 ms that planning as if
    # no op held one found before it (forty-sixth session).
    snap = PlanningSnapshot.load(SNAPSHOTS / "snapshot_tensile_resnet50_b16_tensile_graph_match_msr_0.671_"
                                 "copy_latency_ms_0.1_bn_from_stats_stream_optimizer_16_stream_prefetch_2_"
                                 "stream_resident_4_20261204T184344.json.gz")
    tl, budget = snap.timeline, int(530 * MB)
    assert max(tl.scratch.values()) > 64 * MB
    greedy = snap.replan(budget_bytes=budget, swap_search="never")
    assert not greedy.feasible and greedy.peak_after > 600 * MB
    p = snap.replan(budget_bytes=budget)
    check_plan(tl, p)
    assert p.feasible and simulate(tl, p).peak <= budget and p.swaps
    assert p.est_overhead_ms < 1.0


def test_swap_out_early_and_in_late():
    tl = _simple()
    p = plan(tl, d2h_bw=1e10, h2d_bw=1e10, allow_cross_iteration=False, copy_latency_ms=0.0)
    (s,) = [s for s in p.swaps if s.sid == 11]
    copy_ms = 4 * MB / 1e10 * 1e3
    assert s.out_start_ms == pytest.approx(tl.end[1])  # right after relu writes it
    assert s.release_after_op == 2                      # after fc reads it
    assert s.in_end_ms == pytest.approx(tl.start[5])    # just in time for fc_bwd
    assert s.in_start_ms == pytest.approx(tl.start[5] - copy_ms)
    assert s.in_issue_op == 3 and s.use_op == 5  # issued once the peak op is done
    check_plan(tl, p)


def test_the_steps_own_copies_keep_their_channel_time_from_the_plans_swaps():
    """A streamed optimizer's copy into the device while fc_bwd waits for relu's output: the
    host→device channel is busy then, so relu's output comes back before that copy (or not
    at all), never overlapping it; its copy out is unaffected."""
    base = _simple()
    busy_from = base.start[3]                        # the copy starts with the loss op...
    streamed = AccessTimeline.from_ops(
        [(n, ph, ms, r, w) for n, ph, ms, r, w in zip(base.names, base.phases, base.op_ms,
                                                        base.reads, base.writes)],
        {sid: t.nbytes for sid, t in base.tensors.items()},
        {1: "input", 2: "param", 3: "param", 4: "opt_state"}, needed_by={2: 0, 3: 1},
        transfers=[(3, "h2d", 30 * MB)])              # ...and takes 3 ms at 10 GB/s
    kw = dict(d2h_bw=1e10, h2d_bw=1e10, allow_cross_iteration=False, copy_latency_ms=0.0)
    (free,) = [s for s in plan(base, **kw).swaps if s.sid == 11]
    assert free.in_end_ms == pytest.approx(base.start[5])      # just in time, as before
    p = plan(streamed, **kw)
    busy_to = busy_from + 30 * MB / 1e10 * 1e3
    for s in p.swaps:
        assert s.in_end_ms <= busy_from + EPS or s.in_start_ms >= busy_to - EPS, s
    check_plan(streamed, p)
    with pytest.raises(ValueError, match=r"transfers\[0\]: expected \(op index in \[0, 10\), 'h2d' or 'd2h'"):
        AccessTimeline.from_ops([(n, ph, ms, r, w) for n, ph, ms, r, w in zip(
            base.names, base.phases, base.op_ms, base.reads, base.writes)],
            {sid: t.nbytes for sid, t in base.tensors.items()}, transfers=[(10, "h2d", 1)])
    assert streamed.with_op_times(streamed.op_ms * 2).transfers == ((3, "h2d", 30 * MB),)


def test_allow_swaps_false_plans_recomputation_only():
    """Where swaps shave the peak at no estimated cost, ``allow_swaps=False`` moves nothing by
    copy: without an allowance nothing is planned, with one it recomputes instead (here to
    the same peak), and the plan is still a valid one."""
    tl = _dense_block()
    kw = dict(d2h_bw=1e10, h2d_bw=1e10, allow_cross_iteration=False, copy_latency_ms=0.0)
    swapped = plan(tl, max_overhead=0.5, **kw)
    assert swapped.swaps and not swapped.recomputes
    none = plan(tl, allow_swaps=False, **kw)
    assert not none.swaps and not none.recomputes and none.peak_after == none.peak_before
    rec = plan(tl, allow_swaps=False, max_overhead=0.5, **kw)
    assert not rec.swaps and rec.recomputes and rec.peak_after == swapped.peak_after < rec.peak_before
    check_plan(tl, rec, max_overhead=0.5)


def test_a_swapped_activation_is_dropped_when_its_copy_out_should_end():
    """Not right after its last read: in a CUDA graph the release waits for the copy-out."""
    ops = [
        ("a", "forward", 1.0, [1], [10]),
        ("b", "forward", 0.5, [10], [11]),       # the last forward read of 10
        ("c", "forward", 0.5, [11], [12]),
        ("d", "forward", 0.5, [12], [13]),       # 10's copy-out ends in here
        ("loss", "loss", 1.0, [13], [14, 16]),   # 16: a big scratch tensor, the peak
        ("d_bwd", "backward", 2.0, [14], [15]),
        ("a_bwd", "backward", 1.0, [15, 10], [17]),
    ]
    sizes = {1: MB, 10: 12 * MB, 11: MB, 12: MB, 13: MB, 14: MB, 15: MB, 16: 32 * MB, 17: MB}
    tl = AccessTimeline.from_ops(ops, sizes, {1: "input"})
    bw = 12 * MB / 1.2e-3                        # 1.2 ms a copy: from 1.0 to 2.2 ms
    p = plan(tl, d2h_bw=bw, h2d_bw=bw, allow_cross_iteration=False, copy_latency_ms=0.0)
    (s,) = [s for s in p.swaps if s.sid == 10]
    assert s.out_end_ms == pytest.approx(2.2)
    assert s.release_after_op == 3               # d, not b
    assert simulate(tl, p).peak == p.peak_after
    check_plan(tl, p)


def test_cross_iteration_swap_of_optimizer_state():
    tl = _simple(opt_tail_ms=5.0)  # room after the state update to copy 8 MiB out
    p = plan(tl, d2h_bw=1e10, h2d_bw=1e10)
    cross = [s for s in p.swaps if s.cross_iteration]
    assert [s.sid for s in cross if s.sid == 4] == [4]
    assert p.peak_after < p.peak_before
    check_plan(tl, p)
    # 8 MiB cannot leave in a 0.1 ms tail: the copy runs into the next iteration, and the
    # state is gone only from the first op that starts after the copy ended.
    tl_tight = _simple(opt_tail_ms=0.1)
    tight = plan(tl_tight, d2h_bw=1e10, h2d_bw=1e10)
    (s4,) = [s for s in tight.swaps if s.sid == 4]
    past_end = s4.out_end_ms - tl_tight.iteration_ms
    assert s4.cross_iteration and past_end > 0
    lo, hi = absent_ranges(tl_tight, tight)[4]
    assert lo == tl_tight.first_op_starting_at_or_after(past_end) > 0 and hi == s4.in_issue_op
    check_plan(tl_tight, tight)
    slow = plan(tl_tight, d2h_bw=1e7, h2d_bw=1e10)      # 0.8 s to copy out: never in time
    assert 4 not in [s.sid for s in slow.swaps]


SLOW_OPS = [
    ("a", "forward", 1.0, [1], [10]),
    ("b", "forward", 1.0, [10], [11]),      # 11 = b(10), 10 stays for backward
    ("c", "forward", 1.0, [11], [12]),
    ("l", "loss", 1.0, [12], [13, 16]),    # 16: scratch, the peak
    ("c_bwd", "backward", 1.0, [13, 11], [14]),
    ("b_bwd", "backward", 1.0, [14, 10], [15]),
]
SLOW_SIZES = {1: MB, 10: 2 * MB, 11: 8 * MB, 12: MB, 13: 4, 14: MB, 15: MB, 16: 8 * MB}


def test_max_overhead_recomputes_what_no_copy_can_move_within_the_allowance():
    tl = AccessTimeline.from_ops(SLOW_OPS, SLOW_SIZES, {1: "input"})   # a 6 ms iteration
    slow = dict(d2h_bw=1e3, h2d_bw=1e3)                                 # nothing hides at 1 kB/s
    assert plan(tl, **slow).peak_after == plan(tl, **slow).peak_before
    assert not plan(tl, **slow, max_overhead=0.1).recomputes           # 1 ms > 10 % of 6 ms
    p = plan(tl, **slow, max_overhead=0.2)
    assert [r.sid for r in p.recomputes] == [11] and p.est_overhead_ms == pytest.approx(1.0)
    assert p.peak_after == p.peak_before - 8 * MB and p.feasible
    check_plan(tl, p, max_overhead=0.2)
    with pytest.raises(ValueError, match="max_overhead must be a fraction of the iteration time >= 0"):
        plan(tl, **slow, max_overhead=-0.1)


def test_recompute_when_swaps_cannot_hide():
    ops, sizes = SLOW_OPS, SLOW_SIZES
    tl = AccessTimeline.from_ops(ops, sizes, {1: "input"})
    slow = dict(d2h_bw=1e3, h2d_bw=1e3)
    assert not plan(tl, **slow).swaps  # nothing hides at 1 kB/s
    p = plan(tl, budget_bytes=13 * MB, **slow)
    assert [r.sid for r in p.recomputes] == [11] and p.feasible
    assert p.recomputes[0].sources == [10] and p.est_overhead_ms == pytest.approx(1.0)
    check_plan(tl, p)
    assert not plan(tl, budget_bytes=13 * MB, allow_recompute=False, **slow).feasible
    random = AccessTimeline.from_ops(ops, sizes, {1: "input"}, random_ops={1})
    assert 11 not in [r.sid for r in plan(random, budget_bytes=13 * MB, **slow).recomputes]


def test_actions_and_summary_are_readable():
    p = plan(_simple(opt_tail_ms=5.0), d2h_bw=1e10, h2d_bw=1e10)
    acts = p.actions()
    assert any("swap_out" in a for v in acts.values() for a in v)
    text = str(p)
    assert "peak" in text and "swap_in" in text and "[next iteration]" in text


def test_same_actions_ignores_the_planners_times_only():
    """A re-plan that does what the old plan did (a captured job need not capture again)
    differs only in its times; any other change counts."""
    import copy
    import dataclasses
    tl = _simple()
    p = plan(tl, d2h_bw=1e10, h2d_bw=1e10, allow_cross_iteration=False, copy_latency_ms=0.0)
    assert p.swaps
    slower = plan(tl, d2h_bw=0.9e10, h2d_bw=0.9e10, allow_cross_iteration=False, copy_latency_ms=0.0)
    assert slower.swaps[0].in_start_ms != p.swaps[0].in_start_ms   # other times, same actions
    assert p.same_actions(slower) and slower.same_actions(p)
    retimed = dataclasses.replace(p, iteration_ms=2 * p.iteration_ms, est_overhead_ms=1.0)
    assert p.same_actions(retimed)
    later = copy.deepcopy(p)
    later.swaps[0].in_issue_op += 1
    assert not p.same_actions(later)
    fewer = dataclasses.replace(p, swaps=p.swaps[1:])
    assert not p.same_actions(fewer)
    assert not p.same_actions(dataclasses.replace(p, num_ops=p.num_ops + 1))


def test_plan_json_rejects_other_json(tmp_path):
    p = plan(_simple(), d2h_bw=1e10, h2d_bw=1e10)
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == p
    with pytest.raises(ValueError, match="not a TENSILE plan"):
        Plan.from_json('{"nodes": []}')


def test_planning_snapshot_round_trips_and_rejects_other_files(tmp_path):
    import gzip
    from tensile import PlanningSnapshot
    tl = _simple()
    p = plan(tl, budget_bytes=int(simulate(tl).peak * 0.8), d2h_bw=1e10, h2d_bw=1e10, allow_swaps=False)
    assert not plan(tl, budget_bytes=p.budget_bytes, d2h_bw=1e10, h2d_bw=1e10).same_actions(p)
    snap = PlanningSnapshot(timeline=tl, budget_bytes=p.budget_bytes, d2h_bw=1e10, h2d_bw=1e10,
                            copy_latency_ms=COPY_LATENCY_MS, min_bytes=1, plan=p, meta={"model": "toy"},
                            options={"allow_swaps": False})
    back = PlanningSnapshot.load(snap.save(tmp_path / "a" / "snap.json.gz"))
    assert back.plan == p and back.meta == {"model": "toy"} and back.options == {"allow_swaps": False}
    assert list(back.timeline.op_ms) == list(tl.op_ms) and back.timeline.tensors == tl.tensors
    assert back.replan().same_actions(p)                   # with the options it was made with
    assert not back.replan(allow_swaps=True).same_actions(p)
    # a plan of another planner (options unknown): replan() says so unless told how
    other = dataclasses.replace(back, options=None)
    with pytest.raises(ValueError, match="another planner than TENSILE's"):
        other.replan()
    assert other.replan(allow_swaps=False).same_actions(p)
    old = snap.to_dict()
    del old["options"]                                     # files written before options were kept
    assert PlanningSnapshot.from_dict(old).options is None
    with gzip.open(tmp_path / "plan.json.gz", "wt") as f:
        f.write(p.to_json())
    with pytest.raises(ValueError, match="not a TENSILE planning snapshot"):
        PlanningSnapshot.load(tmp_path / "plan.json.gz")
    broken = snap.to_dict()
    broken["op_ms"] = broken["op_ms"][:-1]
    with pytest.raises(ValueError, match="planning snapshot: timeline.names"):
        PlanningSnapshot.from_dict(broken)


@given(tl=timelines(), bw=st.floats(1e3, 1e9), frac=st.floats(0.2, 1.0))
def test_what_is_held_at_each_op_adds_up_to_the_replayed_curve(tl, bw, frac):
    """held_at splits simulate's curve by role: swaps, rebuilds, kept sources and inputs
    rebuilt for one recompute alone count where the replay counts them."""
    p = plan(tl, budget_bytes=max(1, int(frac * tl.vanilla_curve().max())), d2h_bw=bw, h2d_bw=bw)
    curve, vanilla = simulate(tl, p).curve, tl.vanilla_curve()
    for k in range(tl.num_ops):
        assert sum(held_at(tl, p, k).values()) == curve[k]
        assert sum(held_at(tl, None, k).values()) == vanilla[k]


def test_what_is_held_adds_up_where_rebuilds_run_ahead_of_need():
    """Inception-v4 at checkpointing's peak, rebuilds issued ahead (the GPU's plan): an input
    rebuilt ahead for its own use is resident again when a recompute that reads it rebuilds it
    once more for that recompute alone, and the replay counts it twice there (op 951)."""
    snap = PlanningSnapshot.load(SNAPSHOTS / "snapshot_tensile_inception_v4_b16_tensile_graph_match_peak_"
                                 "checkpoint_graph_copy_latency_ms_0.1_allow_swaps_false_bn_from_stats_"
                                 "rebuild_ahead_2.json.gz")
    tl, p = snap.timeline, snap.plan
    assert any(r.before_op == 951 and r.transient for r in p.recomputes)
    curve = simulate(tl, p).curve
    assert [k for k in range(tl.num_ops) if sum(held_at(tl, p, k).values()) != curve[k]] == []


def test_what_is_held_leaves_out_a_swapped_tensor_while_it_is_away():
    tl = _simple()
    for cross, sid, role in ((True, 4, "opt_state"), (False, 11, "activation")):
        p = plan(tl, budget_bytes=28 * MB, d2h_bw=1e10, h2d_bw=1e10, allow_recompute=False,
                 allow_cross_iteration=cross)
        away = absent_ranges(tl, p)
        assert list(away) == [sid], p.swaps   # Adam's state, else relu's output
        for k in range(tl.num_ops):
            during, vanilla = held_at(tl, p, k), held_at(tl, None, k)
            gone = tl.tensors[sid].nbytes if away[sid][0] <= k <= away[sid][1] else 0
            assert vanilla[role] - during[role] == gone
            assert {r: b for r, b in during.items() if r != role} == \
                {r: b for r, b in vanilla.items() if r != role}
    with pytest.raises(ValueError, match=r"op: expected an index in \[0, 10\), got 10"):
        held_at(tl, p, 10)


def test_simulate_rejects_plan_of_other_timeline():
    p = plan(_simple(), d2h_bw=1e10, h2d_bw=1e10)
    small = AccessTimeline.from_ops([("a", "forward", 1.0, [], [1])], {1: 4})
    with pytest.raises(ValueError, match="ops"):
        simulate(small, p)


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget_bytes=0), "budget_bytes"),
    (dict(budget_bytes=1.5), "budget_bytes"),
    (dict(d2h_bw=0), "d2h_bw"),
    (dict(h2d_bw=float("nan")), "h2d_bw"),
    (dict(min_bytes=0), "min_bytes"),
    (dict(swap_cost_ms=-0.01), "swap_cost_ms"),
    (dict(swap_cost_ms=True), "swap_cost_ms"),
    (dict(swap_copy_share=1.5), r"swap_copy_share must be a share of a swap's copy time in \[0, 1\]"),
    (dict(swap_copy_share=-0.01), "swap_copy_share"),
    (dict(swap_copy_share=True), "swap_copy_share"),
    (dict(swap_search="sometimes"), r"swap_search: expected one of 'unmet', 'always', 'never'; got 'sometimes'"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(d2h_bw=1e9, h2d_bw=1e9) | kwargs
    with pytest.raises(ValueError, match=match):
        plan(_simple(), **args)


def test_planner_is_fast_on_a_large_timeline():
    """~3000 ops and ~2000 tensors (ResNet-50 scale) plan in seconds, not minutes."""
    rng = np.random.default_rng(0)
    n_fwd, n_bwd = 1200, 1600
    ops, sizes = [], {}
    for k in range(n_fwd):
        sizes[k + 1] = int(rng.integers(1 << 16, 1 << 24))
        ops.append((f"f{k}", "forward", float(rng.uniform(0.01, 1)), [k] if k else [], [k + 1]))
    ops.append(("loss", "loss", 0.01, [n_fwd], [n_fwd + 1]))
    sizes[n_fwd + 1] = 4
    for k in range(n_bwd):
        src = n_fwd - (k * n_fwd) // n_bwd
        ops.append((f"b{k}", "backward", float(rng.uniform(0.01, 2)), [src], []))
    tl = AccessTimeline.from_ops(ops, sizes)
    p = plan(tl, d2h_bw=5e10, h2d_bw=5e10)
    assert p.peak_after < p.peak_before
    assert p.planner_ms < 30_000
    check_plan(tl, p)


def _bn_relu_ops(bn_name: str) -> list:
    """conv → batch norm (writes running stats 3) → ReLU in place → head, and backward."""
    return [
        ("aten.convolution.default", "forward", 1.0, [1, 2], [10]),
        (bn_name, "forward", 1.0, [10, 3], [11, 3]),
        ("aten.relu_.default", "forward", 1.0, [11], [11]),
        ("head", "forward", 1.0, [11], [12]),
        ("l", "loss", 1.0, [12], [13, 16]),                  # 16: scratch, the peak
        ("head_bwd", "backward", 1.0, [13, 11], [14]),
        ("bn_bwd", "backward", 1.0, [14, 10], [15]),
    ]


BN_SIZES = {1: MB, 2: 4, 3: 4, 10: 2 * MB, 11: 8 * MB, 12: MB, 13: 4, 14: MB, 15: MB, 16: 8 * MB}
BN_ROLES = {1: "input", 2: "param", 3: "buffer"}


def test_recompute_reruns_in_place_updates_and_batch_norm_on_scratch_statistics():
    slow = dict(d2h_bw=1e3, h2d_bw=1e3)
    tl = AccessTimeline.from_ops(_bn_relu_ops("aten.native_batch_norm.default"), BN_SIZES, BN_ROLES)
    p = plan(tl, budget_bytes=13 * MB, **slow)
    (r,) = [r for r in p.recomputes if r.sid == 11]
    assert (r.producer_op, r.then_ops, r.scratch, r.sources) == (1, [2], [3], [10])
    assert r.cost_ms == pytest.approx(2.0) and p.feasible
    assert "recompute 11 (op 1, 2)" in str(p)
    check_plan(tl, p)
    # a batch norm rebuilt from its statistics: the rerun costs a share of the op's time
    cheap = AccessTimeline.from_ops(_bn_relu_ops("aten.native_batch_norm.default"), BN_SIZES,
                                    BN_ROLES, rerun_share={1: 0.25})
    (r,) = [r for r in plan(cheap, budget_bytes=13 * MB, **slow).recomputes if r.sid == 11]
    assert r.cost_ms == pytest.approx(0.25 + 1.0)       # op 1 at a quarter, the relu_ whole
    fused = AccessTimeline.from_ops(_bn_relu_ops("aten.native_batch_norm.default"), BN_SIZES,
                                    BN_ROLES, rerun_share={1: 0.5, 2: 0.0})  # relu_ in its pass
    (r,) = [r for r in plan(fused, budget_bytes=13 * MB, **slow).recomputes if r.sid == 11]
    assert r.cost_ms == pytest.approx(0.5) and r.then_ops == [2]
    assert cheap.with_op_times([2.0] * cheap.num_ops).rerun_share == {1: 0.25}
    # any other op that writes a tensor besides its output would repeat that write
    other = AccessTimeline.from_ops(_bn_relu_ops("aten.foo.default"), BN_SIZES, BN_ROLES)
    assert 11 not in [r.sid for r in plan(other, budget_bytes=13 * MB, **slow).recomputes]


def test_a_recompute_may_read_a_dropped_tensor_that_is_rebuilt_first():
    tl = AccessTimeline.from_ops(_bn_relu_ops("aten.native_batch_norm.default"), BN_SIZES, BN_ROLES)
    p = plan(tl, budget_bytes=1, d2h_bw=1e3, h2d_bw=1e3)
    by_sid = {r.sid: r for r in p.recomputes}
    assert {10, 11} <= set(by_sid)
    # 10 is read again only by op 6, but 11's rebuild (before op 5) reads it: rebuilt by 5
    assert by_sid[11].sources == [10] and by_sid[10].before_op == by_sid[11].before_op == 5
    check_plan(tl, p)



def _dense_block() -> AccessTimeline:
    """A DenseNet block of three layers (batch norms left out): the stem's output x, then
    c0 = cat(x) → f1 = conv(c0); c1 = cat(x, f1) → f2 = conv(c1); c2 = cat(x, f1, f2) →
    f3 = conv(c2); c3 = cat(x, f1, f2, f3) → head. Backward reads the concatenations (the
    convs' inputs), never x or the new features f: those are done with in forward. A
    concatenation is as large as what it joins, so dropping one while keeping its inputs
    frees nothing at the peak (in the loss, past their last read); keeping the inputs once
    serves all of them."""
    ops = [
        ("stem", "forward", 1.0, [0, 20], [1]),
        ("aten.cat.default", "forward", 0.1, [1], [5]),
        ("aten.convolution.default", "forward", 1.0, [5, 21], [2]),
        ("aten.cat.default", "forward", 0.1, [1, 2], [6]),
        ("aten.convolution.default", "forward", 1.0, [6, 22], [3]),
        ("aten.cat.default", "forward", 0.1, [1, 2, 3], [7]),
        ("aten.convolution.default", "forward", 1.0, [7, 23], [4]),
        ("aten.cat.default", "forward", 0.1, [1, 2, 3, 4], [8]),
        ("head", "forward", 1.0, [8, 24], [9]),
        ("loss", "loss", 1.0, [9], [10, 16]),       # 16: scratch, the peak
        ("head_bwd", "backward", 1.0, [10, 8, 24], [11]),
        ("conv3_bwd", "backward", 1.0, [11, 7, 23], [12]),
        ("conv2_bwd", "backward", 1.0, [12, 6, 22], [13]),
        ("conv1_bwd", "backward", 1.0, [13, 5, 21], [14]),
        ("stem_bwd", "backward", 1.0, [14, 0], [15]),
    ]
    sizes = {0: MB, 1: 4 * MB, 2: MB, 3: MB, 4: MB, 5: 4 * MB, 6: 5 * MB, 7: 6 * MB, 8: 7 * MB,
             9: MB, 10: 4, 11: MB, 12: MB, 13: MB, 14: MB, 15: MB, 16: 8 * MB}
    sizes.update({k: 4 for k in range(20, 25)})
    roles = {0: "input", **{k: "param" for k in range(20, 25)}}
    return AccessTimeline.from_ops(ops, sizes, roles)


def test_concatenations_are_rebuilt_from_the_inputs_they_joined_kept_once(monkeypatch):
    tl = _dense_block()
    slow = dict(d2h_bw=1e3, h2d_bw=1e3, max_overhead=1.0)
    p = plan(tl, **slow)
    check_plan(tl, p, max_overhead=1.0)
    by_sid = {r.sid: r for r in p.recomputes}
    assert {5, 6, 7} <= set(by_sid), p
    assert set(by_sid[7].kept) == {1, 2, 3}
    assert kept_ranges(tl, p.recomputes)[1] == (tl.tensors[1].last + 1, by_sid[5].before_op)
    # one at a time, none of them would lower the peak
    monkeypatch.setattr(tensile.planner.PlanState, "_best_group", lambda *a: None)
    assert plan(tl, **slow).peak_after == p.peak_before
    monkeypatch.undo()
    # without keeping, no concatenation can be rebuilt: its inputs are gone by then
    orig = tensile.planner.recompute_of
    monkeypatch.setattr(tensile.planner, "recompute_of",
                        lambda *a, **k: orig(*a, **{**k, "keep_sources": False}))
    without = plan(tl, **slow)
    assert not {5, 6, 7, 8} & {r.sid for r in without.recomputes}
    assert p.peak_after <= without.peak_after - 4 * MB


def test_a_scheduler_says_whether_its_graph_serves_the_current_plan():
    """Scheduler.graph_is_current: no graph yet, the graph's own plan, a graph captured
    before tensile.trim_stack (stale), a plan that does the same (only times differ), and
    one that does something else."""
    import copy
    import dataclasses
    from types import SimpleNamespace
    from tensile.api import Scheduler
    tl = _simple()
    p = plan(tl, d2h_bw=1e10, h2d_bw=1e10, allow_cross_iteration=False, copy_latency_ms=0.0)
    sched = SimpleNamespace(_graph=None, _graph_plan=None, plan=p)
    current = lambda: Scheduler.graph_is_current.fget(sched)  # noqa: E731
    assert not current()                                       # nothing captured yet
    sched._graph, sched._graph_plan = SimpleNamespace(stale=False), p
    assert current()
    sched._graph.stale = True                                  # captured before trim_stack
    assert not current()
    sched._graph.stale = False
    sched.plan = dataclasses.replace(p, iteration_ms=2 * p.iteration_ms)
    assert current()                                           # same actions: no capture
    later = copy.deepcopy(p)
    later.swaps[0].in_issue_op += 1
    sched.plan = later
    assert not current()


def _unpruned(run):
    """``run()`` with try_recompute weighing every candidate (no score bound)."""
    from unittest import mock
    with mock.patch.object(tensile.planner.PlanState, "_score_bound",
                           lambda self, sid, i: float("inf")):
        return run()


def _same_plan(a: Plan, b: Plan) -> bool:
    return (a.same_actions(b) and a.peak_after == b.peak_after
            and [(r.sid, r.cost_ms, r.transient) for r in a.recomputes]
            == [(r.sid, r.cost_ms, r.transient) for r in b.recomputes])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tl=st.one_of(chains(), timelines()), frac=st.floats(0.2, 0.95), bw=bandwidths,
       overhead=st.floats(0.0, 0.5), budgeted=st.booleans())
def test_the_rebuild_score_bound_only_skips_what_could_not_win(tl, frac, bw, overhead, budgeted):
    """try_recompute skips a tensor whose bytes over its own rerun time cannot beat the best
    so far (:meth:`PlanState._score_bound`): the plans are those of weighing every one."""
    budget = max(1, int(frac * tl.vanilla_curve().max())) if budgeted else None
    run = lambda: plan(tl, budget_bytes=budget, d2h_bw=bw, h2d_bw=bw, max_overhead=overhead,
                       swap_search="always")
    assert _same_plan(run(), _unpruned(run))


def test_the_rebuild_score_bound_keeps_resnet50s_plan_at_checkpointings_peak():
    snap = PlanningSnapshot.load(SNAPSHOTS / "snapshot_tensile_resnet50_b16_tensile_graph_match_peak_"
                                 "checkpoint_graph_copy_latency_ms_0.1_bn_from_stats_swap_search_"
                                 "always_20261204T205242.json.gz")
    pruned = snap.replan(swap_search="always")
    assert pruned.feasible and pruned.recomputes
    assert _same_plan(pruned, _unpruned(lambda: snap.replan(swap_search="always")))
