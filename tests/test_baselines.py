"""The baseline adapters on CPU: outputs equal eager's, unavailable backends say why,
failures become rows, and TVM artifacts built here load with the runtime alone.

Tolerance for "equal to eager": ``torch.testing.assert_close(rtol=1e-4, atol=1e-5)`` on
fp32 logits of magnitude ~1 (what reassociated fp32 sums differ by; a wrong weight or a
stale BatchNorm statistic is off by orders of magnitude more).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from baselines import (BACKENDS, Availability, Backend, BackendUnavailable, get_backend, register_backend,
                       try_prepare)
from baselines.torch_backends import TorchScriptBackend, jit_fuser

ROOT = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-4, 1e-5
HAVE_TVM = importlib.util.find_spec("tvm") is not None
HAVE_ORT = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None
needs_tvm = pytest.mark.skipif(not HAVE_TVM, reason="apache-tvm is not installed")


class Branchy(nn.Module):
    """Two conv branches, concatenated, BatchNorm, pooling, linear: the smallest model with
    independent branches and BatchNorm statistics that matter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(torch.cat([self.a(x), self.b(x)], dim=1))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def _randomise_bn(model: nn.Module, seed: int) -> nn.Module:
    """Non-trivial running statistics, so a backend that ignores or bakes them fails."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.eval()


def _branchy(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = _randomise_bn(Branchy(), seed)
    m._suite_name = "branchy"
    return m


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    m = _randomise_bn(torchvision.models.resnet18(num_classes=10), 1)
    m._suite_name = "resnet18"
    return m


MODELS = {"branchy": (_branchy, (2, 3, 16, 16)), "resnet18": (_resnet18, (1, 3, 64, 64))}


def _inputs(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(42))


def _check_equal_to_eager(backend_name: str, model_name: str) -> str:
    build, shape = MODELS[model_name]
    model, x = build(), _inputs(shape)
    with torch.no_grad():
        ref = model(x)
    r = try_prepare(get_backend(backend_name), model, (x,), "cpu")
    assert r.status == "ok", f"{backend_name}: {r.status}: {r.reason}"
    assert r.prepare_s > 0 and r.version
    x2 = _inputs(shape) * 2  # a second, different input: no stale static buffers
    with torch.no_grad():
        ref2 = model(x2)
    torch.testing.assert_close(r.fn(x), ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(r.fn(x2), ref2, rtol=RTOL, atol=ATOL)
    return r.version


CPU_BACKENDS = ["eager", "torchscript",
                pytest.param("onnxruntime", marks=pytest.mark.skipif(not HAVE_ORT, reason="onnxruntime not installed")),
                pytest.param("tvm", marks=needs_tvm)]


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
def test_cpu_backend_matches_eager(backend_name: str, model_name: str) -> None:
    _check_equal_to_eager(backend_name, model_name)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", list(MODELS))
def test_inductor_cpu_matches_eager(model_name: str) -> None:
    version = _check_equal_to_eager("inductor", model_name)
    assert "mode=default" in version


@pytest.mark.parametrize("backend_name", ["cudagraph", "inductor-cudagraphs", "inductor-max-autotune",
                                          "tensorrt", "tvm-tuned"])
def test_cuda_only_backends_are_unavailable_on_cpu(backend_name: str) -> None:
    r = try_prepare(get_backend(backend_name), _branchy(), (_inputs((2, 3, 16, 16)),), "cpu")
    assert (r.status, r.fn) == ("unavailable", None)
    assert r.reason and r.prepare_s == 0.0


class _Boom(Backend):
    name = "boom"

    def prepare(self, model, example_inputs, training=False):
        raise ValueError("kernel build exploded\nsecond line of a long traceback")


class _Missing(Backend):
    name = "missing"

    def _check(self, device):
        return Availability(True)

    def prepare(self, model, example_inputs, training=False):
        raise BackendUnavailable("libfoo.so not found")


def test_build_failure_is_an_error_row() -> None:
    r = try_prepare(_Boom(), _branchy(), (_inputs((2, 3, 16, 16)),), "cpu")
    assert r.status == "error" and r.fn is None
    assert r.reason == "ValueError: kernel build exploded"  # first line only
    assert r.prepare_s >= 0


def test_backend_unavailable_raised_in_prepare_is_unavailable() -> None:
    r = try_prepare(_Missing(), _branchy(), (_inputs((2, 3, 16, 16)),), "cpu")
    assert (r.status, r.reason) == ("unavailable", "libfoo.so not found")


def test_bad_inputs_are_error_rows_not_crashes() -> None:
    model = _branchy()
    r = try_prepare(get_backend("eager"), model, [1, 2], "cpu")
    assert r.status == "error" and r.reason.startswith("TypeError: example_inputs must be a Tensor")
    r = try_prepare(get_backend("eager"), model, (_inputs((2, 3, 16, 16)),), "tpu")
    assert r.status == "unavailable" and "'tpu'" in r.reason


def test_training_on_inference_only_backend_is_unavailable() -> None:
    r = try_prepare(get_backend("torchscript"), _branchy(), (_inputs((2, 3, 16, 16)),), "cpu", training=True)
    assert r.status == "unavailable" and "inference only" in r.reason


def test_eager_training_returns_differentiable_outputs() -> None:
    model = _branchy()
    r = try_prepare(get_backend("eager"), model, (_inputs((2, 3, 16, 16)),), "cpu", training=True)
    assert r.status == "ok" and model.training
    r.fn(_inputs((2, 3, 16, 16))).sum().backward()
    assert model.fc.weight.grad is not None


def test_unknown_backend_lists_valid_names() -> None:
    with pytest.raises(KeyError) as e:
        get_backend("tensorflow")
    for name in ("eager", "torchscript", "cudagraph", "inductor", "tensorrt", "tvm", "onnxruntime"):
        assert name in str(e.value)


def test_register_backend_refuses_a_clash() -> None:
    class Mine(Backend):
        name = "mine-test"

    register_backend("mine-test", Mine)
    register_backend("mine-test", Mine)  # same factory again: fine
    try:
        assert isinstance(get_backend("mine-test"), Mine)
        with pytest.raises(ValueError, match="already registered"):
            register_backend("mine-test", _Boom)
    finally:
        BACKENDS.pop("mine-test")


# ------------------------------------------------------------------ TorchScript fuser

_FUSER_SEEN: list[tuple[str, bool]] = []  # (where, NNC enabled) as the probe ran


@torch.library.custom_op("nimble_test::fuser_probe", mutates_args=())
def _fuser_probe(x: torch.Tensor) -> torch.Tensor:
    """An op the traced graph keeps: it runs in Python on every call of the TorchScript module,
    so it sees the JIT fuser flags in force during calls, not only during tracing."""
    _FUSER_SEEN.append(("call", torch._C._jit_texpr_fuser_enabled()))
    return x.clone()


class _FuserProbe(Branchy):
    """Branchy, recording whether NNC is enabled while traced (Python forward) and when called."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _FUSER_SEEN.append(("trace", torch._C._jit_texpr_fuser_enabled()))
        return super().forward(_fuser_probe(x))


