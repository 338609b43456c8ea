"""Apache TVM (Relax) as a baseline: torch.export -> Relax -> default GPU schedules (dlight)
or MetaSchedule-tuned kernels -> CUDA-graph rewrite -> VM.

Two ways to get a compiled model, one way to run it:

* **compile** (the ``tvm`` compiler package is installed): build in-process inside
  :meth:`TvmBackend.prepare`, so the build time lands in ``prepare_s``.
* **artifact** (only the runtime is here, e.g. an offline GPU host): load a library that
  ``python -m baselines.tvm_build`` made on another host (see docs/tvm-offline.md). The
  artifact is found by ``(model name, batch, target)``: the model name is read from
  ``model._suite_name``, which the experiment runner sets.

Either way the weights are *not* in the library: every parameter and floating-point buffer
(BatchNorm statistics too) is a VM input, fed from the PyTorch model at call time through
DLPack, in the order stored in the manifest. So an artifact runs any weights of the same
architecture. The VM is run through ``tvm_ffi`` only (``vm_load_executable`` ->
``vm_initialization``), which is all the runtime-only path has.

Hazards (each reproduced, see /work/shared/reference/tvm-offline-gpu.md): compile inside
``with target:`` and with ``relax_pipeline="default"`` (other pipelines silently compile
every kernel for the CPU); without ``DecomposeOpsForInference`` BatchNorm stays a separate
kernel; a CUDA build on a host whose TVM cannot load its CUDA runtime silently ships CUDA
*source* (refused here, see :func:`check_cuda_binary`).
"""
from __future__ import annotations

import copy
import ctypes
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .base import Availability, Backend, BackendUnavailable, register_backend

__all__ = [
    "TvmBackend",
    "ARTIFACTS_ENV",
    "DEFAULT_ARTIFACTS",
    "MANIFEST_FORMAT",
    "target_key_for_device",
    "tvm_target",
    "cuda_arch",
    "weight_names",
    "export_to_relax",
    "compile_relax",
    "check_cuda_binary",
    "artifact_paths",
    "make_vm_fn",
    "load_runtime",
]

ARTIFACTS_ENV = "NIMBLE_TVM_ARTIFACTS"
DEFAULT_ARTIFACTS = ".artifacts/tvm"
MANIFEST_FORMAT = 1
RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_runtime_cuda.so")  # what a runtime-only host loads

# DLDeviceType codes used by vm_initialization; allocator 2 = pooled.
_DL_CPU, _DL_CUDA, _POOLED = 1, 2, 2


# ---------------------------------------------------------------- targets

def target_key_for_device(device: torch.device) -> str:
    """The artifact target key for a torch device: "llvm" on CPU, "cuda-sm90" on an H200."""
    if device.type == "cpu":
        return "llvm"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    raise ValueError(f"tvm targets are 'cpu' or 'cuda' devices, got {device}")


def cuda_arch(key: str) -> str | None:
    """"sm_90" for "cuda-sm90", None for "llvm"; ValueError for anything else."""
    if key == "llvm":
        return None
    m = re.fullmatch(r"cuda-sm(\d{2,3}[a-z]?)", key)
    if m is None:
        raise ValueError(f"target must be 'llvm' or 'cuda-smXY' (e.g. 'cuda-sm90'), got {key!r}")
    return f"sm_{m.group(1)}"


