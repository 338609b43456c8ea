"""Where a backend's time goes on the GPU: a kernel census of its calls.

Each backend prepares the model as in ``experiments.run``; its calls then run under the
PyTorch profiler (CUPTI), one at a time, each after a marker kernel so the GPU tasks of one
call are told from the next's. Per call (means over the calls):

* ``kernels``: GPU tasks (kernels, memcpys, memsets) issued;
* ``kernel_ms``: their summed durations (what they cost one after the other);
* ``busy_ms``: the time at least one of them runs (the union of their intervals: below
  ``kernel_ms`` when streams overlap);
* ``copy_ms``: the summed durations of its memory copies (``Memcpy ...``), which the copy
  engines run beside the kernels;
* ``compute_busy_ms``: the time at least one task other than a copy runs: with copies
  beside the kernels (a TENSILE plan's swaps), ``busy_ms`` counts time the compute units
  wait as busy, this does not;
* ``span_ms``: the call's first task start to its last task end, under the profiler (which
  slows every launch down: an eager call's span is about twice its latency);
* ``busy_share = busy_ms / median_ms``, ``median_ms`` being the call's latency by the timing
  protocol (CUDA events, no profiler) in the same process: the share of the latency in which
  the GPU runs something. The rest is the GPU waiting for the host (launches; for a graph,
  its launch after the input copy) or between dependent kernels. Near 1, the kernels bound
  the call: only fewer or faster kernels make it faster, not scheduling.

    python -m experiments.kernels --models mobilenet_v2,efficientnet_b0 --batch 1 \\
        --backends eager,nimble,nimble-inductor-freeze

Rows go to ``<results>/<gpu>/kernels.csv`` (one per model x batch x backend, with the
environment and the ten costliest kernel names); the report prints them. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from tqdm import tqdm

from .cli import int_list, model_list
from .env import environment, gpu_slug, host_load
from .store import append_table_row
from .models import build_model, example_input
from .timing import measure

__all__ = ["Census", "summarize", "census", "kernel_diff", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
TOP = 10    # kernel names kept per row
_MARK_NAME, _MARK_CYCLES = "spin_kernel", 1000     # the marker between calls (torch.cuda._sleep)
# The row's own columns, in order (the environment's follow); a failed backend leaves the
# figures empty, so every row of the file has the same columns.
COLUMNS = ["model", "batch_size", "backend", "status", "reason", "median_ms", "prepare_s", "calls",
           "kernels", "kernel_ms", "busy_ms", "span_ms", "busy_share", "top_kernels"]


@dataclass
class Census:
    """Per-call figures (means over ``calls`` calls, see the module docstring)."""

    calls: int
    kernels: float
    kernel_ms: float
    busy_ms: float
    span_ms: float
    top: list[tuple[str, float, float]]     # (name, launches per call, us per call), costliest first
    # every name's (launches per call, us per call): what :func:`kernel_diff` compares
    by_name: dict[str, tuple[float, float]] = field(default_factory=dict)
    copy_ms: float = 0.0
    compute_busy_ms: float = 0.0


def is_copy(name: str) -> bool:
    """Whether the profiler's GPU task ``name`` is a memory copy (run by a copy engine)."""
    return name.startswith("Memcpy")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """The time at least one of ``intervals`` (start, end) covers."""
    if not intervals:
        return 0.0
    intervals = sorted(intervals)
    total, (run_start, run_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > run_end:             # a gap: close the busy run so far
            total += run_end - run_start
            run_start = start
        run_end = max(run_end, end)
    return total + run_end - run_start


def summarize(tasks: Iterable[tuple[int, str, float, float]], calls: int) -> Census:
    """The census of GPU ``tasks`` (call index, name, start us, end us) of ``calls`` calls."""
    if calls < 1:
        raise ValueError(f"calls: expected at least 1, got {calls}")
    per_call: dict[int, list[tuple[float, float]]] = defaultdict(list)
    compute: dict[int, list[tuple[float, float]]] = defaultdict(list)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for call, name, start, end in tasks:
        if end < start:
            raise ValueError(f"task {name!r} ends ({end}) before it starts ({start})")
        if not 0 <= call < calls:
            raise ValueError(f"task {name!r} belongs to call {call}; expected 0..{calls - 1}")
        per_call[call].append((start, end))
        if not is_copy(name):
            compute[call].append((start, end))
        by_name[name][0] += 1
        by_name[name][1] += end - start
    if len(per_call) < calls:
        missing = sorted(set(range(calls)) - set(per_call))
        raise ValueError(f"no GPU task was recorded in call(s) {missing[:5]}: did they run on a "
                         "CUDA device?")
    busy_us = sum(_union_us(intervals) for intervals in per_call.values())
    compute_us = sum(_union_us(intervals) for intervals in compute.values())
    span_us = sum(max(end for _, end in intervals) - min(start for start, _ in intervals)
                  for intervals in per_call.values())
    kernel_us = sum(total for _, total in by_name.values())
    every = {name: (count / calls, total / calls) for name, (count, total) in by_name.items()}
    top = sorted(every.items(), key=lambda kv: -kv[1][1])[:TOP]
    return Census(calls=calls, kernels=sum(map(len, per_call.values())) / calls,
                  kernel_ms=kernel_us / calls / 1e3, busy_ms=busy_us / calls / 1e3,
                  span_ms=span_us / calls / 1e3,
                  top=[(name, count, us) for name, (count, us) in top], by_name=every,
                  copy_ms=sum(t for n, (_, t) in by_name.items() if is_copy(n)) / calls / 1e3,
                  compute_busy_ms=compute_us / calls / 1e3)


def kernel_diff(base: dict[str, tuple[float, float]], other: dict[str, tuple[float, float]],
                top: int = TOP) -> list[tuple[str, float, float]]:
    """The kernel names whose time per call changes most from ``base`` to ``other``
    (:attr:`Census.by_name` of each): ``(name, launches added, us added)`` per call, the
    largest change first (a name missing on one side counts as zero there)."""
    names = set(base) | set(other)
    diff = [(n, other.get(n, (0.0, 0.0))[0] - base.get(n, (0.0, 0.0))[0],
             other.get(n, (0.0, 0.0))[1] - base.get(n, (0.0, 0.0))[1]) for n in names]
    return sorted(diff, key=lambda d: (-abs(d[2]), d[0]))[:top]


def census(fn: Callable, inputs: Sequence[torch.Tensor], calls: int = 20, warmup: int = 20,
           no_grad: bool = True) -> Census:
    """Run ``fn(*inputs)`` ``calls`` times under the profiler, each synchronised; their census.

    Between two calls a short spin kernel (``torch.cuda._sleep``) runs alone: it marks where
    one call's GPU tasks end and the next's begin, and is left out of the census. Only CUDA
    activity is recorded, so the profiler adds no host work to a call. ``no_grad`` (inference
    calls); a training step passes False.
    """
    from torch.profiler import ProfilerActivity, profile
    if not all(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
        raise ValueError("census counts CUDA kernels: the inputs must be CUDA tensors")
    with torch.set_grad_enabled(not no_grad):
        for _ in range(warmup):
            fn(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                torch.cuda._sleep(_MARK_CYCLES)
                torch.cuda.synchronize()
                fn(*inputs)
                torch.cuda.synchronize()
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    tasks, call = [], -1
    for start, end, name in gpu:
        if _MARK_NAME in name:
            call += 1
        elif call >= 0:
            tasks.append((call, name, float(start), float(end)))
    if call + 1 != calls:
        raise RuntimeError(f"census: found {call + 1} call markers, expected {calls}")
    return summarize(tasks, calls)


def measure_backend(name: str, batch_size: int, backend: str, *, iters: int = 200) -> dict:
    """Prepare ``name`` with ``backend`` (inference), time it, count its kernels: one row."""
    from baselines import get_backend, try_prepare
    model = build_model(name).cuda().eval()
    x = example_input(name, batch_size, "cuda")
    row = {"model": name, "batch_size": batch_size, "backend": backend}
    result = try_prepare(get_backend(backend), model, (x,), device="cuda")
    if result.status != "ok":
        return {**row, "status": result.status, "reason": result.reason}
    timing = measure(result.fn, (x,), warmup=50, iters=iters)
    found = asdict(census(result.fn, (x,)))
    top = found.pop("top")
    for key in ("by_name", "copy_ms", "compute_busy_ms"):   # the row keeps COLUMNS' figures
        found.pop(key)
    return {**row, "status": "ok", "reason": "", "median_ms": timing.median_ms,
            "prepare_s": round(result.prepare_s, 2), **found,
            "busy_share": found["busy_ms"] / timing.median_ms,
            "top_kernels": json.dumps([[n[:120], round(c, 2), round(us, 2)] for n, c, us in top])}


def main(argv: list[str] | None = None) -> int:
    from baselines import BACKENDS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, type=model_list,
                        help="comma-separated model names (experiments.models)")
    parser.add_argument("--batch", type=int_list, default=[1], help="batch sizes, e.g. 1,32")
    parser.add_argument("--backends", default="eager,nimble", help="comma-separated backend names")
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="results folder")
    parser.add_argument("--iters", type=int, default=200, help="timed calls (>= 100 for the protocol)")
    args = parser.parse_args(argv)
    names = args.models
    backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; registered: {sorted(BACKENDS)}")
    if not torch.cuda.is_available():
        parser.error("this experiment counts CUDA kernels: no CUDA device is available here")
    out = Path(args.results) / gpu_slug() / "kernels.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    jobs = [(m, b, k) for m in names for b in args.batch for k in backends]
    # the sweep's settings (conf/device/cuda.yaml), recorded in every row
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    for name, batch, backend in tqdm(jobs, desc="kernel census", unit="backend"):
        found = measure_backend(name, batch, backend, iters=args.iters)
        row = {**{c: found.get(c) for c in COLUMNS}, **environment("cuda"), **host_load()}
        append_table_row(out, row)
        if row["status"] == "ok":
            print(f"{name} b{batch} {backend}: {row['median_ms']:.3f} ms, {row['kernels']:.0f} kernels, "
                  f"{row['kernel_ms']:.3f} ms of kernels, busy {row['busy_share']:.2f}", flush=True)
        else:
            print(f"{name} b{batch} {backend}: {row['status']}: {row['reason']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
