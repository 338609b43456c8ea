"""The workspaces PyTorch gives cuBLAS, and shrinking them.

    released = tensile.trim_blas_workspace()     # bytes the workspaces held, given back

Why: PyTorch allocates a workspace for every (cuBLAS handle, stream) pair that runs a matrix
product and keeps it for the life of the process, from its caching allocator: 32 MiB each on
Hopper while ``CUBLAS_WORKSPACE_CONFIG`` is unset. A training step uses two handles (the
forward runs on the Python thread's, the backward on autograd's device thread's), so a job
holds 64 MiB of them on every stream it trained on: 128 MiB once it ran eager steps on the
default stream and captured its step on a side stream. The TENSILE models at batch 2 do not
need them. On the H200 (torch 2.11), captured steps of VGG-16, ResNet-50, Inception-v3/v4
and DenseNet-121 replayed as fast with 1 MiB workspaces as with 32 MiB, and as fast with none;
the trim gave back 130 MiB per process (``results/h200/README.md``, thirty-eighth session).
A captured DenseNet-121 job at batch 2 peaks at 484 MB allocated with them. On a GPU shared
by several training processes they count once per process, and no plan can reach them.

How: ``CUBLAS_WORKSPACE_CONFIG`` is set to ``:<kib>:1``; PyTorch reads it each time it
allocates a workspace. Then the workspaces cuBLAS and cuBLASLt hold are dropped
(``torch._C._cuda_clearCublasWorkspaces``), and the allocator's cache is emptied. The next
product on each handle and stream allocates a workspace of the new size. cuBLASLt's
workspace is capped at that size too. Results can differ in the last bits: cuBLAS may pick
another kernel.

Hazard, CUDA graphs: a graph keeps the workspace addresses of its capture, and after the trim
the allocator hands those bytes to other tensors. So every trim counts (:func:`blas_trim_count`):
:class:`tensile.GraphStep` refuses to replay a graph captured before the latest trim, and
:meth:`tensile.Scheduler.replay` captures such a step again. Trim between steps, after the
first one and before capturing, as :func:`tensile.trim_stack`.

Hazard, determinism: ``torch.use_deterministic_algorithms(True)`` accepts only
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` or ``:16:8``, so the trim refuses to run under it.
"""
from __future__ import annotations

import os

import torch

__all__ = ["DEFAULT_KIB", "blas_trim_count", "trim_blas_workspace"]

DEFAULT_KIB = 1024          # 1 MiB: cuBLASLt's own default workspace
ENV = "CUBLAS_WORKSPACE_CONFIG"

_trims = 0                  # trim_blas_workspace calls in this process (module notes)


def trim_blas_workspace(kib: int = DEFAULT_KIB) -> int:
    """Give back the cuBLAS workspaces this process holds, and make later ones ``kib`` KiB
    (module notes). Returns the bytes the dropped workspaces held on the current device. It
    waits for that device's queued work and is not allowed during a CUDA graph capture. CUDA
    graphs captured before the trim must be captured again (module notes)."""
    global _trims
    if isinstance(kib, bool) or not isinstance(kib, int) or kib < 0:
        raise ValueError(f"kib: expected a whole number of KiB >= 0, got {kib!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("cuBLAS workspaces belong to a CUDA process: this process has no "
                           "usable CUDA GPU")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("trim_blas_workspace frees memory a capture may use: call it "
                           "between steps, outside a CUDA graph capture")
    if torch.are_deterministic_algorithms_enabled():
        raise RuntimeError(f"deterministic algorithms are on, and they need {ENV}=:4096:8 or "
                           f":16:8 (now {os.environ.get(ENV)!r}); trim_blas_workspace would set "
                           f":{kib}:1")
    os.environ[ENV] = f":{kib}:1"
    # In-flight products may still use a workspace: wait for them before its bytes go back.
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    released = before - torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    _trims += 1
    return released


def blas_trim_count() -> int:
    """How many times :func:`trim_blas_workspace` ran in this process: a CUDA graph captured
    when the count was lower must not be replayed (module notes)."""
    return _trims
