"""The several-jobs TENSILE harness (experiments.tensile_multi) in its CPU smoke mode.

Real job processes and a real scheduler process train mobilenet_v2 at 32x32, batch 2, a few
steps each (the runtime's simulation mode; RSS instead of GPU memory).
"""
from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys
import time
import types

import pytest
import torch

from experiments import models
from experiments import tensile_multi as tm
from experiments.mps import available as mps_available
from experiments.store import COLUMNS, read_rows

SMOKE = ["--device", "cpu", "--batch", "2", "--warmup", "2", "--iters", "3", "--timeout", "240"]


def _rows(results_dir) -> list[dict]:
    rows = read_rows(results_dir / "cpu" / "tensile_multi.csv")
    for r in rows:
        r["extra"] = json.loads(r["extra"]) if r["extra"] else {}
    return rows


def _run_on_gpu(tmp_path, args: list[str], mode: str | None) -> tuple:
    """Run ``args`` with results in ``tmp_path``: the CSV's path and its rows by backend, each
    ``extra`` parsed, every row checked ``ok`` (and of ``mode``, when given)."""
    assert tm.main([*args, "--results-dir", str(tmp_path)]) == 0
    (csv_path,) = tmp_path.glob("*/tensile_multi.csv")
    rows = {r["backend"]: {**r, "extra": json.loads(r["extra"]) if r["extra"] else {}}
            for r in read_rows(csv_path)}
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
        assert mode is None or r["mode"] == mode, (name, r["mode"])
    return csv_path, rows


def _events(path) -> list[tuple[str, str]]:
    with open(path, newline="") as f:
        return [(r["phase"], r["event"]) for r in csv.DictReader(f) if r["event"]]


@pytest.fixture(scope="module")
def copies2(tmp_path_factory):
    """One setting: two concurrent copies of mobilenet_v2, both phases."""
    out = tmp_path_factory.mktemp("copies2")
    args = ["--scenario", "copies", "--models", "mobilenet_v2", "--copies", "2",
            "--results-dir", str(out), *SMOKE]
    assert tm.main(args) == 0
    return out, args


# --------------------------------------------------------------------------- whole runs

def test_rows_for_every_job_and_the_gpu(copies2):
    out, _ = copies2
    assert list(read_rows(out / "cpu" / "tensile_multi.csv")[0]) == COLUMNS
    rows = {r["backend"]: r for r in _rows(out)}
    assert set(rows) == {"mobilenet_v2-1", "mobilenet_v2-2", "GPU"}
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
        assert r["experiment"] == "tensile_multi" and r["device"] == "cpu"
        assert r["mode"] == "copies:mobilenet_v2x2,img=32"
        assert isinstance(r["extra"]["eor"], float)
        # arrival of the other job (and the first measurement) re-plan every job
        assert r["extra"]["replans"] >= 1
    for name in ("mobilenet_v2-1", "mobilenet_v2-2"):
        e = rows[name]["extra"]
        assert e["job"] == name and e["weight"] == 1.0 and e["copies"] == 2
        assert float(rows[name]["median_ms"]) > 0 and e["iter_ms_median_vanilla"] > 0
        assert e["measured_iters_vanilla"] == e["measured_iters_tensile"] == 3
        assert len(e["plan_versions"]) == e["replans"] + 1
        assert e["bn_rerun_share_median"] is None    # without --bn-from-stats
        assert e["msr_alloc"] is None and e["peak_alloc_tensile_mb"] is None  # no GPU
        # the stages where the process's memory outside its allocator is read (None on CPU)
        assert e["outside_allocator_mb_vanilla"] == dict.fromkeys(["on_device", "first_step", "last_step"])
        assert e["outside_allocator_mb_tensile"] == dict.fromkeys(
            ["on_device", "scheduler", "first_step", "last_step"])
        assert e["bytes_swapped"] >= 0 and e["passive_swapins"] >= 0
        # what the job's last plan does (a captured job's replays count nothing on the host)
        assert isinstance(e["swaps_planned"], int) and isinstance(e["recomputes_planned"], int)
        assert e["est_overhead_ms"] >= 0
        # what the job's last plan assumed; its timed steps (the first measured one) timed
        assert e["plan_iteration_ms"] > 0 and e["timed_steps"] >= 1
        assert e["stall_ms_per_timed_step"] is not None
        assert e["capture_s_vanilla"] == e["capture_s_tensile"] == []   # nothing captured
    gpu = rows["GPU"]["extra"]
    assert gpu["memory_source"] == "rss" and "RSS" in gpu["memory_note"]
    assert isinstance(gpu["msr_nvml"], float)
    assert gpu["replan_kinds"]["arrival"] == 2 and gpu["replan_kinds"]["first_measurement"] >= 1
    # the scheduler's time for each joint plan, read off its log beside the reasons
    assert len(gpu["replan_planner_ms"]) == len(gpu["replan_reasons"]) == gpu["replans"]
    assert all(isinstance(ms, float) and ms >= 0 for ms in gpu["replan_planner_ms"])


