"""A private CUDA MPS (Multi-Process Service) daemon for the job processes of one run.

Without MPS, the processes sharing a GPU take turns on it in time slices: one process's
kernels and copies never run beside another's. A streamed TENSILE job waits on its copies
sixteen times a step, and each wait can idle the GPU for the rest of its slice (on the H200,
two streamed Inception-v4 jobs at batch 2: 85 ms a step each under time slicing, 40 ms
under MPS, against 18 ms alone). Under MPS the processes' work runs side by side, as
several jobs of one process would.

:func:`mps_daemon` starts ``nvidia-cuda-mps-control -d`` with its pipe and log folders in a
fresh temporary folder, so it serves only the processes started with the environment it
sets (``CUDA_MPS_PIPE_DIRECTORY``) and never a daemon or client of anybody else's; it quits
the daemon and restores the environment on the way out, also on errors. It changes no
setting of the GPU (its compute mode stays as it is).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

CONTROL = "nvidia-cuda-mps-control"
ENV_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def client_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` (the environment the daemon started with) for a client of that daemon.

    The daemon serves only the GPUs its ``CUDA_VISIBLE_DEVICES`` names and numbers them
    from 0 for its clients, so a client's ``CUDA_VISIBLE_DEVICES`` must count from 0 too:
    one that kept ``1`` finds no GPU at all. It must not be dropped either: PyTorch counts
    GPUs through NVML, which sees every GPU of the host, so a client without it believes
    in GPUs the daemon does not serve and fails when it initialises CUDA ("device=1,
    num_gpus=1", seen on the H200 host). Without ``CUDA_VISIBLE_DEVICES`` (the daemon serves
    every GPU) the environment is kept as it is."""
    out = dict(env)
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible:
        out["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(visible)))
    return out


def available() -> bool:
    """Whether the MPS control program is on ``PATH``."""
    return shutil.which(CONTROL) is not None


@contextmanager
def mps_daemon(env: dict[str, str] | None = None) -> Iterator[str]:
    """Run a private MPS daemon while the block runs; yields its pipe folder.

    ``env``: the environment the daemon starts with (its ``CUDA_VISIBLE_DEVICES`` picks
    the GPUs it serves), by default this process's. The pipe and log folders are set in
    ``os.environ`` too, so every process started inside the block from this one's
    environment is a client of this daemon; start clients with :func:`client_env`.
    """
    if not available():
        raise RuntimeError(f"MPS needs {CONTROL} on PATH (NVIDIA's driver utilities); not found")
    root = tempfile.mkdtemp(prefix="tensile_mps_")
    dirs = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for d in dirs.values():
        os.makedirs(d)
    before = {k: os.environ.get(k) for k in ENV_KEYS}
    start = subprocess.run([CONTROL, "-d"], env={**(env or os.environ), **dirs},
                           capture_output=True, text=True, timeout=60)
    if start.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"{CONTROL} -d failed (exit code {start.returncode}): "
                           f"{(start.stderr or start.stdout).strip()[-500:]}")
    os.environ.update(dirs)
    try:
        yield dirs["CUDA_MPS_PIPE_DIRECTORY"]
    finally:
        # quit: the daemon waits for its clients to exit, which the caller has stopped
        subprocess.run([CONTROL], input="quit\n", env={**os.environ}, capture_output=True,
                       text=True, timeout=60)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)
