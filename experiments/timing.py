"""Latency measurement with the suite's timing protocol.

Protocol (project guide): warm up before timing (cuDNN autotuning, lazy init, allocator, graph
capture all happen there); then time every iteration on its own — on CUDA with one event pair
around the call, followed by a synchronize, so iterations never overlap and each sample is one
complete batch; report the median and p10/p90 (plus mean/std, which the paper reported). Each
iteration also gets a host ``perf_counter`` time (``wall_ms``): events can hide host launch cost
when the GPU is starved, and that host cost is exactly what Nimble removes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["Timing", "measure", "summarize_ms", "peak_memory", "allocated_mb"]

MB = 2**20


@dataclass
class Timing:
    """Summary of ``iters`` timed calls, in milliseconds; ``samples`` are the per-call times."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    std_ms: float
    wall_ms: float
    samples: list[float] = field(default_factory=list, repr=False)


def _is_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda"


def measure(fn: Callable[..., Any], inputs: Sequence[Any], *, warmup: int = 50, iters: int = 200,
            device: str | torch.device = "cuda") -> Timing:
    """Time ``fn(*inputs)``: ``warmup`` untimed calls, then ``iters`` timed ones.

    On CUDA each sample is the CUDA-event time of one call on the current stream (the call is
    synchronised before the next starts); on CPU it is the ``perf_counter`` time. ``wall_ms`` is
    the median host time of a call including the synchronize.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    cuda = _is_cuda(device)
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("measure(device='cuda') on a host without CUDA; use device='cpu'")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    for _ in range(warmup):
        fn(*inputs)
    sync()

    gpu_ms: list[float] = []
    wall_ms: list[float] = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn(*inputs)
            end.record()
            end.synchronize()
            wall_ms.append((time.perf_counter() - t0) * 1e3)
            gpu_ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*inputs)
            wall_ms.append((time.perf_counter() - t0) * 1e3)
    samples = gpu_ms if cuda else wall_ms
    return Timing(**_statistics(samples), wall_ms=float(np.median(wall_ms)),
                  samples=[float(x) for x in samples])


def _statistics(samples: Sequence[float]) -> dict[str, float]:
    """``median_ms``, ``p10_ms``, ``p90_ms``, ``mean_ms``, ``std_ms`` of times in ms."""
    arr = np.asarray(samples, dtype=float)
    return {"median_ms": float(np.median(arr)), "p10_ms": float(np.percentile(arr, 10)),
            "p90_ms": float(np.percentile(arr, 90)), "mean_ms": float(arr.mean()),
            "std_ms": float(arr.std(ddof=1)) if arr.size > 1 else 0.0}


def summarize_ms(samples: Sequence[float]) -> dict[str, float]:
    """:func:`measure`'s statistics of step times in ms, rounded to 0.1 µs (what the result
    rows store)."""
    return {k: round(v, 4) for k, v in _statistics(samples).items()}


def allocated_mb(device: str | torch.device = "cuda") -> float:
    """Memory currently allocated by PyTorch's caching allocator on ``device`` (NaN on CPU)."""
    if not _is_cuda(device) or not torch.cuda.is_available():
        return math.nan
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) / MB


def peak_memory(fn: Callable[..., Any], inputs: Sequence[Any],
                device: str | torch.device = "cuda") -> float:
    """Peak allocated memory (MB) during one call of ``fn(*inputs)``, NaN on CPU.

    Counts everything alive at the peak, including parameters and memory the prepared callable
    holds (e.g. a CUDA graph's private pool), not only the call's own temporaries.
    """
    if not _is_cuda(device) or not torch.cuda.is_available():
        return math.nan
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn(*inputs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / MB
