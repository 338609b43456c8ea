"""TENSILE cold-start estimates: roofline op times, EWMA updates, 30 % drift test (median)."""
from __future__ import annotations

import itertools

import pytest

from nimble.graph import OpNode, TaskGraph
from tensile.estimate import (DRIFT_MIN_REPORTS, DRIFT_THRESHOLD, DRIFT_WINDOW, EWMA_NEW_WEIGHT,
                              DriftDetector, OpTimeModel, estimate_op_times, scaled_op_times,
                              measure_copy_bandwidth, measure_peak_rates)


def _graph() -> TaskGraph:
    nodes = [
        OpNode(0, "aten.mm.default", flops=2_000_000, bytes_read=1000, bytes_written=1000),
        OpNode(1, "aten.relu.default", flops=0, bytes_read=4_000_000, bytes_written=4_000_000),
    ]
    return TaskGraph(nodes=nodes, edges=[(0, 1)])


def test_roofline_takes_the_slower_of_compute_and_memory():
    ms = estimate_op_times(_graph(), peak_flops=1e9, peak_bytes_per_s=1e9, launch_overhead_ms=0.01)
    assert ms[0] == pytest.approx(2.0 + 0.01)   # 2 MFLOP at 1 GFLOP/s; bytes are negligible
    assert ms[1] == pytest.approx(8.0 + 0.01)   # 8 MB at 1 GB/s; no FLOPs


@pytest.mark.parametrize("kwargs", [dict(peak_flops=0, peak_bytes_per_s=1),
                                    dict(peak_flops=1, peak_bytes_per_s=-1),
                                    dict(peak_flops=1, peak_bytes_per_s=1, launch_overhead_ms=0)])
def test_roofline_rejects_bad_rates(kwargs):
    with pytest.raises(ValueError):
        estimate_op_times(_graph(), **kwargs)


def test_ewma_weights_new_samples_by_point_nine():
    assert EWMA_NEW_WEIGHT == 0.9 and DRIFT_THRESHOLD == 0.30
    m = OpTimeModel([1.0, 10.0])
    m.update([2.0, 0.0])
    assert m.op_ms[0] == pytest.approx(0.9 * 2.0 + 0.1 * 1.0)
    assert m.op_ms[1] == pytest.approx(0.1 * 10.0)
    m.update([2.0, 1.0])
    assert m.op_ms[0] == pytest.approx(0.9 * 2.0 + 0.1 * 1.9)
    assert m.updates == 2


# Per-iteration times of a job sharing a GPU with co-runners: -40 % .. +67 % around ~60 ms
# (as measured on an H200: ResNet-50 batch 2, p10 36 ms, median 59 ms, p90 101 ms).
NOISY = [60.0, 36.0, 100.0, 58.0, 40.0, 95.0]


def _reports(m: OpTimeModel, times) -> list[bool]:
    return [m.drifted(t) for t in times]


def _replanned(reference_times) -> OpTimeModel:
    """A model just re-planned, its reference set from ``reference_times``."""
    m = OpTimeModel([4.0, 6.0])
    m.update([5.0, 5.0])
    assert _reports(m, [999.0, *reference_times]) == [False] * (1 + len(reference_times))
    return m


def test_drift_is_thirty_percent_of_the_reference_by_the_median():
    # Single-sample behaviour before: drifted(13.1) was True at once. Now the median of
    # the last 5 reports is tested, and only from the 3rd report after the reference.
    assert DRIFT_WINDOW == 5 and DRIFT_MIN_REPORTS == 3
    for t, expect in ((12.9, False), (7.1, False), (13.1, True), (6.9, True)):
        m = OpTimeModel([4.0, 6.0])      # cold start: the estimate, 10 ms
        assert m.reference_ms == pytest.approx(10.0)
        assert _reports(m, [t] * 3) == [False, False, expect], t
    m = OpTimeModel([4.0, 6.0])
    m.update([5.0, 5.0])                 # after a re-plan the reference is unset ...
    assert m.reference_ms is None
    assert not m.drifted(99.0)           # ... the first one grows the allocator: ignored
    assert _reports(m, [20.0, 19.0]) == [False, False] and m.reference_ms is None
    assert not m.drifted(21.0)
    assert m.reference_ms == 20.0        # ... the median of the next 3 is the reference
    assert _reports(m, [25.0] * 3 + [27.0] * 3) == [False] * 5 + [True]


def test_noisy_iteration_times_do_not_drift():
    m = _replanned(NOISY[:3])
    assert m.reference_ms == 60.0
    assert not any(_reports(m, NOISY * 10))
    cold = OpTimeModel([30.0, 30.0])     # and from a cold-start reference of 60 ms
    assert not any(_reports(cold, NOISY * 10))


