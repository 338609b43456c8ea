"""experiment=tensile through the Hydra app: rows, metrics against vanilla, errors, presets.

A small CNN replaces the model zoo (``experiments.run._models``), so the app runs on CPU in
seconds with timing=quick (the smoke setting: the tensile runtime simulates, memory is not
measured).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

from experiments import run, tensile_run
from experiments.store import COLUMNS, read_rows

CONF = Path(__file__).resolve().parents[1] / "conf"
MB = 2**20
PAPER_MODELS = ["vgg16", "inception_v3", "inception_v4", "resnet50", "densenet121"]


def _compose(overrides=(), hydra_cfg=False):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_cfg)


def small_models():
    """The model registry's interface with one small CNN, ``small``."""
    def build_model(name, *, num_classes=None):
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)),
            nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes or 10)).eval()

    def example_input(name, batch_size, device="cpu", image_size=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, 3, image_size, image_size, generator=g).to(device)

    def check_image_size(name, image_size):   # its max pool needs 2 px
        if image_size < 2:
            raise ValueError(f"{name} needs inputs of at least 2 px a side, got {image_size}")

    spec = SimpleNamespace(name="small", image_size=16, num_classes=10)
    return SimpleNamespace(MODELS={"small": spec}, build_model=build_model,
                           example_input=example_input, check_image_size=check_image_size)


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(run, "_models", small_models)


def _cfg(tmp_path, *overrides, device="cpu"):
    return _compose(["experiment=tensile", f"device={device}", "timing=quick", "model.name=small",
                     "experiment.image_size=16", "experiment.num_classes=10", "batch_size=4",
                     f"results_dir={tmp_path}", *overrides])


def _gpu_rows(tmp_path, *overrides):
    """Run the experiment on CUDA with ``overrides``; its rows by method."""
    from experiments.env import gpu_slug
    run.run_config(_cfg(tmp_path, *overrides, device="cuda"))
    return _rows(tmp_path, gpu_slug())


def _rows(tmp_path, gpu="cpu"):
    rows = read_rows(tmp_path / gpu / "tensile.csv")
    for r in rows:
        r["extra"] = json.loads(r["extra"]) if r["extra"] else {}
    return {r["backend"]: r for r in rows}


# --------------------------------------------------------------------------- the runner

def test_rows_carry_metrics_against_the_same_process_vanilla(small, tmp_path):
    # capuchin is listed before tensile: it still runs after it and plans to its peak.
    cfg = _cfg(tmp_path, "experiment.methods=[vanilla,capuchin,checkpoint,tensile]")
    written = run.run_config(cfg)
    assert [r["backend"] for r in written] == ["vanilla", "checkpoint", "tensile", "capuchin"]
    assert list(read_rows(tmp_path / "cpu" / "tensile.csv")[0]) == COLUMNS
    rows = _rows(tmp_path)
    van = rows["vanilla"]
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
        assert (r["experiment"], r["mode"], r["warmup"], r["iters"]) == ("tensile", "whole-step", "3", "10")
        ex = r["extra"]
        assert ex["repeats"] == 1 and len(ex["repeat_mean_ms"]) == 1
        assert ex["time_vanilla_ms"] == float(van["mean_ms"])
        assert ex["eor"] == pytest.approx(float(r["mean_ms"]) / float(van["mean_ms"]) - 1)
        # CPU: no GPU memory, so no MSR (never a made-up number)
        assert r["peak_mem_mb"] == "" and ex["msr"] is None and ex["cbr"] is None
    assert rows["vanilla"]["extra"]["eor"] == 0
    assert rows["checkpoint"]["extra"]["blocks"] == 3
    ten, cap = rows["tensile"]["extra"], rows["capuchin"]["extra"]
    for ex in (ten, cap):
        assert ex["passive_share"] == 0 and ex["bytes_moved_per_step"] > 0
        assert ex["planner_ms"] > 0 and ex["replans"] >= 1 and ex["swaps_planned"] > 0
        assert 0 < ex["msr_planned"] < 1
        assert ex["d2h_gbps"] > 0 and ex["h2d_gbps"] > 0 and ex["stall_ms"] >= 0
        # what the plan assumed beside what its timed steps' copies measured
        assert ex["plan_iteration_ms"] > 0 and ex["timed_steps"] >= 1
        assert ex["d2h_gbps_measured"] > 0 and ex["h2d_gbps_measured"] > 0
        assert ex["stall_ms_per_timed_step"] >= 0
    assert "d2h_gbps" not in rows["checkpoint"]["extra"]
    assert ten["budget"] is None and cap["budget"] == int(ten["planned_peak_mb"] * MB)


def test_a_rerun_measures_only_what_is_missing(small, tmp_path):
    assert len(run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,sac]"))) == 2
    again = run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,sac,save_on_cpu]"))
    assert [r["backend"] for r in again] == ["save_on_cpu"]
    assert again[0]["extra"] and json.loads(again[0]["extra"])["time_vanilla_ms"] > 0
    assert run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,sac,save_on_cpu]")) == []


def test_an_overhead_allowance_is_a_tensile_variant_of_its_own(small, tmp_path):
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]"))
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]", "experiment.max_overhead=0.2"))
    rows = _rows(tmp_path)
    assert set(rows) == {"vanilla", "tensile", "tensile(max_overhead=0.2)"}  # vanilla not re-run
    assert rows["tensile(max_overhead=0.2)"]["status"] == "ok"
    assert rows["tensile"]["mode"] == rows["tensile(max_overhead=0.2)"]["mode"] == "whole-step"


def test_fused_adam_trains_every_method_of_the_job_and_names_the_mode(small, tmp_path, monkeypatch):
    """experiment.optimizer=adam_fused: every method's optimizer is Adam(fused=True), and the
    rows' mode says so (a separate setting from the foreach rows, which stay as they were)."""
    made = []
    real = tensile_run.make_optimizer

    def spy(model, name, *args, **kwargs):
        made.append(real(model, name, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tensile_run, "make_optimizer", spy)
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]"))
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]", "experiment.optimizer=adam_fused"))
    rows = read_rows(tmp_path / "cpu" / "tensile.csv")
    assert sorted((r["backend"], r["mode"]) for r in rows) == [
        ("tensile", "whole-step"), ("tensile", "whole-step,opt=adam_fused"),
        ("vanilla", "whole-step"), ("vanilla", "whole-step,opt=adam_fused")]
    assert all(r["status"] == "ok" for r in rows)
    fused = [all(g["fused"] for g in o.param_groups) for o in made]
    assert fused[:2] == [False, False] and fused[2:] == [True, True]
    assert all(isinstance(o, torch.optim.Adam) for o in made)


def test_census_keeps_kernels_apart_that_differ_past_the_names_cut():
    stem = "void at::native::elementwise_kernel<128, 2, " + "x" * 100
    add, mul = stem + "CUDAFunctor_add<float>", stem + "MulFunctor<float>"
    by_name = tensile_run.census_by_name({add: (898.0, 1795.7), mul: (70.0, 327.4),
                                          "conv": (3.0, 50.0), "tiny": (1.0, 0.5)})
    assert len(by_name) == 3 and "tiny" not in by_name        # under CENSUS_MIN_US
    assert by_name["conv"] == [3.0, 50.0]
    long_keys = sorted(k for k in by_name if k != "conv")
    assert all(len(k) == tensile_run.CENSUS_NAME_CHARS and k.startswith(stem[:100]) for k in long_keys)
    assert sorted(by_name[k][0] for k in long_keys) == [70.0, 898.0]   # neither overwrote the other


