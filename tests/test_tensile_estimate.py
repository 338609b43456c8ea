"""TENSILE cold-start estimates: roofline op times, EWMA updates, 30 % drift test."""
from __future__ import annotations

import pytest

from nimble.graph import OpNode, TaskGraph
from tensile.estimate import (DRIFT_THRESHOLD, EWMA_NEW_WEIGHT, OpTimeModel, estimate_op_times,
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


def test_drift_is_thirty_percent_of_the_reference():
    m = OpTimeModel([4.0, 6.0])          # cold start: the estimate, 10 ms
    assert m.reference_ms == pytest.approx(10.0)
    assert not m.drifted(12.9) and not m.drifted(7.1)
    assert m.drifted(13.1) and m.drifted(6.9)
    m.update([5.0, 5.0])                 # after a re-plan the 2nd iteration is the reference
    assert m.reference_ms is None
    assert not m.drifted(99.0)           # the first one grows the allocator: ignored
    assert not m.drifted(20.0)
    assert m.reference_ms == 20.0
    assert m.drifted(27.0) and not m.drifted(25.0)


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
