"""The GPU memory a process's CUDA context reserves for thread stacks, and trimming it.

    released = tensile.trim_stack()          # bytes given back to the GPU, at once
    tensile.stack_reservation().bytes        # what the context holds for stacks now

Why: the CUDA driver reserves local memory ("stack") for every thread the GPU can hold at
once: the per-thread stack size x the SMs x the most threads an SM holds. The size starts
at 1 KiB, so a context holds 264 MiB for it on an H200 (132 SMs x 2048 threads), outside
PyTorch's caching allocator, in every process, from its first CUDA call. The driver grows
the size when a kernel that needs more is launched and never shrinks it by itself. The
kernels of the TENSILE models' training steps need far less: on the H200 (torch 2.11,
cuDNN 9.19) the size came back to 160 bytes (32 for DenseNet-121) after a trim, so 222
MiB of each job's 770 MiB outside its allocator was stack nobody used
(``results/h200/README.md``, thirty-second session). On a GPU shared by several training
processes that is memory a plan cannot reach: TENSILE's multi-job MSR is taken on NVML's
device memory, where it counts once per process.

How: ``cudaDeviceSetLimit(cudaLimitStackSize, 0)`` through the CUDA runtime library the
process already mapped (:func:`tensile.streams.find_cudart`), on the device made current.
The CUDA documentation of ``cuCtxSetLimit``: the driver "automatically increases the
per-thread stack size for each kernel launch as needed", and setting the limit blocks
until the device's preceding work is done. A later eager launch that needs more stack gets
it (a one-off wait for the device when it grows), and no kernel or result changes. Trim
after warm-up (cuDNN's benchmark tries many kernels; the reservation keeps the largest
stack any of them needed), and before capturing CUDA graphs.

Hazard, CUDA graphs: a graph keeps the stack size of the moment it was instantiated. On
the H200 (driver 580, torch 2.11) every ResNet-50 and DenseNet-121 training-step graph
captured before a trim failed its first replay after it ("unspecified launch failure", or
a segfault), also after eager steps had grown the limit again and also beside a graph
captured after the trim; graphs captured after the trim replayed correctly, and so did the
pre-trim graph once the limit was set back to the size it was captured at
(``results/h200/excluded/trim_probe_20261203.*``). So every trim counts
(:func:`trim_count`): :class:`tensile.GraphStep` refuses to replay a graph captured
before the latest trim, and :meth:`tensile.Scheduler.replay` captures such a step again.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .streams import _cudart

__all__ = ["StackReservation", "stack_reservation", "trim_count", "trim_stack"]

CUDA_LIMIT_STACK_SIZE = 0   # cudaLimitStackSize

_trims = 0                  # successful trim_stack calls in this process (module notes)


@dataclass(frozen=True)
class StackReservation:
    """What one device's context reserves for thread stacks: ``bytes_per_thread`` (the
    current stack size limit) x ``threads`` (SMs x the most threads an SM holds)."""

    bytes_per_thread: int
    threads: int

    @property
    def bytes(self) -> int:
        return self.bytes_per_thread * self.threads


def _device(device: torch.device | str | int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("the thread-stack reservation belongs to a CUDA context: this "
                           "process has no usable CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device!r}")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _runtime():
    lib = _cudart()
    if lib is None:
        raise RuntimeError("no CUDA runtime library (libcudart) is mapped into this process "
                           "(a static build, or no /proc/self/maps): the stack limit cannot be set")
    return lib


def _check(rc: int, call: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{call} failed with CUDA error {rc}")


def _threads(dev: torch.device) -> int:
    props = torch.cuda.get_device_properties(dev)
    return props.multi_processor_count * props.max_threads_per_multi_processor


def stack_reservation(device: torch.device | str | int | None = None) -> StackReservation:
    """The thread-stack reservation of ``device``'s context (default: the current device)."""
    dev = _device(device)
    lib = _runtime()
    size = ctypes.c_size_t()
    with torch.cuda.device(dev):
        torch.cuda.init()
        _check(lib.cudaDeviceGetLimit(ctypes.byref(size), ctypes.c_int(CUDA_LIMIT_STACK_SIZE)),
               "cudaDeviceGetLimit(cudaLimitStackSize)")
    return StackReservation(bytes_per_thread=int(size.value), threads=_threads(dev))


def trim_stack(device: torch.device | str | int | None = None) -> int:
    """Give back the thread-stack memory ``device``'s context reserved (module notes):
    set the stack size limit to 0, which the driver raises again for any later kernel
    that needs stack. Returns the bytes released. Waits for the device's queued work; not
    allowed while a CUDA graph is being captured. CUDA graphs captured before the trim
    must be captured again (module notes)."""
    global _trims
    dev = _device(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("trim_stack waits for the device: call it outside a CUDA graph capture")
    before = stack_reservation(dev)
    with torch.cuda.device(dev):
        _check(_runtime().cudaDeviceSetLimit(ctypes.c_int(CUDA_LIMIT_STACK_SIZE), ctypes.c_size_t(0)),
               "cudaDeviceSetLimit(cudaLimitStackSize, 0)")
    _trims += 1
    return before.bytes - stack_reservation(dev).bytes


def trim_count() -> int:
    """How many times :func:`trim_stack` changed the stack limit in this process: a CUDA
    graph captured when the count was lower must not be replayed (module notes)."""
    return _trims
