"""Op times before and after measurement (TENSILE's cold start, reference §3.3 and §6).

* Cold start: every op's time is estimated from its FLOPs and bytes against the
  device's measured peak rates (a roofline: ``max(flops / peak_flops, bytes / peak_bw)``)
  plus a fixed launch overhead. TENSILE trained one MLP per op type for this; the
  roofline needs no training data and is what the reference suggests for a port (§11).
* Afterwards: measured op times (CUDA events) update the estimate by an exponential
  moving average, new sample weight 0.9 as in the authors' code, and a re-plan is due
  when a measured iteration time drifts more than 30 % from the reference (median of
  the last 5 iterations: one iteration time of a job sharing a GPU is too noisy to
  re-plan on, see :class:`DriftDetector`).

The ``measure_*`` helpers time the machine itself: peak compute and memory rates for
the roofline, and pinned host<->device copy bandwidth for the planner's copy channels.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Sequence

import torch

from .streams import side_stream

__all__ = [
    "estimate_op_times",
    "OpTimeModel",
    "DriftDetector",
    "measure_peak_rates",
    "measure_copy_bandwidth",
    "EWMA_NEW_WEIGHT",
    "DRIFT_THRESHOLD",
    "DRIFT_WINDOW",
    "DRIFT_MIN_REPORTS",
]

EWMA_NEW_WEIGHT = 0.9   # TENSILE: estimate = 0.9 * new sample + 0.1 * old estimate
DRIFT_THRESHOLD = 0.30  # TENSILE re-plans when a job's iteration time drifts > 30 %
DRIFT_WINDOW = 5        # ... measured as the median of the last 5 iteration times
DRIFT_MIN_REPORTS = 3   # ... and tested only once 3 came in since the reference was set


def estimate_op_times(graph, peak_flops: float, peak_bytes_per_s: float,
                      launch_overhead_ms: float = 0.005) -> list[float]:
    """Roofline time in ms of every node of a :class:`nimble.graph.TaskGraph`.

    ``peak_flops`` in FLOP/s and ``peak_bytes_per_s`` in bytes/s (device memory).
    The launch overhead keeps tiny ops from costing nothing and every time positive.
    """
    if not (peak_flops > 0 and peak_bytes_per_s > 0):
        raise ValueError(f"peak rates must be positive, got peak_flops={peak_flops!r}, "
                         f"peak_bytes_per_s={peak_bytes_per_s!r}")
    if not launch_overhead_ms > 0:
        raise ValueError(f"launch_overhead_ms must be positive, got {launch_overhead_ms!r}")
    out = []
    for n in graph.nodes:
        compute_s = n.flops / peak_flops
        memory_s = (n.bytes_read + n.bytes_written) / peak_bytes_per_s
        out.append(max(compute_s, memory_s) * 1e3 + launch_overhead_ms)
    return out


class DriftDetector:
    """Noise-robust drift test of one job's reported iteration times.

    One iteration time of a job sharing a GPU says little (H200, ResNet-50 batch 2 with
    co-runners: p10 36 ms, median 59 ms, p90 101 ms), and testing each one against 30 %
    re-planned dozens of times in 55 iterations. So the test compares the median of the
    last :data:`DRIFT_WINDOW` reports with the reference, and only once
    :data:`DRIFT_MIN_REPORTS` reports came in since :meth:`restart` (the reference was
    set), so a fresh reference is not judged by the reports that led up to it. A
    detection restarts the count itself: one change is reported once, not at every
    report until the caller's re-plan lands. The reports themselves are kept across
    restarts; :meth:`median_ms` is the job's recent typical iteration time.
    """

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=DRIFT_WINDOW)
        self.since_restart = 0

    def add(self, iter_ms: float) -> None:
        """Take one reported iteration time (ms)."""
        self._recent.append(float(iter_ms))
        self.since_restart += 1

    def restart(self) -> None:
        """A new reference was set: wait for :data:`DRIFT_MIN_REPORTS` reports again."""
        self.since_restart = 0

    @property
    def count(self) -> int:
        """How many reports :meth:`median_ms` is over (at most :data:`DRIFT_WINDOW`)."""
        return len(self._recent)

    def median_ms(self) -> float | None:
        """Median of the last :data:`DRIFT_WINDOW` reports; ``None`` before any."""
        return float(statistics.median(self._recent)) if self._recent else None

    def settled_ms(self) -> float | None:
        """The median once :data:`DRIFT_MIN_REPORTS` reports are in, else ``None``.

        What a reference is taken from: one or two reports may be outliers (the timed
        step, the step that grows the allocator, an unlucky overlap with a co-runner).
        """
        return self.median_ms() if len(self._recent) >= DRIFT_MIN_REPORTS else None

    def settle(self) -> float | None:
        """:meth:`settled_ms` taken as the new reference: the count restarts when there is
        one, so the reference is judged only by the reports that come after it."""
        reference = self.settled_ms()
        if reference is not None:
            self.restart()
        return reference

    def drifted(self, reference_ms: float, threshold: float = DRIFT_THRESHOLD) -> bool:
        """True when the median differs from ``reference_ms`` by more than ``threshold``."""
        if self.since_restart < DRIFT_MIN_REPORTS:
            return False
        if abs(self.median_ms() - reference_ms) <= threshold * reference_ms:
            return False
        self.restart()
        return True


def scaled_op_times(shape_ms: Sequence[float], iteration_ms: float) -> list[float]:
    """``shape_ms`` scaled to add up to ``iteration_ms``: op times for a step whose total was
    measured but whose ops were not, like a captured CUDA graph's replay (one launch, no
    per-op events). The shape should be the GPU's: the roofline estimates, not op times
    measured in a host-bound eager step, whose gaps between kernels are host time."""
    _check_times(shape_ms, "shape_ms")
    _check_times([iteration_ms], "iteration_ms")
    total = float(sum(shape_ms))
    return [float(x) * iteration_ms / total for x in shape_ms]


class OpTimeModel:
    """Per-op time estimates (ms) with EWMA updates and a drift test.

    ``reference_ms`` is the iteration time the current plan was made for: the sum of
    the op estimates at cold start; after :meth:`update` it is unset, the first
    iteration time passed to :meth:`drifted` is skipped and the median of the next
    :data:`DRIFT_MIN_REPORTS` becomes the reference (a median, not one sample: one
    noisy reference would make the smoothed times "drift" from it at once). A measured
    iteration includes gaps between ops that op times do not, the step that times every
    op runs slower than the others, and the first step under a new plan grows the
    allocator, so iterations are compared with ordinary ones under the plan. The test
    itself is :class:`DriftDetector`'s: the median of the last 5 iteration times, once
    3 came in since the reference was set.
    """

    def __init__(self, op_ms: Sequence[float]) -> None:
        _check_times(op_ms, "op_ms")
        self.op_ms = [float(x) for x in op_ms]
        self.reference_ms: float | None = float(sum(self.op_ms))
        self.updates = 0
        self._skip = 0
        self._drift = DriftDetector()

    def update(self, measured_op_ms: Sequence[float]) -> None:
        """Blend in one measured iteration: ``est = 0.9 * measured + 0.1 * est``."""
        if len(measured_op_ms) != len(self.op_ms):
            raise ValueError(f"expected {len(self.op_ms)} measured op times, "
                             f"got {len(measured_op_ms)}")
        _check_times(measured_op_ms, "measured_op_ms", allow_zero=True)
        w = EWMA_NEW_WEIGHT
        # A measured 0 (timer resolution) would make an op free; keep a floor.
        self.op_ms = [max(w * m + (1 - w) * e, 1e-6) for m, e in zip(measured_op_ms, self.op_ms)]
        self.updates += 1
        self.reference_ms = None
        self._skip = 1  # the first iteration under a new plan grows the allocator: not typical
        self._drift = DriftDetector()  # times under the old plan say nothing about the new one

    def reset(self, op_ms: Sequence[float]) -> None:
        """Replace the estimates (e.g. with :func:`scaled_op_times` for a captured step);
        their sum becomes the reference iteration time."""
        if len(op_ms) != len(self.op_ms):
            raise ValueError(f"expected {len(self.op_ms)} op times, got {len(op_ms)}")
        _check_times(op_ms, "op_ms")
        self.op_ms = [float(x) for x in op_ms]
        self.reference_ms = float(sum(self.op_ms))
        self._skip = 0
        self._drift = DriftDetector()

    def drifted(self, measured_iter_ms: float, threshold: float = DRIFT_THRESHOLD) -> bool:
        """True when the recent iteration times drift more than 30 % from the reference.

        Without a reference (just after :meth:`update`) the times go into the new one.
        """
        _check_times([measured_iter_ms], "measured_iter_ms", allow_zero=True)
        if self.reference_ms is None and self._skip:
            self._skip -= 1
            return False
        self._drift.add(measured_iter_ms)
        if self.reference_ms is None:
            self.reference_ms = self._drift.settle()
            return False
        return self._drift.drifted(self.reference_ms, threshold)


def measure_peak_rates(device: torch.device | str, dtype: torch.dtype = torch.float32,
                       matmul_n: int | None = None, copy_mib: int | None = None,
                       repeats: int = 5) -> tuple[float, float]:
    """Measured ``(peak FLOP/s, memory bytes/s)`` of ``device`` for the roofline.

    FLOP/s from a square matmul in ``dtype``; bytes/s from a device-to-device copy
    (read + write counted). Sizes default to something that saturates an H200 on CUDA
    and takes well under a second on a CPU.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = matmul_n or (8192 if cuda else 512)
    mib = copy_mib or (1024 if cuda else 64)
    rates = _time_mm_and_copy(device, dtype, n, mib << 20, repeats)
    if cuda:
        torch.cuda.empty_cache()  # give the scratch buffers back: they would skew memory readings
    return rates


