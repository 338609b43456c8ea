"""The Hydra app: config composition, fail-fast validation, the runner, timing and environment.

The runner is tested with a tiny model and fake backends substituted for the registries, so these
tests need neither the model zoo's large networks nor any optional backend library.
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from experiments import run
from experiments.env import environment, gpu_slug
from experiments.store import COLUMNS, ResultStore
from experiments.timing import measure, peak_memory

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
GROUPS = ["model", "backend", "experiment", "timing", "device"]
PRESETS = sorted(p.stem for p in (CONF / "sweep").glob("*.yaml"))
REQUIRED_BACKENDS = ["eager", "torchscript", "cudagraph", "inductor", "inductor-cudagraphs",
                     "inductor-max-autotune", "tensorrt", "tvm", "onnxruntime", "nimble",
                     "nimble-single"]


def _compose(overrides=(), hydra_cfg=False):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_cfg)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# --------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes(group):
    options = _options(group)
    assert options, f"conf/{group}/ is empty"
    for option in options:
        cfg = _compose([f"{group}={option}"])
        assert cfg[group].name == option


def test_backend_configs_cover_the_suite():
    assert set(REQUIRED_BACKENDS) <= set(_options("backend"))


def test_model_configs_match_the_registry():
    from experiments.models import MODELS
    assert set(_options("model")) == set(MODELS)
    for name, spec in MODELS.items():
        cfg = _compose([f"model={name}"])
        assert (cfg.model.image_size, cfg.model.num_classes) == (spec.image_size, spec.num_classes)


def test_defaults_are_the_full_timing_protocol():
    cfg = _compose()
    assert cfg.timing.warmup >= 50 and cfg.timing.iters >= 200
    assert list(cfg.backends) == ["eager"]  # one measurement: just the backend group's
    assert list(_compose(["backend=nimble"]).backends) == ["nimble"]
    quick = _compose(["timing=quick"]).timing
    assert (quick.warmup, quick.iters) == (3, 10)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_sweep_preset_composes_as_a_multirun(preset):
    cfg = _compose([f"+sweep={preset}"], hydra_cfg=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    params = cfg.hydra.sweeper.params
    models = str(params.model).split(",")
    assert models and set(models) <= set(_options("model"))
    assert all(int(b) > 0 for b in str(params.batch_size).split(","))
    assert set(cfg.backends) <= set(_options("backend"))
    # each job of the sweep composes too
    job = _compose([f"+sweep={preset}", f"model={models[-1]}"])
    assert job.model.name == models[-1]


def test_paper_presets_match_the_paper():
    from experiments.models import PAPER_INFERENCE_SET
    inf = _compose(["+sweep=paper_inference"], hydra_cfg=True)
    assert str(inf.hydra.sweeper.params.model).split(",") == PAPER_INFERENCE_SET
    assert str(inf.hydra.sweeper.params.batch_size) == "1"
    assert {"eager", "nimble", "nimble-single", "nimble-select", "tensorrt", "tvm",
            "torchscript"} <= set(inf.backends)   # nimble-select: the paper's conv selection
    train = _compose(["+sweep=paper_training"], hydra_cfg=True)
    assert train.experiment.name == "training"
    assert (train.experiment.image_size, train.experiment.num_classes) == (32, 10)
    assert str(train.hydra.sweeper.params.batch_size) == "32,64,128"
    abl = _compose(["+sweep=multistream_ablation"], hydra_cfg=True)
    assert {"nimble", "nimble-single"} <= set(abl.backends)


def test_launcher_configs_compose():
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    cfg = _compose(["hydra/launcher=local_gpus", "device.gpus=4"], hydra_cfg=True)
    assert cfg.hydra.launcher._target_.endswith("JoblibLauncher")
    assert cfg.hydra.launcher.n_jobs == 4


def test_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = _compose(["hydra/launcher=slurm_gpu"], hydra_cfg=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.gpus_per_node == 1


def test_sweep_size_counts_jobs_like_the_basic_sweeper():
    hc = _compose(["+sweep=paper_training"], hydra_cfg=True).hydra
    assert run.sweep_size(hc, argv=["+sweep=paper_training"]) == 9
    # command-line overrides win over the preset's params, per key
    assert run.sweep_size(hc, argv=["+sweep=paper_training", "batch_size=32"]) == 3
    plain = _compose(hydra_cfg=True).hydra
    assert run.sweep_size(plain, argv=["-m", "model=glob(*)", "backend=eager,nimble"]) == 2 * len(
        _options("model"))
    assert run.sweep_size(plain, argv=["-m", "model=glob(resnet*)", "batch_size=range(1,4)"]) == 6


def test_a_preset_and_a_command_line_sweep_multiply():
    # the README's fused-Adam commands: one model of the preset, both optimizers
    argv = ["-m", "+sweep=tensile_authors", "model=inception_v4", "experiment.stream_optimizer=16",
            "experiment.optimizer=adam,adam_fused"]
    hc = _compose(["+sweep=tensile_authors"], hydra_cfg=True).hydra
    assert run.sweep_size(hc, argv=argv) == 2
    assert run.sweep_size(hc, argv=argv[:-1]) == 1


# --------------------------------------------------------------------------- fakes

class Tiny(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def fake_models():
    spec = SimpleNamespace(name="tiny", image_size=8, num_classes=10)

    def build_model(name, *, num_classes=None):
        torch.manual_seed(0)
        return Tiny(num_classes or 10).eval()

    def example_input(name, batch_size, device="cpu", image_size=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, 3, image_size or 8, image_size or 8, generator=g).to(device)

    return SimpleNamespace(MODELS={"tiny": spec}, build_model=build_model, example_input=example_input,
                           check_image_size=lambda name, size: None)   # runs at any size


@dataclass
class PrepareResult:
    status: str
    fn: object = None
    reason: str = ""
    prepare_s: float = 0.0
    version: str = ""


class FakeBackend:
    supports_training = True

    def __init__(self, name, kind="ok"):
        self.name, self.kind = name, kind

    def version(self):
        return "0.0-fake"


def fake_backends(**kinds):
    """Backends: ``ok`` runs the model, ``wrong`` returns garbage, ``metrics`` exposes fn.extra,
    ``missing`` is unavailable, ``broken`` raises in prepare, ``crash`` raises when called."""
    registry = {name: (lambda name=name, kind=kind: FakeBackend(name, kind)) for name, kind in kinds.items()}

    def get_backend(name):
        return registry[name]()

    def try_prepare(backend, model, example_inputs, device, training=False):
        if backend.kind == "missing":
            return PrepareResult("unavailable", reason=f"{backend.name} is not installed here")
        if backend.kind == "broken":
            return PrepareResult("error", reason="RuntimeError: capture failed")
        fn = model
        if backend.kind == "wrong":
            fn = lambda x: model(x) + 1.0  # noqa: E731
        elif backend.kind == "crash":
            def fn(x):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        elif backend.kind == "metrics":
            def fn(x):
                return model(x)
            fn.extra = {"streams": 3, "syncs": 2, "graph_mem_mb": 99.0}
        return PrepareResult("ok", fn=fn, prepare_s=0.01, version="0.0-fake")

    return SimpleNamespace(BACKENDS=registry, get_backend=get_backend, try_prepare=try_prepare)


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setattr(run, "_models", fake_models)
    backends = fake_backends(eager="ok", nimble="metrics", wrong="wrong", tensorrt="missing",
                             tvm="broken", crashy="crash")
    monkeypatch.setattr(run, "_backends", lambda: backends)
    return backends


def _cpu_cfg(tmp_path, *overrides):
    return _compose(["device=cpu", "timing=quick", "model.name=tiny", f"results_dir={tmp_path}",
                     *overrides])


# --------------------------------------------------------------------------- validation

def _config_error(cfg, match):
    with pytest.raises(run.ConfigError, match=match):
        run.validate(cfg)


@pytest.mark.parametrize("value", ["0", "-5", "soon", "true"])
def test_backend_timeout_must_be_positive_seconds_or_null(fakes, tmp_path, value):
    _config_error(_cpu_cfg(tmp_path, f"backend_timeout_s={value}"),
                  r"backend_timeout_s must be a number of seconds > 0, or null")


def test_a_bad_backend_option_is_a_config_error(tmp_path):
    _config_error(_compose(["device=cpu", "backends=[eager,torchscript]", f"results_dir={tmp_path}",
                            "backend_options.torchscript.fuser=nnc"]),
                  r"backend torchscript: torchscript fuser must be one of .*got 'nnc'")
    _config_error(_compose(["device=cpu", "backends=[eager,tvm]", f"results_dir={tmp_path}",
                            "+backend_options.tvm.trials=5"]),
                  r"backend tvm: backend tvm takes the options \['source', .*got \['trials'\]")


def test_backend_options_reach_the_backend(tmp_path):
    cfg = _compose(["device=cpu", "backends=[torchscript]", "backend_options.torchscript.fuser=none",
                    f"results_dir={tmp_path}"])
    assert run.backend_options(cfg, "torchscript") == {"fuser": "none"}
    assert run.backend_options(cfg, "eager") == {}
    assert run.backend_options(cfg, "tvm-tuned") == {"tune_trials": 2000}


def test_backend_timeout_accepts_seconds_and_null(fakes, tmp_path):
    run.validate(_cpu_cfg(tmp_path, "backend_timeout_s=2.5"))
    run.validate(_cpu_cfg(tmp_path, "backend_timeout_s=null"))


def test_unknown_model_lists_valid_choices(fakes, tmp_path):
    _config_error(_cpu_cfg(tmp_path, "model.name=nope"), r"unknown model 'nope'; valid: tiny")


def test_unknown_backend_lists_valid_choices(fakes, tmp_path):
    _config_error(_cpu_cfg(tmp_path, "backends=[eager,bogus]"),
                  r"unknown backend\(s\) \['bogus'\]; valid: .*eager.*nimble")


@pytest.mark.parametrize("batch", [0, -1])
def test_nonpositive_batch_size_is_refused(fakes, tmp_path, batch):
    _config_error(_cpu_cfg(tmp_path, f"batch_size={batch}"), "batch_size must be a positive integer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without CUDA")
def test_cuda_on_a_cpu_host_suggests_device_cpu(fakes, tmp_path):
    _config_error(_compose(["model.name=tiny", f"results_dir={tmp_path}"]), "device=cpu")


def test_bad_training_knobs_are_refused(fakes, tmp_path):
    _config_error(_cpu_cfg(tmp_path, "experiment=training", "experiment.optimizer=lbfgs"),
                  "valid: sgd, adam")
    _config_error(_cpu_cfg(tmp_path, "experiment=training", "experiment.mode=fwd"),
                  "valid: fwd-bwd, whole-step")


def test_hydra_lists_group_options_for_an_unknown_config():
    from hydra.errors import MissingConfigException
    with pytest.raises(MissingConfigException, match="resnet50"):
        _compose(["model=nope"])


# --------------------------------------------------------------------------- the runner

def test_runner_writes_one_row_per_backend_with_reasons(fakes, tmp_path):
    cfg = _cpu_cfg(tmp_path, "backends=[eager,nimble,tensorrt,tvm,wrong,crashy]", "batch_size=2")
    printed = []
    rows = run.run_config(cfg, on_row=printed.append)
    assert [r["backend"] for r in rows] == ["eager", "nimble", "tensorrt", "tvm", "wrong", "crashy"]
    by = {r["backend"]: r for r in rows}
    assert by["eager"]["status"] == "ok" and float(by["eager"]["median_ms"]) > 0
    assert by["eager"]["iters"] == "10" and by["eager"]["device"] == "cpu" and by["eager"]["gpu"] == "cpu"
    extra = json.loads(by["nimble"]["extra"])
    assert extra["streams"] == 3 and extra["graph_mem_mb"] == 99.0  # backend metrics land in extra
    assert by["nimble"]["graph_mem_mb"] == ""  # ... never over a measured column (CPU: not measured)
    assert by["tensorrt"]["status"] == "unavailable" and "not installed" in by["tensorrt"]["reason"]
    assert by["tvm"]["status"] == "error" and "capture failed" in by["tvm"]["reason"]
    assert by["wrong"]["status"] == "error" and "differs from eager" in by["wrong"]["reason"]
    assert by["crashy"]["status"] == "error" and "illegal memory access" in by["crashy"]["reason"]
    stored = ResultStore(tmp_path / "cpu" / "inference.csv").rows()
    assert len(stored) == 6 and set(stored[0]) == set(COLUMNS)
    assert len(printed) == 6 and "median" in run.format_row(printed[0])
    assert "unavailable" in run.format_row(by["tensorrt"])


def test_memory_that_falls_during_prepare_is_no_graph_size(fakes, tmp_path, monkeypatch):
    held = iter([500.0, 400.0, 300.0, 350.0])  # before/after prepare, per backend
    monkeypatch.setattr(run, "allocated_mb", lambda device: next(held))
    rows = run.run_config(_cpu_cfg(tmp_path, "backends=[eager,nimble]"))
    fell, grew = rows
    assert fell["graph_mem_mb"] == "" and "fell by 100.0 MiB" in json.loads(fell["extra"])["graph_mem_note"]
    assert float(grew["graph_mem_mb"]) == 50.0 and "graph_mem_note" not in json.loads(grew["extra"])


def test_rows_carry_the_host_load(fakes, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 1.0, 1.0))
    row, = run.run_config(_cpu_cfg(tmp_path, "backends=[eager]"))
    extra = json.loads(row["extra"])
    assert extra["host_load_1m"] == 7.5 and extra["cpus"] == len(os.sched_getaffinity(0))


def test_rerun_skips_measured_rows_and_redo_measures_again(fakes, tmp_path):
    cfg = _cpu_cfg(tmp_path, "backends=[eager,nimble]")
    assert len(run.run_config(cfg)) == 2
    assert run.run_config(cfg) == []  # everything already measured
    more = _cpu_cfg(tmp_path, "backends=[eager,nimble,tensorrt]")
    assert [r["backend"] for r in run.run_config(more)] == ["tensorrt"]
    again = _cpu_cfg(tmp_path, "backends=[eager]", "redo=true")
    assert len(run.run_config(again)) == 1
    assert len(ResultStore(tmp_path / "cpu" / "inference.csv").rows()) == 4


def test_a_quick_row_does_not_satisfy_the_full_protocol(fakes, tmp_path):
    run.run_config(_cpu_cfg(tmp_path, "backends=[eager]"))
    full = _cpu_cfg(tmp_path, "backends=[eager]", "timing.iters=12", "timing.warmup=0")
    assert len(run.run_config(full)) == 1


def test_model_name_is_handed_to_the_backend(fakes, tmp_path, monkeypatch):
    seen = []
    original = fakes.try_prepare

    def spy(backend, model, example_inputs, device, training=False):
        seen.append(getattr(model, "_suite_name", None))
        return original(backend, model, example_inputs, device, training)
    monkeypatch.setattr(fakes, "try_prepare", spy)
    run.run_config(_cpu_cfg(tmp_path, "backends=[eager]"))
    assert seen == ["tiny"]


def test_training_fwd_bwd_takes_optimizer_steps(fakes, tmp_path):
    cfg = _cpu_cfg(tmp_path, "experiment=training", "batch_size=4", "backends=[eager,tensorrt,nimble]")
    rows = run.run_config(cfg)
    assert [r["status"] for r in rows] == ["ok", "unavailable", "ok"]
    assert rows[0]["mode"] == "fwd-bwd" and rows[0]["experiment"] == "training"
    extra = json.loads(rows[2]["extra"])
    assert extra["streams"] == 3                            # the backend's metrics survive the step
    assert 0 < extra["critical_path_ms"] <= extra["kernel_sum_ms"]   # and the step's limit
    assert "critical_path_ms" not in json.loads(rows[0]["extra"])   # (Nimble rows only)
    assert (tmp_path / "cpu" / "training.csv").exists()


def test_whole_step_needs_a_capturing_backend(fakes, tmp_path):
    cfg = _cpu_cfg(tmp_path, "experiment=training", "experiment.mode=whole-step",
                   "backends=[eager,nimble]")
    rows = run.run_config(cfg)
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"] == "unavailable" and "prepare_step" in rows[1]["reason"]


def test_output_error():
    a = torch.tensor([1.0, -2.0])
    assert run.output_error(a, a.clone()) == 0.0
    assert run.output_error(a, a + 0.2) == pytest.approx(0.1)
    assert run.output_error((a,), (a, a)) == math.inf
    assert run.output_error(a, a[:1]) == math.inf


def _claim(lock_dir, barrier, queue):
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        queue.put(run.claim_gpu(2, Path(lock_dir)))
    except RuntimeError as exc:
        queue.put(str(exc))
    barrier.wait(30)  # hold the claim until every worker has tried


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.is_initialized(),
                    reason="forked workers must not inherit an initialised CUDA context")
def test_each_worker_claims_a_distinct_gpu(tmp_path):
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), barrier, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
    assert sorted(g for g in got if isinstance(g, int)) == [0, 1]
    assert any(isinstance(g, str) and "claimed by other workers" in g for g in got)


# --------------------------------------------------------------------------- timing and env

def test_measure_on_cpu_times_each_call():
    calls = []

    def fn(x):
        calls.append(x)
        time.sleep(0.002)
    t = measure(fn, (1,), warmup=2, iters=5, device="cpu")
    assert len(calls) == 7 and len(t.samples) == 5
    assert 1.5 < t.median_ms < 50 and t.p10_ms <= t.median_ms <= t.p90_ms
    assert t.wall_ms == pytest.approx(t.median_ms)
    with pytest.raises(ValueError, match="iters must be >= 1"):
        measure(fn, (1,), warmup=0, iters=0, device="cpu")
    assert math.isnan(peak_memory(fn, (1,), device="cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_on_cuda_uses_events():
    a = torch.randn(2048, 2048, device="cuda")
    t = measure(lambda m: m @ m, (a,), warmup=3, iters=20, device="cuda")
    assert t.median_ms > 0 and len(t.samples) == 20
    assert peak_memory(lambda m: m @ m, (a,), device="cuda") >= 32  # a and the result: 16 MB each


def test_gpu_slug_and_environment():
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    assert gpu_slug("Tesla V100-SXM2-16GB") == "v100-sxm2-16gb"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert gpu_slug("cpu") == "cpu"
    env = environment("cpu")
    assert env["gpu"] == "cpu" and env["device"] == "cpu"
    for key in ["torch", "python", "commit", "date", "host", "tf32_matmul", "cudnn_benchmark"]:
        assert key in env


# --------------------------------------------------------------------------- the real CLI

def _cli(*args, cwd=REPO, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_config_error_is_a_message_not_a_traceback(tmp_path):
    pytest.importorskip("baselines.base")
    res = _cli("device=cpu", "batch_size=0", f"results_dir={tmp_path}",
               f"hydra.run.dir={tmp_path}/out")
    assert res.returncode == 2
    assert "config error: batch_size must be a positive integer" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_cli_multirun_with_progress_and_resume(tmp_path):
    pytest.importorskip("baselines.base")
    args = ["-m", "device=cpu", "timing=quick", "model=mobilenet_v2", "experiment.image_size=32",
            "backend=eager", "batch_size=1,2", f"results_dir={tmp_path}",
            f"hydra.sweep.dir={tmp_path}/multirun"]
    res = _cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sweep: 100%" in res.stderr and "2/2" in res.stderr  # one bar with a total
    lines = [line for line in (res.stdout + res.stderr).splitlines() if "median" in line]
    assert len(lines) == 2
    rows = ResultStore(tmp_path / "cpu" / "inference.csv").rows()
    assert [(r["batch_size"], r["status"]) for r in rows] == [("1", "ok"), ("2", "ok")]
    again = _cli(*args)
    assert again.returncode == 0
    assert len(ResultStore(tmp_path / "cpu" / "inference.csv").rows()) == 2  # skipped


# --------------------------------------------------------------------------- reproduce, wheelhouse

def test_reproduce_plan_on_a_cuda_host_runs_every_sweep_through_hydra():
    from experiments import reproduce
    steps, skipped = reproduce.plan(cuda=True)
    commands = [" ".join(cmd) for _, cmd in steps]
    for sweep in reproduce.GPU_SWEEPS:
        assert any(f"-m experiments.run +sweep={sweep}" in c for c in commands)
        assert (CONF / "sweep" / f"{sweep}.yaml").exists()
    assert "experiments.analysis" in commands[0] and "experiments.report" in commands[-1]
    # Inception-v4 at the authors' MSR once more, with fc's state alone resident
    (v4,) = [c for c in commands if "+sweep=tensile_authors model=inception_v4" in c]
    assert v4.endswith("experiment.stream_optimizer=16 experiment.stream_resident=1")
    assert commands.index(v4) > commands.index(next(c for c in commands if c.endswith("+sweep=tensile_authors")))
    # ... and DenseNet-121 with recomputation only, its Adam state on the device
    (dn,) = [c for c in commands if "+sweep=tensile_authors model=densenet121" in c]
    assert dn.endswith("experiment.stream_optimizer=0 experiment.allow_swaps=false")
    assert commands.index(dn) > commands.index(v4)
    # ... and VGG-16 with fc6's Adam state in row slices, the last 7 kept on the device
    (vgg,) = [c for c in commands if "+sweep=tensile_authors model=vgg16" in c]
    assert "experiment.stream_slice_mb=32 experiment.stream_slice_resident=7" in vgg
    assert "experiment.stream_pace=true" in vgg   # the slices paced by one timed step
    assert "experiment.stream_optimizer=3 experiment.stream_resident=3" in vgg
    assert vgg.endswith("experiment.defer_wgrad_mb=64") and commands.index(vgg) > commands.index(dn)
    only = [" ".join(cmd) for _, cmd in reproduce.plan(cuda=True, sweeps=["tensile_single"])[0]]
    assert not any("tensile_authors" in c for c in only)
    multi = [c for c in commands if "-m experiments.tensile_multi --scenario" in c]
    assert len(multi) == 6
    # the setting that met the authors' several-jobs figures, as results/h200/README.md ran it
    assert "--budget-share 0.8" in multi[-3] and "--stream-resident 16" in multi[-3]
    assert "--captured" in multi[-3] and "--trim-blas tensile" in multi[-3]
    # ... VGG-16's, with chunked updates, and Inception-v4's, 7 of its 16 groups' state streamed
    # through one buffer and batch norms rebuilt from their statistics, both under expandable
    # segments set for those steps alone
    vgg, v4 = multi[-2:]
    assert all(c.startswith("env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ") for c in (vgg, v4))
    assert "--models vgg16 --copies 2,3" in vgg and "--stream-chunk 64" in vgg
    assert "--models inception_v4 --copies 2,3" in v4
    assert "--stream-prefetch 1 --stream-resident 9 --budget-share 0.83 --bn-from-stats" in v4
    assert not any("expandable" in c for c in multi[:-2])
    (headroom,) = [c for c in commands if "-m experiments.headroom" in c]
    assert "--batch 1,32" in headroom and "--results" in headroom
    (kernels,) = [c for c in commands if "-m experiments.kernels" in c]
    assert "nimble-inductor-freeze" in kernels and "--results" in kernels
    (stack,) = [c for c in commands if "-m experiments.stack_trim" in c]
    assert "--results" in stack
    plain, streamed = [c for c in commands if "-m experiments.tensile_plans" in c]
    assert "--stream-optimizer" not in plain and "--stream-optimizer 16" in streamed
    assert commands.index(plain) > max(i for i, c in enumerate(commands) if "+sweep=" in c)
    (bounds,) = [c for c in commands if "-m experiments.tensile_bounds" in c]
    assert commands.index(bounds) > max(i for i, c in enumerate(commands) if "+sweep=" in c)
    assert skipped == []


@pytest.mark.parametrize("has_mps", [True, False])
def test_reproduce_runs_the_authors_several_jobs_setting_through_mps_where_there_is_one(
        monkeypatch, has_mps):
    from experiments import mps, reproduce
    monkeypatch.setattr(mps, "available", lambda: has_mps)
    steps, _ = reproduce.plan(cuda=True)
    multi = [cmd for _, cmd in steps if "experiments.tensile_multi" in cmd]
    assert all(("--mps" in cmd) == has_mps for cmd in multi[-3:])
    assert not any("--mps" in cmd for cmd in multi[:-3])


def test_reproduce_plan_without_cuda_says_what_it_does_not_run():
    from experiments import reproduce
    steps, skipped = reproduce.plan(cuda=False)
    commands = [" ".join(cmd) for _, cmd in steps]
    assert not any("+sweep=" in c for c in commands)
    assert any("device=cpu" in c and "timing=quick" in c for c in commands)
    assert sum("-m experiments.tensile_plans --gpu h200" in c for c in commands) == 2
    assert sum("-m experiments.tensile_bounds --gpu h200" in c for c in commands) == 1
    assert "experiments.report" in commands[-1]
    assert all(any(s in line for line in skipped) for s in reproduce.GPU_SWEEPS)
    assert sum("TENSILE, several jobs" in line for line in skipped) == 6
    assert any("concurrency headroom" in line for line in skipped)
    assert any("kernel census" in line for line in skipped)
    assert any("thread-stack memory (experiments/stack_trim.py)" in line for line in skipped)
    assert all("needs a CUDA GPU" in line for line in skipped[:-1])
    with pytest.raises(ValueError, match="unknown sweep"):
        reproduce.plan(cuda=True, sweeps=["nope"])


def test_reproduce_dry_run_prints_the_plan(capsys):
    from experiments import reproduce
    assert reproduce.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "experiments.report" in out
    if not torch.cuda.is_available():
        assert "NOT RUN on this host" in out


def test_wheelhouse_pins_the_tested_versions_and_explains_offline_install():
    from importlib import metadata

    from experiments import wheelhouse
    assert wheelhouse.requirement("hydra-core") == f"hydra-core=={metadata.version('hydra-core')}"
    assert wheelhouse.requirement("surely-not-installed-pkg") == "surely-not-installed-pkg"
    text = wheelhouse.install_instructions(".whl")
    assert "--no-index --find-links .whl" in text and "PYTHONPATH=/tmp/site" in text
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime"} <= set(wheelhouse.PACKAGES)


@pytest.mark.slow
def test_cli_joblib_launcher_runs_jobs_in_parallel_workers(tmp_path):
    pytest.importorskip("baselines.base")
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    res = _cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "device=cpu", "timing=quick",
               "model=mobilenet_v2", "experiment.image_size=32", "backend=eager", "batch_size=1,2,3",
               f"results_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/multirun")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = ResultStore(tmp_path / "cpu" / "inference.csv").rows()
    assert sorted(r["batch_size"] for r in rows) == ["1", "2", "3"]
    assert all(r["status"] == "ok" for r in rows)


def test_backend_analysis_goes_into_extra_and_never_sinks_a_row():
    def fn():
        pass
    assert run._analysis_of(fn, 1.0) == {}
    fn.analyze = lambda median_ms: {"over_critical_path": median_ms / 0.5}
    assert run._analysis_of(fn, 1.0) == {"over_critical_path": 2.0}
    fn.analyze = lambda median_ms: 1 / 0
    assert "ZeroDivisionError" in run._analysis_of(fn, 1.0)["analysis_error"]


def test_summarize_ms_gives_the_row_statistics():
    from experiments.timing import summarize_ms
    s = summarize_ms([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s == {"median_ms": 3.0, "p10_ms": 1.4, "p90_ms": 61.6, "mean_ms": 22.0,
                 "std_ms": round(statistics.stdev([1, 2, 3, 4, 100]), 4)}
    assert summarize_ms([2.5])["std_ms"] == 0.0


# --------------------------------------------------------------------------- stuck backends

# A backend that never returns from prepare (as TorchScript on DenseNet-121 did on CUDA),
# registered in a child process that then runs the ordinary CLI entry point.
_STUCK_CHILD = """
import sys, time
from baselines.base import Backend, register_backend
class Stuck(Backend):
    name = "stuck"
    def prepare(self, model, example_inputs, training=False):
        time.sleep(3600)
