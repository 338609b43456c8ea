"""experiments.tensile_plans: TENSILE's plans of captured steps, worked out on the CPU."""
from __future__ import annotations

import pandas as pd
import pytest

from experiments import tensile_plans
from experiments.report import tensile_cpu_plans
from experiments.store import ResultStore


def gpu_rows(folder, rows: list[dict]):
    """``rows`` appended in order (the last of a key is its latest) as full-protocol H200 rows."""
    store = ResultStore(folder / "tensile.csv")
    base = {"experiment": "tensile", "mode": "whole-step", "model": "mobilenet_v2", "batch_size": 2,
            "status": "ok", "backend": "tensile_graph", "device": "cuda", "gpu": "NVIDIA H200",
            "warmup": 5, "iters": 50}
    for r in rows:
        store.append({**base, **r})
    return folder


def test_the_latest_captured_step_gives_step_time_and_bandwidths(tmp_path):
    gpu = gpu_rows(tmp_path / "h200", [
        {"mean_ms": 99.0, "date": "2026-11-29T04:00:00+00:00", "extra": {"eor_vs_graph": 0.0}},
        {"mean_ms": 30.0, "date": "2026-11-30T04:00:00+00:00",
         "extra": {"eor_vs_graph": 1.0, "d2h_gbps_measured": 40.0, "d2h_gbps": 50.0, "h2d_gbps": 45.0}},
        {"backend": "tensile_graph(max_overhead=0.1)", "mean_ms": 1.0,      # no graph reference
         "date": "2026-12-01T04:00:00+00:00", "extra": {}},
        {"backend": "tensile_graph(max_overhead=0.3)", "mean_ms": 2.0, "iters": 3,   # a smoke row
         "date": "2026-12-02T04:00:00+00:00", "extra": {"eor_vs_graph": 0.0}},
    ])
    step = tensile_plans.captured_step(gpu, "mobilenet_v2", 2)
    assert step["step_ms"] == pytest.approx(15.0)            # 30 ms = (1 + 1.0) x the graph step
    assert (step["d2h_gbps"], step["h2d_gbps"]) == (40.0, 45.0)  # measured where recorded
    assert step["source"] == "captured vanilla step, tensile_graph row of 2026-11-30"
    assert tensile_plans.captured_step(gpu, "mobilenet_v2", 4) is None
    assert tensile_plans.captured_step(tmp_path / "nothing", "mobilenet_v2", 2) is None
    # without a captured step, the eager vanilla step (host gaps included) stands in; never a smoke row
    eager = gpu_rows(tmp_path / "other", [
        {"backend": "vanilla", "mean_ms": 20.0, "extra": {}, "date": "2026-11-29T04:00:00+00:00"},
        {"backend": "vanilla", "mode": "smoke", "mean_ms": 2.0, "warmup": 1, "extra": {},
         "date": "2026-11-30T04:00:00+00:00"}])
    step = tensile_plans.captured_step(eager, "mobilenet_v2", 2)
    assert step["step_ms"] == 20.0 and step["d2h_gbps"] is None
    assert step["source"].startswith("eager vanilla step, row of 2026-11-29")


