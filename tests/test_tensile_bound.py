"""tensile.bound: the least extra time any within-iteration plan needs for a budget."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensile.bound import extra_time_bound
from tensile.planner import plan, swap_price_ms
from tensile.timeline import AccessTimeline
from test_tensile_planner import EPS, bandwidths, timelines

MB = 1 << 20


def two_activations(transfers=()) -> AccessTimeline:
    """x (input) -> a (conv, 2 ms, 4 MB) -> b (relu, 0.5 ms, 4 MB) -> loss; backward makes
    two 8 MB gradients, then reads b, then a: the peak (op 4) is where both lie idle."""
    ops = [("aten.convolution", "forward", 2.0, [0, 9], [1]),
           ("aten.relu", "forward", 0.5, [1], [2]),
           ("aten.sum", "loss", 0.1, [2], [3]),
           ("aten.mul", "backward", 0.1, [3], [4]),
           ("aten.neg", "backward", 0.1, [4], [5]),
           ("aten.threshold_backward", "backward", 0.5, [5, 2], [6]),
           ("aten.convolution_backward", "backward", 2.0, [6, 1, 9], [7])]
    sizes = {0: MB, 9: MB, 1: 4 * MB, 2: 4 * MB, 3: 4, 4: 8 * MB, 5: 8 * MB, 6: MB, 7: MB}
    return AccessTimeline.from_ops(ops, sizes, {0: "input", 9: "param"}, transfers=transfers)


def test_no_excess_costs_nothing_and_the_cheapest_bytes_go_first():
    tl = two_activations()
    peak = int(tl.vanilla_curve().max())
    assert extra_time_bound(tl, peak).extra_ms == 0.0
    assert int(tl.vanilla_curve().argmax()) == 4
    # 2 MB over where both a (2 ms to rebuild) and b (0.5 ms) lie idle: half of b's rerun,
    # the cheapest per byte (the bound is fractional: a real plan rebuilds all of b)
    b = extra_time_bound(tl, peak - 2 * MB)
    assert b.extra_ms == pytest.approx(0.25) and b.rebuildable == 2 and not b.swaps
    # more than b frees: the rest from a at 2 ms per 4 MB
    assert extra_time_bound(tl, peak - 6 * MB).extra_ms == pytest.approx(0.5 + 1.0)
    # below what dropping both frees at those ops: no plan of these moves fits
    assert extra_time_bound(tl, peak - 9 * MB).extra_ms is None


def test_swaps_are_free_only_as_far_as_the_copies_can_carry_them():
    tl = two_activations()
    peak = int(tl.vanilla_curve().max())
    budget = peak - 6 * MB
    # 1 TB/s: a (read at op 6) goes out and back in around the peak for free; b is read by
    # the op right after the peak, so no copy can bring it back in time: the other 2 MB are
    # half of b's rebuild
    assert extra_time_bound(tl, peak - 4 * MB, d2h_bw=1e12, h2d_bw=1e12).extra_ms == 0.0
    fast = extra_time_bound(tl, budget, d2h_bw=1e12, h2d_bw=1e12)
    assert fast.swaps and fast.extra_ms == pytest.approx(0.25)
    # 2 MB/s: by the peak (2.7 ms in) barely 5 KB can be out; the rebuilds pay for the rest
    slow = extra_time_bound(tl, budget, d2h_bw=2e6, h2d_bw=2e6)
    assert slow.extra_ms == pytest.approx(1.5, rel=1e-2)


def test_each_swap_pays_its_price_and_each_copy_its_latency():
    """4 MB over at the peak: swapping a (out after op 0, back in op 5's 0.5 ms) or
    rebuilding b (0.5 ms). The planner prices each swap at ``swap_cost_ms`` and each copy
    at ``copy_latency_ms`` besides its bytes; so does the bound."""
    tl = two_activations()
    budget = int(tl.vanilla_curve().max()) - 4 * MB

    def bound(**kw):
        return extra_time_bound(tl, budget, d2h_bw=1e12, h2d_bw=1e12, **kw).extra_ms
    assert bound(swap_cost_ms=0.3) == pytest.approx(0.3)    # the swap, at its price
    assert bound(swap_cost_ms=0.6) == pytest.approx(0.5)    # b's rebuild is cheaper
    # a 0.8 ms copy no longer fits the 0.5 ms before backward reads a: only part of a
    # swap counts (the relaxation), the rest is b's rebuild
    assert 0.0 < bound(copy_latency_ms=0.8) < 0.5
    assert bound(copy_latency_ms=0.4) == 0.0


@pytest.mark.parametrize("copy", [(0, "d2h"), (4, "h2d")], ids=["out-before", "in-after"])
def test_the_steps_own_copies_leave_swaps_only_the_rest_of_the_channel(copy):
    """A streamed optimizer's copies (``transfers``) keep a channel busy: copying 3 GB at
    1 TB/s from the step's start fills the device-to-host channel past the peak (2.7 ms
    in), copying it from the peak on fills host-to-device to the step's end. Either way no
    swap can free the peak, and the bound is the rebuilds' (as without bandwidths)."""
    budget = int(two_activations().vanilla_curve().max()) - 4 * MB
    op, direction = copy
    busy = two_activations(transfers=[(op, direction, 3 * 10**9)])
    assert extra_time_bound(two_activations(), budget, d2h_bw=1e12, h2d_bw=1e12).extra_ms == 0.0
    assert extra_time_bound(busy, budget, d2h_bw=1e12, h2d_bw=1e12).extra_ms == \
        pytest.approx(extra_time_bound(busy, budget).extra_ms) == pytest.approx(0.5)