def _run_probe(backend: Backend) -> tuple[list[bool], list[bool], str]:
    """Prepare the probe with ``backend`` on CPU, check it against eager on two inputs; returns
    NNC's state seen while tracing, while called after prepare, and the version string."""
    torch.manual_seed(0)
    model, x = _randomise_bn(_FuserProbe(), 0), _inputs((2, 3, 16, 16))
    with torch.no_grad():
        ref, ref2 = model(x), model(x * 2)
    _FUSER_SEEN.clear()
    r = try_prepare(backend, model, (x,), "cpu")
    assert r.status == "ok", r.reason
    traced = [on for where, on in _FUSER_SEEN if where == "trace"]
    _FUSER_SEEN.clear()
    torch.testing.assert_close(r.fn(x), ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(r.fn(x * 2), ref2, rtol=RTOL, atol=ATOL)
    called = [on for where, on in _FUSER_SEEN if where == "call"]
    return traced, called, r.version


def test_torchscript_fuser_none_is_in_force_while_tracing_and_calling() -> None:
    before = torch._C._jit_texpr_fuser_enabled()
    assert before, "NNC is PyTorch's default TorchScript fuser; the probe needs it on to see a change"
    traced, called, version = _run_probe(TorchScriptBackend(fuser="none"))
    assert traced and not any(traced)
    assert len(called) == 2 and not any(called)
    assert torch._C._jit_texpr_fuser_enabled() == before  # restored after each call
    assert version == f"torch {torch.__version__} (torchscript fuser=none)"


def test_torchscript_default_fuser_is_unchanged() -> None:
    backend = get_backend("torchscript")
    assert backend.fuser == "default"
    traced, called, version = _run_probe(backend)
    assert all(traced) and called == [True, True]  # PyTorch's own setting: NNC on
    assert version == f"torch {torch.__version__}"


@pytest.mark.parametrize("fuser", ["fuser0",
                                   pytest.param("fuser1", marks=pytest.mark.skipif(
                                       not torch._C._llvm_enabled(), reason="NNC on CPU needs LLVM"))])
def test_torchscript_other_fusers_match_eager(fuser: str) -> None:
    _, called, version = _run_probe(TorchScriptBackend(fuser=fuser))
    assert called == [fuser == "fuser1"] * 2
    assert version.endswith(f"(torchscript fuser={fuser})")


@pytest.mark.parametrize("name", ["none", "fuser0", "fuser1"])
def test_jit_fuser_sets_what_torch_jit_fuser_sets(name: str) -> None:
    C = torch._C

    def flags() -> tuple[bool, ...]:
        return (C._jit_can_fuse_on_cpu(), C._jit_can_fuse_on_gpu(), C._jit_texpr_fuser_enabled(),
                C._jit_llga_enabled(), C._get_graph_executor_optimize())

    with torch.jit.optimized_execution(False):  # so forcing optimisation on shows
        before = flags()
        with torch.jit.fuser(name):
            theirs = flags()
        with jit_fuser(name):
            ours = flags()
        assert ours == theirs
        assert flags() == before


def test_torchscript_bad_fuser_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError) as e:
        TorchScriptBackend(fuser="nnc")
    assert str(e.value) == ("torchscript fuser must be one of 'default', 'none', 'fuser0', 'fuser1'; "
                            "got 'nnc'")
    with pytest.raises(ValueError, match="got 'fuser2' .*nvFuser"):
        TorchScriptBackend(fuser="fuser2")
    with pytest.raises(ValueError, match="got 'None'"):
        get_backend("torchscript", fuser="None")
    assert get_backend("torchscript", fuser="none").fuser == "none"
    with pytest.raises(ValueError, match=r"backend torchscript takes the options \['fuser'\]; got \['fusr'\]"):
        get_backend("torchscript", fusr="none")
    with pytest.raises(ValueError, match=r"backend eager takes the options none; got \['fuser'\]"):
        get_backend("eager", fuser="none")
    assert get_backend("tvm-tuned", tune_trials=64).tune_trials == 64