def test_timeline_and_plot_with_arrivals_and_exits(copies2):
    out, _ = copies2
    gpu = next(r for r in _rows(out) if r["backend"] == "GPU")
    stamp = "".join(c for c in gpu["date"][:19] if c.isalnum())    # the run's files: per date
    assert gpu["extra"]["timeline_csv"] == f"tensile_multi_timeline_copies_mobilenet_v2x2_img_32_{stamp}.csv"
    assert gpu["extra"]["plot_png"] == f"tensile_multi_copies_mobilenet_v2x2_img_32_{stamp}.png"
    timeline = out / "cpu" / gpu["extra"]["timeline_csv"]
    png = out / "cpu" / gpu["extra"]["plot_png"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(timeline, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["phase", "t_s", "used_mb", "event"]
        samples = list(reader)
    assert sum(not r["event"] for r in samples) > 10   # plain samples every ~20 ms
    events = _events(timeline)
    for phase in ("vanilla", "tensile"):
        for job in ("mobilenet_v2-1", "mobilenet_v2-2"):
            for kind in ("start", "arrive", "ready", "measuring", "exit"):
                assert (phase, f"{kind} {job}") in events
        # the barrier after warm-up: every job measures only once all are warm
        order = [e for p, e in events if p == phase]
        last_ready = max(order.index(f"ready {j}") for j in ("mobilenet_v2-1", "mobilenet_v2-2"))
        assert min(order.index(f"measuring {j}") for j in ("mobilenet_v2-1", "mobilenet_v2-2")) > last_ready


def test_a_rerun_skips_stored_settings(copies2, capsys, monkeypatch):
    out, args = copies2
    before = len(_rows(out))
    calls = []

    def run_setting(setting, *args):
        calls.append(setting.label)
        return [{"mode": setting.label, "backend": "GPU", "status": "ok", "extra": ""}]

    monkeypatch.setattr(tm, "run_setting", run_setting)
    assert tm.main(args) == 0
    assert calls == [] and len(_rows(out)) == before
    assert "already measured" in capsys.readouterr().out
    assert tm.main([*args, "--redo"]) == 0
    assert calls == ["copies:mobilenet_v2x2,img=32"]


def test_a_crashing_job_is_an_error_row_and_the_others_finish(tmp_path):
    opts = tm.Options(device="cpu", warmup=2, iters=3, results_dir=tmp_path, timeout_s=240)
    steps = opts.warmup + opts.iters
    setting = tm.Setting("mdw", "mdw:crash-test,img=32",
                         [tm.JobSpec("good-1", "mobilenet_v2", steps),
                          tm.JobSpec("bad-1", "no_such_model", steps)])
    written = tm.run([setting], opts, tm._probe("cpu"))
    assert [r["backend"] for r in written] == ["good-1", "bad-1", "GPU"]
    rows = {r["backend"]: r for r in _rows(tmp_path)}
    assert rows["good-1"]["status"] == "ok", rows["good-1"]["reason"]
    bad = rows["bad-1"]
    assert bad["status"] == "error"
    assert "vanilla: exit code 1" in bad["reason"] and "no_such_model" in bad["reason"]
    assert "Traceback" in bad["extra"]["stderr_tail_tensile"]
    assert rows["GPU"]["status"] == "error" and "bad-1" in rows["GPU"]["reason"]


def test_a_setting_over_its_timeout_stops_every_process(tmp_path):
    psutil = pytest.importorskip("psutil")
    opts = tm.Options(device="cpu", warmup=2, iters=3, results_dir=tmp_path, timeout_s=2.0)
    (setting,) = tm.build_settings("copies", ["mobilenet_v2"], [2], opts)
    tm.run([setting], opts, tm._probe("cpu"))
    rows = {r["backend"]: r for r in _rows(tmp_path)}
    assert set(rows) == {"mobilenet_v2-1", "mobilenet_v2-2", "GPU"}
    for name in ("mobilenet_v2-1", "mobilenet_v2-2"):
        assert rows[name]["status"] == "error"
        reason = rows[name]["reason"]
        assert "vanilla: timeout: the setting ran longer than 2 s" in reason
        assert "tensile: tensile phase failed: TimeoutError" in reason
    alive = [p for p in psutil.Process().children(recursive=True) if p.status() != "zombie"]
    assert alive == []
    assert rows["GPU"]["extra"]["msr_nvml"] is None   # no job ever trained


def test_dynamic_arrivals_and_an_early_leaver(tmp_path):
    args = ["--scenario", "dynamic", "--models", "mobilenet_v2,mobilenet_v2",
            "--arrive-every", "2", "--results-dir", str(tmp_path), *SMOKE]
    assert tm.main(args) == 0
    rows = {r["backend"]: r for r in _rows(tmp_path)}
    assert all(r["status"] == "ok" for r in rows.values()), [r["reason"] for r in rows.values()]
    stayer, leaver = rows["mobilenet_v2-1"]["extra"], rows["mobilenet_v2-2"]["extra"]
    assert leaver["measured_iters_tensile"] == 1          # max(1, iters // 2): leaves early
    assert stayer["measured_iters_tensile"] >= 3          # trains on until the last one is done
    kinds = rows["GPU"]["extra"]["replan_kinds"]
    assert kinds["arrival"] == 2 and kinds["departure"] >= 1
    timeline = tmp_path / "cpu" / rows["GPU"]["extra"]["timeline_csv"]
    assert timeline.name.startswith("tensile_multi_timeline_dynamic_mobilenet_v2_mobilenet_v2_every_2_img_32_")
    events = [e for p, e in _events(timeline) if p == "tensile"]
    # job 2 arrives only after job 1 is ready (and has trained 2 steps); job 1 outlives it
    assert events.index("ready mobilenet_v2-1") < events.index("arrive mobilenet_v2-2")
    assert events.index("exit mobilenet_v2-2") < events.index("exit mobilenet_v2-1")


# --------------------------------------------------------------------------- pieces

def test_streamed_optimizer_jobs_train_under_the_scheduler(tmp_path):
    """--stream-optimizer: TENSILE's jobs update in backward with Adam's moments in host
    memory; with --stream-resident auto each job chooses its resident groups for the
    setting's two jobs on one link (tensile.tune_resident); both phases finish. Here with
    --optimizer adam_fused (every job of both phases; the setting names it)."""
    args = ["--scenario", "copies", "--models", "mobilenet_v2", "--copies", "2", "--optimizer", "adam_fused",
            "--stream-optimizer", "4", "--stream-prefetch", "2", "--stream-resident", "auto",
            "--stream-overhead", "0.1", "--stream-chunk", "0.01", "--compact", "tensile",
            "--results-dir", str(tmp_path), *SMOKE]
    assert tm.main(args) == 0
    rows = {r["backend"]: r for r in _rows(tmp_path)}
    assert set(rows) == {"mobilenet_v2-1", "mobilenet_v2-2", "GPU"}
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
        assert r["mode"] == ("copies:mobilenet_v2x2,img=32,opt=adam_fused,stream_optimizer=4,stream_prefetch=2,"
                             "stream_resident=auto,stream_overhead=0.1,stream_chunk=0.01,"
                             "compact=tensile")
    n_params = len(list(models.build_model("mobilenet_v2", num_classes=10).parameters()))
    for job in ("mobilenet_v2-1", "mobilenet_v2-2"):
        e = rows[job]["extra"]
        assert e["measured_iters_tensile"] == e["measured_iters_vanilla"] > 0
        assert math.isfinite(e["loss_tensile"])
        # --compact tensile: TENSILE's jobs moved at least their parameters after the first
        # step (their streamed state is on the host), the vanilla jobs nothing
        assert e["compacted_tensile"]["moved"] >= n_params and e["compacted_vanilla"] is None
        tuned = e["stream_tuned"]
        assert tuned["jobs"] == 2 and tuned["max_overhead"] == 0.1 and 0 <= tuned["resident"] <= 4
        assert tuned["delay_ms"] <= 0.1 * tuned["step_ms"] + 1e-6


def test_jobs_rebuild_recomputed_batch_norms_from_their_statistics(tmp_path):
    """--bn-from-stats: TENSILE's jobs hand batch_norm_from_stats=True to their Scheduler, which
    then measures what rebuilding each batch norm from its statistics costs (the share the
    planner prices those recomputes at, in the rows); both phases train to a finite loss. The
    rows list what each job's plan recomputes, by op."""
    args = ["--scenario", "copies", "--models", "mobilenet_v2", "--copies", "2",
            "--budget-share", "0.8", "--bn-from-stats", "--results-dir", str(tmp_path), *SMOKE]
    assert tm.main(args) == 0
    rows = {r["backend"]: r for r in _rows(tmp_path)}
    assert set(rows) == {"mobilenet_v2-1", "mobilenet_v2-2", "GPU"}
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
        assert r["mode"] == "copies:mobilenet_v2x2,img=32,budget_share=0.8,bn_from_stats"
    for job in ("mobilenet_v2-1", "mobilenet_v2-2"):
        e = rows[job]["extra"]
        assert math.isfinite(e["loss_tensile"])
        assert e["bn_rerun_share_median"] > 0     # measured: the Scheduler had the option on
        assert sum(e["recomputes_by_op"].values()) == e["recomputes_planned"]


def test_settings_follow_the_scenario_rules(monkeypatch):
    opts = tm.Options(warmup=5, iters=30, image_size=224, budget_bytes=2**30)
    copies = tm.build_settings("copies", ["vgg16", "resnet50"], [1, 3], opts)
    assert [s.label for s in copies] == ["copies:vgg16x1,budget=1073741824",
                                         "copies:vgg16x3,budget=1073741824",
                                         "copies:resnet50x1,budget=1073741824",
                                         "copies:resnet50x3,budget=1073741824"]
    assert [j.job_id for j in copies[1].jobs] == ["vgg16-1", "vgg16-2", "vgg16-3"]
    cut = tm.build_settings("copies", ["vgg16"], [2], tm.Options(image_size=224, budget_share=0.8))
    assert [s.label for s in cut] == ["copies:vgg16x2,budget_share=0.8"]
    low = tm.build_settings("copies", ["vgg16"], [2], tm.Options(image_size=224, max_overhead=0.05))
    assert [s.label for s in low] == ["copies:vgg16x2,max_overhead=0.05"]
    shared = tm.build_settings("copies", ["vgg16"], [2], tm.Options(image_size=224, captured=True, mps=True))
    assert [s.label for s in shared] == ["copies:vgg16x2,captured,mps"]
    trimmed = tm.build_settings("copies", ["vgg16"], [1], tm.Options(image_size=224, trim_stack="all"))
    assert [s.label for s in trimmed] == ["copies:vgg16x1,trim_stack=all"]
    fused = tm.build_settings("copies", ["vgg16"], [1], tm.Options(image_size=224, optimizer="adam_fused"))
    assert [s.label for s in fused] == ["copies:vgg16x1,opt=adam_fused"]
    assert tm._payload(fused[0].jobs[0], fused[0], "vanilla", tm.Options(optimizer="adam_fused"),
                       {}, None)["optimizer"] == "adam_fused"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)   # read first: it would hide the next
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the jobs inherit it
    assert [s.label for s in tm.build_settings("copies", ["vgg16"], [1],
                                               tm.Options(device="cuda", image_size=224))
            ] == ["copies:vgg16x1,expandable"]
    assert [s.label for s in tm.build_settings("copies", ["vgg16"], [1], tm.Options(image_size=224))
            ] == ["copies:vgg16x1"]               # a CPU smoke run has no CUDA allocator to name
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert [tm._payload(trimmed[0].jobs[0], trimmed[0], ph, tm.Options(trim_stack=which), {}, None)
            ["trim_stack"] for which in ("none", "tensile", "all") for ph in ("vanilla", "tensile")
            ] == [False, False, False, True, True, True]
    packed = tm.build_settings("copies", ["vgg16"], [1],
                               tm.Options(image_size=224, trim_stack="tensile", compact="tensile"))
    assert [s.label for s in packed] == ["copies:vgg16x1,trim_stack=tensile,compact=tensile"]
    assert [tm._payload(packed[0].jobs[0], packed[0], ph, tm.Options(compact=which), {}, None)
            ["compact"] for which in ("none", "tensile", "all") for ph in ("vanilla", "tensile")
            ] == [False, False, False, True, True, True]
    lean = tm.build_settings("copies", ["vgg16"], [1], tm.Options(
        image_size=224, trim_stack="tensile", compact="tensile", trim_blas="all"))
    assert [s.label for s in lean] == ["copies:vgg16x1,trim_stack=tensile,compact=tensile,trim_blas=all"]
    assert [tm._payload(lean[0].jobs[0], lean[0], ph, tm.Options(trim_blas=which), {}, None)
            ["trim_blas"] for which in ("none", "tensile", "all") for ph in ("vanilla", "tensile")
            ] == [False, False, False, True, True, True]
    rebuilt = tm.build_settings("copies", ["vgg16"], [2], tm.Options(image_size=224, bn_from_stats=True))
    assert [s.label for s in rebuilt] == ["copies:vgg16x2,bn_from_stats"]
    assert [tm._payload(rebuilt[0].jobs[0], rebuilt[0], ph, tm.Options(bn_from_stats=on), {}, None)
            ["bn_from_stats"] for on in (False, True) for ph in ("vanilla", "tensile")
            ] == [False, False, True, True]
    assert all(s.arrive_every is None and j.steps == 35 for s in copies for j in s.jobs)
    (dyn,) = tm.build_settings("dynamic", ["vgg16", "resnet50", "vgg16"], [1], opts)
    assert [(j.job_id, j.steps, j.until_stop) for j in dyn.jobs] == [
        ("vgg16-1", 35, True), ("resnet50-1", 20, False), ("vgg16-2", 35, True)]
    assert dyn.arrive_every == 5


def test_replans_and_their_planner_times_come_from_the_scheduler_log(tmp_path):
    log = tmp_path / "scheduler.log"
    log.write_text(
        "INFO job a-1 registered: 812 ops, weight 1\n"
        "INFO re-plan v1 (arrival of a-1): 1 jobs, joint peak 10.0 -> 8.0 MiB (sum of job "
        "peaks 10.0 MiB), budget none, feasible True, 212.5 ms\n"
        "INFO re-plan v2 (a-1 retimed (14.36 ms per iteration); departure of b-2 (left)): 2 jobs, "
        "joint peak 20.0 -> 16.0 MiB (sum of job peaks 21.0 MiB), budget 17.0 MiB, "
        "feasible False, 7034.0 ms\n")
    assert tm._scheduler_replans(log) == [
        tm.Replan("arrival of a-1", 212.5),
        tm.Replan("a-1 retimed (14.36 ms per iteration); departure of b-2 (left)", 7034.0)]
    assert tm._scheduler_replans(tmp_path / "none.log") == []


def test_capture_seconds_per_job_from_the_timeline_events():
    samples = [("tensile", t, 0, e) for t, e in (
        (1.0, "capture a-1"), (1.5, "capture a-2"), (4.0, "captured a-1"), (4.5, ""),
        (9.5, "captured a-2"), (20.0, "capture a-1"), (20.5, "captured a-1"))]
    samples.append(("vanilla", 1.0, 0, "capture a-1"))   # another phase, never captured
    assert tm.capture_seconds(samples, "tensile") == {"a-1": [3.0, 0.5], "a-2": [8.0]}
    assert tm.capture_seconds(samples, "vanilla") == {}


def test_settle_index():
    assert tm.settle_index([50, 30, 11, 10, 10.5, 9.5], 10) == 2
    assert tm.settle_index([10, 10, 10], 10) == 0
    assert tm.settle_index([10, 10, 20], 10) is None   # the last one is off: never settled


def test_steady_peaks_leave_the_steps_that_captured_out():
    """A capture's set-up peak (the timing graph, the warm-up's copies) does not count;
    the steps before and after it do, and a replayed graph counts with its capture's peak."""
    stats = {"alloc": 0.0, "reserved": 0.0}
    resets = []

    def run(alloc, reserved):   # a step that peaks at these (the allocator's running max)
        stats["alloc"], stats["reserved"] = max(stats["alloc"], alloc), max(stats["reserved"], reserved)

    def reset():
        resets.append(1)
        stats["alloc"] = stats["reserved"] = 0.0

    steady = tm.SteadyPeaks(lambda: (stats["alloc"], stats["reserved"]), reset)
    for captured, alloc, reserved, graph in [(False, 500, 600, None),   # an uncaptured step
                                             (True, 900, 1400, 300),    # captures: set-up peak
                                             (False, 310, 700, 300),    # replays that graph
                                             (False, 310, 650, 300)]:
        before = (stats["alloc"], stats["reserved"])
        run(alloc, reserved)
        steady.add(before, captured, graph)
    assert steady.result() == (500, 700)   # neither 900 nor 1400
    assert len(resets) == 1
    # a graph whose capture peaked above every uncaptured step sets the allocated peak
    late = tm.SteadyPeaks(lambda: (stats["alloc"], stats["reserved"]), reset)
    late.add((0, 0), True, 800)
    assert late.result()[0] == 800


def test_job_summary_times_exclude_capture_steps():
    result = {"iter_ms": [90, 10, 400, 10, 12, 350, 11], "warmup": 2, "capture_steps": [1, 2, 5]}
    s = tm._job_summary(result)
    assert s["iters"] == 3 and s["median"] == 11 and s["captures"] == 2 and s["capture_ms"] == 750
    with pytest.raises(ValueError, match="no measured step without a capture"):
        tm._job_summary({"iter_ms": [9, 9, 9], "warmup": 2, "capture_steps": [2]})


def test_phase_memory_leaves_start_ups_out_of_the_steady_peak():
    mb = tm.MB
    samples = [("tensile", 0.0, 100 * mb, ""), ("tensile", 0.1, 100 * mb, "arrive a"),
               ("tensile", 0.2, 900 * mb, ""),                     # a records: vanilla memory
               ("tensile", 0.3, 300 * mb, "ready a"), ("tensile", 0.4, 400 * mb, ""),
               ("tensile", 0.5, 400 * mb, "exit a"), ("vanilla", 0.0, 5 * mb, "")]
    mem = tm.phase_memory(samples, "tensile")
    assert mem == {"idle_mb": 100.0, "peak_all_mb": 900.0, "peak_mb": 400.0}
    assert tm.phase_memory(samples, "nothing")["peak_mb"] is None
    # --captured: a step that captured a graph is set-up too; a job reports its span after
    # the fact, so its two events come after the samples they enclose
    captured = samples[:5] + [("tensile", 0.45, 700 * mb, ""), ("tensile", 0.5, 400 * mb, "exit a"),
                              ("tensile", 0.42, 400 * mb, "capture a"),
                              ("tensile", 0.47, 400 * mb, "captured a")]
    mem = tm.phase_memory(captured, "tensile")
    assert mem == {"idle_mb": 100.0, "peak_all_mb": 900.0, "peak_mb": 400.0}


def test_a_jobs_warm_up_is_start_up_when_it_says_measuring():
    """Warm-up steps (a captured job's uncaptured first steps) stay out of the
    steady peak; a timeline without ``measuring`` ends the start-up at ``ready``."""
    mb = tm.MB
    samples = [("tensile", 0.0, 100 * mb, ""), ("tensile", 0.1, 100 * mb, "arrive a"),
               ("tensile", 0.3, 300 * mb, "ready a"), ("tensile", 0.4, 800 * mb, ""),  # warm-up
               ("tensile", 0.5, 300 * mb, "measuring a"), ("tensile", 0.6, 400 * mb, ""),
               ("tensile", 0.7, 400 * mb, "exit a")]
    assert tm.phase_memory(samples, "tensile")["peak_mb"] == 400.0
    old = [s for s in samples if s[3] != "measuring a"]
    assert tm.phase_memory(old, "tensile")["peak_mb"] == 800.0


def test_a_span_a_job_reports_lands_at_its_own_times():
    sampler = tm.MemorySampler("cpu")
    sampler.start("tensile")
    t0 = time.monotonic()
    sampler.mark_span("capture a", t0 + 0.5, t0 + 0.75)
    sampler.stop()
    (a, b) = [x for x in sampler.samples if x[3]]
    assert a[3] == "capture a" and b[3] == "captured a"
    assert a[1] == pytest.approx(0.5, abs=0.05) and b[1] - a[1] == pytest.approx(0.25)


def test_the_nvml_sampler_reads_the_gpu_the_jobs_run_on(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: ("index", i),
        nvmlDeviceGetHandleByUUID=lambda u: ("uuid", u),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=123 * tm.MB, handle=h))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    for cvd, gpu_index, handle in [(None, None, ("index", 0)), ("3,1", None, ("index", 3)),
                                   ("GPU-8f2e", None, ("uuid", "GPU-8f2e")),
                                   ("3", 1, ("index", 1))]:
        if cvd is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
        sampler = tm.MemorySampler("cuda", gpu_index)
        assert sampler.source == "nvml" and sampler._handle == handle
        assert sampler.read() == 123 * tm.MB
        sampler.start("vanilla")
        sampler.mark("arrive a")
        time.sleep(0.1)
        sampler.stop()
        sampler.close()
        assert ("vanilla", pytest.approx(0, abs=0.1), 123 * tm.MB, "arrive a") in sampler.samples
        assert sum(not e for *_, e in sampler.samples) >= 2   # sampled every ~20 ms
    assert calls.count("init") == calls.count("shutdown") == 4
    env = tm._child_env(tm.Options(device="cuda", gpu_index=1))
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


