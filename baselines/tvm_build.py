"""Build TVM artifacts on a host without a GPU, for a GPU host that has only TVM's runtime.

    python -m baselines.tvm_build --models resnet50,inception_v3 --batches 1 \\
        --target cuda-sm90 --out .artifacts/tvm --ffi-wheel 3.12

writes, for each model and batch::

    <out>/<target>/<model>_b<batch>.so     the compiled model (kernels + VM code, no weights)
    <out>/<target>/<model>_b<batch>.json   manifest: model, batch, target, versions, input
                                            shapes, weight names/shapes in VM argument order
    <out>/runtime/libtvm_runtime*.so       TVM's runtime, for hosts without the tvm package
    <out>/wheels/apache_tvm_ffi-*.whl      (--ffi-wheel) tvm_ffi for the GPU host's Python

The ``tvm`` baseline (:mod:`baselines.tvm_backend`) loads these where the compiler is absent.
A CUDA build on a host without a GPU needs: nvcc (TVM_CUDA_COMPILE_MODE=nvcc is set here),
TVM's CUDA runtime loadable, which needs ``libcudart.so.13`` (torch's CUDA build brings it)
and ``libcuda.so.1``, provided by a stub compiled from ``cuda_stub.c`` with gcc. See
docs/tvm-offline.md for the whole workflow.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import Tensor, nn

from .tvm_backend import (MANIFEST_FORMAT, RUNTIME_LIBS, artifact_paths, build_failure_path, check_cuda_binary, compile_relax,
                          cuda_arch, export_to_relax, tune, tvm_target)

__all__ = ["build_artifact", "prepare_cuda_build", "copy_runtime", "download_ffi_wheel", "main"]

STUB_SOURCE = Path(__file__).with_name("cuda_stub.c")
_STUB_DIR: tempfile.TemporaryDirectory | None = None  # lives as long as the process


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def prepare_cuda_build(fast_math: bool = False) -> str:
    """Make this process able to compile CUDA artifacts; call before the first ``import tvm``.

    Returns what was done (for the log). Raises RuntimeError naming what is missing.
    """
    global _STUB_DIR
    if "tvm" in sys.modules:
        raise RuntimeError("prepare_cuda_build must run before tvm is imported (TVM loads its CUDA runtime "
                           "once, at import)")
    notes = []
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH or /usr/local/cuda/bin): TVM compiles CUDA kernels with it here")
    os.environ["PATH"] = f"{Path(nvcc).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    if not fast_math:  # strict fp32, as PyTorch computes; TVM defaults to --use_fast_math
        os.environ["TVM_CUDA_NVCC_NO_FAST_MATH"] = "1"
    notes.append(f"nvcc={nvcc}")
    _load_cudart()
    if _driver_present():
        notes.append("real libcuda.so.1")
    else:
        gcc = shutil.which("gcc") or shutil.which("cc")
        if gcc is None:
            raise RuntimeError("no libcuda.so.1 and no gcc to build the stub from baselines/cuda_stub.c")
        _STUB_DIR = tempfile.TemporaryDirectory(prefix="tvm-cuda-stub-")
        stub = Path(_STUB_DIR.name) / "libcuda.so.1"
        subprocess.run([gcc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub), str(STUB_SOURCE)],
                       check=True, capture_output=True, text=True)
        # Loaded by soname: libtvm_runtime_cuda.so's DT_NEEDED libcuda.so.1 resolves to it.
        ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
        notes.append("stub libcuda.so.1")
    import tvm

    if tvm.get_global_func("device_api.cuda", True) is None:
        raise RuntimeError("TVM's CUDA runtime did not load (is libcudart.so.13 findable? try "
                           "LD_LIBRARY_PATH=/usr/local/cuda/lib64)")
    return ", ".join(notes)


def _load_cudart() -> None:
    """Load libcudart.so.13 globally if torch has not (a CPU-only torch, say)."""
    candidates = ["libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so.13"]
    for c in candidates:
        try:
            ctypes.CDLL(c, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue
    # Not fatal here: the device_api.cuda check after `import tvm` reports it.


def build_artifact(model: nn.Module, example_inputs: tuple[Tensor, ...], model_name: str, target_key: str,
                   out: str | Path, *, cuda_graph: bool = True, tune_trials: int = 0,
                   fast_math: bool = False) -> dict:
    """Compile ``model`` for ``target_key`` and write library + manifest under ``out``.

    Returns the manifest. Files are written under temporary names and renamed, manifest
    last, so a failed build never leaves a library that looks valid.
    """
    import tvm
    import tvm_ffi

    start = time.perf_counter()
    model = model.eval()
    batch = int(example_inputs[0].shape[0])
    lib_path, manifest_path = artifact_paths(out, model_name, batch, target_key)
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    mod, names = export_to_relax(model, example_inputs)
    database = None
    if tune_trials:
        if target_key == "llvm":
            raise ValueError("tuning is for CUDA targets only (MetaSchedule CPU builds failed here)")
        if not torch.cuda.is_available():
            raise RuntimeError("MetaSchedule measures candidates on the target GPU; none here. Tune on the GPU "
                               "host with the full compiler (docs/tvm-offline.md)")
        database = tune(mod, target_key, tune_trials, Path(out) / "tuning" / f"{model_name}_b{batch}_{target_key}")
    ex = compile_relax(mod, target_key, cuda_graph=cuda_graph, database=database)
    if target_key != "llvm":
        check_cuda_binary(ex)
    tmp_lib = lib_path.with_name(lib_path.name + ".tmp.so")
    ex.export_library(str(tmp_lib))
    os.replace(tmp_lib, lib_path)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    manifest = {
        "format": MANIFEST_FORMAT,
        "model": model_name,
        "batch": batch,
        "target": target_key,
        "tvm_target": str(tvm_target(target_key)),
        "library": lib_path.name,
        "tvm_version": tvm.__version__,
        "tvm_ffi_version": getattr(tvm_ffi, "__version__", "?"),
        "torch_version": torch.__version__,
        "input_shapes": [list(x.shape) for x in example_inputs],
        "input_dtypes": [str(x.dtype).removeprefix("torch.") for x in example_inputs],
        "weights": [{"name": n, "shape": list(state[n].shape), "dtype": str(state[n].dtype).removeprefix("torch.")}
                    for n in names],
        "cuda_graph": bool(cuda_graph and target_key != "llvm"),
        "fast_math": fast_math,
        "tune_trials": tune_trials,
        "build_s": round(time.perf_counter() - start, 2),
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "built_on": f"{platform.machine()} Python {platform.python_version()}",
    }
    tmp_manifest = manifest_path.with_name(manifest_path.name + ".tmp")
    tmp_manifest.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp_manifest, manifest_path)
    return manifest


def copy_runtime(out: str | Path) -> list[Path]:
    """Copy TVM's runtime libraries into ``<out>/runtime`` (what a runtime-only host loads)."""
    import tvm

    src = Path(tvm.__file__).parent / "lib"
    dest = Path(out) / "runtime"
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for lib in RUNTIME_LIBS:
        shutil.copy2(src / lib, dest / lib)
        copied.append(dest / lib)
    return copied