def test_make_optimizer_builds_each_name_and_refuses_others():
    from experiments.optim import OPTIMIZERS, make_optimizer
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)   # only what trains
    made = {name: make_optimizer(model, name, 0.01, capturable=True) for name in OPTIMIZERS}
    assert type(made["sgd"]) is torch.optim.SGD and made["sgd"].defaults["momentum"] == 0.9
    assert made["adam"].defaults["fused"] is None and made["adam"].defaults["capturable"]
    assert made["adam_fused"].defaults["fused"] is True
    assert all(len(o.param_groups[0]["params"]) == 3 for o in made.values())
    with pytest.raises(ValueError, match="expected one of sgd, adam, adam_fused, got 'lbfgs'"):
        make_optimizer(model, "lbfgs", 0.01)


def test_batch_norm_from_stats_reaches_the_runtime(small, tmp_path, monkeypatch):
    from tensile import runtime
    flags = []
    real = runtime.PlanRunner.__init__

    def init(self, *args, **kwargs):
        flags.append(kwargs.get("batch_norm_from_stats"))
        real(self, *args, **kwargs)
    monkeypatch.setattr(runtime.PlanRunner, "__init__", init)
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]", "experiment.max_overhead=0.5",
                        "experiment.batch_norm_from_stats=true"))
    row = _rows(tmp_path)["tensile(max_overhead=0.5,bn_from_stats)"]
    assert row["status"] == "ok", row["reason"]
    assert flags == [True]   # (what it does: tests/test_tensile_runtime.py)


def _tensile_snapshot(tmp_path, option: str, backend: str):
    """Run vanilla and tensile at a budget with ``option`` set; the planning snapshot of the
    row named ``backend`` (asserted ok)."""
    from tensile import PlanningSnapshot
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]", "experiment.budget=0.8",
                        option, "experiment.snapshot=true"))
    row = _rows(tmp_path)[backend]
    assert row["status"] == "ok", row["reason"]
    return PlanningSnapshot.load(tmp_path / "cpu" / row["extra"]["snapshot_file"])


def test_swap_search_reaches_the_planner_and_names_the_method(small, tmp_path):
    snap = _tensile_snapshot(tmp_path, "experiment.swap_search=always", "tensile(swap_search=always)")
    assert snap.options["swap_search"] == "always"
    assert snap.replan().same_actions(snap.plan)   # planned again with the same option


def test_uncounted_workspaces_reach_the_scheduler_and_name_the_method(small, tmp_path, monkeypatch):
    from tensile import api
    seen = []
    real = api.Scheduler.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("count_workspaces", True))
        real(self, *args, **kwargs)
    monkeypatch.setattr(api.Scheduler, "__init__", spy)
    _tensile_snapshot(tmp_path, "experiment.count_workspaces=false", "tensile(count_workspaces=false)")
    assert seen and not any(seen)


def test_swap_cost_reaches_the_planner_and_names_the_method(small, tmp_path):
    snap = _tensile_snapshot(tmp_path, "experiment.swap_cost_ms=0.5", "tensile(swap_cost_ms=0.5)")
    assert snap.options["swap_cost_ms"] == 0.5
    p = snap.plan
    assert p.est_overhead_ms == pytest.approx(sum(r.cost_ms for r in p.recomputes) + 0.5 * len(p.swaps))


def test_swap_copy_share_reaches_the_planner_and_names_the_method(small, tmp_path):
    snap = _tensile_snapshot(tmp_path, "experiment.swap_copy_share=0.5", "tensile(swap_copy_share=0.5)")
    assert snap.options["swap_copy_share"] == 0.5
    p = snap.plan
    copies_ms = sum(1e3 * s.nbytes * (1 / snap.d2h_bw + 1 / snap.h2d_bw) for s in p.swaps)
    assert p.est_overhead_ms == pytest.approx(sum(r.cost_ms for r in p.recomputes) + 0.5 * copies_ms)
    row = _rows(tmp_path)["tensile(swap_copy_share=0.5)"]
    assert row["extra"]["plan_swaps_priced_ms"] == pytest.approx(0.5 * copies_ms)


def test_rebuild_ahead_reaches_the_plan_and_names_the_method(small, tmp_path):
    # without swaps: the plan then rebuilds (with them it may only swap)
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]", "experiment.budget=0.8",
                        "experiment.rebuild_ahead=2", "experiment.snapshot=true",
                        "experiment.allow_swaps=false"))
    row = _rows(tmp_path)["tensile(allow_swaps=false,rebuild_ahead=2)"]
    assert row["status"] == "ok", row["reason"]
    from tensile import PlanningSnapshot
    snap = PlanningSnapshot.load(tmp_path / "cpu" / row["extra"]["snapshot_file"])
    ahead = sum(r.issue_op is not None for r in snap.plan.recomputes)
    assert row["extra"]["recomputes_ahead"] == ahead > 0
    assert ahead == sum(r.issue_op is not None for r in snap.replan(rebuild_ahead=2.0).recomputes)


def test_trace_writes_a_profiler_trace_per_method(small, tmp_path):
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]", "trace=true"))
    for name in ("vanilla", "tensile"):
        trace = json.loads((tmp_path / "cpu" / f"trace_tensile_small_{name}.json").read_text())
        assert any("convolution" in str(e.get("name", "")) for e in trace["traceEvents"])


def test_snapshot_saves_each_planned_method_so_it_replans_offline(small, tmp_path):
    from tensile import PlanningSnapshot, simulate
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile,capuchin]",
                        "experiment.budget=0.9", "experiment.snapshot=true", "experiment.allow_swaps=false"))
    rows = _rows(tmp_path)
    assert "snapshot_file" not in rows["vanilla"]["extra"]      # nothing planned
    for backend, file_part in (("tensile(allow_swaps=false)", "tensile_allow_swaps_false"),
                               ("capuchin", "capuchin")):
        path = tmp_path / "cpu" / rows[backend]["extra"]["snapshot_file"]
        assert re.fullmatch(rf"snapshot_tensile_small_b4_{file_part}_\d{{8}}T\d{{6}}\.json\.gz", path.name)
        snap = PlanningSnapshot.load(path)
        assert snap.meta["backend"] == backend and snap.meta["batch_size"] == 4
        assert snap.budget_bytes == snap.plan.budget_bytes > 0
        # the saved timeline is the one the plan was made on: it simulates to the plan's peak
        assert simulate(snap.timeline, snap.plan).peak == snap.plan.peak_after
        assert simulate(snap.timeline).peak == snap.plan.peak_before
    # the saved inputs and options give TENSILE's own plan back; Capuchin's plan has none
    snap = PlanningSnapshot.load(tmp_path / "cpu" / rows["tensile(allow_swaps=false)"]["extra"]["snapshot_file"])
    assert snap.options["allow_swaps"] is False and snap.replan().same_actions(snap.plan)
    capuchin = PlanningSnapshot.load(tmp_path / "cpu" / rows["capuchin"]["extra"]["snapshot_file"])
    assert capuchin.options is None