def test_plans_of_a_recorded_step_are_rows_and_a_table(tmp_path):
    gpu = gpu_rows(tmp_path / "results" / "h200", [
        {"mean_ms": 30.0, "date": "2026-11-30T04:00:00+00:00",
         "extra": {"eor_vs_graph": 1.0, "d2h_gbps_measured": 40.0, "h2d_gbps_measured": 45.0}}])
    out = tmp_path / "analysis"
    df = tensile_plans.run_plans(["mobilenet_v2"], out, batch_size=2, overheads=[0.0, 0.5],
                                 gpu_dir=gpu)
    assert (out / "tensile_plans.csv").exists() and "planned_msr" in (out / "tensile_plans.md").read_text()
    assert list(df["status"]) == ["ok", "ok"] and list(df["max_overhead"]) == [0.0, 0.5]
    assert set(df["step_ms"]) == {15.0} and set(df["d2h_gbps"]) == {40.0}
    assert df["step_source"].str.endswith("tensile_graph row of 2026-11-30").all()
    for _, r in df.iterrows():
        assert r["planned_peak_mb"] <= r["vanilla_peak_mb"]
        assert r["planned_msr"] == pytest.approx(1 - r["planned_peak_mb"] / r["vanilla_peak_mb"], abs=1e-3)
        assert 0 <= r["est_eor"] <= r["max_overhead"] + 1e-9
    no_overhead, allowance = df.iloc[0], df.iloc[1]
    assert no_overhead["recomputes"] == 0 and allowance["recomputes"] > 0
    assert allowance["planned_peak_mb"] < no_overhead["planned_peak_mb"]
    # the report's table puts the authors' figures beside them where they have some
    paper = pd.DataFrame([{"model": "mobilenet_v2", "batch_size": 2, "msr": 0.5, "eor": 0.2}])
    table = tensile_cpu_plans(pd.read_csv(out / "tensile_plans.csv"), paper)
    assert list(table["paper_msr"]) == [0.5, 0.5] and "rebuilt_first" in table


def test_a_streamed_optimizer_lowers_the_planned_peak(tmp_path):
    """Recorded with tensile.stream_optimizer, the step has no Adam moments on the device and
    each group's gradients die in backward: the vanilla peak and the plan drop with them."""
    plain = tensile_plans.plan_model("mobilenet_v2", 1, [0.0], None)[0]
    df = tensile_plans.run_plans(["mobilenet_v2"], tmp_path, batch_size=1, overheads=[0.0],
                                 stream_groups=8)
    (streamed,) = df.to_dict("records")
    assert (tmp_path / "tensile_plans_streamed.csv").exists()
    assert "optimizer streamed (8 groups, 2 copied in ahead, none resident)" in (tmp_path / "tensile_plans_streamed.md").read_text()
    assert streamed["status"] == "ok" and streamed["stream_optimizer"] == 8
    assert plain["stream_optimizer"] == 0
    # MobileNetV2 at batch 1: its 3.5 M parameters' moments (27 MiB) weigh against few
    # activations (CPU recording: 122.3 -> 116.7 MiB unplanned, 99.0 -> 65.4 planned;
    # unplanned, the ring's slots, held some updates past their last copy-out, and each
    # group's gradients, held to the end of its update, take back part of the moments)
    from experiments.models import build_model
    moments_mb = 2 * 4 * sum(p.numel() for p in build_model("mobilenet_v2").parameters()) / 2**20
    assert streamed["vanilla_peak_mb"] < plain["vanilla_peak_mb"] - moments_mb / 8
    assert streamed["planned_peak_mb"] < plain["planned_peak_mb"] - moments_mb / 2


def test_without_gpu_rows_the_roofline_sets_the_step(tmp_path):
    (row,) = tensile_plans.plan_model("mobilenet_v2", 1, [0.1], None)
    assert row["status"] == "ok" and row["step_source"] == "roofline (no GPU row)"
    assert row["d2h_gbps"] == tensile_plans.DEFAULT_GBPS and row["step_ms"] > 0


def test_bad_input_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(KeyError, match="unknown model 'nope'"):
        tensile_plans.run_plans(["nope"], tmp_path)
    with pytest.raises(ValueError, match="max_overhead values must be fractions >= 0"):
        tensile_plans.run_plans(["mobilenet_v2"], tmp_path, overheads=[-0.1])
    for argv, match in ((["--max-overhead", "a,b"], "comma-separated numbers"),
                        (["--models", "nope"], "unknown or missing model names"),
                        (["--batch-size", "0"], "--batch-size must be >= 1"),
                        (["--stream-optimizer", "-1"], "--stream-optimizer >= 0")):
        with pytest.raises(SystemExit) as exc:
            tensile_plans.main([*argv, "--out", str(tmp_path)])
        assert exc.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "tensile_plans.csv").exists()