def download_ffi_wheel(out: str | Path, python_version: str) -> Path:
    """pip-download the installed apache-tvm-ffi version as a manylinux x86_64 wheel for
    ``python_version`` (e.g. "3.12") into ``<out>/wheels``; returns that folder."""
    from importlib.metadata import version

    dest = Path(out) / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [f"manylinux_2_{n}_x86_64" for n in (28, 27, 24, 17)] + ["manylinux2014_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
           "--python-version", python_version, "-d", str(dest), f"apache-tvm-ffi=={version('apache-tvm-ffi')}"]
    for p in platforms:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True)
    return dest


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m baselines.tvm_build", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True,
                   help="comma-separated names of experiments.models (e.g. resnet50,inception_v3)")
    p.add_argument("--batches", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--target", default="cuda-sm90", help="'cuda-smXY' (cuda-sm90 = H100/H200) or 'llvm'")
    p.add_argument("--out", default=".artifacts/tvm", help="artifact folder (default .artifacts/tvm)")
    p.add_argument("--tune-trials", type=int, default=0,
                   help="MetaSchedule trial budget (needs the target device here; default 0 = dlight)")
    p.add_argument("--no-cuda-graph", action="store_true", help="disable Relax's CUDA-graph rewrite")
    p.add_argument("--fast-math", action="store_true", help="nvcc --use_fast_math (default: strict fp32)")
    p.add_argument("--skip-existing", action="store_true",
                   help="keep artifacts already in --out whose manifest has the same target, "
                        "CUDA-graph, fast-math and tuning settings (build only what is missing)")
    p.add_argument("--ffi-wheel", metavar="PYVER", default=None,
                   help="also download the apache-tvm-ffi wheel for this Python (e.g. 3.12) into <out>/wheels")
    return p.parse_args(argv)


def _up_to_date(args: argparse.Namespace, name: str, batch: int) -> bool:
    """An artifact for ``name`` x ``batch`` exists, built with the settings asked for now."""
    lib, manifest_path = artifact_paths(args.out, name, batch, args.target)
    if not (lib.exists() and manifest_path.exists()):
        return False
    m = json.loads(manifest_path.read_text())
    want = {"cuda_graph": not args.no_cuda_graph and args.target != "llvm",
            "fast_math": args.fast_math, "tune_trials": args.tune_trials}
    return all(m.get(k) == v for k, v in want.items())


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1 if any model failed to build)."""
    args = _parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not models or not batches or min(batches) < 1:
        raise SystemExit(f"need at least one model and batch sizes >= 1, got {models} / {batches}")
    if cuda_arch(args.target) is not None:  # also validates the key before anything is built
        print(f"[tvm_build] CUDA build setup: {prepare_cuda_build(args.fast_math)}", flush=True)
    from experiments.models import build_model, example_input

    for path in copy_runtime(args.out):
        print(f"[tvm_build] runtime {path}", flush=True)
    if args.ffi_wheel:
        print(f"[tvm_build] wheels in {download_ffi_wheel(args.out, args.ffi_wheel)}", flush=True)
    failed = []
    for name in models:
        for batch in batches:
            if args.skip_existing and _up_to_date(args, name, batch):
                print(f"[tvm_build] kept {artifact_paths(args.out, name, batch, args.target)[0]}",
                      flush=True)
                continue
            try:
                model = build_model(name)
                model._suite_name = name
                x = example_input(name, batch)
                m = build_artifact(model, (x,), name, args.target, args.out, cuda_graph=not args.no_cuda_graph,
                                   tune_trials=args.tune_trials, fast_math=args.fast_math)
                lib, _ = artifact_paths(args.out, name, batch, args.target)
                build_failure_path(lib).unlink(missing_ok=True)
                print(f"[tvm_build] {lib}  {lib.stat().st_size / 2**20:.1f} MiB  {m['build_s']:.0f} s", flush=True)
            except Exception as e:  # keep building the others; report at the end
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                failed.append(f"{name} b{batch}: {why}")
                print(f"[tvm_build] FAILED {failed[-1]}", file=sys.stderr, flush=True)
                lib, _ = artifact_paths(args.out, name, batch, args.target)
                lib.parent.mkdir(parents=True, exist_ok=True)   # the GPU run quotes it in its row
                build_failure_path(lib).write_text(why + "\n")
    if failed:
        print(f"[tvm_build] {len(failed)} failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
