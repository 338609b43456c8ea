"""The environment a measurement ran in, recorded with every row.

Numbers from different GPUs, drivers or TF32 settings are not comparable, so each row carries them
and the results of one GPU live in their own folder, ``results/<gpu_slug()>/``.
"""
from __future__ import annotations

import functools
import os
import platform
import re
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

from nimble.allocator import allocator_conf

__all__ = ["environment", "gpu_name", "gpu_slug", "precision_flags", "git_commit", "host_load"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def gpu_name(device: str = "cuda") -> str:
    """The GPU's marketing name (``"NVIDIA H200"``), or ``"cpu"`` for CPU runs / no CUDA."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(torch.device(device))


def gpu_slug(name: str | None = None) -> str:
    """A folder name for a GPU: ``"NVIDIA H200"`` → ``"h200"``, ``"cpu"`` → ``"cpu"``.

    With no argument, the slug of the current CUDA device (or ``"cpu"``).
    """
    name = gpu_name() if name is None else name
    slug = re.sub(r"^(nvidia|tesla|geforce|quadro)\s+", "", name.strip().lower())
    slug = re.sub(r"^(tesla|geforce|quadro)\s+", "", slug)
    slug = re.sub(r"[^a-z0-9]+", "-", slug).strip("-")
    return slug or "unknown"


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """Short commit hash of the repository, ``+dirty`` with local changes.

    ``$SUITE_COMMIT``, when set, wins: a tree copied to a GPU host may carry a stale ``.git``
    (it reported the base commit ``+dirty`` there). Without either, ``"unknown"``.
    """
    if os.environ.get("SUITE_COMMIT"):
        return os.environ["SUITE_COMMIT"]
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _driver_version() -> str:
    """NVIDIA driver version via NVML if ``nvidia-ml-py`` is installed, else empty."""
    try:
        import pynvml  # optional; present on the GPU host image
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - any NVML failure just means "not known"
        return ""


def host_load() -> dict:
    """How busy the host's CPUs were, to read beside CPU-bound timings (eager PyTorch at small
    batches): the 1-minute load average and the CPUs this process may run on (``taskset``)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host_load_1m": round(os.getloadavg()[0], 2), "cpus": cpus}


def precision_flags() -> dict[str, bool]:
    """The global numerics switches that change latencies: read them at measurement time."""
    return {
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }


@functools.lru_cache(maxsize=4)
def _static_environment(device: str) -> dict[str, str]:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env = {
        "device": "cuda" if device.startswith("cuda") else device,
        "gpu": gpu_name(device),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "cudnn": str(cudnn or ""),
        "python": platform.python_version(),
        "commit": git_commit(),
    }
    driver = _driver_version() if device.startswith("cuda") else ""
    if driver:  # not a column: goes into the row's extra JSON
        env["driver"] = driver
    if device.startswith("cuda") and torch.cuda.is_available():
        # native caching allocator or cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF): changes
        # the memory of multi-stream graphs, so it goes with the row (extra JSON)
        env["allocator"] = torch.cuda.get_allocator_backend()
    alloc_conf = allocator_conf()
    if alloc_conf and device.startswith("cuda"):
        # expandable segments and the like change what a run reserves (extra JSON)
        env["alloc_conf"] = alloc_conf
    return env


def environment(device: str = "cuda") -> dict[str, object]:
    """Everything recorded beside a measurement: GPU, versions, commit, date, precision flags.

    ``device`` is ``"cuda"`` (or ``"cuda:N"``) or ``"cpu"``; ``gpu`` is ``"cpu"`` for CPU runs.
    """
    env: dict[str, object] = dict(_static_environment(str(device)))
    env.update(precision_flags())
    env["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return env