def _time_mm_and_copy(device: torch.device, dtype: torch.dtype, n: int, nbytes: int,
                      repeats: int) -> tuple[float, float]:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = _best_time(lambda: torch.mm(a, b), device, repeats)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cp_s = _best_time(lambda: dst.copy_(src), device, repeats)
    return 2.0 * n ** 3 / mm_s, 2.0 * nbytes / cp_s


def measure_copy_bandwidth(device: torch.device | str, mib: int = 256,
                           repeats: int = 5) -> tuple[float, float]:
    """Measured ``(device→host, host→device)`` bytes/s with a pinned host buffer.

    Each direction is timed alone on its own stream with CUDA events, as the runtime
    copies. On a CPU device (the runtime's simulation mode) both are a host memcpy.
    """
    device = torch.device(device)
    if device.type != "cuda":
        src = torch.empty(mib << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        s = _best_time(lambda: dst.copy_(src), device, repeats)
        return src.numel() / s, src.numel() / s
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    rates = []
    for dst, src, role in ((host, dev, "d2h"), (dev, host, "h2d")):
        with torch.cuda.stream(side_stream(device, role)):   # the runtime's copy streams
            s = _best_time(lambda: dst.copy_(src, non_blocking=True), device, repeats)
        rates.append(host.numel() / s)
    return rates[0], rates[1]


def _best_time(fn, device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` runs of ``fn`` in seconds (CUDA events on a GPU)."""
    fn()  # warm-up: lazy init, cuBLAS handles, page faults
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _check_times(xs: Sequence[float], what: str, allow_zero: bool = False) -> None:
    for k, x in enumerate(xs):
        ok = isinstance(x, (int, float)) and math.isfinite(x) and (x >= 0 if allow_zero else x > 0)
        if not ok:
            raise ValueError(f"{what}[{k}] must be a {'non-negative' if allow_zero else 'positive'} "
                             f"finite number of ms, got {x!r}")