# ------------------------------------------------------------------ TVM artifacts

@pytest.fixture(scope="module")
def llvm_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A resnet18 llvm artifact + the runtime libraries, as baselines.tvm_build lays them out."""
    if not HAVE_TVM:
        pytest.skip("apache-tvm is not installed")
    from baselines.tvm_build import build_artifact, copy_runtime

    out = tmp_path_factory.mktemp("tvm")
    build, shape = MODELS["resnet18"]
    manifest = build_artifact(build(), (_inputs(shape),), "resnet18", "llvm", out)
    copy_runtime(out)
    assert manifest["weights"][0]["name"] == "conv1.weight"
    assert any(w["name"].endswith("running_var") for w in manifest["weights"])  # BN stats are inputs
    return out


@needs_tvm
def test_tvm_artifact_manifest_and_layout(llvm_artifacts: Path) -> None:
    manifest = json.loads((llvm_artifacts / "llvm" / "resnet18_b1.json").read_text())
    assert (manifest["model"], manifest["batch"], manifest["target"]) == ("resnet18", 1, "llvm")
    assert manifest["input_shapes"] == [[1, 3, 64, 64]]
    assert (llvm_artifacts / "llvm" / "resnet18_b1.so").stat().st_size < 5 * 2**20  # no weights inside
    assert (llvm_artifacts / "runtime" / "libtvm_runtime.so").exists()


@needs_tvm
def test_tvm_artifact_loads_with_runtime_only(llvm_artifacts: Path, tmp_path: Path) -> None:
    """A fresh process where `import tvm` fails (the GPU host's situation) runs the
    artifact with tvm_ffi + the copied runtime, with *other* weights than it was built from."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["tvm"] = None          # no compiler package: runtime-only path
        import torch, torchvision
        sys.path.insert(0, {str(ROOT)!r})
        from baselines import try_prepare
        from baselines.tvm_backend import TvmBackend
        torch.manual_seed(7)               # weights differ from the build's
        m = torchvision.models.resnet18(num_classes=10).eval()
        with torch.no_grad():
            for b in m.modules():
                if isinstance(b, torch.nn.BatchNorm2d):
                    b.running_mean.uniform_(-1, 1); b.running_var.uniform_(0.5, 2)
        m._suite_name = "resnet18"
        x = torch.randn(1, 3, 64, 64)
        r = try_prepare(TvmBackend(), m, (x,), "cpu")
        assert r.status == "ok", (r.status, r.reason)
        assert "runtime-only" in r.version and "artifact resnet18_b1.so" in r.version, r.version
        with torch.no_grad():
            torch.testing.assert_close(r.fn(x), m(x), rtol={RTOL}, atol={ATOL})
        assert sys.modules.get("tvm") is None
        print("RUNTIME-ONLY OK")
    """)
    env = {**os.environ, "NIMBLE_TVM_ARTIFACTS": str(llvm_artifacts)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "RUNTIME-ONLY OK" in proc.stdout, proc.stdout + proc.stderr


@needs_tvm
def test_tvm_artifact_missing_or_mismatched(llvm_artifacts: Path, tmp_path: Path) -> None:
    from baselines.tvm_backend import TvmBackend

    model = _resnet18()
    r = try_prepare(TvmBackend(source="artifact", artifacts=tmp_path), model, (_inputs((1, 3, 64, 64)),), "cpu")
    assert r.status == "unavailable" and "python -m baselines.tvm_build --models resnet18" in r.reason
    r = try_prepare(TvmBackend(source="artifact", artifacts=llvm_artifacts), model, (_inputs((1, 3, 32, 32)),), "cpu")
    assert r.status == "error" and "built for input shapes [[1, 3, 64, 64]]" in r.reason
    del model._suite_name
    r = try_prepare(TvmBackend(source="artifact", artifacts=llvm_artifacts), model, (_inputs((1, 3, 64, 64)),), "cpu")
    assert r.status == "unavailable" and "_suite_name" in r.reason
    r = try_prepare(TvmBackend(source="artifact", artifacts=llvm_artifacts), _branchy(), (_inputs((1, 3, 64, 64)),),
                    "cpu")
    assert r.status == "unavailable"  # no artifact named "branchy"


@needs_tvm
def test_tvm_build_cli_reports_failures(tmp_path: Path) -> None:
    from baselines.tvm_build import main

    assert main(["--models", "no_such_model", "--target", "llvm", "--out", str(tmp_path)]) == 1
    from baselines.tvm_backend import artifact_paths, build_failure_path
    failed = build_failure_path(artifact_paths(tmp_path, "no_such_model", 1, "llvm")[0])
    assert "no_such_model" in failed.read_text()       # a GPU run's row quotes this
    with pytest.raises(ValueError, match="cuda-smXY"):
        main(["--models", "resnet50", "--target", "cuda -arch=sm_90", "--out", str(tmp_path)])


_CUDA_BUILD = """
import sys, torch
sys.path.insert(0, {root!r})
from torch import nn
from baselines import tvm_build
if {stub}:
    print(tvm_build.prepare_cuda_build())
from baselines.tvm_build import build_artifact
m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
try:
    build_artifact(m, (torch.randn(1, 3, 16, 16),), "tiny", "cuda-sm90", {out!r})
    print("BUILT")
except RuntimeError as e:
    print("REFUSED", e)
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TVM or shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists()
                    or shutil.which("gcc") is None, reason="needs apache-tvm, nvcc and gcc")