def test_capuchin_alone_gets_its_budget_from_an_unwritten_tensile_run(small, tmp_path):
    rows = run.run_config(_cfg(tmp_path, "experiment.methods=[capuchin]"))
    assert [r["backend"] for r in rows] == ["capuchin"] and rows[0]["status"] == "ok"
    assert json.loads(rows[0]["extra"])["budget"] > 0


def test_an_explicit_budget_is_in_the_rows_key_and_goes_to_tensile_and_capuchin(small, tmp_path):
    run.run_config(_cfg(tmp_path, "experiment.methods=[tensile,capuchin]", "experiment.budget=0.9"))
    rows = _rows(tmp_path)
    assert set(rows) == {"tensile", "capuchin"}
    for r in rows.values():
        assert r["mode"] == "whole-step,budget=0.9" and r["extra"]["budget"] == 0.9


def test_out_of_memory_is_an_error_row_and_the_job_goes_on(small, tmp_path, monkeypatch):
    real = tensile_run.make_method

    def make_method(name, *args, **kwargs):
        if name == "checkpoint":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if name == "sac":
            raise RuntimeError("SAC broke\nsecond line")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(tensile_run, "make_method", make_method)
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,checkpoint,sac,save_on_cpu]"))
    rows = _rows(tmp_path)
    assert rows["checkpoint"]["status"] == "error"
    assert rows["checkpoint"]["reason"] == "out of memory at memory_fraction=1 (the whole GPU)"
    assert rows["checkpoint"]["extra"]["eor"] is None
    assert (rows["sac"]["status"], rows["sac"]["reason"]) == ("error", "RuntimeError: SAC broke")
    assert rows["save_on_cpu"]["status"] == "ok" and rows["save_on_cpu"]["extra"]["eor"] is not None


def test_a_plan_that_runs_out_of_memory_keeps_what_it_planned(small, tmp_path, monkeypatch):
    real = tensile_run.make_method

    def make_method(name, *args, **kwargs):
        step = real(name, *args, **kwargs)
        if name != "tensile":
            return step
        calls = {"n": 0}

        class Failing:                  # the planned step, out of memory at its third call
            def __call__(self, batch):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise torch.OutOfMemoryError("CUDA out of memory")
                return step(batch)

            def stats(self):
                return step.stats()
        return Failing()

    monkeypatch.setattr(tensile_run, "make_method", make_method)
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]"))
    t = _rows(tmp_path)["tensile"]
    assert t["status"] == "error" and t["reason"].startswith("out of memory at")
    assert t["extra"]["oom_phase"] in ("warm-up", "timed steps")
    assert t["extra"]["planned_peak_mb"] > 0 and "plan_feasible" in t["extra"]


def test_tensile_recorded_at_small_batches_is_its_own_row(small, tmp_path):
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,tensile]",
                        "experiment.record_batches=[1,2,3]"))
    rows = _rows(tmp_path)
    assert set(rows) == {"vanilla", "tensile(record_batches=1-2-3)"}
    t = rows["tensile(record_batches=1-2-3)"]
    assert t["status"] == "ok", t["reason"]
    assert t["extra"]["planned_peak_vanilla_mb"] > 0