@pytest.mark.parametrize("argv, expected", [
    (["--scenario", "nope"], ["invalid choice: 'nope'", "copies", "mdw", "dynamic"]),
    (["--models", "vgg16"], ["--scenario is required; valid: copies, mdw, dynamic"]),
    (["--scenario", "copies", "--models", "vgg16,nope"], ["unknown model(s) ['nope']; valid: ",
                                                         "resnet50"]),
    (["--scenario", "copies", "--copies", "1,0"], ["expected positive integers separated by "
                                                   "commas, e.g. 1,2,3; got '1,0'"]),
    (["--scenario", "copies", "--warmup", "1"], ["--warmup must be >= 2", "got 1"]),
    (["--scenario", "copies", "--models", "vgg16,vgg16"], ["lists a model twice"]),
    (["--scenario", "mdw", "--models", "vgg16"], ["needs at least 2 models, got ['vgg16']"]),
    (["--scenario", "copies", "--budget", "lots"], ["expected bytes such as 40G", "'lots'"]),
    (["--scenario", "copies", "--budget", "1G", "--budget-share", "0.8"],
     ["give --budget or --budget-share, not both"]),
    (["--scenario", "copies", "--budget-share", "80"],
     ["--budget-share must be a share of the joint peak in (0, 1], got 80.0"]),
    (["--scenario", "copies", "--device", "gpu"], ["invalid choice: 'gpu'", "cuda", "cpu"]),
    (["--scenario", "copies", "--memory-gb", "8"], ["--memory-gb, --gpu-index, --captured, --mps, "
                                                    "--trim-stack and --trim-blas are for --device cuda"]),
    (["--scenario", "copies", "--captured"], ["--trim-blas are for --device cuda"]),
    (["--scenario", "copies", "--mps"], ["--trim-blas are for --device cuda"]),
    (["--scenario", "copies", "--trim-stack", "all"], ["--trim-blas are for --device cuda"]),
    (["--scenario", "copies", "--trim-blas", "tensile"], ["--trim-blas are for --device cuda"]),
    (["--scenario", "copies", "--trim-blas", "some"], ["invalid choice: 'some'", "none", "tensile",
                                                      "all"]),
    (["--scenario", "copies", "--trim-stack", "some"], ["invalid choice: 'some'", "none", "tensile",
                                                       "all"]),
    (["--scenario", "copies", "--stream-optimizer", "-1"], ["--stream-optimizer must be a number of parameter groups >= 0"]),
    (["--scenario", "copies", "--stream-optimizer", "4", "--stream-prefetch", "0"],
     ["--stream-prefetch must be a number of groups >= 1, got 0"]),
    (["--scenario", "copies", "--stream-optimizer", "4", "--stream-resident", "5"],
     ["--stream-resident must be a number of groups from 0 to --stream-optimizer, or auto, got 5"]),
    (["--scenario", "copies", "--stream-optimizer", "4", "--stream-resident", "most"],
     ["expected a number of groups or 'auto', got 'most'"]),
    (["--scenario", "copies", "--stream-resident", "auto"],
     ["--stream-resident auto chooses among --stream-optimizer's groups"]),
    (["--scenario", "copies", "--stream-optimizer", "4", "--stream-overhead", "2"],
     ["--stream-overhead must be a share of the step in [0, 1), got 2.0"]),
    (["--scenario", "copies", "--stream-chunk", "64"],
     ["--stream-chunk bounds the streamed optimizer's updates: give --stream-optimizer too"]),
    (["--scenario", "copies", "--stream-optimizer", "4", "--stream-chunk", "0"],
     ["expected a positive number, got '0'"]),
    (["--scenario", "copies", "--batch", "0"], ["expected a positive integer, got '0'"]),
    (["--scenario", "copies", "--models", "inception_v4,resnet50"],   # the CPU's 32 px
     ["inception_v4 needs inputs of at least 75 px a side (its own size is 299), got "
      "image_size=32 (--image-size; default 32 with --device cpu)"]),
    (["--scenario", "copies", "--optimizer", "sgd"],
     ["--optimizer: invalid choice: 'sgd'", "adam_fused"]),   # quoting differs by Python
    (["--scenario", "copies", "--gpu-index", "-1"], ["--gpu-index must be >= 0, got -1"]),
    (["--scenario", "copies", "--max-overhead", "1.5"], ["--max-overhead must be a share of the "
                                                         "iteration time in [0, 1), got 1.5"]),
])
def test_bad_command_lines_exit_2_naming_what_is_expected(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        tm.main(argv if "--device" in argv else [*argv, "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_on_a_host_without_one_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        tm.main(["--scenario", "copies", "--device", "cuda"])
    assert exc.value.code == 2
    assert "no usable CUDA GPU; for a smoke run use --device cpu" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("pynvml") is None,
                    reason="captured jobs replay CUDA graphs and the GPU's memory is read "
                           "through NVML: needs a CUDA GPU and nvidia-ml-py")
def test_captured_jobs_rebuild_batch_norms_from_statistics_under_a_budget(tmp_path):
    """--bn-from-stats with a budget: the captured jobs' plans rebuild batch norms from their
    statistics (CUDA: the Triton kernel) and train on to a finite loss within 1.5x vanilla."""
    args = ["--scenario", "copies", "--models", "resnet50", "--copies", "2", "--batch", "8",
            "--warmup", "4", "--iters", "10", "--timeout", "300", "--budget-share", "0.8",
            "--captured", "--bn-from-stats"]
    _, rows = _run_on_gpu(tmp_path, args, "copies:resnet50x2,budget_share=0.8,captured,bn_from_stats")
    for job in ("resnet50-1", "resnet50-2"):
        e = rows[job]["extra"]
        assert 0 < e["bn_rerun_share_median"] < 1
        assert any("batch_norm" in op for op in e["recomputes_by_op"]), e["recomputes_by_op"]
        assert math.isfinite(e["loss_tensile"])
        assert e["iter_ms_median_tensile"] < 1.5 * e["iter_ms_median_vanilla"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("pynvml") is None,
                    reason="captured jobs replay CUDA graphs and the GPU's memory is read "
                           "through NVML: needs a CUDA GPU and nvidia-ml-py")
def test_captured_jobs_replay_the_plan_the_scheduler_made_for_their_graphs(tmp_path):
    """--captured: every job captures its step after its first one; a TENSILE job sends
    the graph's op times to the scheduler (retimed) and captures the plan that comes back.
    One job: its measured steps are replays of one graph (with co-runners, a new plan
    mid-run means a capture among them)."""
    args = ["--scenario", "copies", "--models", "resnet50", "--copies", "1", "--batch", "2",
            "--warmup", "4", "--iters", "10", "--timeout", "300", "--max-overhead", "0.3",
            "--captured"]
    csv_path, rows = _run_on_gpu(tmp_path, args, "copies:resnet50x1,max_overhead=0.3,captured")
    assert set(rows) == {"resnet50-1", "GPU"}
    gpu = rows["GPU"]["extra"]
    assert gpu["replan_kinds"]["retimed"] == 1 and gpu["replan_kinds"]["first_measurement"] == 0
    # the steps that captured are set-up spans, left out of the steady NVML peak
    events = _events(csv_path.parent / gpu["timeline_csv"])
    for phase in ("vanilla", "tensile"):
        assert (phase, "capture resnet50-1") in events and (phase, "captured resnet50-1") in events
    e = rows["resnet50-1"]["extra"]
    assert e["measured_iters_tensile"] == 10 and e["replans"] == 1
    # no capture among the measured steps, so every peak is a replay's (the graph's own)
    assert e["measured_captures_tensile"] == 0 and e["measured_captures_vanilla"] == 0
    # both phases replay graphs: the plan's extra time is the GPU's, not the host's
    # (H200: 5.30 against 5.21 ms; the eager runtime's job took 2.4x its vanilla step)
    assert e["iter_ms_median_tensile"] < 1.5 * e["iter_ms_median_vanilla"]
    # where each capture's set-up went: the vanilla job's one capture, and the TENSILE
    # job's first (planned for the graph: timed, profiled, planned)
    assert [set(c) for c in e["capture_s_vanilla"]] == [{"warmup", "capture"}]
    first = e["capture_s_tensile"][0]
    assert set(first) == {"time_vanilla", "profile_ops", "plan", "warmup", "capture"}
    assert all(v > 0 for v in first.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("pynvml") is None
                    or not mps_available(),
                    reason="--mps runs the jobs under a CUDA MPS daemon: needs a CUDA GPU, "
                           "nvidia-ml-py and nvidia-cuda-mps-control")
def test_jobs_under_a_private_mps_daemon(tmp_path):
    """--mps: both phases' jobs are clients of one private daemon, which is gone afterwards."""
    import os
    args = ["--scenario", "copies", "--models", "resnet50", "--copies", "2", "--batch", "2",
            "--warmup", "4", "--iters", "10", "--timeout", "300", "--max-overhead", "0.3",
            "--captured", "--mps"]
    _, rows = _run_on_gpu(tmp_path, args, "copies:resnet50x2,max_overhead=0.3,captured,mps")
    assert set(rows) == {"resnet50-1", "resnet50-2", "GPU"}
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("pynvml") is None,
                    reason="trims the jobs' CUDA contexts and reads the GPU through NVML: needs a "
                           "CUDA GPU and nvidia-ml-py")
def test_trimmed_jobs_give_their_stack_back_and_train_on(tmp_path):
    """--trim-stack all: both phases' jobs release their thread-stack reservation after their
    first step (264 MiB on an H200), and hold that much less outside their allocator."""
    args = ["--scenario", "copies", "--models", "resnet50", "--copies", "1", "--batch", "2",
            "--warmup", "3", "--iters", "5", "--timeout", "300", "--trim-stack", "all"]
    _, rows = _run_on_gpu(tmp_path, args, "copies:resnet50x1,trim_stack=all")
    e = rows["resnet50-1"]["extra"]
    props = torch.cuda.get_device_properties(0)
    default_mb = 1024 * props.multi_processor_count * props.max_threads_per_multi_processor / 2**20
    for phase in ("vanilla", "tensile"):
        outside = e[f"outside_allocator_mb_{phase}"]
        assert e[f"stack_released_mb_{phase}"] >= default_mb, e
        # cudaMemGetInfo counts the device's 2 MiB pages
        assert outside["first_step"] - outside["trimmed"] >= e[f"stack_released_mb_{phase}"] - 2
        assert math.isfinite(e[f"loss_{phase}"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("pynvml") is None,
                    reason="trims the jobs' cuBLAS workspaces and reads the GPU through NVML: "
                           "needs a CUDA GPU and nvidia-ml-py")
def test_captured_jobs_give_back_their_blas_workspaces_and_train_on(tmp_path):
    """--trim-blas tensile --captured: the TENSILE job gives back its workspaces (two handles,
    4 MiB or more each) after its first step and captures afterwards; the vanilla job keeps
    them, and both train."""
    args = ["--scenario", "copies", "--models", "resnet50", "--copies", "1", "--batch", "2",
            "--warmup", "3", "--iters", "5", "--timeout", "300", "--captured",
            "--trim-blas", "tensile"]
    _, rows = _run_on_gpu(tmp_path, args, "copies:resnet50x1,captured,trim_blas=tensile")
    e = rows["resnet50-1"]["extra"]
    assert e["blas_released_mb_vanilla"] is None and e["blas_released_mb_tensile"] >= 8, e
    assert math.isfinite(e["loss_vanilla"]) and math.isfinite(e["loss_tensile"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("pynvml") is None,
                    reason="compacts jobs' CUDA memory before their graphs are captured: needs a "
                           "CUDA GPU and nvidia-ml-py")
def test_compacted_captured_jobs_give_back_segments_and_train_on(tmp_path):
    """--compact all with --captured and a streamed optimizer: both phases' jobs allocate
    their long-lived tensors again after the first step and before the capture; the TENSILE
    job's reservation shrinks (its state went to the host, leaving holes), and both train."""
    args = ["--scenario", "copies", "--models", "densenet121", "--copies", "1", "--batch", "2",
            "--warmup", "4", "--iters", "8", "--timeout", "300", "--captured",
            "--stream-optimizer", "8", "--compact", "all"]
    _, rows = _run_on_gpu(tmp_path, args, None)
    e = rows["densenet121-1"]["extra"]
    for phase in ("vanilla", "tensile"):
        c = e[f"compacted_{phase}"]
        assert c["moved"] > 0 and c["released_mb"] >= 0, c
        assert math.isfinite(e[f"loss_{phase}"])
    assert e["compacted_tensile"]["released_mb"] > 0


def test_a_failed_job_is_named_by_its_exception_not_the_traceback_after_it():
    """PyTorch appends the call's original traceback after a CUDA initialisation error: the
    reason names the error, not that traceback's last frame."""
    tail = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "RuntimeError: device >= 0 && device < num_gpus INTERNAL ASSERT FAILED. device=1, num_gpus=1\n\n"
            "CUDA call was originally invoked at:\n\n  File \"torch/cuda/__init__.py\", line 421\n"
            "    _queued_calls.append((callable, traceback.format_stack()))\n")
    o = tm.JobOutcome(spec=None, stderr_tail=tail)
    assert tm._failure(o) == ("exit code None: RuntimeError: device >= 0 && device < num_gpus "
                              "INTERNAL ASSERT FAILED. device=1, num_gpus=1")
    o.stderr_tail = "some warning\nlast words\n"
    assert tm._failure(o) == "exit code None: last words"
    o.stderr_tail = ""
    assert tm._failure(o) == "exit code None: no stderr"


def test_jobs_measured_together_have_no_steady_peak_after_the_first_exit():
    """With every job measuring together, samples after the first exit are not the whole
    set's: a setting whose jobs re-captured through all their measured steps (the H200's
    MDW run with 13 re-plans) has no steady peak, rather than the peak of the samples after
    the exits (which gave it an NVML MSR of 0.70)."""
    mb = tm.MB
    head = [("tensile", 0.0, 100 * mb, ""), ("tensile", 0.1, 100 * mb, "arrive a"),
            ("tensile", 0.1, 100 * mb, "arrive b"), ("tensile", 0.3, 900 * mb, "measuring a"),
            ("tensile", 0.3, 900 * mb, "measuring b"), ("tensile", 0.4, 900 * mb, "")]
    tail = [("tensile", 0.5, 900 * mb, "exit a"), ("tensile", 0.6, 300 * mb, ""),
            ("tensile", 0.7, 300 * mb, "exit b")]
    assert tm.phase_memory(head + tail, "tensile")["peak_mb"] == 900.0
    recaptured = head + [("tensile", 0.35, 900 * mb, "capture a"),
                         ("tensile", 0.45, 900 * mb, "captured a")] + tail
    assert tm.phase_memory(recaptured, "tensile")["peak_mb"] is None
    # jobs that come and go (no barrier): every steady sample counts, exits or not
    dynamic = [s for s in head + tail if not s[3].startswith("measuring")] + [
        ("tensile", 0.3, 900 * mb, "ready a"), ("tensile", 0.3, 900 * mb, "ready b")]
    assert tm.phase_memory(dynamic, "tensile")["peak_mb"] == 900.0


def test_a_captured_job_captures_a_plan_that_came_during_the_barrier_before_it_measures(capsys):
    """_settle: the plan pushed while a job waited at the barrier is captured before its
    measured steps (a 'captured' span the steady window leaves out); a current graph is
    not captured again; it gives up after a few tries."""
    class FakeScheduler:
        def __init__(self, stale_steps):
            self.stale, self.beats, self.steps = stale_steps, 0, 0

        def heartbeat(self):
            self.beats += 1

        @property
        def graph_is_current(self):
            return self.steps >= self.stale

        def step(self):
            self.steps += 1

    s = FakeScheduler(stale_steps=1)
    assert tm._settle(s, s.step, "a-1") == 1
    assert (s.steps, s.beats) == (1, 2)
    events = [json.loads(ln[len(tm.PREFIX):]) for ln in capsys.readouterr().out.splitlines()
              if ln.startswith(tm.PREFIX)]
    assert [e["event"] for e in events] == ["captured"] and events[0]["job"] == "a-1"
    assert events[0]["t0"] <= events[0]["t1"]
    current = FakeScheduler(stale_steps=0)
    assert tm._settle(current, current.step, "b-1") == 0
    assert current.steps == 0 and current.beats == 1
    never = FakeScheduler(stale_steps=99)
    assert tm._settle(never, never.step, "c-1", tries=3) == 3
    assert never.steps == 3


def test_warm_jobs_settle_in_rounds_until_none_captures_then_measure_together():
    """The harness side of the barrier: a round of 'settle' goes to every live job; the next
    starts only when all have answered; a round without captures (or the last allowed one)
    is followed by 'measure' for all."""
    class Pipe:
        def __init__(self):
            self.lines = []

        def write(self, text):
            self.lines.append(text.strip())

        def flush(self):
            pass

    class Marks:
        def __init__(self):
            self.events = []

        def mark(self, event):
            self.events.append(event)

    def job(name):
        o = tm.JobOutcome(tm.JobSpec(name, "m", 10))
        o.proc = type("P", (), {"stdin": Pipe()})()
        o.warm = True
        return o

    a, b = job("a-1"), job("b-1")
    marks, flags = Marks(), {}
    tm._settle_or_measure([a, b], marks, flags)
    assert a.proc.stdin.lines == b.proc.stdin.lines == ["settle"] and marks.events == ["settle round1"]
    a.settled, a.settle_captures = 1, 1
    tm._settle_or_measure([a, b], marks, flags)          # b has not answered: wait
    assert b.proc.stdin.lines == ["settle"]
    b.settled, b.settle_captures = 1, 0
    tm._settle_or_measure([a, b], marks, flags)          # a captured: another round
    assert a.proc.stdin.lines == ["settle", "settle"] and flags["settle_round"] == 2
    a.settled, a.settle_captures, b.settled = 2, 0, 2
    tm._settle_or_measure([a, b], marks, flags)
    assert a.proc.stdin.lines[-1] == b.proc.stdin.lines[-1] == "measure" and flags["measuring"]
    # a job that keeps capturing: measured anyway after MAX_SETTLE_ROUNDS rounds
    c, flags = job("c-1"), {}
    for r in range(1, tm.MAX_SETTLE_ROUNDS + 1):
        tm._settle_or_measure([c], marks, flags)
        assert c.proc.stdin.lines[-1] == "settle"
        c.settled, c.settle_captures = r, 1
    tm._settle_or_measure([c], marks, flags)
    assert c.proc.stdin.lines.count("settle") == tm.MAX_SETTLE_ROUNDS
    assert c.proc.stdin.lines[-1] == "measure"