def test_tvm_cuda_build_on_cpu_host(tmp_path: Path) -> None:
    """With the stub libcuda an sm_90 library is built; without it the build is refused
    (instead of silently shipping CUDA source)."""
    def run(stub: bool) -> str:
        code = _CUDA_BUILD.format(root=str(ROOT), stub=stub, out=str(tmp_path / str(stub)))
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                               timeout=300).stdout

    if torch.cuda.is_available():
        pytest.skip("a real GPU is here; the stub is for GPU-less hosts")
    built = run(True)
    assert "BUILT" in built, built
    lib = tmp_path / "True" / "cuda-sm90" / "tiny_b1.so"
    assert lib.exists() and b"__global__" not in lib.read_bytes()  # compiled, not source
    assert "REFUSED" in run(False)


def test_tvm_build_skips_only_artifacts_built_with_the_same_settings(tmp_path):
    import json

    from baselines import tvm_build
    from baselines.tvm_backend import artifact_paths
    lib, manifest = artifact_paths(tmp_path, "resnet50", 32, "cuda-sm90")
    lib.parent.mkdir(parents=True)
    args = tvm_build._parse_args(["--models", "resnet50", "--batches", "32", "--out", str(tmp_path),
                                  "--skip-existing"])
    assert not tvm_build._up_to_date(args, "resnet50", 32)            # nothing built yet
    lib.write_bytes(b"so")
    manifest.write_text(json.dumps({"cuda_graph": True, "fast_math": False, "tune_trials": 0}))
    assert tvm_build._up_to_date(args, "resnet50", 32)
    fast = tvm_build._parse_args(["--models", "resnet50", "--out", str(tmp_path), "--fast-math"])
    assert not tvm_build._up_to_date(fast, "resnet50", 32)            # other settings: rebuild


