"""experiments.tensile_bounds: an equal-peak job's plan against the bound, on the CPU."""
from __future__ import annotations

import pytest

from experiments import tensile_bounds
from test_tensile_plans import gpu_rows

LABEL = "tensile_graph(match_peak=checkpoint_graph,bn_from_stats)"


def job(run_id: str, date: str, ck_ms: float = 3.6, **extra) -> list[dict]:
    """One equal-peak job's rows: vanilla, graph, the built-in, then TENSILE at its peak."""
    ours = {"match_peak": "checkpoint_graph", "match_met": True, "budget": 140 * 2**20,
            "bn_rerun_share_median": 0.6, "d2h_gbps_measured": 40.0, "h2d_gbps_measured": 45.0,
            **extra}
    rows = [("vanilla", 9.0, {}), ("graph", 3.0, {}), ("checkpoint_graph", ck_ms, {}), (LABEL, 3.2, ours)]
    return [{"backend": b, "mean_ms": ms, "run_id": run_id, "date": date, "extra": e}
            for b, ms, e in rows]


def test_the_latest_equal_peak_job_that_met_its_peak_is_read_whole(tmp_path):
    gpu = gpu_rows(tmp_path / "h200", [
        *job("a", "2026-11-30T04:00:00+00:00"),
        *job("b", "2026-12-01T04:00:00+00:00", ck_ms=4.8, match_met=False),   # missed its peak
        {"backend": "graph", "mean_ms": 1.0, "run_id": "c", "date": "2026-12-01T05:00:00+00:00",
         "extra": {}},                                              # another job's graph: not its own
        {"backend": LABEL, "mean_ms": 1.1, "run_id": "d", "date": "2026-12-01T05:00:00+00:00",
         "extra": {"match_peak": "checkpoint_graph", "match_met": True, "budget": 1,
                   "bn_rerun_share_median": 0.5}}])
    found = tensile_bounds.equal_peak_job(gpu, "mobilenet_v2", 2)
    assert (found["step_ms"], found["builtin_ms"], found["tensile_ms"]) == (3.0, 3.6, 3.2)
    assert found["budget"] == 140 * 2**20 and found["bn_share"] == 0.6 and found["allow_swaps"]
    assert (found["d2h_gbps"], found["h2d_gbps"]) == (40.0, 45.0)
    assert tensile_bounds.equal_peak_job(gpu, "mobilenet_v2", 4) is None
    assert found["tensile"] == LABEL
    # a later fused-Adam job is named so (its own built-in and graph, mode opt=adam_fused)
    gpu_rows(gpu, [{**r, "mode": "whole-step,opt=adam_fused"} for r in job("e", "2026-12-02T04:00:00+00:00")])
    assert tensile_bounds.equal_peak_job(gpu, "mobilenet_v2", 2)["tensile"] == LABEL + ", fused Adam"


def test_a_job_is_bounded_into_rows_and_a_table(tmp_path):
    gpu = gpu_rows(tmp_path / "results" / "h200", job("a", "2026-11-30T04:00:00+00:00"))
    out = tmp_path / "results" / "analysis"
    df = tensile_bounds.run_bounds(["mobilenet_v2", "googlenet"], gpu, out, batch_size=2)
    assert (out / "tensile_bounds.csv").exists() and "bound_swaps_ms" in (out / "tensile_bounds.md").read_text()
    ours, other = df.iloc[0], df.iloc[1]
    assert other["status"] == "skipped" and "no equal-peak job" in other["error"]
    assert ours["status"] == "ok", ours["error"]
    assert ours["allowed_ms"] == pytest.approx(3.6 / 1.2 - 3.0) and ours["measured_ms"] == pytest.approx(0.2)
    # 140 MiB of MobileNetV2's ~196 at b=2: rebuilds fit it; the planner's plan adds no less
    # than any plan must, and swaps only add moves
    assert ours["greedy_feasible"] and 0 < ours["bound_ms"] <= ours["greedy_ms"] + 1e-9
    assert ours["bound_swaps_ms"] <= ours["bound_ms"] + 1e-9
    assert ours["reachable"] == (ours["bound_swaps_ms"] <= ours["allowed_ms"])
    # the report shows the ok rows beside the GPU's
    from experiments.report import write_report
    text = write_report(gpu).read_text()
    assert "### The equal-peak jobs against the floor on any plan" in text
    assert "| mobilenet_v2 |" in text.split("against the floor on any plan")[1].split("###")[0]