register_backend("stuck", Stuck)
sys.argv = ["experiments.run", *sys.argv[1:]]
from experiments.run import main
main()
"""


def test_a_stuck_backend_becomes_an_error_row_and_the_sweep_resumes(tmp_path):
    pytest.importorskip("baselines.base")
    args = ["device=cpu", "timing=quick", "model=mobilenet_v2", "experiment.image_size=32",
            "backends=[stuck,eager]", "backend_timeout_s=3", f"results_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}/out"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = lambda: subprocess.run([sys.executable, "-c", _STUCK_CHILD, *args], cwd=REPO, env=env,  # noqa: E731
                                 capture_output=True, text=True, timeout=240)
    t0 = time.monotonic()
    res = run()
    assert res.returncode == 124, res.stderr[-3000:]
    assert time.monotonic() - t0 < 200  # stopped, not slept out
    assert "did not finish within 3 s" in res.stderr
    assert "in prepare" in res.stderr  # faulthandler's stacks name the stuck frame
    rows = ResultStore(tmp_path / "cpu" / "inference.csv").rows()
    assert [(r["backend"], r["status"]) for r in rows] == [("stuck", "error")]
    assert "backend_timeout_s" in rows[0]["reason"] and "stuck on mobilenet_v2 b=1" in rows[0]["reason"]
    again = run()  # the same command goes on: the stuck backend is skipped, eager runs
    assert again.returncode == 0, again.stderr[-3000:]
    rows = ResultStore(tmp_path / "cpu" / "inference.csv").rows()
    assert [(r["backend"], r["status"]) for r in rows] == [("stuck", "error"), ("eager", "ok")]


def test_watchdog_is_silent_when_the_body_finishes_in_time():
    from experiments.watchdog import stop_if_stuck
    called = []
    with stop_if_stuck(0.5, called.append):
        pass
    time.sleep(0.8)
    assert called == []  # the timer was cancelled
    with stop_if_stuck(None, called.append):  # disabled
        time.sleep(0.01)
    assert called == []


def test_device_allocator_restarts_the_command_under_that_allocator(monkeypatch):
    """PyTorch picks its allocator when torch is imported: the command starts itself again
    under the asked one, or says how to start it where a restart cannot work."""
    cfg = _compose(["device=cuda", "device.allocator=cudaMallocAsync"])
    monkeypatch.setattr(run.torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(run.torch.cuda, "is_initialized", lambda: False)
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", run.RESTARTED_FOR_ALLOCATOR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(run.MAIN_PID, str(os.getpid()))
    started = []
    monkeypatch.setattr(run.os, "execve", lambda exe, argv, env: started.append((exe, argv, env)))
    run.choose_allocator(cfg)
    ((exe, argv, env),) = started
    assert exe == sys.executable and argv[1:] == sys.orig_argv[1:]
    assert env["PYTORCH_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert env[run.RESTARTED_FOR_ALLOCATOR] == "cudaMallocAsync"

    monkeypatch.setenv(run.RESTARTED_FOR_ALLOCATOR, "cudaMallocAsync")     # restarted, still native
    with pytest.raises(run.ConfigError, match="it was restarted for that already.*"
                                              "PYTORCH_ALLOC_CONF=backend:cudaMallocAsync"):
        run.choose_allocator(cfg)
    monkeypatch.delenv(run.RESTARTED_FOR_ALLOCATOR)
    monkeypatch.setenv(run.MAIN_PID, "1")                                  # a launcher's worker
    with pytest.raises(run.ConfigError, match="a launcher's worker process"):
        run.choose_allocator(cfg)
    with pytest.raises(run.ConfigError, match="expected one of native, cudaMallocAsync"):
        run.choose_allocator(_compose(["device=cuda", "device.allocator=async"]))
    assert run.choose_allocator(_compose(["device=cuda"])) == "native"     # running it: no restart
    assert run.choose_allocator(_compose(["device=cpu"])) is None
    assert len(started) == 1