def test_compile_cache_use_names_warm_cold_and_mixed_compiles() -> None:
    from baselines.torch_backends import compile_cache_use
    warm = compile_cache_use({"fxgraph_cache_hit": 3}, {"fxgraph_cache_hit": 5, "select_algorithm_autotune": 0})
    assert warm == {"fxgraph_cache_hits": 2, "fxgraph_cache_misses": 0, "autotune_benchmarks": 0,
                    "compile_cache": "warm"}
    assert compile_cache_use({}, {"fxgraph_cache_miss": 1, "select_algorithm_autotune": 40})["compile_cache"] == "cold"
    assert compile_cache_use({}, {"fxgraph_cache_miss": 1, "fxgraph_cache_hit": 1})["compile_cache"] == "mixed"
    assert compile_cache_use({}, {})["compile_cache"] == "not used"


@pytest.mark.slow
def test_a_second_inductor_compile_of_the_same_model_says_it_came_from_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))    # a cold cache of our own
    torch._dynamo.reset()
    model, x = _branchy(), _inputs(MODELS["branchy"][1])
    first = try_prepare(get_backend("inductor"), model, (x,), "cpu")
    torch._dynamo.reset()                                           # forget in-process compiles
    second = try_prepare(get_backend("inductor"), _branchy(), (x,), "cpu")
    assert first.status == second.status == "ok", (first.reason, second.reason)
    assert first.fn.extra["compile_cache"] == "cold" and first.fn.extra["fxgraph_cache_misses"] >= 1
    assert second.fn.extra["compile_cache"] == "warm" and second.fn.extra["fxgraph_cache_hits"] >= 1


def test_nimble_auto_is_not_for_the_fwd_bwd_training_mode() -> None:
    r = try_prepare(get_backend("nimble-auto"), _branchy(), (_inputs(MODELS["branchy"][1]),), "cuda",
                    training=True)
    assert r.status == "unavailable" and r.fn is None
    if torch.cuda.is_available():
        assert "compares whole graphs: for training it needs experiment.mode=whole-step" in r.reason