def test_a_job_with_a_planning_snapshot_is_bounded_on_the_gpus_timeline(tmp_path):
    from experiments.tensile_plans import recorded_timeline
    from tensile import PlanningSnapshot
    from tensile.bound import extra_time_bound
    from tensile.planner import plan
    gpu = tmp_path / "results" / "h200"
    tl, _, _, _ = recorded_timeline("mobilenet_v2", 2, {"step_ms": 3.0, "d2h_gbps": 40.0, "h2d_gbps": 45.0})
    tl.op_ms[:] = tl.op_ms * 3      # not what the CPU recording would say: the row must use these
    budget = 140 * 2**20
    ran = plan(tl, budget_bytes=budget, d2h_bw=40e9, h2d_bw=45e9, allow_cross_iteration=False,
               min_bytes=1 << 16)
    PlanningSnapshot(timeline=tl, budget_bytes=budget, d2h_bw=40e9, h2d_bw=45e9, copy_latency_ms=0.1,
                     min_bytes=1 << 16, plan=ran, meta={}).save(gpu / "snapshot_tensile_x.json.gz")
    gpu_rows(gpu, job("a", "2026-11-30T04:00:00+00:00", snapshot_file="snapshot_tensile_x.json.gz"))
    df = tensile_bounds.run_bounds(["mobilenet_v2"], gpu, tmp_path / "out", batch_size=2)
    row = df.iloc[0]
    assert row["status"] == "ok", row["error"]
    assert (row["op_times"], row["snapshot"]) == ("gpu", "snapshot_tensile_x.json.gz")
    assert row["greedy_ms"] == pytest.approx(ran.est_overhead_ms, abs=1e-3)
    assert row["bound_ms"] == pytest.approx(extra_time_bound(tl, budget, min_bytes=1 << 16).extra_ms, abs=1e-3)
    # a snapshot named but not here: the CPU recording, said so
    (gpu / "snapshot_tensile_x.json.gz").unlink()
    row = tensile_bounds.run_bounds(["mobilenet_v2"], gpu, tmp_path / "out", batch_size=2).iloc[0]
    assert row["status"] == "ok" and row["op_times"] == "cpu"
    assert row["greedy_ms"] < ran.est_overhead_ms


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(KeyError):
        tensile_bounds.run_bounds(["no_such_model"], tmp_path, tmp_path)
    with pytest.raises(SystemExit):
        tensile_bounds.main(["--results", str(tmp_path)])           # no tensile.csv there


def test_a_job_that_saved_its_snapshot_is_preferred_to_a_later_one_without(tmp_path):
    gpu = gpu_rows(tmp_path / "h200", [
        *job("a", "2026-11-30T04:00:00+00:00", ck_ms=3.7, snapshot_file="snapshot_tensile_a.json.gz"),
        *job("b", "2026-12-01T04:00:00+00:00", ck_ms=3.8)])
    # the snapshot is not beside the rows: the latest job, bounded on the CPU recording
    assert tensile_bounds.equal_peak_job(gpu, "mobilenet_v2", 2)["builtin_ms"] == 3.8
    (gpu / "snapshot_tensile_a.json.gz").write_bytes(b"")
    found = tensile_bounds.equal_peak_job(gpu, "mobilenet_v2", 2)
    assert found["builtin_ms"] == 3.7 and found["snapshot"] == "snapshot_tensile_a.json.gz"