def test_a_failed_vanilla_leaves_the_ratios_empty_with_the_reason(small, tmp_path, monkeypatch):
    real = tensile_run.make_method

    def make_method(name, *args, **kwargs):
        if name == "vanilla":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(tensile_run, "make_method", make_method)
    run.run_config(_cfg(tmp_path, "experiment.methods=[vanilla,checkpoint]"))
    ck = _rows(tmp_path)["checkpoint"]
    assert ck["status"] == "ok" and ck["extra"]["eor"] is None
    assert ck["extra"]["vanilla_reason"].startswith("out of memory at")


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("overrides, match", [
    (["experiment.record_batches=[1,2]"], r"record_batches must be null or three or more .* got \[1, 2\]"),
    (["experiment.record_batches=[1,2,4]"], r"below batch_size=4"),
    (["experiment.methods=[vanilla,bogus]"], r"unknown method\(s\) \['bogus'\]; valid: vanilla, checkpoint"),
    (["experiment.methods=[]"], "experiment.methods is empty"),
    (["experiment.methods=[vanilla,vanilla]"], "lists a method twice"),
    (["experiment.budget=1.5"], "budget must be null, a fraction in"),
    (["experiment.budget=-3"], "budget must be null"),
    (["experiment.memory_gb=16"], "need device=cuda"),
    (["experiment.methods=[vanilla,tensile_graph]"], r"\['tensile_graph'\] capture CUDA graphs: they need device=cuda"),
    (["experiment.optimizer=lbfgs"], "valid: sgd, adam, adam_fused"),
    (["experiment.activation_memory_budget=2"], r"activation_memory_budget must be in \[0, 1\]"),
    (["experiment.max_overhead=-0.1"], r"max_overhead must be a fraction of the iteration time in \[0, 1\)"),
    (["experiment.copy_latency_ms=-1"], r"copy_latency_ms must be a time in ms >= 0, got -1"),
    (["experiment.swap_cost_ms=-0.1"], r"swap_cost_ms must be a time in ms >= 0, or null"),
    (["experiment.swap_copy_share=1.5"], r"swap_copy_share must be a share of a swap's copy time in \[0, 1\], got 1.5"),
    (["experiment.swap_copy_share=null"], r"swap_copy_share must be a share of a swap's copy time"),
    (["experiment.swap_search=sometimes"], r"swap_search must be one of unmet, always, never .*, got 'sometimes'"),
    (["experiment.count_workspaces=2"], r"experiment.count_workspaces must be true or false \(whether"),
    (["experiment.time_captured_copies=2"], "experiment.time_captured_copies must be true or false, got 2"),
    (["experiment.rebuild_ahead=-2"], r"rebuild_ahead must be a number of rerun times >= 0 \(0: "
                                      r"rebuild on demand\), got -2"),
    (["experiment.stream_optimizer=-1"], r"stream_optimizer must be a number of parameter groups >= 0"),
    (["experiment.stream_prefetch=0"], r"stream_prefetch must be a number of groups >= 1, got 0"),
    (["experiment.allow_swaps=maybe"], "experiment.allow_swaps must be true or false, got 'maybe'"),
    (["experiment.batch_norm_from_stats=1"], "experiment.batch_norm_from_stats must be true or false, got 1"),
    (["experiment.methods=[vanilla,streamed_graph]"],
     r"method streamed_graph streams the optimizer: set experiment.stream_optimizer"),
    (["experiment.stream_optimizer=4", "experiment.stream_resident=5"],
     r"stream_resident must be a number of groups from 0 to stream_optimizer, or 'auto', got 5 \(stream_optimizer=4\)"),
    (["experiment.stream_optimizer=4", "experiment.stream_resident=some"],
     r"stream_resident must be a number of groups from 0 to stream_optimizer, or 'auto', got 'some'"),
    (["experiment.stream_optimizer=4", "experiment.stream_overhead=1.5"],
     r"stream_overhead must be a fraction of the step in \[0, 1\), got 1.5"),
    (["experiment.stream_optimizer=4", "experiment.stream_slice_mb=-1"],
     r"stream_slice_mb must be MiB > 0 \(larger parameters stream their state in row slices"),
    (["experiment.stream_optimizer=4", "experiment.stream_resident=auto",
      "experiment.stream_slice_mb=32"],
     r"stream_slice_mb cannot go with stream_resident=auto"),
    (["experiment.stream_optimizer=4", "experiment.stream_slice_resident=2"],
     r"stream_slice_resident=2 keeps slices' state on the device: it needs "
     r"experiment.stream_slice_mb"),
    (["experiment.stream_optimizer=4", "experiment.stream_slice_mb=32",
      "experiment.stream_slice_resident=-1"],
     r"stream_slice_resident must be a number of slices >= 0 .*got -1"),
    (["experiment.stream_optimizer=4", "experiment.stream_pace=true"],
     r"stream_pace=true times when row slices update: it needs experiment.stream_slice_mb"),
    (["experiment.stream_optimizer=4", "experiment.stream_slice_mb=32",
      "experiment.stream_pace=1"],
     r"stream_pace"),
    (["experiment.stream_optimizer=4", "experiment.stream_chunk_mb=0"],
     r"stream_chunk_mb must be MiB > 0 \(the most parameter bytes one optimizer update call "
     r"takes\) or null, got 0"),
    (["experiment.defer_wgrad_mb=-1"],
     r"defer_wgrad_mb must be MiB >= 0 \(linear layers with a weight at least that large .*\) or "
     r"null, got -1"),
    (["experiment.match_peak=checkpoint"],
     r"match_peak='checkpoint' plans tensile_graph to that method's peak: add tensile_graph"),
    (["experiment.match_peak=tensile_graph", "experiment.methods=[vanilla,tensile_graph]"],
     r"match_peak must name another method of this job, .* \(one of \['vanilla'\]\); got 'tensile_graph'"),
    (["experiment.match_peak=sac", "experiment.methods=[vanilla,checkpoint,tensile_graph]"],
     r"one of \['vanilla', 'checkpoint'\]\); got 'sac'"),
    (["experiment.match_peak=checkpoint", "experiment.methods=[vanilla,checkpoint,tensile_graph]",
      "experiment.budget=0.5"], r"leave experiment.budget null \(got 0.5\)"),
    (["experiment.match_peak=checkpoint", "experiment.methods=[vanilla,checkpoint,tensile_graph]",
      "experiment.max_overhead=0.1"], r"max_overhead=0.1 has no effect under a budget"),
    (["experiment.match_msr=1.5"],
     r"match_msr must be null, a memory saving in \(0, 1\) or 'paper' .*; got 1.5"),
    (["experiment.match_msr=0.5"], r"experiment.methods needs vanilla and tensile_graph \(got \['vanilla', "),
    (["experiment.match_msr=0.5", "experiment.match_peak=checkpoint",
      "experiment.methods=[vanilla,checkpoint,tensile_graph]"],
     r"match_msr=0.5 and match_peak='checkpoint' both set tensile_graph's target peak: give one"),
    (["experiment.match_msr=0.5", "experiment.methods=[vanilla,tensile_graph]", "experiment.max_overhead=0.1"],
     r"leave experiment.budget null and max_overhead 0 \(got None, 0.1\)"),
    (["experiment.match_msr=paper", "experiment.methods=[vanilla,tensile_graph]"],
     r"the TENSILE authors give no MSR for small at batch 4 \(they give vgg16 at batch 16, .*"
     r"densenet121 at batch 16\); give a number"),
    (["experiment.census=yes"], "experiment.census must be true or false, got 'yes'"),
    (["experiment.census=true"], r"experiment.census counts the CUDA kernels .*: it needs device=cuda"),
    (["timing.warmup=1"], "need >= 2 warm-up steps"),
    (["batch_size=0"], "batch_size must be a positive integer"),
    (["model.name=nope"], "unknown model 'nope'; valid: small"),
    (["experiment.image_size=1"],
     r"small needs inputs of at least 2 px a side, got 1 \(experiment.image_size\)"),
])
def test_bad_configs_are_refused_before_anything_runs(small, tmp_path, overrides, match):
    with pytest.raises(run.ConfigError, match=match):
        run.validate(_cfg(tmp_path, *overrides))


