"""TENSILE joint planner: several jobs on one timeline with shared copy channels."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensile.multi import JobSpec, layout_jobs, plan_jobs, simulate_joint
from tensile.planner import plan
from tensile.simulate import simulate
from tensile.timeline import AccessTimeline

MB = 1 << 20
EPS = 1e-6
BW = 20e9  # bytes/s: an 8 MiB copy takes ~0.43 ms


def job_timeline(scale: float = 1.0, act: int = 8 * MB) -> AccessTimeline:
    """A small training step: three saved activations, a parameter and its Adam state."""
    sizes = {1: 4 * MB, 2: act, 3: act, 4: act, 5: 1 * MB, 6: 2 * MB, 7: 2 * MB}
    roles = {1: "input", 6: "param", 7: "opt_state"}
    ops = [("a", "forward", 1.0, [1, 6], [2]), ("b", "forward", 1.0, [2], [3]),
           ("c", "forward", 1.0, [3], [4]), ("l", "loss", 1.0, [4], [5]),
           ("d", "backward", 1.0, [5, 4], []), ("e", "backward", 1.0, [3], []),
           ("f", "backward", 1.0, [2, 6], []), ("o", "optimizer", 0.5, [6, 7], [6, 7])]
    ops = [(n, ph, ms * scale, r, w) for n, ph, ms, r, w in ops]
    return AccessTimeline.from_ops(ops, sizes, roles)


def check_joint(jobs, jp) -> None:
    """Every invariant of a joint plan."""
    lay = jp.layout
    replay = simulate_joint(lay, jp.plans)
    assert int(replay.max()) == jp.peak_after
    assert int(simulate_joint(lay, {j: None for j in jp.plans}).max()) == jp.peak_before
    assert jp.peak_after <= jp.peak_before
    assert jp.peak_before <= jp.sum_of_peaks_before
    assert jp.peak_after <= jp.sum_of_peaks_after
    if jp.budget_bytes is not None:
        assert jp.feasible == (jp.peak_after <= jp.budget_bytes)
    for j in jobs:
        p = jp.plans[j.job_id]
        tl = lay.timelines[j.job_id]
        assert simulate(tl, p).peak == p.peak_after
        assert p.feasible == jp.feasible and p.budget_bytes == jp.budget_bytes
        moved = [s.sid for s in p.swaps] + [r.sid for r in p.recomputes]
        assert len(moved) == len(set(moved))
        for s in p.swaps:
            assert tl.tensors[s.sid].swappable
            # a copy-out of optimizer state may run into the job's next iteration
            assert -EPS <= s.out_start_ms < s.out_end_ms < s.out_start_ms + tl.iteration_ms
            assert s.out_end_ms <= tl.iteration_ms + EPS or s.cross_iteration
            assert -EPS <= s.in_start_ms < s.in_end_ms <= tl.iteration_ms + EPS
    for direction, copies in jp.channel_copies().items():
        for (a0, a1, *_), (b0, b1, *who) in zip(copies, copies[1:]):
            assert b0 >= a1 - EPS, f"{direction}: copies overlap at {b0} (job {who})"
        for a, b, *_ in copies:
            assert 0 <= a < b <= lay.cycle_ms + EPS


# --------------------------------------------------------------------------- basics
@pytest.mark.parametrize("budget", [None, 20 * MB])
def test_one_job_is_the_single_job_planner(budget):
    tl = job_timeline()
    alone = plan(tl, budget_bytes=budget, d2h_bw=BW, h2d_bw=BW)
    jp = plan_jobs([JobSpec("a", tl)], budget_bytes=budget, d2h_bw=BW, h2d_bw=BW)
    p = jp.plans["a"]
    assert p.swaps == alone.swaps and p.recomputes == alone.recomputes
    assert (p.peak_before, p.peak_after, p.feasible) == (alone.peak_before, alone.peak_after,
                                                         alone.feasible)
    assert jp.peak_after == alone.peak_after


def test_aligned_jobs_share_channels_and_shave_jointly():
    jobs = [JobSpec("a", job_timeline()), JobSpec("b", job_timeline())]
    jp = plan_jobs(jobs, d2h_bw=BW, h2d_bw=BW)
    check_joint(jobs, jp)
    # Aligned identical jobs peak together: the joint peak is the sum at first ...
    assert jp.peak_before == jp.sum_of_peaks_before == 2 * 33 * MB
    # ... and both are shaved, with copies queued one after another on each channel.
    assert jp.peak_after < jp.peak_before
    assert all(jp.plans[j].swaps for j in "ab")


def test_offset_jobs_peak_below_the_sum_of_peaks():
    """A measured phase (iteration starts on a shared clock) puts the peaks apart."""
    jobs = [JobSpec("a", job_timeline(), iter_start_s=100.0),
            JobSpec("b", job_timeline(), iter_start_s=100.0035)]  # 3.5 ms later
    jp = plan_jobs(jobs, d2h_bw=BW, h2d_bw=BW)
    check_joint(jobs, jp)
    assert jp.layout.phases["b"] == pytest.approx(3.5)
    assert jp.peak_before < jp.sum_of_peaks_before  # TENSILE would have planned for the sum
    assert jp.peak_after <= jp.peak_before


def test_shared_channel_is_the_bottleneck():
    """Slow copies: independently planned jobs would collide on the bus, joint ones do not."""
    bw = 5e9  # an 8 MiB copy takes ~1.7 ms: one copy fills the gap it must fit in
    jobs = [JobSpec("a", job_timeline()), JobSpec("b", job_timeline())]
    jp = plan_jobs(jobs, d2h_bw=bw, h2d_bw=bw)
    check_joint(jobs, jp)
    alone = [plan(j.timeline, d2h_bw=bw, h2d_bw=bw) for j in jobs]
    assert all(p.swaps for p in alone)
    outs = sorted((s.out_start_ms, s.out_end_ms) for p in alone for s in p.swaps)
    assert any(b0 < a1 - EPS for (a0, a1), (b0, b1) in zip(outs, outs[1:])), \
        "independent plans should overlap on the channel (TENSILE's flaw)"
    n_joint = sum(len(p.swaps) for p in jp.plans.values())
    assert n_joint < sum(len(p.swaps) for p in alone)  # the bus fits fewer copies


def test_faster_job_repeats_in_the_cycle():
    jobs = [JobSpec("slow", job_timeline(), iter_ms=15.0),
            JobSpec("fast", job_timeline(), iter_ms=7.0)]
    lay = layout_jobs(jobs)
    assert lay.cycle_ms == 15.0 and lay.repeats == {"slow": 1, "fast": 2}
    assert lay.periods["fast"] == pytest.approx(7.5)
    assert lay.timelines["fast"].iteration_ms == pytest.approx(7.5)  # proportional stretch
    assert lay.timelines["slow"].iteration_ms == pytest.approx(15.0)
    jp = plan_jobs(jobs, d2h_bw=BW, h2d_bw=BW)
    check_joint(jobs, jp)
    copies = jp.channel_copies()["d2h"]
    fast = [c for c in copies if c[2] == "fast"]
    assert len(fast) == 2 * len(jp.plans["fast"].swaps)  # once per repeat


def test_measured_op_starts_set_the_wall_clock_spans():
    tl = job_timeline()
    starts = [0.0, 2.0, 3.0, 5.0, 6.0, 6.5, 8.0, 9.0]  # waits between some ops
    lay = layout_jobs([JobSpec("a", tl, iter_ms=10.0, op_start_ms=starts)])
    np.testing.assert_allclose(lay.timelines["a"].start, starts)
    assert lay.timelines["a"].iteration_ms == pytest.approx(10.0)
    with pytest.raises(ValueError, match="op_start_ms has 3 entries"):
        layout_jobs([JobSpec("a", tl, iter_ms=10.0, op_start_ms=[0, 1, 2])])
    with pytest.raises(ValueError, match="non-decreasing"):
        layout_jobs([JobSpec("a", tl, iter_ms=10.0, op_start_ms=starts[::-1])])


# --------------------------------------------------------------------------- weights
@pytest.mark.parametrize("heavy", ["a", "b"])
def test_higher_weight_keeps_more_resident(heavy):
    light = "b" if heavy == "a" else "a"
    jobs = [JobSpec(j, job_timeline(), weight=3.0 if j == heavy else 1.0) for j in "ab"]
    budget = 2 * 33 * MB - 8 * MB  # reachable by shaving one job alone
    jp = plan_jobs(jobs, budget_bytes=budget, d2h_bw=BW, h2d_bw=BW)
    check_joint(jobs, jp)
    assert jp.feasible
    moved = {j: sum(s.nbytes for s in jp.plans[j].swaps) +
             sum(r.nbytes for r in jp.plans[j].recomputes) for j in "ab"}
    assert moved[heavy] == 0 < moved[light]


def test_recompute_goes_to_the_lower_weight_first():
    # Fast copies cannot hide anything when the bandwidth is tiny: only recomputation helps.
    jobs = [JobSpec("a", job_timeline(), weight=1.0), JobSpec("b", job_timeline(), weight=2.0)]
    jp = plan_jobs(jobs, budget_bytes=2 * 33 * MB - 8 * MB, d2h_bw=1e6, h2d_bw=1e6)
    check_joint(jobs, jp)
    assert jp.plans["a"].recomputes and not jp.plans["b"].recomputes
    assert not jp.plans["a"].swaps and not jp.plans["b"].swaps


def test_joint_plan_prices_reruns_at_a_jobs_rerun_shares():
    """A job's rerun shares (batch norms rebuilt from statistics) price its recomputes in the
    joint plan as they do in a local one."""
    def plans(share):
        tl = job_timeline()
        tl = AccessTimeline(tl.names, tl.phases, tl.op_ms, tl.random, tl.reads, tl.writes,
                            tl.tensors, rerun_share={k: share for k in range(tl.num_ops)})
        jobs = [JobSpec("a", tl, weight=1.0), JobSpec("b", job_timeline(), weight=2.0)]
        jp = plan_jobs(jobs, budget_bytes=2 * 33 * MB - 8 * MB, d2h_bw=1e6, h2d_bw=1e6)
        check_joint(jobs, jp)
        return {r.sid: r.cost_ms for r in jp.plans["a"].recomputes}
    whole, half = plans(1.0), plans(0.5)
    assert whole and whole.keys() == half.keys()
    assert all(half[s] == pytest.approx(whole[s] / 2) for s in whole)


def test_priced_swaps_go_to_an_unpriced_job_or_give_way_to_recomputes():
    """A job whose swaps cost its step time (a captured step's joins, ``swap_cost_ms``): under
    a budget the joint plan counts that price, and keeps the plan without such swaps when it
    is cheaper, as the single-job planner does."""
    budget = 2 * 33 * MB - 8 * MB    # one 8 MiB swap or rebuild in either job reaches it

    def joint(cost_a, cost_b):
        jobs = [JobSpec("a", job_timeline(), swap_cost_ms=cost_a),
                JobSpec("b", job_timeline(), swap_cost_ms=cost_b)]
        jp = plan_jobs(jobs, budget_bytes=budget, d2h_bw=BW, h2d_bw=BW)
        check_joint(jobs, jp)
        assert jp.feasible
        return jp.plans
    free = joint(0.0, 0.0)           # ties go to job a: it swaps, for free
    assert len(free["a"].swaps) == 1 and free["a"].est_overhead_ms == 0
    one = joint(1e-3, 0.0)           # b's swap is free, a's is not: b swaps instead
    assert not one["a"].swaps and not one["a"].recomputes and len(one["b"].swaps) == 1
    assert one["b"].est_overhead_ms == 0
    cheap = joint(1e-3, 1e-3)        # priced, but cheaper than a 1 ms rerun: kept, and counted
    assert len(cheap["a"].swaps) == 1 and cheap["a"].est_overhead_ms == pytest.approx(1e-3)
    dear = joint(10.0, 10.0)         # dearer than a rerun: recomputation only
    assert not dear["a"].swaps and not dear["b"].swaps
    rebuilt = dear["a"].recomputes + dear["b"].recomputes
    assert len(rebuilt) == 1
    assert dear["a"].est_overhead_ms + dear["b"].est_overhead_ms == pytest.approx(rebuilt[0].cost_ms)


def test_a_jobs_swaps_priced_by_their_bytes():
    """``swap_copy_share``: each swap of the job costs that share of its copies' time (an
    8 MiB swap at 20 GB/s: 0.84 ms out and in); under a budget the joint plan weighs it
    against a 0.5 ms rerun, as the single-job planner does."""
    budget = 2 * 33 * MB - 8 * MB
    copies_ms = 2 * 8 * MB / BW * 1e3

    def joint(share):
        jobs = [JobSpec("a", job_timeline(0.5), swap_copy_share=share),
                JobSpec("b", job_timeline(0.5), swap_copy_share=share)]
        jp = plan_jobs(jobs, budget_bytes=budget, d2h_bw=BW, h2d_bw=BW)
        check_joint(jobs, jp)
        assert jp.feasible
        return jp.plans
    cheap = joint(0.25)              # 0.21 ms: cheaper than the rerun, kept and counted
    assert len(cheap["a"].swaps) == 1 and not cheap["a"].recomputes
    assert cheap["a"].est_overhead_ms == pytest.approx(0.25 * copies_ms)
    dear = joint(1.0)                # 0.84 ms: the rerun is cheaper
    assert not dear["a"].swaps and not dear["b"].swaps
    assert len(dear["a"].recomputes + dear["b"].recomputes) == 1
    with pytest.raises(ValueError, match="swap_copy_share must be a share of a swap's copy time"):
        plan_jobs([JobSpec("a", job_timeline(), swap_copy_share=2.0)], d2h_bw=BW, h2d_bw=BW)


def test_a_budget_share_is_that_share_of_the_joint_peak():
    """``budget_share`` plans as the same budget in bytes would, and moves only what the
    cut needs: fewer swaps than without a budget, which hides every swap it can."""
    jobs = [JobSpec("a", job_timeline(), iter_start_s=100.0),
            JobSpec("b", job_timeline(), iter_start_s=100.0035)]
    shared = plan_jobs(jobs, budget_share=0.9, d2h_bw=BW, h2d_bw=BW)
    check_joint(jobs, shared)
    assert shared.budget_bytes == int(0.9 * shared.peak_before)
    assert shared.feasible and shared.peak_after <= shared.budget_bytes
    in_bytes = plan_jobs(jobs, budget_bytes=shared.budget_bytes, d2h_bw=BW, h2d_bw=BW)
    assert {j: p.swaps for j, p in in_bytes.plans.items()} == \
        {j: p.swaps for j, p in shared.plans.items()}
    unlimited = plan_jobs(jobs, d2h_bw=BW, h2d_bw=BW)
    n = {name: sum(len(p.swaps) for p in jp.plans.values())
         for name, jp in (("share", shared), ("none", unlimited))}
    assert 0 < n["share"] < n["none"]
    whole = plan_jobs(jobs, budget_share=1.0, d2h_bw=BW, h2d_bw=BW)
    assert whole.feasible and not any(p.swaps or p.recomputes for p in whole.plans.values())


# --------------------------------------------------------------------------- errors
def test_bad_jobs_are_refused():
    tl = job_timeline()
    with pytest.raises(ValueError, match="unique"):
        plan_jobs([JobSpec("a", tl), JobSpec("a", tl)], d2h_bw=BW, h2d_bw=BW)
    with pytest.raises(ValueError, match="no jobs"):
        plan_jobs([], d2h_bw=BW, h2d_bw=BW)
    with pytest.raises(ValueError, match="weight"):
        plan_jobs([JobSpec("a", tl, weight=0)], d2h_bw=BW, h2d_bw=BW)
    with pytest.raises(ValueError, match="iter_ms"):
        plan_jobs([JobSpec("a", tl, iter_ms=-1.0)], d2h_bw=BW, h2d_bw=BW)
    with pytest.raises(ValueError, match="budget"):
        plan_jobs([JobSpec("a", tl)], budget_bytes=0, d2h_bw=BW, h2d_bw=BW)
    for share in (0, 1.01, True, "0.8"):
        with pytest.raises(ValueError, match=r"budget_share must be a share of the joint peak "
                                             r"in \(0, 1\]"):
            plan_jobs([JobSpec("a", tl)], budget_share=share, d2h_bw=BW, h2d_bw=BW)
    with pytest.raises(ValueError, match="give budget_bytes or budget_share, not both"):
        plan_jobs([JobSpec("a", tl)], budget_bytes=MB, budget_share=0.5, d2h_bw=BW, h2d_bw=BW)
    with pytest.raises(ValueError, match="swap_cost_ms must be a number of ms >= 0"):
        plan_jobs([JobSpec("a", tl, swap_cost_ms=-0.01)], d2h_bw=BW, h2d_bw=BW)


# --------------------------------------------------------------------------- properties
@st.composite
def random_job(draw, k: int) -> JobSpec:
    """A random small training step plus random timing, phase and weight."""
    n_fwd, n_bwd = draw(st.integers(2, 6)), draw(st.integers(2, 6))
    phases = ["forward"] * n_fwd + ["loss"] + ["backward"] * n_bwd + ["optimizer"]
    n = len(phases)
    reads, writes = [set() for _ in range(n)], [set() for _ in range(n)]
    sizes, roles = {1: draw(st.integers(1, 4 * MB))}, {1: "input"}
    reads[0].add(1)
    p, s = 2, 3
    sizes[p], sizes[s] = draw(st.integers(1, 4 * MB)), draw(st.integers(1, 4 * MB))
    roles[p], roles[s] = "param", "opt_state"
    reads[draw(st.integers(1, n_fwd - 1))].add(p)
    reads[n - 1].update({p, s})
    writes[n - 1].update({p, s})
    for sid in range(4, 4 + draw(st.integers(1, 8))):
        sizes[sid] = draw(st.integers(1, 8 * MB))
        prod = draw(st.integers(0, n_fwd - 1))
        writes[prod].add(sid)
        if draw(st.booleans()):
            reads[prod].add(1)
        reads[draw(st.integers(n_fwd + 1, n_fwd + n_bwd))].add(sid)
    ops = [(f"op{i}", phases[i], draw(st.floats(0.1, 3.0)), sorted(reads[i]), sorted(writes[i]))
           for i in range(n)]
    tl = AccessTimeline.from_ops(ops, sizes, roles)
    iter_ms = draw(st.one_of(st.none(), st.floats(0.5, 3.0).map(lambda f: f * tl.iteration_ms)))
    start = draw(st.one_of(st.none(), st.floats(0.0, 0.05)))
    return JobSpec(f"job{k}", tl, weight=draw(st.sampled_from([1.0, 2.0])), iter_ms=iter_ms,
                   iter_start_s=start)


@st.composite
def job_sets(draw):
    return [draw(random_job(k)) for k in range(draw(st.integers(1, 3)))]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=job_sets(), bw=st.floats(1e8, 1e11),
       budget_frac=st.one_of(st.none(), st.floats(0.3, 1.0)))
def test_joint_plans_keep_every_invariant(jobs, bw, budget_frac):
    jp = plan_jobs(jobs, budget_share=budget_frac, d2h_bw=bw, h2d_bw=bw)
    check_joint(jobs, jp)
    if budget_frac is not None:
        assert jp.budget_bytes == max(1, int(budget_frac * layout_jobs(jobs).joint_curve(
            {j.job_id: j.timeline.vanilla_curve() for j in jobs}).max()))


# -------------------------------------------------------------------- a job's channel view
def _fold_all(busy, phase: float, period: float) -> list[tuple[float, float]]:
    """Every shared interval folded into one job's period at once, sorted and merged."""
    from tensile.multi import EPS, _wrap
    folded = sorted(x for s, e in busy for x in _wrap(s - phase, e - phase, period))
    merged: list[list[float]] = []
    for s, e in folded:
        if merged and s <= merged[-1][1] + EPS:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


@settings(max_examples=200, deadline=None)
@given(copies=st.lists(st.tuples(st.floats(0, 40), st.floats(0.001, 12)), min_size=1, max_size=30),
       phase=st.floats(0, 10), period=st.floats(1, 20), looks=st.sets(st.integers(0, 30)))
def test_a_jobs_channel_view_folds_new_copies_into_what_it_saw(copies, phase, period, looks):
    """The view is brought up to date with the copies added since it was last looked at;
    whenever it is looked at, it is what folding every copy so far at once gives."""
    from tensile.multi import _JobChannel, _SharedChannel
    shared = _SharedChannel(cycle=40.0)
    view = _JobChannel(shared, phase, period, repeats=1)
    for k, (start, length) in enumerate(copies):
        shared.add(start, start + length)
        if k in looks or k == len(copies) - 1:
            assert view._view().busy == _fold_all(shared.busy, phase, period)