def test_an_input_kept_for_a_rebuild_frees_nothing_after_it():
    """b is rebuilt from a, and backward needs b (op 5) before a (op 6): dropping both frees a
    only until b's rebuild, unless a is rebuilt twice. 8 MB over at op 4 takes both; 1 MB
    over at op 5, where only a is idle, then takes a quarter of a second rebuild of a."""
    tl = two_activations()
    peak = int(tl.vanilla_curve().max())
    assert extra_time_bound(tl, peak - 8 * MB).extra_ms == pytest.approx(2.0 + 0.5 + 0.25 * 2.0)
    # the planner finds no plan there at all: rebuilding b keeps a on the device at op 5
    assert not plan(tl, budget_bytes=peak - 8 * MB, d2h_bw=1e9, h2d_bw=1e9,
                    allow_cross_iteration=False, allow_swaps=False).feasible


def test_bad_arguments_are_refused():
    tl = two_activations()
    for budget in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="budget_bytes"):
            extra_time_bound(tl, budget)
    with pytest.raises(ValueError, match="d2h_bw"):
        extra_time_bound(tl, MB, d2h_bw=0.0, h2d_bw=1e9)
    with pytest.raises(ValueError, match="copy_latency_ms must be >= 0, got -0.1"):
        extra_time_bound(tl, MB, copy_latency_ms=-0.1)
    with pytest.raises(ValueError, match="swap_cost_ms must be a number of ms >= 0"):
        extra_time_bound(tl, MB, swap_cost_ms="0.02")


def test_a_swap_also_pays_its_share_of_its_copies_time():
    """As :func:`test_each_swap_pays_its_price_and_each_copy_its_latency`, at 10 GB/s: a's
    copies take 0.42 ms each way, and ``swap_copy_share`` of their 0.84 ms is priced on top
    of ``swap_cost_ms``, as the planner prices it, until b's 0.5 ms rebuild is cheaper."""
    tl = two_activations()
    budget = int(tl.vanilla_curve().max()) - 4 * MB
    copies_ms = 2 * 4 * MB / 1e10 * 1e3

    def bound(**kw):
        return extra_time_bound(tl, budget, d2h_bw=1e10, h2d_bw=1e10, **kw).extra_ms
    assert bound() == 0.0
    assert bound(swap_copy_share=0.25) == pytest.approx(0.25 * copies_ms)
    assert bound(swap_cost_ms=0.1, swap_copy_share=0.25) == pytest.approx(0.1 + 0.25 * copies_ms)
    assert bound(swap_copy_share=1.0) == pytest.approx(0.5)   # 0.84 ms: b's rebuild is cheaper
    assert swap_price_ms(4 * MB, 1e10, 2e10, 0.1, 0.5) == pytest.approx(0.1 + 0.5 * (0.4194 + 0.2097), rel=1e-4)
    for bad in (-0.1, 1.5, True, "0.04"):
        with pytest.raises(ValueError, match="swap_copy_share must be a share of a swap's copy time in"):
            extra_time_bound(tl, budget, swap_copy_share=bad)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tl=timelines(), bw=bandwidths, frac=st.floats(0.0, 1.0), swaps=st.booleans(),
       latency=st.sampled_from([0.0, 0.01, 0.1]), swap_cost=st.sampled_from([0.0, 0.02, 0.5]),
       share=st.sampled_from([0.0, 0.04, 0.5]))
def test_no_plan_the_planner_finds_costs_less_than_the_bound(tl, bw, frac, swaps, latency, swap_cost,
                                                              share):
    # a budget the planner can reach: between the lowest peak it plans to and the peak
    lowest = plan(tl, d2h_bw=bw, h2d_bw=bw, allow_cross_iteration=False, allow_swaps=swaps,
                  max_overhead=100.0, copy_latency_ms=latency)
    budget = max(1, lowest.peak_after + int(frac * (lowest.peak_before - lowest.peak_after)))
    p = plan(tl, budget_bytes=budget, d2h_bw=bw, h2d_bw=bw, allow_cross_iteration=False,
             allow_swaps=swaps, copy_latency_ms=latency, swap_cost_ms=swap_cost,
             swap_copy_share=share)
    b = extra_time_bound(tl, budget, d2h_bw=bw if swaps else None, h2d_bw=bw if swaps else None,
                         copy_latency_ms=latency, swap_cost_ms=swap_cost, swap_copy_share=share)
    if p.feasible:   # a plan that fits is a solution of the bound's program: never cheaper
        assert b.extra_ms is not None
        assert p.est_overhead_ms >= b.extra_ms - EPS
