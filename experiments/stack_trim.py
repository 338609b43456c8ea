"""What a training process holds for thread stacks and cuBLAS workspaces, what
:func:`tensile.trim_stack` and :func:`tensile.trim_blas_workspace` give back, and whether the
step slows down after them.

    python -m experiments.stack_trim --models resnet50,densenet121 --batch 2,16

Each model and batch size runs in a fresh process (a new CUDA context): the TENSILE
workload's training step (Adam, 1000 classes, :func:`tensile.training_step`) is captured in
a CUDA graph (:class:`tensile.GraphStep`) after its warm-up, its replay is timed (the
suite's protocol: CUDA events, ``--iters`` timed replays after 20 untimed), the stack is
trimmed, the step is captured again (a graph captured before a trim must not be replayed:
:mod:`tensile.stack`), and its replay is timed again in the same process; then the cuBLAS
workspaces are trimmed (:mod:`tensile.workspace`), the step captured and timed a third time
(``*_blas`` columns; ``allocated_mb_<stage>``: the allocator's allocated bytes after each
capture, workspaces included). Memory outside
the caching allocator = the device's used memory as NVML counts it, less what NVML saw used
before the process touched CUDA (``idle_mb``: the driver's own and other processes'
contexts, such as ``make reproduce``'s own) and what the allocator reserved. Without
nvidia-ml-py it is ``cudaMemGetInfo``'s used memory less the reservation (run on an
otherwise idle GPU then); ``outside_source`` names which. Rows go to
``<results>/<gpu>/stack_trim.csv``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from .cli import int_list, model_list

__all__ = ["measure_trim", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
MB = 2**20
PREFIX = "STACK_TRIM "


def _nvml_used_mb() -> float | None:
    """The GPU's used memory as NVML counts it (all processes and the driver's own), or
    None without nvidia-ml-py."""
    try:
        import pynvml
    except ImportError:
        return None
    from .tensile_multi import _nvml_handle   # the GPU CUDA numbers 0 here
    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(pynvml, None)).used / MB
    finally:
        pynvml.nvmlShutdown()


def _outside_mb(idle_mb: float | None) -> float:
    """What this process holds on the device outside its caching allocator, in MB: NVML's
    used memory now less ``idle_mb`` and the allocator's reservation. Both from NVML:
    ``cudaMemGetInfo`` leaves out of its total the memory NVML shows used on an idle GPU
    (618 MiB on the H200), so used-from-cudaMemGetInfo minus NVML's idle came out 618 MiB
    low (22a9be9's rows). Without NVML: cudaMemGetInfo's used less the reservation
    (other processes then count)."""
    import torch
    torch.cuda.synchronize()
    used = _nvml_used_mb() if idle_mb is not None else None
    if used is None:
        free, total = torch.cuda.mem_get_info()
        used, idle_mb = (total - free) / MB, 0.0
    return used - idle_mb - torch.cuda.memory_reserved() / MB


def measure_trim(name: str, batch_size: int, iters: int = 200) -> dict:
    """One row: the captured step of ``name`` at ``batch_size`` timed before and after
    :func:`tensile.trim_stack`, and after :func:`tensile.trim_blas_workspace` as well, with
    the memory at each stage. Call in a fresh process."""
    import torch

    import tensile
    from tensile import GraphStep, training_step

    from .env import environment
    from .models import build_model, example_input
    from .tensile_run import _drop_aux_head, classification_loss
    from .timing import measure

    if not torch.cuda.is_available():
        raise RuntimeError("experiments.stack_trim trims a CUDA context: no CUDA device is available here")
    idle = _nvml_used_mb()   # the idle GPU: before this process's first CUDA call
    model = _drop_aux_head(build_model(name, num_classes=1000)).train().cuda()
    batch = (example_input(name, batch_size, "cuda"),
             torch.randint(0, 1000, (batch_size,), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    training_step(model, opt, batch, classification_loss)   # the optimizer's state

    def capture() -> GraphStep:
        return GraphStep(lambda b, capturing: training_step(model, opt, b, classification_loss),
                         batch, model, opt)

    step = capture()
    row = {"model": name, "batch_size": batch_size, "iters": iters, "idle_mb": idle,
           "outside_source": "nvml" if idle is not None else "cudaMemGetInfo"}
    timings = {}
    for when in ("before", "after", "blas"):
        if when != "before":
            del step   # captured before the trim: it must not replay after it
            torch.cuda.empty_cache()
            if when == "after":
                row["released_mb"] = tensile.trim_stack() / MB
                row["outside_mb_trimmed"] = _outside_mb(idle)
            else:
                row["blas_released_mb"] = tensile.trim_blas_workspace() / MB
            step = capture()
        row[f"allocated_mb_{when}"] = torch.cuda.memory_allocated() / MB
        row[f"stack_bytes_per_thread_at_capture_{when}"] = tensile.stack_reservation().bytes_per_thread
        t = measure(step, batch, warmup=20, iters=iters)
        timings[when] = t
        stack = tensile.stack_reservation()
        row.update({f"step_ms_{when}": t.median_ms, f"p10_ms_{when}": t.p10_ms,
                    f"p90_ms_{when}": t.p90_ms, f"outside_mb_{when}": _outside_mb(idle),
                    f"stack_bytes_per_thread_{when}": stack.bytes_per_thread,
                    f"stack_mb_{when}": stack.bytes / MB})
    row["reserved_mb"] = torch.cuda.memory_reserved() / MB
    row["saved_mb"] = row["outside_mb_before"] - row["outside_mb_after"]
    row["step_ratio"] = timings["after"].median_ms / timings["before"].median_ms
    row["blas_step_ratio"] = timings["blas"].median_ms / timings["after"].median_ms
    return {**row, **environment("cuda")}


def _child(name: str, batch: int, iters: int) -> dict:
    cmd = [sys.executable, "-m", "experiments.stack_trim", "--child", f"{name}:{batch}",
           "--iters", str(iters)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    for line in out.stdout.splitlines():
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX):])
    raise RuntimeError(f"{name} b{batch}: the measuring process failed (rc {out.returncode}):\n"
                       f"{out.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=model_list,
                        default=["vgg16", "inception_v3", "inception_v4", "resnet50", "densenet121"],
                        help="comma-separated model names (default: TENSILE's five)")
    parser.add_argument("--batch", type=int_list, default=[2, 16], help="batch sizes (default 2,16)")
    parser.add_argument("--iters", type=int, default=200, help="timed replays each side (>= 100)")
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="results folder")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)   # MODEL:BATCH, one row
    args = parser.parse_args(argv)
    if args.iters < 100:
        parser.error(f"--iters must be >= 100 (the suite's timing protocol), got {args.iters}")
    if args.child:
        name, batch = args.child.rsplit(":", 1)
        print(PREFIX + json.dumps(measure_trim(name, int(batch), args.iters)), flush=True)
        return 0
    import torch

    from .env import gpu_slug
    from .store import append_table_row
    # This process stays without a CUDA context (is_available asks the driver only): its
    # own context would count in every child's memory outside the allocator.
    if not torch.cuda.is_available():
        parser.error("this experiment trims a CUDA context: no CUDA device is available here")
    jobs = [(m, b) for m in args.models for b in args.batch]
    for name, batch in tqdm(jobs, desc="stack_trim", unit="job"):
        row = _child(name, batch, args.iters)
        out = Path(args.results) / gpu_slug(row["gpu"]) / "stack_trim.csv"
        out.parent.mkdir(parents=True, exist_ok=True)
        append_table_row(out, row)
        print(f"{name} b{batch}: stack {row['stack_mb_before']:.0f} MiB "
              f"({row['stack_bytes_per_thread_before']} B/thread) -> released "
              f"{row['released_mb']:.0f} MiB, back to {row['stack_bytes_per_thread_after']} B/thread; "
              f"outside the allocator {row['outside_mb_before']:.0f} -> {row['outside_mb_after']:.0f} MiB; "
              f"step {row['step_ms_before']:.3f} -> {row['step_ms_after']:.3f} ms "
              f"({row['step_ratio']:.3f}x); cuBLAS workspaces {row['blas_released_mb']:.0f} MiB "
              f"released, step {row['step_ms_blas']:.3f} ms ({row['blas_step_ratio']:.3f}x)",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