def test_a_step_change_drifts_once_and_the_new_level_becomes_the_reference():
    m = _replanned(NOISY[:3])
    assert not any(_reports(m, NOISY * 3))
    slower = itertools.cycle([1.6 * t for t in NOISY])  # +60 %, e.g. a co-runner started
    for _ in range(5):
        if m.drifted(next(slower)):
            break
    else:
        pytest.fail("no drift within 5 reports of a +60 % step")
    m.update([5.0, 5.0])                 # the caller re-plans on it (Scheduler.step) ...
    assert not any(m.drifted(next(slower)) for _ in range(60))  # ... and that was all
    assert m.reference_ms == pytest.approx(1.6 * 59.0, rel=0.05)
    # Without a re-plan a lasting drift is reported again, every 3rd report only.
    m = _replanned(NOISY[:3])
    hits = [k for k, hit in enumerate(_reports(m, [1.6 * t for t in NOISY] * 2)) if hit]
    assert len(hits) >= 2 and all(b - a >= DRIFT_MIN_REPORTS for a, b in zip(hits, hits[1:]))


def test_drift_detector_waits_for_reports_and_keeps_them_across_restarts():
    d = DriftDetector()
    assert d.median_ms() is None and d.settled_ms() is None
    for t in (10.0, 30.0):
        d.add(t)
    assert d.median_ms() == 20.0 and d.settled_ms() is None and not d.drifted(1.0)
    d.add(11.0)
    assert d.settled_ms() == 11.0 and d.drifted(1.0)
    assert not d.drifted(1.0)            # a detection restarts the count
    for t in (12.0, 13.0, 14.0):
        d.add(t)
    assert d.count == 5 and d.median_ms() == 13.0  # the last 5: 30, 11, 12, 13, 14
    d.restart()
    assert d.settled_ms() == 13.0 and d.since_restart == 0


def test_time_model_rejects_bad_input():
    with pytest.raises(ValueError, match="op_ms"):
        OpTimeModel([1.0, 0.0])
    m = OpTimeModel([1.0])
    with pytest.raises(ValueError, match="expected 1"):
        m.update([1.0, 2.0])
    with pytest.raises(ValueError, match="measured_op_ms"):
        m.update([float("nan")])


def test_measured_rates_on_cpu_are_positive():
    flops, bw = measure_peak_rates("cpu", matmul_n=64, copy_mib=1, repeats=1)
    d2h, h2d = measure_copy_bandwidth("cpu", mib=1, repeats=1)
    assert flops > 0 and bw > 0 and d2h > 0 and h2d > 0


def test_op_times_scaled_to_a_measured_iteration_keep_their_shape():
    """A captured step is timed as a whole: the roofline's shape, scaled to its replay time."""
    scaled = scaled_op_times([1.0, 3.0, 4.0], 4.0)
    assert scaled == pytest.approx([0.5, 1.5, 2.0]) and sum(scaled) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="iteration_ms"):
        scaled_op_times([1.0, 3.0], float("nan"))
    with pytest.raises(ValueError, match="shape_ms"):
        scaled_op_times([1.0, -3.0], 4.0)


def test_reset_op_times_become_the_reference_of_the_drift_test():
    m = OpTimeModel([4.0, 6.0])
    m.update([40.0, 60.0])                     # eager, host-bound: 10x longer
    m.reset(scaled_op_times([1.0, 1.0], 2.0))  # the captured step: 2 ms
    assert m.op_ms == [1.0, 1.0] and m.reference_ms == 2.0
    assert not m.drifted(2.1) and not m.drifted(2.0) and not m.drifted(2.05)
    # the median of the last 5 moves 50 % off once most of them are 3 ms
    assert [m.drifted(3.0) for _ in range(3)] == [False, False, True]
    with pytest.raises(ValueError, match="expected 2 op times, got 3"):
        m.reset([1.0, 1.0, 1.0])


def test_a_recorded_op_that_writes_in_place_and_returns_nothing_counts_its_writes():
    """``_foreach_*_`` and ``_fused_adam_`` return nothing: the bytes they write in place
    (parameters and Adam's moments) still price the op at cold start, as nimble's trace
    counts them; an in-place op that returns its argument counts it once."""
    import torch
    from torch import nn

    from tensile.record import record_step
    from tensile.step import training_step
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(inplace=True), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    batch = (torch.randn(8, 64), torch.randint(0, 4, (8,)))
    training_step(model, opt, batch, nn.functional.cross_entropy)   # the state exists
    nodes = record_step(model, opt, batch, nn.functional.cross_entropy).graph.nodes
    params = sum(p.nbytes for p in model.parameters())
    adam = [n for n in nodes if n.name == "aten._fused_adam_.default"]
    # parameters, gradients (the schema lets it unscale them) and both moments
    assert len(adam) == 1 and adam[0].bytes_written == 4 * params
    relu = [n for n in nodes if n.name == "aten.relu_.default"]
    assert relu and relu[0].bytes_written == 8 * 32 * 4
