"""CUDA side streams that do not start PyTorch's stream pool.

    d2h = side_stream(device, "d2h")     # the same stream on every call for this device

Why: the first ``torch.cuda.Stream()`` of a process creates the device's whole stream pool
(32 streams per priority level). On an H200 with torch 2.11 that holds 70 MB of device
memory outside the caching allocator (``.gpu/outside_diag.py``: 768.8 → 838.8 MiB outside
the allocator at the first stream, no change at the second). A vanilla training job never
creates a stream; a TENSILE job needs two copy streams and a warm-up stream, so on a GPU
shared by several jobs those 70 MB per process offset much of what a small job's plan
saves (issue 7: NVML MSR at batch 2).

How: ``cudaStreamCreateWithFlags(cudaStreamNonBlocking)`` through the CUDA runtime library
the process already mapped (found in ``/proc/self/maps``), wrapped in
``torch.cuda.ExternalStream``. Non-blocking as the pool's streams are: a blocking stream
(``torch.cuda.cudart().cudaStreamCreate``) would wait for all work on the legacy default
stream, on which PyTorch computes, and the copies would no longer overlap it. A stream
handle belongs to the driver's context, so any loaded ``libcudart`` serves. The streams
live as long as the process, one per (device, role). Where no runtime library can be
found (a static build, a platform without ``/proc``), ``torch.cuda.Stream`` is used and a
warning says that the pool's memory comes with it.
"""
from __future__ import annotations

import ctypes
import functools
import warnings

import torch

__all__ = ["side_stream", "find_cudart"]

CUDA_STREAM_NON_BLOCKING = 1   # cudaStreamNonBlocking


def find_cudart(maps_text: str | None = None) -> str | None:
    """Path of the CUDA runtime library mapped into this process (``/proc/self/maps``),
    or None. ``maps_text`` replaces the file's text (tests)."""
    if maps_text is None:
        try:
            with open("/proc/self/maps") as f:
                maps_text = f.read()
        except OSError:
            return None
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)   # address perms offset dev inode path
        if len(fields) == 6 and fields[5].rsplit("/", 1)[-1].startswith("libcudart.so"):
            return fields[5]
    return None


@functools.lru_cache(maxsize=None)
def _cudart() -> ctypes.CDLL | None:
    path = find_cudart()
    return ctypes.CDLL(path) if path else None


@functools.lru_cache(maxsize=None)
def _side_stream(index: int, role: str) -> torch.cuda.Stream:
    lib = _cudart()
    if lib is None:
        warnings.warn("tensile: no CUDA runtime library found in this process's memory map; "
                      "side streams come from torch.cuda.Stream, whose stream pool holds "
                      "about 70 MB of device memory outside the allocator", RuntimeWarning)
        return torch.cuda.Stream(index)
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):
        err = lib.cudaSetDevice(ctypes.c_int(index))
        if err == 0:
            err = lib.cudaStreamCreateWithFlags(ctypes.byref(handle),
                                                ctypes.c_uint(CUDA_STREAM_NON_BLOCKING))
    if err != 0:
        raise RuntimeError(f"cudaStreamCreateWithFlags failed on cuda:{index} "
                           f"(cudaError {err}) for the {role!r} stream")
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))


def side_stream(device: torch.device | str | int | None = None,
                role: str = "side") -> torch.cuda.Stream:
    """The process's non-blocking stream for ``role`` on ``device`` (created once).

    Distinct roles get distinct streams (the runtime's ``"d2h"`` and ``"h2d"`` copies must
    not queue behind each other); the same role always gets the same stream.
    """
    torch.cuda.init()
    return _side_stream(torch.cuda._utils._get_device_index(device, optional=True), role)