def test_cpu_runs_are_smoke_runs_only(small, tmp_path):
    cfg = _compose(["experiment=tensile", "device=cpu", "model.name=small", f"results_dir={tmp_path}"])
    with pytest.raises(run.ConfigError, match="add timing=quick"):
        run.validate(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without CUDA")
def test_cuda_on_a_cpu_host_says_how_to_smoke_test(small, tmp_path):
    with pytest.raises(run.ConfigError, match="device=cpu timing=quick"):
        run.validate(_cfg(tmp_path, device="cuda"))


def test_both_memory_caps_are_refused(small, tmp_path):
    cfg = _cfg(tmp_path, "experiment.memory_gb=16", "experiment.memory_fraction=0.5")
    OmegaConf.update(cfg, "device.name", "cuda")
    if torch.cuda.is_available():
        with pytest.raises(run.ConfigError, match="not both"):
            run.validate(cfg)
    else:
        with pytest.raises(run.ConfigError, match="no usable CUDA GPU"):
            run.validate(cfg)


# --------------------------------------------------------------------------- pure helpers

def test_derived_metrics():
    ref = {"status": "ok", "mean_ms": 100.0, "peak_mem_mb": 1000.0, "extra": {"peak_reserved_mb": 1200.0}}
    row = {"status": "ok", "mean_ms": 125.0, "peak_mem_mb": 400.0, "extra": {"peak_reserved_mb": 600.0}}
    m = tensile_run.derived_metrics(row, ref)
    assert m["msr"] == pytest.approx(0.6) and m["msr_reserved"] == pytest.approx(0.5)
    assert m["eor"] == pytest.approx(0.25) and m["cbr"] == pytest.approx(2.4)
    assert m["cbr_reserved"] == pytest.approx(2.0)
    vanilla = (m["peak_vanilla_mb"], m["peak_vanilla_reserved_mb"], m["time_vanilla_ms"])
    assert vanilla == (1000.0, 1200.0, 100.0)
    faster = tensile_run.derived_metrics({**row, "mean_ms": 90.0}, ref)
    assert faster["eor"] == pytest.approx(-0.1) and faster["cbr"] is None  # unbounded: not a number
    assert tensile_run.derived_metrics(row, None)["msr"] is None
    assert tensile_run.derived_metrics(row, {**ref, "status": "error"})["eor"] is None


def test_tensile_graph_is_measured_against_the_captured_vanilla_step():
    graph = {"status": "ok", "mean_ms": 10.0, "peak_mem_mb": 1000.0}
    row = {"status": "ok", "mean_ms": 11.0, "peak_mem_mb": 600.0}
    m = tensile_run._against_graph(row, graph)
    assert m["msr_vs_graph"] == pytest.approx(0.4) and m["eor_vs_graph"] == pytest.approx(0.1)
    none = {"msr_vs_graph": None, "eor_vs_graph": None}
    assert tensile_run._against_graph(row, None) == none
    assert tensile_run._against_graph(row, {**graph, "status": "error"}) == none
    # a capturable Adam for the captured methods only (a CUDA graph cannot read a host step count)
    exp = _compose(["experiment=tensile"]).experiment
    net = nn.Linear(2, 2)
    assert tensile_run._optimizer(net, exp, capturable=True).param_groups[0]["capturable"] is True
    assert tensile_run._optimizer(net, exp).param_groups[0]["capturable"] is False


def test_methods_run_after_what_they_are_measured_against():
    order = tensile_run.method_order
    assert order(["checkpoint", "vanilla"], True) == ["vanilla", "checkpoint"]
    assert order(["capuchin"], True) == ["vanilla", "tensile", "capuchin"]
    assert order(["capuchin", "tensile"], False) == ["vanilla", "capuchin", "tensile"]  # own budget
    assert order(["tensile_graph", "graph", "sac"], True) == ["vanilla", "graph", "tensile_graph", "sac"]
    assert order(["tensile_graph"], True) == ["vanilla", "graph", "tensile_graph"]
    assert order(["checkpoint_graph", "tensile_graph"], True) == [
        "vanilla", "graph", "checkpoint_graph", "tensile_graph"]
    # the method whose peak tensile_graph plans to goes before it, wherever it was listed
    assert order(["tensile_graph", "checkpoint_graph"], True, match_peak="checkpoint_graph") == [
        "vanilla", "graph", "checkpoint_graph", "tensile_graph"]
    assert order(["tensile_graph", "sac"], True, match_peak="sac") == [
        "vanilla", "sac", "graph", "tensile_graph"]
    assert order(["tensile_graph"], True, match_peak="vanilla") == ["vanilla", "graph", "tensile_graph"]


def test_match_budget_lowers_the_budget_by_the_overshoot_until_the_peak_fits():
    # a captured step that peaks 50 MB above its budget; no plan goes below 300 MB
    calls = []

    def captured(budget):
        calls.append(budget)
        return max(budget / MB, 300) + 50, budget >= 300 * MB

    budget, tries = tensile_run.match_budget(1000.0, captured)
    assert budget == calls[-1] and budget / MB + 50 <= 1000.0
    # first try at the target, the second lowered by the 50 MB excess plus 0.5 % of it: fits
    assert [t["budget_mb"] for t in tries] == [1000.0, 945.0] and tries[-1]["peak_mb"] == 995.0
    # a target the plan cannot reach stops at the infeasible try, not after every attempt
    budget, tries = tensile_run.match_budget(320.0, captured)
    assert not tries[-1]["feasible"] and len(tries) == 2 and tries[-1]["peak_mb"] == 350.0
    # an overshoot that keeps growing stops after the attempts, with every try kept
    budget, tries = tensile_run.match_budget(1000.0, lambda b: (1100.0, True), attempts=3)
    assert len(tries) == 3 and budget == tries[-1]["budget_mb"] * MB


def test_match_budget_takes_back_memory_a_fitting_try_left_unused():
    """A plan that fits with room to spare recomputes for nothing: the search raises the
    budget again, never to one that peaked above, and keeps the highest that fitted."""
    def captured(budget):          # a plan's own excess: 70 MB above a 900 MB budget, else 25
        b = budget / MB
        return b + (70 if b > 900 else 25), True

    budget, tries = tensile_run.match_budget(953.4, captured)
    fits = [t for t in tries if t["peak_mb"] <= 953.4]
    assert budget / MB == pytest.approx(max(t["budget_mb"] for t in fits), abs=0.1)
    assert len(tries) == 5 and tries[1]["peak_mb"] <= 953.4 < tries[2]["peak_mb"]
    assert tries[2]["budget_mb"] > tries[1]["budget_mb"]          # raised after a fit...
    over = min(t["budget_mb"] for t in tries if t["peak_mb"] > 953.4)
    assert all(t["budget_mb"] < over for t in tries if t["budget_mb"] != tries[0]["budget_mb"]
               and t["peak_mb"] <= 953.4)                          # ...never past an overshoot
    assert captured(budget)[0] > 953.4 - 40   # 31 MB left, not the first fit's 49


def test_match_msr_paper_is_the_authors_figure_for_the_model_and_batch():
    exp = _compose(["experiment=tensile", "experiment.match_msr=paper"]).experiment
    theirs = pd.read_csv(tensile_run.PAPER_SINGLE)
    for r in theirs.itertuples():
        assert tensile_run.target_msr(exp, r.model, r.batch_size) == r.msr
    assert tensile_run.target_msr(exp, "resnet50", 16) == 0.671
    assert tensile_run.paper_msr("resnet50", 32) is None
    assert tensile_run.target_msr(_compose(["experiment=tensile"]).experiment, "resnet50", 16) is None
    number = _compose(["experiment=tensile", "experiment.match_msr=0.4"]).experiment
    assert tensile_run.target_msr(number, "anything", 3) == 0.4


def test_match_target_is_a_measured_peak_or_a_saving_against_both_vanilla_peaks():
    peaks = {"vanilla": 1000.0, "graph": 900.0, "checkpoint_graph": 700.0}
    assert tensile_run.match_target("checkpoint_graph", None, peaks) == (700.0, {"match_peak": "checkpoint_graph"})
    # the lower reference: the row's MSR is then at least 0.6 against vanilla and graph
    target, info = tensile_run.match_target(None, 0.6, peaks)
    assert target == pytest.approx(360.0) and info == {"match_msr": 0.6}
    assert 1 - target / 1000.0 >= 0.6 and 1 - target / 900.0 >= 0.6 - 1e-12
    assert tensile_run.match_target(None, 0.5, {"vanilla": 800.0})[0] == pytest.approx(400.0)
    with pytest.raises(ValueError, match="match_msr=0.5: vanilla has no measured peak"):
        tensile_run.match_target(None, 0.5, {"graph": 800.0})
    with pytest.raises(ValueError, match="match_peak='sac': sac has no measured peak"):
        tensile_run.match_target("sac", None, peaks)


def test_a_match_msr_row_names_the_resolved_figure_and_says_why_it_could_not_plan(small, tmp_path,
                                                                                  monkeypatch):
    # on the CPU no peak is measured: the tensile_graph row is an error that says so, under
    # the label of the figure "paper" resolved to (graph and tensile_graph need CUDA)
    monkeypatch.setattr(tensile_run, "paper_msr", lambda model, batch: 0.42)
    cfg = _cfg(tmp_path, "experiment.match_msr=paper", "experiment.methods=[vanilla,tensile_graph]")
    from experiments.env import environment
    tensile_run.run(cfg, small_models(), "cpu", environment("cpu"), tmp_path / "cpu")
    rows = _rows(tmp_path)
    assert set(rows) == {"vanilla", "graph", "tensile_graph(match_msr=0.42)"}
    assert rows["vanilla"]["status"] == "ok"
    assert {r["extra"]["run_id"] for r in rows.values()} == {run.RUN_ID}   # one process, one run
    ours = rows["tensile_graph(match_msr=0.42)"]
    assert ours["status"] == "error"
    assert "match_msr=0.42: vanilla has no measured peak" in ours["reason"]


def test_setting_and_label_name_what_changes_the_measurement(monkeypatch):
    exp = _compose(["experiment=tensile", "experiment.memory_gb=16", "experiment.budget=0.5",
                    "experiment.activation_memory_budget=0.3"]).experiment
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert tensile_run.setting(exp) == "whole-step,mem=16GiB,budget=0.5"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert tensile_run.setting(exp) == "whole-step,mem=16GiB,budget=0.5,expandable"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert tensile_run.method_label("compile_budget", exp) == "compile_budget=0.3"
    assert tensile_run.method_label("tensile", exp) == "tensile"
    assert tensile_run.method_label("tensile_graph", exp) == "tensile_graph"
    mo = _compose(["experiment=tensile", "experiment.max_overhead=0.05"]).experiment
    assert tensile_run.method_label("tensile_graph", mo) == "tensile_graph(max_overhead=0.05)"
    mp = _compose(["experiment=tensile", "experiment.match_peak=checkpoint_graph"]).experiment
    assert tensile_run.method_label("tensile_graph", mp) == "tensile_graph(match_peak=checkpoint_graph)"
    assert tensile_run.method_label("tensile", mp) == "tensile"   # captured only
    assert tensile_run.setting(mp) == "whole-step"   # beside the other whole-step rows
    fused = _compose(["experiment=tensile", "experiment.optimizer=adam_fused"]).experiment
    assert tensile_run.setting(fused) == "whole-step,opt=adam_fused"
    sgd = _compose(["experiment=tensile", "experiment.optimizer=sgd"]).experiment
    assert tensile_run.setting(sgd) == "whole-step,opt=sgd"
    msr = _compose(["experiment=tensile", "experiment.match_msr=0.5"]).experiment
    assert tensile_run.method_label("tensile_graph", msr) == "tensile_graph(match_msr=0.5)"
    bn = _compose(["experiment=tensile", "experiment.batch_norm_from_stats=true"]).experiment
    assert tensile_run.method_label("tensile_graph", bn) == "tensile_graph(bn_from_stats)"
    assert tensile_run._method_opts("tensile", bn, "cpu", None, None, {})["batch_norm_from_stats"]
    assert "batch_norm_from_stats" not in tensile_run._method_opts("vdnn", bn, "cpu", None, None, {})
    assert tensile_run.method_label("graph", mo) == "graph"
    tc = _compose(["experiment=tensile", "experiment.time_captured_copies=true"]).experiment
    assert tensile_run.method_label("tensile_graph", tc) == "tensile_graph(time_copies)"
    assert tensile_run.method_label("tensile", tc) == "tensile"   # captured only
    assert tensile_run._method_opts("tensile_graph", tc, "cuda", None, None, {})["time_copies"] is True
    assert "time_copies" not in tensile_run._method_opts("tensile_graph", exp, "cuda", None, None, {})
    assert "time_copies" not in tensile_run._method_opts("tensile", tc, "cpu", None, None, {})
    lat = _compose(["experiment=tensile", "experiment.max_overhead=0.08",
                    "experiment.copy_latency_ms=0.05"]).experiment
    assert tensile_run.method_label("tensile_graph", lat) == \
        "tensile_graph(max_overhead=0.08,copy_latency_ms=0.05)"
    assert tensile_run._method_opts("tensile_graph", lat, "cuda", None, None, {})["copy_latency_ms"] == 0.05
    so = _compose(["experiment=tensile", "experiment.stream_optimizer=16"]).experiment
    # prefetch 2 is the default now; rows from before it was an option had 1, unnamed
    assert tensile_run.method_label("tensile_graph", so) == "tensile_graph(stream_optimizer=16,stream_prefetch=2)"
    one = _compose(["experiment=tensile", "experiment.stream_optimizer=16",
                    "experiment.stream_prefetch=1"]).experiment
    assert tensile_run.method_label("tensile_graph", one) == "tensile_graph(stream_optimizer=16)"
    assert tensile_run.method_label("tensile", so) == "tensile"     # tensile_graph's option only
    assert tensile_run._method_opts("tensile_graph", so, "cuda", None, None, {})["stream_optimizer"] == 16
    assert "stream_optimizer" not in tensile_run._method_opts("tensile", so, "cuda", None, None, {})
    pf = _compose(["experiment=tensile", "experiment.stream_optimizer=8",
                   "experiment.stream_prefetch=3"]).experiment
    assert tensile_run.method_label("tensile_graph", pf) == "tensile_graph(stream_optimizer=8,stream_prefetch=3)"
    assert tensile_run._method_opts("tensile_graph", pf, "cuda", None, None, {})["stream_prefetch"] == 3
    rs = _compose(["experiment=tensile", "experiment.stream_optimizer=16",
                   "experiment.stream_resident=4"]).experiment
    assert tensile_run.method_label("tensile_graph", rs) == \
        "tensile_graph(stream_optimizer=16,stream_prefetch=2,stream_resident=4)"
    assert tensile_run._method_opts("tensile_graph", rs, "cuda", None, None, {})["stream_resident"] == 4
    ns = _compose(["experiment=tensile", "experiment.max_overhead=0.1",
                   "experiment.allow_swaps=false"]).experiment
    assert tensile_run.method_label("tensile_graph", ns) == "tensile_graph(max_overhead=0.1,allow_swaps=false)"
    assert tensile_run._method_opts("tensile_graph", ns, "cuda", None, None, {})["allow_swaps"] is False
    assert "allow_swaps" not in tensile_run._method_opts("tensile_graph", so, "cuda", None, None, {})
    assert "allow_swaps" not in tensile_run._method_opts("capuchin", ns, "cuda", None, 10, {})
    # the streaming alone, captured without a plan: its label names the same knobs
    assert tensile_run.method_label("streamed_graph", rs) == \
        "streamed_graph(stream_optimizer=16,stream_prefetch=2,stream_resident=4)"
    assert tensile_run._method_opts("streamed_graph", rs, "cuda", None, None, {}) == {
        "stream_optimizer": 16, "stream_prefetch": 2, "stream_resident": 4, "stream_overhead": 0.05,
        "stream_chunk_mb": None, "stream_slice_mb": None, "stream_slice_resident": 0,
        "stream_pace": False}
    # a large parameter's state streamed in row slices: named, and passed on
    sliced = _compose(["experiment=tensile", "experiment.stream_optimizer=16",
                       "experiment.stream_resident=16", "experiment.stream_slice_mb=32"]).experiment
    assert tensile_run.method_label("tensile_graph", sliced) == \
        "tensile_graph(stream_optimizer=16,stream_prefetch=2,stream_resident=16,stream_slice=32)"
    assert tensile_run._method_opts("streamed_graph", sliced, "cuda", None, None, {})[
        "stream_slice_mb"] == 32.0
    # ... with the last slices' state kept on the device
    kept = _compose(["experiment=tensile", "experiment.stream_optimizer=16",
                     "experiment.stream_slice_mb=32", "experiment.stream_slice_resident=4"]).experiment
    assert tensile_run.method_label("tensile_graph", kept) == \
        "tensile_graph(stream_optimizer=16,stream_prefetch=2,stream_slice=32,stream_slice_resident=4)"
    assert tensile_run._method_opts("tensile_graph", kept, "cuda", None, None, {})[
        "stream_slice_resident"] == 4
    # ... and their pace timed (tensile.tune_pace)
    paced = _compose(["experiment=tensile", "experiment.stream_optimizer=16",
                      "experiment.stream_slice_mb=32", "experiment.stream_pace=true"]).experiment
    assert tensile_run.method_label("tensile_graph", paced) == \
        "tensile_graph(stream_optimizer=16,stream_prefetch=2,stream_slice=32,stream_pace)"
    assert tensile_run._method_opts("tensile_graph", paced, "cuda", None, None, {})[
        "stream_pace"] is True
    # a bounded update (tensile.stream_optimizer's update_chunk_mb): named, and passed on
    chunked = _compose(["experiment=tensile", "experiment.stream_optimizer=16",
                        "experiment.stream_chunk_mb=64"]).experiment
    assert tensile_run.method_label("tensile_graph", chunked) == \
        "tensile_graph(stream_optimizer=16,stream_prefetch=2,stream_chunk=64)"
    assert tensile_run._method_opts("streamed_graph", chunked, "cuda", None, None, {})[
        "stream_chunk_mb"] == 64.0
    # resident=auto (tensile.tune_resident): the label names it and its allowance
    auto = _compose(["experiment=tensile", "experiment.stream_optimizer=16",
                     "experiment.stream_resident=auto", "experiment.stream_overhead=0.1"]).experiment
    assert tensile_run.method_label("tensile_graph", auto) == \
        "tensile_graph(stream_optimizer=16,stream_prefetch=2,stream_resident=auto,stream_overhead=0.1)"
    opts = tensile_run._method_opts("streamed_graph", auto, "cuda", None, None, {})
    assert opts["stream_resident"] == "auto" and opts["stream_overhead"] == 0.1
    # deferred weight gradients (tensile.defer_weight_grads): named, and passed on, where taken
    dw = _compose(["experiment=tensile", "experiment.stream_optimizer=16",
                   "experiment.defer_wgrad_mb=64"]).experiment
    assert tensile_run.method_label("tensile_graph", dw) == \
        "tensile_graph(stream_optimizer=16,stream_prefetch=2,defer_wgrad=64)"
    assert tensile_run.method_label("streamed_graph", dw) == \
        "streamed_graph(stream_optimizer=16,stream_prefetch=2,defer_wgrad=64)"
    assert tensile_run._method_opts("tensile_graph", dw, "cuda", None, None, {})["defer_wgrad_mb"] == 64.0
    assert tensile_run._method_opts("streamed_graph", dw, "cuda", None, None, {})["defer_wgrad_mb"] == 64.0
    assert "defer_wgrad_mb" not in tensile_run._method_opts("tensile", dw, "cpu", None, None, {})
    assert tensile_run.method_label("tensile", dw) == "tensile"
    assert "defer_wgrad_mb" not in tensile_run._method_opts("tensile_graph", auto, "cuda", None, None, {})
    exp = _compose(["experiment=tensile", "experiment.memory_fraction=0.25",
                    "experiment.cap_setup=false"]).experiment
    assert tensile_run.setting(exp) == "whole-step,memfrac=0.25,uncapped-setup"


def test_inception_v3_loses_its_auxiliary_head():
    model = nn.Module()
    model.AuxLogits, model.aux_logits = nn.Linear(2, 2), True
    assert tensile_run._drop_aux_head(model).AuxLogits is None and model.aux_logits is False
    plain = nn.Linear(2, 2)
    assert tensile_run._drop_aux_head(plain) is plain


def test_protocol_is_tensiles_unless_quick():
    assert tensile_run.protocol(_compose(["experiment=tensile"])) == (5, 50, 3)
    assert tensile_run.protocol(_compose(["experiment=tensile", "timing=quick"])) == (3, 10, 1)


def test_presets_cover_the_papers_workloads():
    single = _compose(["+sweep=tensile_single"], hydra_cfg=True)
    assert single.experiment.name == "tensile"
    assert str(single.hydra.sweeper.params.model).split(",") == PAPER_MODELS
    assert str(single.hydra.sweeper.params.batch_size) == "16"
    assert (single.experiment.image_size, single.experiment.num_classes) == (224, 1000)
    assert single.experiment.optimizer == "adam"
    assert {"vanilla", "checkpoint", "save_on_cpu", "sac", "tensile", "vdnn", "capuchin"} <= \
        set(single.experiment.methods)
    batch = _compose(["+sweep=tensile_batch"], hydra_cfg=True)
    assert str(batch.hydra.sweeper.params.batch_size) == "2,4,8,16,32"
    assert str(batch.hydra.sweeper.params.model).split(",") == PAPER_MODELS
    captured = _compose(["+sweep=tensile_captured"], hydra_cfg=True)
    assert str(captured.hydra.sweeper.params.model).split(",") == PAPER_MODELS
    assert list(captured.experiment.methods) == ["vanilla", "graph", "tensile_graph", "checkpoint_graph"]
    assert captured.experiment.copy_latency_ms == 0.1 and single.experiment.copy_latency_ms == 0.01
    # every model's target limit (half the authors' EOR, to two places) is one of the points
    assert {0.05, 0.08, 0.13, 0.15, 0.3} == {
        float(o) for o in str(captured.hydra.sweeper.params["experiment.max_overhead"]).split(",")}
    streamed = _compose(["+sweep=tensile_streamed"], hydra_cfg=True)
    assert (streamed.experiment.stream_optimizer, streamed.experiment.stream_prefetch,
            streamed.experiment.stream_resident) == (16, 2, 4)
    assert list(streamed.experiment.methods) == ["vanilla", "graph", "tensile_graph"]
    assert str(streamed.hydra.sweeper.params.model).split(",") == PAPER_MODELS
    cost = _compose(["+sweep=streamed_cost"], hydra_cfg=True)
    assert list(cost.experiment.methods) == ["graph", "streamed_graph"]
    assert cost.experiment.stream_optimizer == 16
    assert str(cost.hydra.sweeper.params["experiment.stream_prefetch"]) == "1,2,4"
    assert str(cost.hydra.sweeper.params["experiment.stream_resident"]) == "0,4"
    budget = _compose(["+sweep=tensile_budget"], hydra_cfg=True)
    assert str(budget.hydra.sweeper.params["experiment.memory_gb"]) == "16"
    assert str(budget.hydra.sweeper.params.batch_size) == "256" and budget.experiment.cap_setup is True
    assert list(budget.experiment.record_batches) == [2, 4, 8]   # the cap holds while it records
    equal = _compose(["+sweep=tensile_equal_peak"], hydra_cfg=True)
    assert equal.experiment.match_peak == "checkpoint_graph"
    assert list(equal.experiment.methods) == ["vanilla", "graph", "checkpoint_graph", "tensile_graph"]
    # the paper models without dropout (checkpoint_graph refuses VGG-16's and Inception-v3's)
    assert str(equal.hydra.sweeper.params.model).split(",") == ["inception_v4", "resnet50", "densenet121"]
    assert str(equal.hydra.sweeper.params["experiment.batch_norm_from_stats"]) == "false,true"
    assert equal.experiment.swap_search == "always"
    authors = _compose(["+sweep=tensile_authors"], hydra_cfg=True)
    assert authors.experiment.match_msr == "paper" and authors.experiment.batch_norm_from_stats
    assert list(authors.experiment.methods) == ["vanilla", "graph", "tensile_graph"]
    assert str(authors.hydra.sweeper.params.model).split(",") == PAPER_MODELS
    assert str(authors.hydra.sweeper.params["experiment.stream_optimizer"]) == "0,16"
    assert authors.experiment.swap_search == "always"
    for cfg in (single, batch, budget, captured, streamed, cost, equal, authors):
        assert set(cfg.experiment.methods) <= set(tensile_run.METHODS)


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_rows_have_memory_ratios_and_a_tiny_cap_runs_out_of_memory(small, tmp_path):
    from experiments.env import gpu_slug
    cfg = _cfg(tmp_path, "experiment.methods=[vanilla,checkpoint,tensile,tensile_graph,checkpoint_graph]",
               device="cuda")
    run.run_config(cfg)
    gpu = gpu_slug()
    rows = _rows(tmp_path, gpu)
    assert set(rows) == {"vanilla", "checkpoint", "tensile", "graph", "tensile_graph", "checkpoint_graph"}
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
        assert float(r["peak_mem_mb"]) > 0 and r["extra"]["msr"] is not None
        e = r["extra"]   # peaks are counted above what was there before: compare whole figures
        assert (e["peak_reserved_mb"] + e["resident_reserved_before_mb"]
                >= float(r["peak_mem_mb"]) + e["resident_before_mb"] - 0.1)
    assert rows["vanilla"]["extra"]["msr"] == 0
    assert rows["checkpoint_graph"]["extra"]["eor_vs_graph"] is not None
    captured = rows["tensile_graph"]["extra"]
    # the capture streams' cuBLAS workspaces exist before either graphed method is measured
    assert captured["resident_before_mb"] == pytest.approx(
        rows["graph"]["extra"]["resident_before_mb"], abs=1.0)
    assert captured["graph_pool_mb"] > 0 and captured["eor_vs_graph"] is not None
    # planned for the captured step's timing: its ops' times in a graph, scaled to one replay
    # (the eager-measured op times this replaces add up to several times the replay)
    assert captured["plan_iteration_ms"] == pytest.approx(captured["captured_vanilla_ms"], rel=1e-3)
    assert captured["msr_vs_graph"] == pytest.approx(
        1 - float(rows["tensile_graph"]["peak_mem_mb"]) / float(rows["graph"]["peak_mem_mb"]), abs=1e-3)
    # 1e-6 of an H200 is ~140 KB; the step must need a new segment for the cap to bite (a
    # tiny step fits in the free part of the 2 MB segment that already holds the inputs)
    cfg = _cfg(tmp_path, "experiment.methods=[vanilla]", "experiment.memory_fraction=1e-6",
               "experiment.image_size=512", device="cuda")
    run.run_config(cfg)
    capped = [r for r in read_rows(tmp_path / gpu / "tensile.csv") if "memfrac" in r["mode"]]
    assert capped[0]["status"] == "error"
    assert capped[0]["reason"].startswith("out of memory at memory_fraction=1e-06")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_census_says_where_a_captured_steps_time_goes(small, tmp_path):
    from experiments.env import gpu_slug
    from experiments import report
    rows = _gpu_rows(tmp_path, "experiment.methods=[vanilla,checkpoint_graph]", "experiment.census=true",
                     "experiment.image_size=64")
    assert "census_busy_ms" not in rows["vanilla"]["extra"]      # eager steps are not counted
    for name in ("graph", "checkpoint_graph"):
        e = rows[name]["extra"]
        assert e["census_kernels"] > 0 and 0 < e["census_busy_ms"] <= e["census_kernel_ms"] + 1e-6
        assert e["census_busy_ms"] <= float(rows[name]["mean_ms"]) * 1.5
        assert 0 < e["census_compute_busy_ms"] <= e["census_busy_ms"] + 1e-6
        assert 0 <= e["census_copy_ms"] < e["census_kernel_ms"]
        assert e["census_by_name"] and all(us >= tensile_run.CENSUS_MIN_US
                                           for _, us in e["census_by_name"].values())
    every = report.load_rows(tmp_path / gpu_slug(), every_row=True)
    every["smoke"] = False    # timing=quick marks the rows smoke; the report leaves those out
    table = report.tensile_census_table(every)
    line = table.set_index("method").loc["checkpoint_graph"]
    # checkpointing reruns each block's forward: kernels added, and the conv kernels grew
    assert line["kernels added ms"] > 0 and line["kernels grown most (us per step)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tensile_graph_plans_to_a_memory_saving(small, tmp_path):
    rows = _gpu_rows(tmp_path, "experiment.methods=[vanilla,tensile_graph]", "experiment.match_msr=0.3",
                     "experiment.image_size=64")
    vanilla, graph, ours = rows["vanilla"], rows["graph"], rows["tensile_graph(match_msr=0.3)"]
    assert ours["status"] == "ok", ours["reason"]
    e = ours["extra"]
    assert e["match_msr"] == 0.3
    lower = min(float(vanilla["peak_mem_mb"]), float(graph["peak_mem_mb"]))
    assert e["match_target_mb"] == pytest.approx(0.7 * lower)
    assert e["match_met"] is (float(ours["peak_mem_mb"]) <= e["match_target_mb"])
    if e["match_met"]:   # at least the saving asked for, against either vanilla step
        assert e["msr"] >= 0.3 - 1e-9 and e["msr_vs_graph"] >= 0.3 - 1e-9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tensile_graph_plans_to_a_built_ins_measured_peak(small, tmp_path):
    rows = _gpu_rows(tmp_path, "experiment.methods=[vanilla,tensile_graph,checkpoint_graph]",
                     "experiment.match_peak=checkpoint_graph", "experiment.image_size=64")
    ck, ours = rows["checkpoint_graph"], rows["tensile_graph(match_peak=checkpoint_graph)"]
    assert ck["status"] == "ok" and ours["status"] == "ok", (ck["reason"], ours["reason"])
    e = ours["extra"]
    assert e["match_peak"] == "checkpoint_graph"
    assert e["match_target_mb"] == pytest.approx(float(ck["peak_mem_mb"]))
    # the least any plan of its moves could be priced at (Scheduler.bound), beside its price
    assert "bound_ms" in e and "bound_swaps_ms" in e
    if e["plan_feasible"]:
        assert e["bound_swaps_ms"] is not None and e["bound_swaps_ms"] <= e["plan_overhead_ms"] + 1e-6
    tries = e["match_tries"]
    assert 1 <= len(tries) <= 5
    met = float(ours["peak_mem_mb"]) <= e["match_target_mb"]
    assert e["match_met"] is met
    fits = [t for t in tries if t["peak_mb"] <= e["match_target_mb"]]
    if fits:   # the row measured the graph of the highest budget that fitted: its very peak
        best = max(fits, key=lambda t: t["budget_mb"])
        assert met and e["budget"] == pytest.approx(best["budget_mb"] * MB, abs=0.1 * MB)
        assert float(ours["peak_mem_mb"]) == pytest.approx(best["peak_mb"], abs=0.1)
    else:      # none fitted: the last try's budget, and the search says why it stopped
        assert not met and e["budget"] == pytest.approx(tries[-1]["budget_mb"] * MB, abs=0.1 * MB)
        assert not tries[-1]["feasible"] or len(tries) == 5