def tvm_target(key: str) -> Any:
    """``tvm.target.Target`` for a target key: "llvm" or "cuda-smXY" (e.g. "cuda-sm90").

    A dict target: CLI strings like "cuda -arch=sm_90" no longer parse in TVM 0.27.
    """
    arch = cuda_arch(key)
    import tvm

    if arch is None:  # num-cores: MetaSchedule's CPU rules require it
        return tvm.target.Target({"kind": "llvm", "num-cores": max(1, (os.cpu_count() or 2) // 2)})
    # The limits every GPU since sm_70 has (as TVM's nvidia/* tags give them); without them
    # TVM warns for each kernel and assumes the same values.
    return tvm.target.Target({"kind": "cuda", "arch": arch, "host": "llvm", "max_shared_memory_per_block": 49152,
                              "max_threads_per_block": 1024, "thread_warp_size": 32,
                              "registers_per_block": 65536})


# ---------------------------------------------------------------- import

def weight_names(model: nn.Module) -> list[str]:
    """Names of the VM's weight inputs, in order: parameters, then floating-point buffers."""
    params = [n for n, _ in model.named_parameters()]
    buffers = [n for n, b in model.named_buffers() if b.is_floating_point()]
    return params + buffers


def _weights(model: nn.Module, names: list[str]) -> list[Tensor]:
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return [state[n].detach() for n in names]


class _WeightsAsInputs(nn.Module):
    """``forward(*inputs, *weights)``: the model with its weights taken from the arguments.

    Exporting this makes every weight a user input of the Relax function: the relax frontend
    otherwise binds buffers (BatchNorm statistics) into the library as constants, so a
    library built from one set of weights would silently give wrong results with another.
    """

    def __init__(self, model: nn.Module, names: list[str], n_inputs: int):
        super().__init__()
        self.model, self.names, self.n_inputs = model, names, n_inputs

    def forward(self, *args: Tensor) -> Any:
        weights = dict(zip(self.names, args[self.n_inputs:]))
        return torch.func.functional_call(self.model, weights, args[: self.n_inputs])


def export_to_relax(model: nn.Module, example_inputs: tuple[Tensor, ...]) -> tuple[Any, list[str]]:
    """Relax IRModule of ``model`` (eval mode) whose ``main`` takes ``(*inputs, *weights)``,
    and the weight names in that order. BatchNorm is decomposed for inference."""
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    model = model.eval()
    names = weight_names(model)
    wrapper = _WeightsAsInputs(model, names, len(example_inputs))
    with torch.no_grad():
        ep = torch.export.export(wrapper, (*example_inputs, *_weights(model, names)))
    mod = from_exported_program(ep, keep_params_as_input=False, unwrap_unit_return_tuple=True)
    n_params = len(mod["main"].params)
    if n_params != len(example_inputs) + len(names):
        raise RuntimeError(f"Relax main takes {n_params} arguments, expected {len(example_inputs)} inputs "
                           f"+ {len(names)} weights")
    return relax.transform.DecomposeOpsForInference()(mod), names


# ---------------------------------------------------------------- compile

def compile_relax(mod: Any, target_key: str, *, cuda_graph: bool = True, database: Any = None) -> Any:
    """Compile with the default pipeline (dlight GPU schedules), or with the tuned kernels of
    a MetaSchedule ``database`` where it has them (dlight for the rest).

    ``cuda_graph`` enables Relax's RewriteCUDAGraph (static regions replayed as CUDA graphs).
    """
    import tvm

    target = tvm_target(target_key)
    config = {"relax.backend.use_cuda_graph": bool(cuda_graph and target_key != "llvm")}
    # Compile INSIDE `with target:`: the dlight schedules read the current target.
    with target, tvm.transform.PassContext(opt_level=3, config=config):
        if database is None:
            return tvm.compile(mod, target=target, relax_pipeline="default")
        with database:
            return tvm.compile(mod, target=target, relax_pipeline=_tuned_pipeline(target))


def _fuse_passes(target: Any) -> list:
    """Legalize and fuse: the kernels MetaSchedule tunes are the fused TIR functions these
    passes make, so tuning and compiling must run the same list (database keys match)."""
    from tvm import relax
    from tvm.relax import pipeline as rp

    return [*rp.library_dispatch_passes(target), relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
            relax.transform.FuseOps(), relax.transform.FuseTIR()]


def _tuned_pipeline(target: Any) -> Any:
    """The default pipeline with MetaSchedule's tuned kernels applied before dlight.

    (``meta_schedule.relax_integration.compile_relax`` does this too, but opens its own
    PassContext and so drops the CUDA-graph setting.)
    """
    import tvm
    from tvm import relax
    from tvm.relax import pipeline as rp

    is_gpu = "cuda" in str(target.kind)

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod: Any, _ctx: Any) -> Any:
        from tvm.s_tir import dlight as dl

        passes = [*_fuse_passes(target), relax.transform.MetaScheduleApplyDatabase()]
        if is_gpu:  # dlight schedules whatever the database has no record for
            passes.append(dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                                  dl.gpu.GeneralReduction(), dl.gpu.Fallback()))
        passes += [*rp.dataflow_lower_passes(target), *rp.finalize_passes(target)]
        return tvm.transform.Sequential(passes)(mod)

    return pipeline


def tune(mod: Any, target_key: str, trials: int, work_dir: str | Path) -> Any:
    """MetaSchedule-tune ``mod``'s kernels with a global budget of ``trials`` measured
    candidates; records go to ``work_dir`` (a JSON database reused by later runs).

    Candidates are measured on the target device, so tuning for CUDA needs the GPU here.
    The XGBoost cost model is used where ``xgboost`` is installed, a random one otherwise.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    import tvm
    from tvm.s_tir import meta_schedule as ms

    cost_model = "xgb" if importlib.util.find_spec("xgboost") is not None else "random"
    target = tvm_target(target_key)
    with target, tvm.transform.PassContext(opt_level=3):
        fused = tvm.transform.Sequential(_fuse_passes(target))(mod)
        return ms.relax_integration.tune_relax(
            fused, params={}, target=target, work_dir=str(work_dir), max_trials_global=trials,
            num_trials_per_iter=min(64, trials), cost_model=cost_model)


def check_cuda_binary(executable: Any) -> None:
    """Raise unless every CUDA module in ``executable`` holds compiled device code.

    Where TVM cannot load its CUDA runtime (no libcuda.so.1 on a CPU host), a CUDA build
    silently keeps CUDA *source* (a module that is not runnable), which a runtime-only GPU
    host cannot compile. Such a library must never be written.
    """
    def walk(m: Any) -> list[Any]:
        return [m] + [x for i in m.imports for x in walk(i)]

    bad = [m for m in walk(executable.mod) if m.kind == "cuda" and not m.is_runnable()]
    if bad:
        raise RuntimeError("the CUDA kernels were kept as source, not compiled: TVM's CUDA runtime did not "
                           "load (libcuda.so.1 / libcudart.so.13 missing?). On a CPU host build through "
                           "`python -m baselines.tvm_build`, which provides a stub libcuda.")


# ---------------------------------------------------------------- artifacts

def artifacts_dir() -> Path:
    """``$NIMBLE_TVM_ARTIFACTS`` or ``.artifacts/tvm``."""
    return Path(os.environ.get(ARTIFACTS_ENV, DEFAULT_ARTIFACTS))


def artifact_paths(root: str | Path, model_name: str, batch: int, target_key: str) -> tuple[Path, Path]:
    """(library, manifest) paths: ``<root>/<target>/<model>_b<batch>.so`` and ``.json``."""
    base = Path(root) / target_key / f"{model_name}_b{batch}"
    return base.with_suffix(".so"), base.with_suffix(".json")


def build_failure_path(lib_path: Path) -> Path:
    """Where ``tvm_build`` leaves the error of a build that failed (beside the library)."""
    return lib_path.with_suffix(".failed.txt")


def check_manifest(manifest: dict, model: nn.Module, example_inputs: tuple[Tensor, ...]) -> list[str]:
    """The weight names of the artifact, after checking it matches the model and inputs.

    Raises ValueError naming the first mismatch (a different architecture or input shape
    would read the wrong buffers).
    """
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"manifest format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}: rebuild the artifact")
    want = [list(s) for s in manifest["input_shapes"]]
    got = [list(x.shape) for x in example_inputs]
    if want != got:
        raise ValueError(f"artifact {manifest['model']} was built for input shapes {want}, got {got}")
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for w in manifest["weights"]:
        t = state.get(w["name"])
        if t is None:
            raise ValueError(f"artifact weight {w['name']!r} is not in the model: a different architecture?")
        if list(t.shape) != w["shape"] or str(t.dtype).removeprefix("torch.") != w["dtype"]:
            raise ValueError(f"artifact weight {w['name']!r} is {w['shape']} {w['dtype']}, the model's is "
                             f"{list(t.shape)} {t.dtype}")
    names = [w["name"] for w in manifest["weights"]]
    if names != weight_names(model):
        raise ValueError("the model's weights differ from the artifact's (names or order): rebuild it")
    return names


# ---------------------------------------------------------------- runtime

_RUNTIME_LOADED: set[str] = set()


def _compiler_importable() -> bool:
    """Is the full ``tvm`` package (compiler included) importable?"""
    try:
        return importlib.util.find_spec("tvm") is not None and importlib.util.find_spec("tvm.relax") is not None
    except (ImportError, ValueError):  # sys.modules["tvm"] = None makes find_spec raise
        return False


def load_runtime(runtime_dir: Path | None, cuda: bool) -> None:
    """Make TVM's VM runtime available to ``tvm_ffi`` without the compiler package.

    With ``tvm`` installed, importing it loads everything. Otherwise load
    ``libtvm_runtime.so`` (and ``libtvm_runtime_cuda.so`` for CUDA) from ``runtime_dir``
    with RTLD_GLOBAL, after torch has loaded ``libcudart.so.13``. Idempotent.
    """
    try:
        import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so, which the runtime needs)
    except ImportError as e:
        raise BackendUnavailable("tvm_ffi is not installed (pip install apache-tvm-ffi==0.1.14.post0, "
                                 "or the wheel that baselines.tvm_build put in the artifact folder)") from e
    if _compiler_importable():
        import tvm  # noqa: F401

        if cuda and tvm_ffi.get_global_func("device_api.cuda", True) is None:
            raise BackendUnavailable("TVM's CUDA runtime did not load (libcudart.so.13 / libcuda.so.1 missing?)")
        return
    needed = RUNTIME_LIBS if cuda else RUNTIME_LIBS[:1]
    for lib in needed:
        if lib in _RUNTIME_LOADED:
            continue
        path = runtime_dir / lib if runtime_dir else None
        if path is None or not path.exists():
            raise BackendUnavailable(f"TVM runtime library {lib} not found in {runtime_dir} "
                                     "(baselines.tvm_build copies it to <artifacts>/runtime/)")
        if lib == "libtvm_runtime_cuda.so":
            import torch.cuda  # noqa: F401  loads libcudart.so.13, which this library needs
            torch.cuda.init()
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _RUNTIME_LOADED.add(lib)


def make_vm_fn(lib: Any, device: torch.device, weights: list[Tensor]) -> Callable[..., Any]:
    """``fn(*inputs)`` running ``main(*inputs, *weights)`` of a VM executable library.

    ``lib`` is a ``tvm_ffi.Module`` of kind relax.VMExecutable (loaded or just compiled).
    Tensors cross by DLPack without copies; on CUDA the VM runs on torch's current stream
    (``tvm_ffi.use_torch_stream``) so CUDA events on that stream time it.
    """
    import tvm_ffi

    vm = lib["vm_load_executable"]()
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        vm["vm_initialization"](_DL_CUDA, idx, _POOLED, _DL_CPU, 0, _POOLED)
    else:
        vm["vm_initialization"](_DL_CPU, 0, _POOLED)
    main = vm["main"]
    # Zero-copy views: in-place updates of the model's weights are seen by the VM.
    weight_args = [tvm_ffi.from_dlpack(w.contiguous()) for w in weights]

    def call(*inputs: Tensor) -> Any:
        args = [tvm_ffi.from_dlpack(x.detach().contiguous()) for x in inputs]
        out = main(*args, *weight_args)
        if isinstance(out, tvm_ffi.Tensor):
            return torch.from_dlpack(out)
        return tuple(torch.from_dlpack(o) for o in out)

    if device.type == "cuda":
        def run(*inputs: Tensor) -> Any:
            with tvm_ffi.use_torch_stream():
                return call(*inputs)
    else:
        run = call
    run._keepalive = (vm, lib)  # type: ignore[attr-defined]
    return run


# ---------------------------------------------------------------- backend

class TvmBackend(Backend):
    """TVM Relax baseline (see module docstring).

    ``source``: "auto" compiles in-process where the ``tvm`` compiler is installed and loads
    an artifact otherwise; "compile" and "artifact" force one way. ``tune_trials`` > 0
    MetaSchedule-tunes in-process (needs the compiler and the target device; records kept
    under ``<artifacts>/tuning/``). ``artifacts`` defaults to ``$NIMBLE_TVM_ARTIFACTS`` or
    ``.artifacts/tvm``. The artifact is looked up by ``model._suite_name`` (set by the
    runner), the batch size of the first input and the device's target key.
    """

    def __init__(self, source: str = "auto", tune_trials: int = 0, cuda_graph: bool = True,
                 artifacts: str | Path | None = None):
        if source not in ("auto", "compile", "artifact"):
            raise ValueError(f"source must be 'auto', 'compile' or 'artifact', got {source!r}")
        if tune_trials < 0:
            raise ValueError(f"tune_trials must be >= 0, got {tune_trials}")
        if tune_trials and source == "artifact":
            raise ValueError("tuning happens while compiling; source='artifact' cannot tune")
        self.source, self.tune_trials, self.cuda_graph = source, tune_trials, cuda_graph
        self.name = "tvm-tuned" if tune_trials else "tvm"
        self.artifacts = Path(artifacts) if artifacts is not None else artifacts_dir()
        self._how = ""  # what version() reports after prepare

    def _check(self, device: torch.device) -> Availability:
        compiler = _compiler_importable()
        if self.tune_trials and device.type != "cuda":
            return Availability(False, "tvm-tuned tunes CUDA kernels only (MetaSchedule CPU builds failed in "
                                "every trial on our CPU host; see docs/tvm-offline.md)")
        if self.source == "compile" or self.tune_trials:
            return Availability(compiler, "" if compiler else "the tvm compiler package is not installed "
                                "(pip install apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post0)")
        if self.source == "auto" and compiler:
            return Availability(True)
        if importlib.util.find_spec("tvm_ffi") is None:
            return Availability(False, "neither the tvm compiler nor tvm_ffi (its runtime) is installed")
        return Availability(True)  # artifact existence is checked in prepare, where the model is known

    def version(self) -> str:
        if _compiler_importable():
            v = _installed_version("apache-tvm") or "?"
        else:
            v = f"runtime-only, tvm_ffi {_installed_version('apache-tvm-ffi')}"
        return f"tvm {v}" + (f" ({self._how})" if self._how else "")

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        self._refuse_training(training)
        model.eval()
        device = example_inputs[0].device
        key = target_key_for_device(device)
        use_compiler = self.source == "compile" or self.tune_trials > 0 or (
            self.source == "auto" and _compiler_importable())
        if use_compiler:
            return self._compile(model, example_inputs, key)
        return self._load(model, example_inputs, key)

    def _compile(self, model: nn.Module, example_inputs: tuple[Tensor, ...], key: str) -> Callable[..., Any]:
        load_runtime(None, cuda=key != "llvm")  # imports tvm; fails clearly without CUDA runtime
        mod, names = export_to_relax(*_export_copy(model, example_inputs))
        database = None
        if self.tune_trials:
            tag = getattr(model, "_suite_name", None) or type(model).__name__
            work = self.artifacts / "tuning" / f"{tag}_b{example_inputs[0].shape[0]}_{key}"
            database = tune(mod, key, self.tune_trials, work)
        ex = compile_relax(mod, key, cuda_graph=self.cuda_graph, database=database)
        if key != "llvm":
            check_cuda_binary(ex)
        tuned = f"MetaSchedule {self.tune_trials} trials" if self.tune_trials else "untuned default schedules (dlight on GPU)"
        self._how = f"compiled in-process for {key}, {tuned}, cuda_graph={self.cuda_graph and key != 'llvm'}"
        return make_vm_fn(ex.mod, example_inputs[0].device, _weights(model, names))

    def _load(self, model: nn.Module, example_inputs: tuple[Tensor, ...], key: str) -> Callable[..., Any]:
        name = getattr(model, "_suite_name", None)
        if not name:
            raise BackendUnavailable("tvm compiler not installed, and the model has no _suite_name to find a "
                                     "prebuilt artifact by (the experiment runner sets it)")
        batch = int(example_inputs[0].shape[0])
        lib_path, manifest_path = artifact_paths(self.artifacts, name, batch, key)
        if not (lib_path.exists() and manifest_path.exists()):
            failed = build_failure_path(lib_path)
            if failed.exists():
                raise BackendUnavailable(f"TVM could not build ({name}, batch {batch}, {key}) on the "
                                         f"build host: {failed.read_text().strip()}")
            raise BackendUnavailable(
                f"no TVM artifact for ({name}, batch {batch}, {key}) at {lib_path}; build it on a host with "
                f"the tvm compiler: python -m baselines.tvm_build --models {name} --batches {batch} "
                f"--target {key} --out {self.artifacts}")
        manifest = json.loads(manifest_path.read_text())
        names = check_manifest(manifest, model, example_inputs)
        load_runtime(self.artifacts / "runtime", cuda=key != "llvm")
        import tvm_ffi

        lib = tvm_ffi.load_module(str(lib_path))
        tuned = manifest.get("tune_trials") or 0
        self._how = (f"artifact {lib_path.name} built with tvm {manifest.get('tvm_version')} for {key}, "
                          + (f"MetaSchedule {tuned} trials" if tuned else "untuned default schedules (dlight on GPU)")
                          + f", cuda_graph={manifest.get('cuda_graph')}")
        return make_vm_fn(lib, example_inputs[0].device, _weights(model, names))


def _export_copy(model: nn.Module, example_inputs: tuple[Tensor, ...]) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """CPU copies to export from: the Relax importer converts every tensor of the exported
    program on the host, so exporting a CUDA model would copy its weights back anyway."""
    if all(x.device.type == "cpu" for x in example_inputs):
        return model, example_inputs
    return copy.deepcopy(model).cpu(), tuple(x.detach().cpu() for x in example_inputs)


def _installed_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _tvm_tuned(tune_trials: int = 2000) -> TvmBackend:
    """The tuned variant: MetaSchedule with a global budget of ``tune_trials`` trials
    (config: ``backend_options.tvm-tuned.tune_trials``)."""
    return TvmBackend(tune_trials=int(tune_trials))


register_backend("tvm", TvmBackend)
register_backend("tvm-tuned", _tvm_tuned)
