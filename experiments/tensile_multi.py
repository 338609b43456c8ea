"""Several TENSILE training jobs sharing one GPU: the measurement harness of issue 7.

    python -m experiments.tensile_multi --scenario copies --models vgg16,resnet50 --copies 1,2,3

Every *setting* (a set of jobs) runs twice with the same jobs, each job its own Python
process (``python -m experiments.tensile_multi --job SPEC.json``):

1. **vanilla**: every job trains with plain PyTorch (:func:`tensile.step.training_step`,
   the step TENSILE records and replays);
2. **tensile**: a fresh scheduler process (:func:`tensile.server.spawn` on a Unix socket in
   a temporary directory, ``--budget`` for all jobs together, or ``--budget-share``: that
   share of their joint peak without plans, at every re-plan) and the same jobs through
   ``tensile.Scheduler(..., scheduler_socket=..., job_id=..., weight=...)``.

A job builds its model, Adam and random batch as ``experiments/tensile_run.py`` does (224x224
inputs, 1000 classes, Inception-v3 without its auxiliary head). All job processes of a phase
start at once and build their model on the CPU; a job *arrives* when the harness tells it to:
it then moves to the GPU (under TENSILE: records one step and registers with the scheduler,
which re-plans) and trains ``--warmup + --iters`` steps. Scenarios:

* ``copies``: each model of ``--models`` with k concurrent copies, for every k in ``--copies``;
* ``mdw``: all of ``--models`` at once, one copy each (the authors' "MDW").
  In both, all jobs arrive together, start training together once all are ready and start
  their measured steps together once all have done their ``--warmup`` steps.
* ``dynamic``: one job per entry of ``--models`` (repeats allowed), in that order. Job 0
  arrives first; job k arrives when job 0 has finished ``--arrive-every`` steps since job
  k-1 was ready (or when job 0 or job k-1 has died). Jobs with an odd k leave early, after
  ``warmup + max(1, iters // 2)`` steps; the others (job 0 included) train at least
  ``warmup + iters`` steps and on until every early leaver has gone and job 0 has done
  ``--arrive-every`` steps since the last exit, so that arrivals and departures always
  meet running jobs.

While a phase runs, a thread of this process samples the whole GPU's used memory through
NVML every ~20 ms (device from ``--gpu-index``, else the first entry of
``CUDA_VISIBLE_DEVICES``, else 0; the jobs get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA and
NVML number GPUs alike), with events when a job's process starts, when it arrives, when it
is ready (on the device, registered) and when it exits. On CPU
(no NVML) it samples the summed RSS of the job processes instead (``memory_source`` = ``rss``
in the row). The timeline goes to ``<results_dir>/<gpu>/tensile_multi_timeline_<setting>_<date>.csv``
and a plot of it to ``<results_dir>/<gpu>/tensile_multi_<setting>_<date>.png`` (``<date>``: the
rows' date, YYYYMMDDTHHMMSS, so a later run of a setting keeps the earlier files).

Rows (``<results_dir>/<gpu>/tensile_multi.csv``, :mod:`experiments.store`): one per job per
setting (``backend`` = the job id) and one per setting with ``backend`` = ``GPU``. ``mode`` is
the setting's label. Metrics (the row's ``extra`` JSON unless a column):

* per job, over its measured steps (after ``--warmup``; with ``--captured`` a step that
  captured a graph is left out, as set-up: ``measured_captures_<phase>`` counts them and
  ``measured_capture_ms_<phase>`` sums their time): ``median_ms``/``p10_ms``/``p90_ms``
  (columns: tensile phase) and ``iter_ms_{median,p10,p90,mean}_{vanilla,tensile}``;
  ``peak_alloc_*_mb`` / ``peak_reserved_*_mb`` (``torch.cuda.max_memory_allocated`` /
  ``_reserved`` over those steps, :class:`SteadyPeaks`; a replayed graph's allocated peak
  is that of its capture; empty on CPU); ``msr_alloc`` / ``msr_reserved`` = 1 - peak_tensile /
  peak_vanilla; ``eor`` = mean_tensile / mean_vanilla - 1; ``cbr`` = msr_alloc / eor (empty
  when eor <= 0), all by :func:`experiments.tensile_run.derived_metrics`;
  ``cold_start_msr`` = the same MSR on the peaks of each job's FIRST step (the scheduler's
  first plan comes from estimated op times); ``replans`` = plan versions the job ran after
  its first one (``plan_versions`` lists them); ``iters_to_steady`` = the first step (0-based,
  warm-up included) after which every iteration time stays within 10 % of the measured
  median, empty if the last one is not; ``passive_swapins``, ``swap_ins``, ``bytes_swapped``
  (D2H + H2D), ``recomputes`` over the measured steps (``Scheduler.report()``; counted on
  the host, so 0 in a captured job's replays); ``swaps_planned``, ``recomputes_planned``,
  ``recomputes_by_op`` (its recomputes by the producing op's name), ``est_overhead_ms``: the
  job's last plan (what a captured job's graph runs); ``bn_rerun_share_median``: with
  ``--bn-from-stats``, the median share of a batch norm's time its rebuild from statistics
  took, what the plan priced those recomputes at (empty without); what the
  last plan assumed beside what the timed steps measured (``SchedulerReport.plan_check()``:
  ``plan_iteration_ms``, ``d2h_gbps_measured``, ``h2d_gbps_measured``,
  ``stall_ms_per_timed_step``); ``outside_allocator_mb_{vanilla,tensile}``: the device's used
  memory minus the job's allocator reservation at stages (``on_device`` after the model and
  batch moved, ``scheduler`` after TENSILE's set-up, ``first_step``, ``trimmed`` right after a
  ``--trim-stack``, ``last_step``; empty on CPU): with one job on the GPU, its growth between
  stages is what the process added outside its allocator; ``stack_released_mb_<phase>``: what
  ``--trim-stack`` gave back (:func:`tensile.trim_stack`; empty where the phase did not trim);
  ``blas_released_mb_<phase>``: what ``--trim-blas`` gave back (:func:`tensile.trim_blas_workspace`);
  ``compacted_<phase>``: what ``--compact`` did (tensors ``moved`` / ``moved_mb``, ``kept`` in
  place, ``released_mb`` of the allocator's reservation; empty where the phase did not compact);
  ``capture_s_<phase>``: with ``--captured``, one entry per capture, the seconds its set-up
  took by part (``tensile.Scheduler.capture_s``; the vanilla jobs' ``warmup`` and ``capture``
  alone);
* per setting (``GPU`` row): ``msr_nvml`` = 1 - (peak - idle) / (peak_vanilla - idle_vanilla)
  of the sampled device memory (idle: before the first arrival), with the peak taken over the
  samples where no job is between its arrival and its first measured step (that start-up
  includes TENSILE's recording step, which runs at vanilla memory, and the warm-up steps,
  where a captured job's first steps run uncaptured, above its graph's memory; grey in the
  plot) nor, with ``--captured``, in a step that captured a graph: the window in which the
  allocator peaks are taken too; for jobs that measure together, only samples from the last
  one's first measured step to the first exit count (none left: no steady peak, as in a
  setting whose jobs re-captured through all their measured steps);
  ``msr_nvml_all`` takes the peak over every sample; ``eor`` = sum of the jobs' mean step times
  tensile / vanilla - 1; ``replans`` = the scheduler's re-plans, ``replan_kinds`` their
  triggers by kind (arrival, departure, first measurement, drift; one re-plan may fold several),
  ``replan_planner_ms`` how long each joint plan took the scheduler process.

A job that crashes, runs out of memory or does not finish within ``--timeout`` (seconds for
the whole setting) gives an ``error`` row with the tail of its stderr; every process started
is stopped on the way out. Settings already stored (their ``GPU`` row) are skipped unless
``--redo``. ``--device cpu`` is a smoke mode (32x32 inputs by default, the runtime's
simulation mode, RSS instead of GPU memory): its rows have ``device`` = cpu, which the report
treats as smoke rows, as for ``experiment=tensile``.

``--trim-stack tensile`` has TENSILE's jobs give back the thread-stack memory their CUDA
context reserved (:mod:`tensile.stack`: 264 MiB per process on an H200, most of it never
used) after their first step; ``--trim-stack all`` has the vanilla jobs do it too, so that the
NVML MSR is what the plans save alone. The label names the choice. ``--trim-blas`` (same
choices) has the jobs give back their cuBLAS workspaces then and use 1 MiB ones from there on
(:mod:`tensile.workspace`: 64 MiB per stream a job ran products on, 130 MiB per job here on
an H200, and the models' steps ran as fast without them). ``--compact`` (same choices) has the
jobs allocate their parameters, gradients, buffers and optimizer state again side by side
right after that (:mod:`tensile.compact`): the first step left them between the holes of its
freed activations, and a TENSILE job's streamed optimizer state leaves more.

Without ``--mps`` the job processes take turns on the GPU in time slices; with it they are
clients of a private MPS daemon (:mod:`experiments.mps`) in both phases and their work runs
side by side (the label says ``mps``).

The job processes inherit the environment, allocator settings included: started with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, both phases' caching allocators map pages
as they grow, so what they reserve differs from the default allocator's, and the label says
``expandable`` (such a run is its own setting). On the H200 it did not bring TENSILE's jobs'
reservation nearer their allocated peak (``results/h200/README.md``, thirty-sixth session).

``--stream-resident auto`` lets every TENSILE job choose how many of its streamed optimizer's
groups stay on the device (:func:`tensile.tune_resident`): the fewest whose copies, with all the
setting's jobs streaming over one link, delay its step by at most ``--stream-overhead``. The
job's row keeps the choice (``extra.stream_tuned``).

Run on an otherwise idle GPU: NVML counts every process on it. The paper's settings on the
GPU host (``--models`` defaults to the five; ``--memory-gb`` emulates a smaller GPU by capping
every job process at that size, which cannot cap their sum, and without ``--budget`` gives the
scheduler 90 % of it, as experiment=tensile; the GPU row says whether each phase's sampled
peak fitted, ``fits_memory_gb_<phase>``)::

    M=vgg16,inception_v3,inception_v4,resnet50,densenet121
    python -m experiments.tensile_multi --scenario copies --models $M --copies 1,2,3 --batch 2
    python -m experiments.tensile_multi --scenario mdw --models $M --batch 2
    # batch 16: the five jobs' traced tensor peaks sum to ~9.6 GiB, so these budgets bind
    python -m experiments.tensile_multi --scenario mdw --models $M --batch 16 --budget 6G
    python -m experiments.tensile_multi --scenario mdw --models $M --batch 16 --memory-gb 8
    python -m experiments.tensile_multi --scenario dynamic --models $M --batch 2 --arrive-every 5
    python -m experiments.tensile_multi --scenario copies --models mobilenet_v2 --copies 2 \\
        --device cpu --warmup 2 --iters 3          # CPU smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from experiments.mps import available as mps_available
from experiments.mps import client_env as mps_client_env
from experiments.mps import mps_daemon
from experiments.store import ResultStore, date_stamp, file_slug, row_key
from experiments.timing import summarize_ms
from nimble.allocator import allocator_conf, expandable_segments
from tensile import server
from tensile.planner import CAPTURED_SWAP_COST_MS
from tensile.resident import AUTO, DEFAULT_STREAM_OVERHEAD
from tensile.streamed import DEFAULT_PREFETCH

__all__ = ["JobSpec", "Setting", "Options", "build_settings", "settle_index", "run_job",
           "MemorySampler", "run_phase", "phase_memory", "write_timeline", "read_timeline",
           "memory_figures", "capture_seconds", "plot_timeline",
           "run_setting", "run", "main"]

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = "tensile_multi"
SCENARIOS = ("copies", "mdw", "dynamic")
# --trim-stack, --trim-blas and --compact: which phases' jobs do it after their first step:
# none; tensile (TENSILE's jobs call tensile.trim_stack / trim_blas_workspace / compact); all
# (vanilla's jobs too: the NVML MSR is then the plans' own saving)
PHASES = {"none": (), "tensile": ("tensile",), "all": ("vanilla", "tensile")}
PAPER_MODELS = ("vgg16", "inception_v3", "inception_v4", "resnet50", "densenet121")
SMOKE_MODELS = ("mobilenet_v2", "googlenet")  # CPU default: the Inceptions need >= 75 px
                                              # (ModelSpec.min_image_size)
NUM_CLASSES = 1000          # TENSILE's workloads (conf/experiment/tensile.yaml)
IMAGE_SIZE = {"cuda": 224, "cpu": 32}
LR = 1e-3                   # Adam, as conf/experiment/tensile.yaml
STEADY_TOLERANCE = 0.10     # "settled": within 10 % of the measured median
SAMPLE_EVERY_S = 0.02
MAX_SETTLE_ROUNDS = 4      # barrier rounds in which captured jobs take the newest plan
PREFIX = "TENSILE_MULTI "   # marks the job's JSON lines on stdout (libraries may print too)
MB = 2**20


# --------------------------------------------------------------------------- settings

@dataclass
class JobSpec:
    """One training job of a setting: which model and how long it trains."""

    job_id: str
    model: str
    steps: int                 # warm-up + measured steps (at least)
    until_stop: bool = False   # dynamic "stayers": train on until the harness says stop
    weight: float = 1.0


@dataclass
class Setting:
    """A set of jobs that share the GPU; ``label`` is the rows' ``mode`` (their identity).

    ``arrive_every`` = K: job k arrives when job 0 has finished K steps since job k-1
    began training; ``None``: all arrive at once and start training together.
    """

    scenario: str
    label: str
    jobs: list[JobSpec]
    copies: int = 1
    arrive_every: int | None = None


@dataclass
class Options:
    """What every setting of one run shares (from the command line)."""

    device: str = "cpu"
    batch: int = 2
    warmup: int = 5
    iters: int = 50
    image_size: int = 32
    budget_bytes: int | None = None     # the scheduler's --budget (all jobs together)
    budget_share: float | None = None   # ... or its --budget-share (of the joint peak)
    max_overhead: float = 0.0           # the scheduler's --max-overhead (recompute allowance)
    memory_gb: float | None = None      # emulated GPU size: caps every job process
    gpu_index: int | None = None
    timeout_s: float = 900.0            # per setting, both phases
    results_dir: Path = Path("results")
    redo: bool = False
    arrive_every: int = 5
    captured: bool = False              # every job's step captured in a CUDA graph (--captured)
    optimizer: str = "adam"             # every job's (experiments.optim): adam or adam_fused
    stream_optimizer: int = 0           # TENSILE's jobs: tensile.stream_optimizer groups (0: not)
    stream_prefetch: int = DEFAULT_PREFETCH   # ... its groups copied in ahead
    stream_resident: int | str = 0      # ... its first groups whose state stays on the device,
                                        # or "auto" (tensile.tune_resident, for the setting's jobs)
    stream_overhead: float = DEFAULT_STREAM_OVERHEAD   # ... with "auto": the delay the streaming may add
    stream_chunk_mb: float | None = None   # ... each update on at most this many MiB of parameters
    bn_from_stats: bool = False         # TENSILE's jobs rebuild a recomputed batch norm from its
                                        # batch statistics (Scheduler(batch_norm_from_stats=True))
    mps: bool = False                   # the jobs share the GPU through a private MPS daemon
    trim_stack: str = "none"            # which phases' jobs give back their thread-stack
                                        # reservation after their first step (PHASES)
    trim_blas: str = "none"             # ... give back their cuBLAS workspaces after it
                                        # (tensile.trim_blas_workspace, PHASES)
    compact: str = "none"               # which phases' jobs allocate their long-lived
                                        # tensors again after it (tensile.compact, PHASES)


def _job_ids(models: Sequence[str]) -> list[str]:
    """``model-1``, ``model-2``, ... numbered per model in order."""
    seen: Counter = Counter()
    ids = []
    for m in models:
        seen[m] += 1
        ids.append(f"{m}-{seen[m]}")
    return ids


def _suffix(opts: Options) -> str:
    """The knobs beyond model and batch that change what a setting measures."""
    parts = []
    if opts.image_size != IMAGE_SIZE["cuda"]:
        parts.append(f"img={opts.image_size}")
    if opts.budget_bytes is not None:
        parts.append(f"budget={opts.budget_bytes}")
    if opts.budget_share is not None:
        parts.append(f"budget_share={opts.budget_share:g}")
    if opts.max_overhead:
        parts.append(f"max_overhead={opts.max_overhead:g}")
    if opts.memory_gb is not None:
        parts.append(f"mem={opts.memory_gb:g}GiB")
    if opts.captured:
        parts.append("captured")
    if opts.optimizer != "adam":   # settings from before the option trained with adam
        parts.append(f"opt={opts.optimizer}")
    if opts.stream_optimizer:
        from experiments.tensile_run import stream_label   # as experiment=tensile names them
        parts += stream_label(opts.stream_optimizer, opts.stream_prefetch, opts.stream_resident,
                              opts.stream_overhead, opts.stream_chunk_mb)
    if opts.bn_from_stats:
        parts.append("bn_from_stats")
    if opts.mps:
        parts.append("mps")
    if opts.trim_stack != "none":
        parts.append(f"trim_stack={opts.trim_stack}")
    if opts.compact != "none":
        parts.append(f"compact={opts.compact}")
    if opts.trim_blas != "none":
        parts.append(f"trim_blas={opts.trim_blas}")
    if opts.device == "cuda" and expandable_segments(allocator_conf()):
        # the jobs inherit this environment: both phases' allocators map pages as needed, so
        # what they reserve differs, and such a run is its own setting, not another run of one
        parts.append("expandable")
    return "".join("," + p for p in parts)


def build_settings(scenario: str, models: Sequence[str], copies: Sequence[int],
                   opts: Options) -> list[Setting]:
    """The settings of one run (see the module docstring for the arrival/leave rules)."""
    steps = opts.warmup + opts.iters
    sfx = _suffix(opts)
    if scenario == "copies":
        return [Setting("copies", f"copies:{m}x{k}{sfx}",
                        [JobSpec(j, m, steps) for j in _job_ids([m] * k)], copies=k)
                for m in models for k in copies]
    if scenario == "mdw":
        jobs = [JobSpec(j, m, steps) for j, m in zip(_job_ids(models), models)]
        return [Setting("mdw", f"mdw:{'+'.join(models)}{sfx}", jobs)]
    if scenario == "dynamic":
        short = opts.warmup + max(1, opts.iters // 2)
        jobs = [JobSpec(j, m, short if k % 2 else steps, until_stop=k % 2 == 0)
                for k, (j, m) in enumerate(zip(_job_ids(models), models))]
        label = f"dynamic:{'+'.join(models)}:every={opts.arrive_every}{sfx}"
        return [Setting("dynamic", label, jobs, arrive_every=opts.arrive_every)]
    raise ValueError(f"unknown scenario {scenario!r}; valid: {', '.join(SCENARIOS)}")


# --------------------------------------------------------------------------- one job (child)

def _emit(msg: dict) -> None:
    print(PREFIX + json.dumps(msg), flush=True)


def settle_index(times: Sequence[float], ref_ms: float,
                 tol: float = STEADY_TOLERANCE) -> int | None:
    """The first index after which every time is within ``tol`` of ``ref_ms``.

    ``None`` when even the last time is outside (the job never settled).
    """
    i = len(times)
    while i > 0 and abs(times[i - 1] - ref_ms) <= tol * ref_ms:
        i -= 1
    return None if i == len(times) else i


def _timed(step, cuda: bool) -> tuple[Any, float]:
    """Run ``step()``; its time in ms (CUDA events on the current stream, else perf_counter)."""
    import torch
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        return loss, start.elapsed_time(end)
    t0 = time.perf_counter()
    loss = step()
    return loss, (time.perf_counter() - t0) * 1e3


def _peaks(cuda: bool) -> tuple[float | None, float | None]:
    import torch
    if not cuda:
        return None, None
    return torch.cuda.max_memory_allocated() / MB, torch.cuda.max_memory_reserved() / MB


def _outside_allocator_mb(cuda: bool) -> float | None:
    """The device's used memory (all processes and the driver's own) minus what this
    process's caching allocator reserved, in MB: with one job on the GPU, its changes
    between two stages are what the process added outside the allocator (kernels loaded,
    library handles, streams)."""
    import torch
    if not cuda:
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return round((total - free - torch.cuda.memory_reserved()) / MB, 1)


class SteadyPeaks:
    """A job's allocator peaks (MB) over its measured steps, steps that captured a graph
    left out: a capture's set-up (the vanilla graph timed for the plan, the warm-up's copies
    of the model and optimizer state) is not what the job needs to train, as the NVML
    steady peak leaves those steps out too (:func:`_windows`).

    ``read()`` gives (allocated, reserved) peaks since the last ``reset()``. Call
    :meth:`add` after every measured step with what ``read()`` gave right before it. A
    graph's replays allocate nothing, so the allocated peak of the steps that replay one
    is the peak of its capture (``GraphStep.peak_bytes``): pass it as ``graph_mb``.
    """

    def __init__(self, read: Callable[[], tuple], reset: Callable[[], None]) -> None:
        self.read, self.reset = read, reset
        self.alloc_mb: float | None = None
        self.reserved_mb: float | None = None
        self._pending = False   # steps since the last reset that count

    def _fold(self, alloc: float | None, reserved: float | None) -> None:
        if alloc is not None:
            self.alloc_mb = alloc if self.alloc_mb is None else max(self.alloc_mb, alloc)
        if reserved is not None:
            self.reserved_mb = reserved if self.reserved_mb is None else max(self.reserved_mb, reserved)

    def add(self, before: tuple, captured: bool, graph_mb: float | None = None) -> None:
        if captured:   # the peaks so far are the steps before this one; start afresh after it
            if self._pending:
                self._fold(*before)
            self.reset()
            self._pending = False
        else:
            self._pending = True
        if graph_mb is not None:
            self._fold(graph_mb, None)

    def result(self) -> tuple[float | None, float | None]:
        """(allocated, reserved) peaks of the steps that count."""
        if self._pending:
            self._fold(*self.read())
            self._pending = False
        return self.alloc_mb, self.reserved_mb


def _reset_peaks(cuda: bool) -> None:
    import torch
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _settle(sched, step: Callable, job_id: str, tries: int = 3) -> int:
    """Before a captured job measures: take the newest plan and, if its graph does not do
    what that plan does, capture it now; returns how many steps captured (at most
    ``tries``, unmeasured). A job's first capture re-times its ops (``retimed``) and so
    re-plans every job; the harness repeats the round until none captured
    (:data:`MAX_SETTLE_ROUNDS`), so that all jobs measure together with the graphs of one
    plan (on the H200 the five-model runs re-captured inside their measured steps, and the
    jobs that had nothing to capture measured and left before the others began)."""
    sched.heartbeat()
    captures = 0
    for _ in range(tries):
        if sched.graph_is_current:
            break
        t0 = time.monotonic()
        step()
        captures += 1
        _emit({"event": "captured", "job": job_id, "t0": t0, "t1": time.monotonic()})
        sched.heartbeat()
    return captures


def _free(cuda: bool) -> None:
    """Give cached blocks back, so that start-up (recording) memory does not count later."""
    import torch
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class _Commands:
    """The harness's commands on this job's stdin, one a line: ``go`` and ``stop``.

    Read with ``select`` + ``os.read`` (unbuffered: a buffered ``sys.stdin`` could hold a
    line that ``select`` no longer sees). End of input (the harness is gone) ends the job.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._lines: list[str] = []
        self.eof = False

    def _poll(self, timeout_s: float) -> None:
        if self.eof or not select.select([0], [], [], timeout_s)[0]:
            return
        data = os.read(0, 4096)
        if not data:
            self.eof = True
            return
        *lines, self._buf = (self._buf + data).split(b"\n")
        self._lines += [ln.decode().strip() for ln in lines]

    def seen(self, word: str) -> bool:
        """Whether ``word`` has come (consumed), without waiting."""
        self._poll(0)
        if word in self._lines:
            self._lines.remove(word)
            return True
        return False

    def wait(self, word: str, tick=None) -> None:
        """Block until ``word`` comes, calling ``tick()`` about every second meanwhile."""
        self.wait_any((word,), tick)

    def wait_any(self, words: Sequence[str], tick=None) -> str:
        """Block until one of ``words`` comes (returned), calling ``tick()`` meanwhile."""
        while True:
            for word in words:
                if self.seen(word):
                    return word
            if self.eof:
                expected = " or ".join(map(repr, words))
                raise RuntimeError(f"the harness closed this job's input before {expected}")
            self._poll(1.0)
            if tick is not None:
                tick()


def run_job(p: dict) -> dict:
    """Train one job as ``p`` says (built by :func:`_payload`); returns its result dict.

    Protocol with the harness (JSON lines on stdout, commands on stdin): builds the model
    on the CPU, says ``prepared`` and waits for ``go`` (its arrival); then moves to the
    device (under TENSILE: records its step and registers with the scheduler), says
    ``ready``, waits for a second ``go`` if ``p["barrier"]`` (all jobs start training
    together) and trains ``p["steps"]`` steps, saying ``step`` after each; with
    ``p["until_stop"]`` it trains on until ``stop`` comes. After its ``p["warmup"]`` steps
    it says ``warm`` and, with ``p["barrier"]``, waits for ``measure`` (all jobs start their
    measured steps together: no job's warm-up or capture runs beside another's measured
    steps), then says ``measuring``. Meanwhile each ``settle`` makes a captured job capture
    the newest plan if its graph is not current (:func:`_settle`); it answers ``settled``.
    """
    import torch

    from experiments import models
    from experiments.optim import make_optimizer
    from experiments.tensile_run import _drop_aux_head, classification_loss
    from tensile import Scheduler, compact, training_step, trim_blas_workspace, trim_stack
    from tensile.resident import install_streamed

    cuda = p["device"] == "cuda"
    stack_released_mb = blas_released_mb = compacted = None
    cmds = _Commands()
    if not cuda:
        torch.set_num_threads(1)  # several jobs share the CPU: no oversubscription
    # Before the arrival: CPU only, so a job that has not arrived holds no GPU memory.
    model = _drop_aux_head(models.build_model(p["model"], num_classes=NUM_CLASSES)).train()
    x = models.example_input(p["model"], p["batch"], image_size=p["image_size"])
    y = torch.randint(0, NUM_CLASSES, (p["batch"],), generator=torch.Generator().manual_seed(0))
    _emit({"event": "prepared", "job": p["job_id"]})
    cmds.wait("go")

    if cuda and p.get("memory_gb"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, p["memory_gb"] * 2**30 / total))
    model.to(p["device"])
    batch = (x.to(p["device"]), y.to(p["device"]))
    captured = p.get("captured", False)
    opt = make_optimizer(model, p.get("optimizer", "adam"), LR, capturable=captured)
    outside = {"on_device": _outside_allocator_mb(cuda)}   # see _outside_allocator_mb
    sched = tuned = None
    if p["phase"] == "tensile":
        if p.get("stream_optimizer"):   # the update in backward, Adam's moments on the host
            # resident "auto": chosen for all the setting's jobs streaming over one link
            streamed = install_streamed(
                model, opt, batch, classification_loss, groups=p["stream_optimizer"],
                prefetch=p.get("stream_prefetch", DEFAULT_PREFETCH),
                resident=p.get("stream_resident", 0), max_overhead=p.get("stream_overhead", DEFAULT_STREAM_OVERHEAD),
                update_chunk_mb=p.get("stream_chunk_mb"),
                jobs=p.get("jobs", 1), h2d_bw=p["rates"]["h2d_bw"], d2h_bw=p["rates"]["d2h_bw"])
            tuned = streamed.tuned
        sched = Scheduler(model, opt, batch, classification_loss, simulate=not cuda,
                          scheduler_socket=p["socket"], job_id=p["job_id"], weight=p["weight"],
                          client_kwargs={"register_timeout_s": 120.0},
                          allow_cross_iteration=not captured,
                          # a captured step's swaps cost their joins: the joint plan prices them
                          swap_cost_ms=CAPTURED_SWAP_COST_MS if captured else 0.0,
                          batch_norm_from_stats=p.get("bn_from_stats", False), **p["rates"])
        outside["scheduler"] = _outside_allocator_mb(cuda)
        # captured: the first replay() steps, the second captures (after the scheduler's
        # plan for the graph's op times), later ones replay or capture a newer plan
        step = (lambda: sched.replay(*batch)) if captured else (lambda: sched.step(*batch))
    elif captured:
        step = _CapturedVanilla(model, opt, batch, classification_loss)
    else:
        step = lambda: training_step(model, opt, batch, classification_loss)  # noqa: E731
    try:
        _free(cuda)
        _emit({"event": "ready", "job": p["job_id"]})
        if p["barrier"]:  # heartbeats: the scheduler drops a job silent for a minute
            cmds.wait("go", tick=sched.heartbeat if sched else None)
        if sched is not None:
            sched.heartbeat()  # take the plan pushed for the jobs that arrived meanwhile
        first_version = sched.report().plan_version if sched else None
        times: list[float] = []
        versions: list[int] = []   # plan versions in the order they ran
        first_peaks = (None, None)
        before = None
        steady = SteadyPeaks(lambda: _peaks(cuda), lambda: _reset_peaks(cuda))
        capture_steps: list[int] = []   # the steps that captured a graph
        i = 0
        while i < p["steps"] or (p["until_stop"] and not cmds.eof and not cmds.seen("stop")):
            if i == p["warmup"]:  # measured steps from here: fresh peaks and counters
                if p["barrier"]:  # and all jobs measure together, none still capturing
                    _emit({"event": "warm", "job": p["job_id"]})
                    tick = sched.heartbeat if sched else None
                    while cmds.wait_any(("settle", "measure"), tick) == "settle":
                        n = _settle(sched, step, p["job_id"]) if captured and sched else 0
                        _emit({"event": "settled", "job": p["job_id"], "captures": n})
                _free(cuda)
                before = sched.report() if sched else None
                _emit({"event": "measuring", "job": p["job_id"]})
            version = sched.report().plan_version if sched else None
            if version is not None and (not versions or versions[-1] != version):
                versions.append(version)
            captures, t0, peaks_before = _captures(sched, step), time.monotonic(), _peaks(cuda)
            loss, ms = _timed(step, cuda)
            times.append(ms)
            captured_now = _captures(sched, step) > captures
            if captured_now:
                capture_steps.append(i)
                _emit({"event": "captured", "job": p["job_id"], "t0": t0, "t1": time.monotonic()})
            if i >= p["warmup"]:
                steady.add(peaks_before, captured_now, _graph_peak_mb(sched, step))
            if i == 0:
                first_peaks = _peaks(cuda)
                outside["first_step"] = _outside_allocator_mb(cuda)
                if p.get("trim_stack"):   # after cuDNN's benchmark: see tensile.stack
                    stack_released_mb = trim_stack() / MB
                    outside["trimmed"] = _outside_allocator_mb(cuda)
                if p.get("trim_blas"):    # before any capture: a graph keeps the workspaces
                    blas_released_mb = trim_blas_workspace() / MB
                if p.get("compact"):      # before any capture: a graph keeps the old addresses
                    c = compact(model, opt)
                    compacted = {"moved": c.moved, "moved_mb": c.moved_bytes / MB, "kept": c.kept,
                                 "released_mb": (c.reserved_before - c.reserved_after) / MB}
            _emit({"event": "step", "job": p["job_id"], "i": i, "ms": ms, "version": version})
            i += 1
        loss = float(loss)
        if not math.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss} after {i} steps")
        peak_alloc, peak_reserved = steady.result()
        outside["last_step"] = _outside_allocator_mb(cuda)
        out = {"iter_ms": times, "warmup": p["warmup"], "loss": loss, "outside_allocator_mb": outside,
               "stack_released_mb": stack_released_mb, "blas_released_mb": blas_released_mb,
               "compacted": compacted,
               "capture_steps": capture_steps, "capture_s": _capture_seconds(sched, step),
               "first_peak_alloc_mb": first_peaks[0], "first_peak_reserved_mb": first_peaks[1],
               "peak_alloc_mb": peak_alloc, "peak_reserved_mb": peak_reserved}
        if tuned:   # what tensile.tune_resident chose (--stream-resident auto)
            out["stream_tuned"] = tuned
        if sched is not None:
            after = sched.report()
            before = before or after
            out.update(plan_at_first_step=first_version, plan_versions=versions,
                       replans=max(0, len(versions) - 1), plans_received=after.plans_received,
                       connected=after.connected,
                       passive_swapins=after.passive_swap_ins - before.passive_swap_ins,
                       swap_ins=after.swap_ins - before.swap_ins,
                       recomputes=after.recomputes - before.recomputes,
                       bytes_swapped=(after.bytes_d2h + after.bytes_h2d
                                      - before.bytes_d2h - before.bytes_h2d),
                       swaps_planned=after.swaps_planned,
                       recomputes_planned=after.recomputes_planned,
                       recomputes_by_op=after.recomputes_by_op,
                       bn_rerun_share_median=after.bn_rerun_share_median,
                       est_overhead_ms=after.est_overhead_ms,
                       **after.plan_check())
        return out
    finally:
        if sched is not None:
            sched.close()  # leave the scheduler: the others are re-planned


class _CapturedVanilla:
    """The vanilla step for ``--captured``: one ordinary step (the optimizer's state),
    then :class:`tensile.GraphStep` captures it at the second call and replays it (and
    captures it again after a ``--trim-stack``)."""

    def __init__(self, model, opt, batch: tuple, loss_fn) -> None:
        self.model, self.opt, self.batch, self.loss_fn = model, opt, batch, loss_fn
        self.graph = None
        self.captures = 0
        self.capture_s: list[dict[str, float]] = []   # each capture's GraphStep.setup_s

    def __call__(self):
        import torch
        from tensile import GraphStep, training_step
        if not self.opt.state:
            return training_step(self.model, self.opt, self.batch, self.loss_fn)
        if self.graph is None or self.graph.stale:   # stale: captured before trim_stack
            self.graph = None
            torch.cuda.empty_cache()
            self.graph = GraphStep(lambda b, capturing: training_step(self.model, self.opt, b,
                                                                      self.loss_fn),
                                   self.batch, self.model, self.opt)
            self.captures += 1
            self.capture_s.append(self.graph.setup_s)
        return self.graph(*self.batch)


def _graph_peak_mb(sched, step) -> float | None:
    """The allocated peak (MB) of the capture of the graph the job replays now, if any."""
    graph = sched.graph if sched is not None else getattr(step, "graph", None)
    return None if graph is None else graph.peak_bytes / MB


def _capture_seconds(sched, step) -> list[dict[str, float]]:
    """Where each capture's set-up time went (s, 3 decimals): ``Scheduler.capture_s``, or the
    captured vanilla step's ``GraphStep.setup_s``; empty when the job does not capture."""
    phases = sched.capture_s if sched is not None else getattr(step, "capture_s", [])
    return [{k: round(v, 3) for k, v in p.items()} for p in phases]


def _captures(sched, step) -> int:
    """How many graphs the job's step has captured so far (0 when it does not capture)."""
    if sched is not None:
        return sched.captures
    return getattr(step, "captures", 0)


def _probe(device: str) -> dict:
    """The row environment, the machine's rates for the planner and the GPU's size."""
    import torch

    from experiments.env import environment
    from experiments.tensile_run import machine_rates
    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    return {"env": environment(device), "rates": machine_rates(device), "total_memory": total}


# --------------------------------------------------------------------------- memory sampler

class MemorySampler:
    """Device memory over time, sampled every ~20 ms in a thread while a phase runs.

    ``source`` is ``nvml`` (used bytes of one whole GPU) or ``rss`` (CPU: the summed resident
    memory of the processes given to :meth:`watch`). Samples are ``(phase, t_s, used_bytes,
    event)`` with ``t_s`` since the phase began and ``event`` empty for plain samples.
    """

    def __init__(self, device: str, gpu_index: int | None = None) -> None:
        self.source = "nvml" if device == "cuda" else "rss"
        self.samples: list[tuple[str, float, int, str]] = []
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self._phase, self._t0 = "", 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.source == "nvml":
            import pynvml  # nvidia-ml-py, on the GPU host
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = _nvml_handle(pynvml, gpu_index)

    def read(self) -> int:
        """Used bytes now."""
        if self.source == "nvml":
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        import psutil
        total = 0
        with self._lock:
            pids = list(self._pids)
        for pid in pids:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:  # exited between two samples
                pass
        return total

    def watch(self, pid: int) -> None:
        with self._lock:
            self._pids.add(pid)

    def unwatch(self, pid: int) -> None:
        with self._lock:
            self._pids.discard(pid)

    def mark(self, event: str) -> None:
        """An event (job start, ready, exit) with a reading taken now."""
        self.samples.append((self._phase, time.monotonic() - self._t0, self.read(), event))

    def mark_span(self, event: str, t0: float, t1: float) -> None:
        """A span a job measured itself (``time.monotonic()`` is one clock for all local
        processes): ``"<event> ..."`` at ``t0`` and ``"<event>d ..."`` at ``t1``, with the
        reading taken now (a job reports it after the fact)."""
        kind, rest = event.split(" ", 1)
        used = self.read()
        self.samples += [(self._phase, t0 - self._t0, used, event),
                         (self._phase, t1 - self._t0, used, f"{kind}d {rest}")]

    def start(self, phase: str) -> None:
        self._phase, self._t0 = phase, time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            self._pids.clear()

    def close(self) -> None:
        if self.source == "nvml":
            self._nvml.nvmlShutdown()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((self._phase, time.monotonic() - self._t0, self.read(), ""))
            self._stop.wait(SAMPLE_EVERY_S)


def _visible_device() -> str | None:
    """First entry of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), if set."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return cvd or None


def _nvml_handle(pynvml, gpu_index: int | None):
    """The NVML handle of the GPU the jobs run on (see the module docstring)."""
    if gpu_index is not None:
        return pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
    cvd = _visible_device()
    if cvd is None:
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    if cvd.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(cvd))
    return pynvml.nvmlDeviceGetHandleByUUID(cvd)


# --------------------------------------------------------------------------- one phase

@dataclass
class JobOutcome:
    """What the harness saw of one job process in one phase."""

    spec: JobSpec
    proc: subprocess.Popen | None = None
    log: Path | None = None
    prepared: bool = False        # built on the CPU, waiting for its arrival
    arrived: bool = False         # told to go
    ready: bool = False           # on the device (registered, under TENSILE)
    warm: bool = False            # done its warm-up steps, waiting to measure (barrier)
    settled: int = 0              # settle rounds answered (barrier of captured jobs)
    settle_captures: int = 0      # graphs it captured in the last round it answered
    lead_steps_at_ready: int | None = None   # steps of job 0 when this one was ready
    steps: int = 0
    exited: bool = False
    result: dict | None = None
    error: str | None = None
    stderr_tail: str = ""


def _child_env(opts: Options) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers GPUs as NVML does
    if opts.gpu_index is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(opts.gpu_index)
    return env


def _payload(job: JobSpec, setting: Setting, phase: str, opts: Options, rates: dict,
             sock: Path | None) -> dict:
    return {"job_id": job.job_id, "model": job.model, "steps": job.steps, "weight": job.weight,
            "until_stop": job.until_stop, "barrier": setting.arrive_every is None,
            "phase": phase, "device": opts.device, "batch": opts.batch, "warmup": opts.warmup,
            "image_size": opts.image_size, "memory_gb": opts.memory_gb, "rates": rates,
            "socket": None if sock is None else str(sock), "captured": opts.captured,
            "optimizer": opts.optimizer,
            "stream_optimizer": opts.stream_optimizer, "stream_prefetch": opts.stream_prefetch,
            "stream_resident": opts.stream_resident, "stream_overhead": opts.stream_overhead,
            "stream_chunk_mb": opts.stream_chunk_mb, "jobs": len(setting.jobs),
            "bn_from_stats": opts.bn_from_stats, "trim_stack": phase in PHASES[opts.trim_stack],
            "trim_blas": phase in PHASES[opts.trim_blas], "compact": phase in PHASES[opts.compact]}


def _read_lines(name: str, stream, out: queue.Queue) -> None:
    for line in stream:
        out.put((name, line))
    out.put((name, None))  # end of output


def _tail(path: Path | None, n: int = 4000) -> str:
    if path is None or not path.exists():
        return ""
    return path.read_text(errors="replace")[-n:]


def _failure(o: JobOutcome) -> str:
    """One line saying why a job gave no result: its exit code and the exception's line (the
    last stderr line naming an ``...Error`` or ``...Exception``; else the last line: PyTorch
    puts the call's original traceback after a CUDA initialisation error)."""
    rc = o.proc.returncode if o.proc is not None else None
    lines = [ln.strip() for ln in o.stderr_tail.splitlines() if ln.strip()]
    raised = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
    why = (raised or lines or ["no stderr"])[-1][:300]
    return f"exit code {rc}: {why}"


# "RuntimeError: ...", "torch.OutOfMemoryError: ...", "KeyboardInterrupt" is not one
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception)\b")


def _command(o: JobOutcome, word: str) -> None:
    """Write one command line to a job (gone already: nothing to tell)."""
    try:
        o.proc.stdin.write(word + "\n")
        o.proc.stdin.flush()
    except (OSError, ValueError):
        pass


def _arrive(o: JobOutcome, sampler: MemorySampler) -> None:
    o.arrived = True
    if not o.exited:
        _command(o, "go")
        sampler.mark(f"arrive {o.spec.job_id}")


def _advance(setting: Setting, outs: list[JobOutcome], sampler: MemorySampler,
             flags: dict) -> None:
    """Send the commands that are due: arrivals, the start barrier, the final stop."""
    live = [o for o in outs if not o.exited]
    if setting.arrive_every is None:  # all arrive together, then all start together
        if not outs[0].arrived and all(o.prepared or o.exited for o in outs):
            for o in outs:
                _arrive(o, sampler)
        elif outs[0].arrived and not flags.get("started") and all(o.ready or o.exited for o in outs):
            for o in live:
                _command(o, "go")
            flags["started"] = True
        elif flags.get("started") and not flags.get("measuring") and all(o.warm or o.exited for o in outs):
            _settle_or_measure(live, sampler, flags)
        return
    lead = outs[0]
    k = next((i for i, o in enumerate(outs) if not o.arrived), None)
    if k is not None:
        prev = outs[k - 1] if k else None
        due = (prev is None or lead.exited or (prev.exited and not prev.ready)
               or (prev.lead_steps_at_ready is not None
                   and lead.steps - prev.lead_steps_at_ready >= setting.arrive_every))
        if due and (outs[k].prepared or outs[k].exited):
            _arrive(outs[k], sampler)
    elif not flags.get("stopped"):
        # Stop the stayers once every early leaver has gone, every stayer has done its
        # steps and job 0 has done K steps since the last exit (the re-plan it caused).
        leavers_gone = all(o.exited for o in outs if not o.spec.until_stop)
        stayers_done = all(o.exited or o.steps >= o.spec.steps for o in outs if o.spec.until_stop)
        after_exit = lead.exited or lead.steps - flags.get("lead_steps_at_exit", 0) >= setting.arrive_every
        if leavers_gone and stayers_done and after_exit:
            for o in live:
                _command(o, "stop")
            flags["stopped"] = True


def _settle_or_measure(live: list[JobOutcome], sampler: MemorySampler, flags: dict) -> None:
    """Every job is warm: rounds of ``settle`` until a round in which no job captured (or
    :data:`MAX_SETTLE_ROUNDS`), then ``measure`` for all. A round ends when every live job
    has answered it; a capture may re-plan the others, hence the next round."""
    round_ = flags.get("settle_round", 0)
    if round_ and not all(o.settled >= round_ for o in live):
        return                                  # the round is still running
    if round_ and (round_ >= MAX_SETTLE_ROUNDS or not any(o.settle_captures for o in live)):
        for o in live:
            _command(o, "measure")
        flags["measuring"] = True
        return
    flags["settle_round"] = round_ + 1
    sampler.mark(f"settle round{round_ + 1}")
    for o in live:
        _command(o, "settle")


def run_phase(setting: Setting, phase: str, opts: Options, rates: dict, work: Path,
              sampler: MemorySampler, deadline: float) -> dict[str, JobOutcome]:
    """Run every job of ``setting`` in ``phase`` (vanilla | tensile); one outcome per job.

    All job processes start at once and build their model on the CPU; they arrive (move to
    the device) by the setting's rule (:func:`_advance`). Every process started here is
    stopped before returning, also on errors and timeouts.
    """
    # --mps: run() started the daemon on the jobs' GPU; its clients number it 0
    env = mps_client_env(_child_env(opts)) if opts.mps else _child_env(opts)
    outs = [JobOutcome(j) for j in setting.jobs]
    by_id = {o.spec.job_id: o for o in outs}
    lines: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    flags: dict = {}
    sock = work / "sched.sock" if phase == "tensile" else None
    sampler.start(phase)
    try:
        time.sleep(0.2)  # idle samples: the baseline before any job
        if sock is not None:
            args = [] if opts.budget_bytes is None else ["--budget", str(opts.budget_bytes)]
            args += [] if opts.budget_share is None else ["--budget-share", str(opts.budget_share)]
            args += ["--max-overhead", str(opts.max_overhead)] if opts.max_overhead else []
            procs.append(_spawn_server(sock, args, work / f"scheduler-{phase}.log", env, deadline))
        for o in outs:
            jid = o.spec.job_id
            spec_path = work / f"{phase}-{jid}.json"
            spec_path.write_text(json.dumps(_payload(o.spec, setting, phase, opts, rates, sock)))
            o.log = work / f"{phase}-{jid}.log"
            with open(o.log, "w") as err:
                o.proc = subprocess.Popen(
                    [sys.executable, "-m", "experiments.tensile_multi", "--job", str(spec_path)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                    env=env, cwd=ROOT)
            procs.append(o.proc)
            sampler.watch(o.proc.pid)
            sampler.mark(f"start {jid}")
            threading.Thread(target=_read_lines, args=(jid, o.proc.stdout, lines), daemon=True).start()
        while not all(o.exited for o in outs):
            _advance(setting, outs, sampler, flags)
            if time.monotonic() > deadline:
                for o in outs:
                    if o.result is None:
                        o.error = f"timeout: the setting ran longer than {opts.timeout_s:g} s ({phase} phase)"
                break
            try:
                jid, line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            o = by_id[jid]
            if line is None:  # the job closed its stdout: it is exiting
                try:
                    o.proc.wait(30)
                except subprocess.TimeoutExpired:
                    server.stop_process(o.proc)
                o.exited = True
                flags["lead_steps_at_exit"] = outs[0].steps
                sampler.unwatch(o.proc.pid)
                sampler.mark(f"exit {jid}")
                continue
            try:
                msg = json.loads(line[len(PREFIX):]) if line.startswith(PREFIX) else {}
            except ValueError:  # a line cut short by a dying job
                msg = {}
            event = msg.get("event")
            if event == "prepared":
                o.prepared = True
            elif event == "ready":
                o.ready, o.lead_steps_at_ready = True, outs[0].steps
                sampler.mark(f"ready {jid}")
            elif event == "step":
                o.steps = msg["i"] + 1
            elif event == "warm":
                o.warm = True
            elif event == "settled":
                o.settled, o.settle_captures = o.settled + 1, msg["captures"]
            elif event == "measuring":
                sampler.mark(f"measuring {jid}")
            elif event == "captured":
                sampler.mark_span(f"capture {jid}", msg["t0"], msg["t1"])
            elif event == "done":
                o.result = msg["result"]
    finally:
        for p in procs:  # only what this phase started, each by its own handle
            server.stop_process(p)
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:  # a command still buffered for a job that is gone
                    pass
        sampler.stop()
    for o in outs:
        o.stderr_tail = _tail(o.log)
        if o.result is None and o.error is None:
            o.error = _failure(o) if o.proc is not None else "never started"
    return by_id


def _spawn_server(sock: Path, args: list[str], log: Path, env: dict, deadline: float) -> subprocess.Popen:
    return server.spawn(sock, *args, log=log, env=env,
                        timeout_s=max(1.0, min(60.0, deadline - time.monotonic())))


class Replan(NamedTuple):
    """One re-plan of the scheduler process: its trigger(s) and how long the joint plan took."""
    reason: str
    planner_ms: float | None


def _scheduler_replans(log: Path) -> list[Replan]:
    """The scheduler's re-plans, in order, from its log (``tensile.server``'s "re-plan" lines)."""
    if not log.exists():
        return []
    pat = re.compile(r"re-plan v\d+ \((.*)\): \d+ jobs(?:.*, ([0-9.]+) ms$)?")
    return [Replan(m.group(1), float(m.group(2)) if m.group(2) else None)
            for ln in log.read_text(errors="replace").splitlines() if (m := pat.search(ln))]


def _reason_kinds(reasons: list[str]) -> dict[str, int]:
    """How many re-plan triggers of each kind there were (one re-plan may fold several)."""
    kinds = {"arrival": "arrival of", "departure": "departure of",
             "first_measurement": "first measurement of", "drift": "drift of",
             "retimed": " retimed ("}
    return {k: sum(r.count(text) for r in reasons) for k, text in kinds.items()}


# --------------------------------------------------------------------------- rows

def _stats(times: Sequence[float]) -> dict[str, float]:
    return {k.removesuffix("_ms"): v for k, v in summarize_ms(times).items()}


def _job_summary(result: dict) -> dict:
    """Step-time statistics over the measured steps, those that captured a graph left out
    (their time is reported apart), and the settling index over all steps."""
    times, warmup = result["iter_ms"], result["warmup"]
    captures = {i for i in result.get("capture_steps", ()) if i >= warmup}
    measured = [t for i, t in enumerate(times) if i >= warmup and i not in captures]
    if not measured:
        raise ValueError(f"no measured step without a capture: {len(times)} steps, warm-up "
                         f"{warmup}, captures at {sorted(captures)}")
    s = _stats(measured)
    return {**s, "iters": len(measured), "iters_to_steady": settle_index(times, s["median"]),
            "captures": len(captures), "capture_ms": sum(times[i] for i in captures)}


def _job_row(setting: Setting, job: JobSpec, van: JobOutcome, ten: JobOutcome,
             opts: Options) -> dict:
    """One job's row: both phases side by side, MSR/EOR/CBR by tensile_run's definitions."""
    from experiments.tensile_run import _saving, derived_metrics
    extra: dict[str, Any] = {"scenario": setting.scenario, "setting": setting.label,
                             "job": job.job_id, "weight": job.weight, "copies": setting.copies,
                             "arrive_every": setting.arrive_every, "until_stop": job.until_stop}
    row: dict[str, Any] = {"model": job.model, "backend": job.job_id, "status": "ok", "reason": "",
                           # the protocol's, as every row of the setting (the report's smoke
                           # rule); the steps this job measured are measured_iters_<phase>
                           "warmup": opts.warmup, "iters": opts.iters}
    phases = {"vanilla": van, "tensile": ten}
    fields: dict[str, dict] = {}
    for name, o in phases.items():
        if o.result is None:
            continue
        s, res = _job_summary(o.result), o.result
        fields[name] = {"status": "ok", "mean_ms": s["mean"], "peak_mem_mb": res["peak_alloc_mb"],
                        "extra": {"peak_reserved_mb": res["peak_reserved_mb"]}}
        extra.update({f"iter_ms_{k}_{name}": s[k] for k in ("median", "p10", "p90", "mean")})
        extra.update({f"peak_alloc_{name}_mb": res["peak_alloc_mb"],
                      f"peak_reserved_{name}_mb": res["peak_reserved_mb"],
                      f"first_iter_peak_alloc_{name}_mb": res["first_peak_alloc_mb"],
                      f"first_iter_peak_reserved_{name}_mb": res["first_peak_reserved_mb"],
                      f"outside_allocator_mb_{name}": res.get("outside_allocator_mb"),
                      f"stack_released_mb_{name}": res.get("stack_released_mb"),
                      f"blas_released_mb_{name}": res.get("blas_released_mb"),
                      f"compacted_{name}": res.get("compacted"),
                      f"capture_s_{name}": res.get("capture_s"),
                      f"iters_to_steady_{name}": s["iters_to_steady"], f"loss_{name}": res["loss"],
                      f"measured_iters_{name}": s["iters"],
                      f"measured_captures_{name}": s["captures"],
                      f"measured_capture_ms_{name}": s["capture_ms"]})
        if name == "tensile":
            row.update(median_ms=s["median"], p10_ms=s["p10"], p90_ms=s["p90"],
                       mean_ms=s["mean"], std_ms=s["std"],
                       peak_mem_mb=res["peak_alloc_mb"])
            extra["iters_to_steady"] = s["iters_to_steady"]
            extra.update({k: res.get(k) for k in (
                "replans", "plan_versions", "plan_at_first_step", "plans_received", "connected",
                "passive_swapins", "swap_ins", "recomputes", "bytes_swapped",
                "swaps_planned", "recomputes_planned", "recomputes_by_op", "bn_rerun_share_median",
                "est_overhead_ms",
                "plan_iteration_ms", "timed_steps", "d2h_gbps_measured", "h2d_gbps_measured",
                "stall_ms_per_timed_step")})
            if "stream_tuned" in res:   # --stream-resident auto: what tune_resident chose
                extra["stream_tuned"] = res["stream_tuned"]
    if "vanilla" in fields and "tensile" in fields:
        d = derived_metrics(fields["tensile"], fields["vanilla"])
        extra.update(msr_alloc=d["msr"], msr_reserved=d["msr_reserved"], eor=d["eor"], cbr=d["cbr"])
        extra["cold_start_msr"] = _saving(ten.result["first_peak_alloc_mb"],
                                          van.result["first_peak_alloc_mb"])
    failed = [(n, o) for n, o in phases.items() if o.result is None]
    if failed:
        row["status"] = "error"
        row["reason"] = "; ".join(f"{n}: {o.error}" for n, o in failed)[:500]
        extra.update({f"stderr_tail_{n}": o.stderr_tail for n, o in failed})
    return {**row, "extra": extra}


def _windows(samples: list[tuple], phase: str, events: list[tuple[float, str, str]] | None = None
             ) -> tuple[list[tuple[float, int]], list[tuple[float, float]]]:
    """The phase's plain samples ``(t, used)`` and every job's start-up interval: from its
    arrival to its first measured step (or exit): it moves to the device and, under
    TENSILE, records one step at vanilla memory, registers and runs its warm-up steps, where
    a captured job's first steps run uncaptured, above its graph's memory. A timeline
    written before jobs said ``measuring`` ends the start-up at ``ready``. With
    ``--captured`` also every step that captured a graph (its timing graphs and warm-up
    live next to the graph it replaces). ``events``: the phase's, if already sorted out."""
    plain = [(t, u) for p, t, u, e in samples if p == phase and not e]
    events = _events(samples, phase) if events is None else events
    measured = {job for _t, kind, job in events if kind == "measuring"}
    starts: dict[str, float] = {}
    spans = []
    for t, kind, job in events:
        if kind == "arrive":
            starts[job] = t
        elif job in starts and (kind == "exit" or kind == ("measuring" if job in measured else "ready")):
            spans.append((starts.pop(job), t))
        elif kind == "capture":     # --captured: a step that captured a graph (a set-up too)
            starts["capture " + job] = t
        elif kind == "captured" and "capture " + job in starts:
            spans.append((starts.pop("capture " + job), t))
    end = max((t for t, _ in plain), default=0.0)
    spans += [(t0, end) for t0 in starts.values()]  # never ready nor exited
    return plain, spans


def phase_memory(samples: list[tuple], phase: str) -> dict[str, float | None]:
    """Idle baseline, peak over all samples and peak outside start-ups (MiB) of one phase."""
    events = _events(samples, phase)
    plain, spans = _windows(samples, phase, events)
    if not plain or not spans:  # no job arrived: nothing to compare
        return {"idle_mb": None, "peak_mb": None, "peak_all_mb": None}
    first = min((a for a, _ in spans), default=math.inf)
    idle = [u for t, u in plain if t < first] or [plain[0][1]]  # before the first arrival
    # Jobs that measure together (each said "measuring"): the steady window runs from the
    # last one's "measuring" to the first exit, as the memory after that is not the whole
    # set's. A setting whose jobs captured again through their measured steps may have no
    # steady sample left: then there is no steady peak (not the peak of the samples after
    # the exits).
    begin, end = _measured_together(events)
    steady = [u for t, u in plain if begin <= t <= end and not any(a <= t <= b for a, b in spans)]
    return {"idle_mb": min(idle) / MB, "peak_all_mb": max(u for _, u in plain) / MB,
            "peak_mb": max(steady) / MB if steady else None}


def capture_seconds(samples: list[tuple], phase: str) -> dict[str, list[float]]:
    """Per job, how long each step that captured a graph took in ``phase`` (s, in order: the
    ``capture``/``captured`` events of ``--captured`` runs; a job's first capture also times
    and profiles its vanilla step and, under TENSILE, waits for the plan made for it)."""
    began: dict[str, float] = {}
    out: dict[str, list[float]] = {}
    for t, kind, job in _events(samples, phase):
        if kind == "capture":
            began[job] = t
        elif kind == "captured" and job in began:
            out.setdefault(job, []).append(t - began.pop(job))
    return out


def _events(samples: list[tuple], phase: str) -> list[tuple[float, str, str]]:
    """The phase's events in time order, as ``(t, kind, job)`` ("arrive a-1" → arrive, a-1)."""
    return [(t, *e.split(" ", 1)) for t, e in sorted((t, e) for p, t, _u, e in samples
                                                    if p == phase and e)]


def _measured_together(events: list[tuple[float, str, str]]) -> tuple[float, float]:
    """``(last "measuring", first exit)`` of a phase's events when every job that arrived said
    ``measuring`` (the barrier of settings whose jobs start together); else no bounds."""
    arrived = {job for _t, kind, job in events if kind == "arrive"}
    measuring = {job: t for t, kind, job in events if kind == "measuring"}
    exits = [t for t, kind, _job in events if kind == "exit"]
    if not arrived or arrived - set(measuring):
        return -math.inf, math.inf
    return max(measuring.values()), min(exits, default=math.inf)


def _msr_above_idle(mem: dict, ref: dict, key: str) -> float | None:
    from experiments.tensile_run import _saving
    if mem[key] is None or ref[key] is None:
        return None
    return _saving(mem[key] - mem["idle_mb"], ref[key] - ref["idle_mb"])


def _gpu_row(setting: Setting, outs: dict[str, dict[str, JobOutcome]], sampler: MemorySampler,
             replans: list[Replan], opts: Options, files: dict[str, str]) -> dict:
    """The setting's device-level row (``backend`` = GPU)."""
    reasons = [r.reason for r in replans]
    mem = memory_figures(sampler.samples, opts.memory_gb)
    models = list(dict.fromkeys(j.model for j in setting.jobs))
    both = [j.job_id for j in setting.jobs
            if outs["vanilla"][j.job_id].result and outs["tensile"][j.job_id].result]
    mean = lambda ph: sum(_job_summary(outs[ph][j].result)["mean"] for j in both)  # noqa: E731
    eor = mean("tensile") / mean("vanilla") - 1 if both else None
    msr = mem["msr_nvml"]
    extra = {"scenario": setting.scenario, "setting": setting.label, "job": "GPU",
             "copies": setting.copies, "jobs": [j.job_id for j in setting.jobs],
             "memory_source": sampler.source, **mem,
             "eor": eor, "cbr": msr / eor if msr is not None and eor and eor > 0 else None,
             "replans": len(reasons), "replan_kinds": _reason_kinds(reasons),
             "replan_reasons": reasons[:50],
             "replan_planner_ms": [r.planner_ms for r in replans][:50],
             "budget_bytes": opts.budget_bytes,
             "budget_share": opts.budget_share,
             "memory_gb": opts.memory_gb, **files}
    if sampler.source == "rss":
        extra["memory_note"] = "CPU smoke run: summed RSS of the job processes, not GPU memory"
    failed = [j.job_id for j in setting.jobs if j.job_id not in both]
    status, reason = "ok", ""
    if failed:
        status, reason = "error", (f"job(s) {', '.join(failed)} failed: the device-level "
                                   "figures are not of the whole job set")
    elif msr is None:
        status, reason = "error", "no memory samples outside the jobs' start-ups"
    return {"model": "+".join(models), "backend": "GPU", "status": status, "reason": reason,
            "warmup": opts.warmup, "iters": opts.iters,
            "peak_mem_mb": mem["peak_tensile_mb"],
            "extra": extra}


# --------------------------------------------------------------------------- timeline files

def write_timeline(samples: list[tuple], path: Path) -> None:
    """The samples as CSV: phase, t_s, used_mb, event (empty for plain samples)."""
    import pandas as pd
    df = pd.DataFrame(samples, columns=["phase", "t_s", "used_bytes", "event"])
    df["used_mb"] = (df.pop("used_bytes") / MB).round(2)
    df["t_s"] = df["t_s"].round(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    df[["phase", "t_s", "used_mb", "event"]].to_csv(path, index=False)


def read_timeline(path: Path) -> list[tuple]:
    """The samples :func:`write_timeline` wrote (bytes again, to 0.01 MB)."""
    import pandas as pd
    df = pd.read_csv(path, keep_default_na=False, dtype={"event": str, "phase": str})
    return [(p, float(t), float(u) * MB, e) for p, t, u, e in
            df[["phase", "t_s", "used_mb", "event"]].itertuples(index=False)]


def memory_figures(samples: list[tuple], memory_gb: float | None = None) -> dict[str, Any]:
    """A setting's device-level memory figures from its samples (both phases; see the
    module notes): ``msr_nvml``, ``msr_nvml_all`` and, per phase, ``idle_<phase>_mb``,
    ``peak_<phase>_mb`` and ``peak_all_<phase>_mb`` (MiB, to 0.1); with ``memory_gb`` (the
    emulated GPU) also ``fits_memory_gb_<phase>``: whether the phase's peak fitted it."""
    van, ten = phase_memory(samples, "vanilla"), phase_memory(samples, "tensile")
    out: dict[str, Any] = {"msr_nvml": _msr_above_idle(ten, van, "peak_mb"),
                           "msr_nvml_all": _msr_above_idle(ten, van, "peak_all_mb")}
    for name, mem in (("vanilla", van), ("tensile", ten)):
        out.update({f"{k.removesuffix('_mb')}_{name}_mb": None if v is None else round(v, 1)
                    for k, v in mem.items()})
        if memory_gb is not None and mem["peak_all_mb"] is not None:
            out[f"fits_memory_gb_{name}"] = mem["peak_all_mb"] <= memory_gb * 1024
    return out


def plot_timeline(samples: list[tuple], path: Path, title: str, source: str) -> None:
    """Memory over time, one panel per phase: arrivals (green), exits (red) and start-ups
    (grey: left out of the steady peak) marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharey=True)
    for ax, phase in zip(axes, ("vanilla", "tensile")):
        plain = [(t, u / 2**30) for p, t, u, e in samples if p == phase and not e]
        if plain:
            ax.plot(*zip(*plain), lw=1, color="C0")
        for a, b in _windows(samples, phase)[1]:
            ax.axvspan(a, b, color="grey", alpha=0.15, lw=0)
        for p, t, _u, e in samples:
            if p != phase or not e.startswith(("arrive", "exit")):
                continue
            kind, job = e.split(" ", 1)
            color, style = ("tab:green", "--") if kind == "arrive" else ("tab:red", ":")
            ax.axvline(t, color=color, ls=style, lw=0.8)
            ax.annotate(f"{kind} {job}", (t, 1), xycoords=("data", "axes fraction"),
                        rotation=90, fontsize=6, va="top", ha="right", color=color)
        ax.set_title(phase, fontsize=9, loc="left")
        ax.set_ylabel("GPU used (GiB)" if source == "nvml" else "jobs' RSS (GiB)")
    axes[-1].set_xlabel("seconds since the phase began")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- settings loop

def _row_env(probe: dict) -> dict:
    """The probe's environment with the date of now (rows are written as settings finish)."""
    return {**probe["env"], "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _gpu_key(setting: Setting, env: dict, opts: Options) -> tuple[str, ...]:
    """The store key of a setting's GPU row: written last, so it marks the setting done."""
    models = "+".join(dict.fromkeys(j.model for j in setting.jobs))
    return row_key({**env, "experiment": EXPERIMENT, "mode": setting.label, "model": models,
                    "backend": "GPU", "batch_size": opts.batch})


def run_setting(setting: Setting, opts: Options, probe: dict, store: ResultStore,
                sampler: MemorySampler) -> list[dict]:
    """Both phases of one setting, its timeline files and rows; returns the rows written.

    Never raises for a job's or a phase's failure: those become error rows.
    """
    deadline = time.monotonic() + opts.timeout_s
    work = Path(tempfile.mkdtemp(prefix="tsl-multi", dir="/tmp"))  # short: a socket path
    sampler.samples = []
    outs: dict[str, dict[str, JobOutcome]] = {}
    try:
        for phase in ("vanilla", "tensile"):
            try:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the setting ran longer than {opts.timeout_s:g} s "
                                       f"before the {phase} phase")
                outs[phase] = run_phase(setting, phase, opts, probe["rates"], work, sampler, deadline)
            except Exception as exc:  # noqa: BLE001 - e.g. the scheduler did not come up
                why = f"{phase} phase failed: {type(exc).__name__}: {exc}"[:500]
                outs[phase] = {j.job_id: JobOutcome(j, error=why) for j in setting.jobs}
        replans = _scheduler_replans(work / "scheduler-tensile.log")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_dir = store.path.parent
    env = _row_env(probe)
    # Named per setting and run (the rows' date): a later run of the setting keeps this one's.
    stamp = date_stamp(env["date"])
    files = {"timeline_csv": f"tensile_multi_timeline_{file_slug(setting.label)}_{stamp}.csv",
             "plot_png": f"tensile_multi_{file_slug(setting.label)}_{stamp}.png"}
    write_timeline(sampler.samples, out_dir / files["timeline_csv"])
    plot_timeline(sampler.samples, out_dir / files["plot_png"], setting.label, sampler.source)
    common = {"experiment": EXPERIMENT, "mode": setting.label, "batch_size": opts.batch}
    rows = [store.append({**env, **common, **_job_row(setting, j, outs["vanilla"][j.job_id],
                                                     outs["tensile"][j.job_id], opts)})
            for j in setting.jobs]
    rows.append(store.append({**env, **common,
                              **_gpu_row(setting, outs, sampler, replans, opts, files)}))
    return rows


def _summary(rows: list[dict]) -> str:
    gpu = rows[-1]
    extra = json.loads(gpu["extra"]) if gpu["extra"] else {}
    ok = sum(r["status"] == "ok" for r in rows[:-1])
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    text = (f"{gpu['mode']}: {ok}/{len(rows) - 1} jobs ok; msr_nvml {fmt(extra.get('msr_nvml'))}"
            f" ({extra.get('memory_source')}), eor {fmt(extra.get('eor'))}, "
            f"{extra.get('replans')} re-plans")
    errors = [f"  {r['backend']}: {r['reason']}" for r in rows[:-1] if r["status"] != "ok"]
    return "\n".join([text, *errors])


def run(settings: list[Setting], opts: Options, probe: dict) -> list[dict]:
    """Every setting not stored yet (all with ``redo``); returns the rows written."""
    from tqdm import tqdm

    from experiments.env import gpu_slug
    env = probe["env"]
    store = ResultStore(opts.results_dir / gpu_slug(env["gpu"]) / f"{EXPERIMENT}.csv")
    done = store.done_keys(redo=opts.redo, min_iters=opts.iters)
    todo = [s for s in settings if _gpu_key(s, env, opts) not in done]
    for s in settings:
        if s not in todo:
            print(f"already measured (--redo to measure again): {s.label}")
    rows: list[dict] = []
    if not todo:
        return rows
    sampler = MemorySampler(opts.device, opts.gpu_index)  # NVML problems stop us here, at once
    try:
        # --mps: both phases' jobs (and the scheduler) are clients of one private daemon
        with mps_daemon(_child_env(opts)) if opts.mps else contextlib.nullcontext():
            bar = tqdm(todo, desc=EXPERIMENT, unit="setting")
            for s in bar:
                bar.set_postfix_str(s.label)
                written = run_setting(s, opts, probe, store, sampler)
                tqdm.write(_summary(written))
                rows += written
    finally:
        sampler.close()
    return rows


def _probe_in_child(opts: Options) -> dict:
    """:func:`_probe` in a process of its own: this one never creates a CUDA context
    (it would show in the NVML samples)."""
    proc = subprocess.run([sys.executable, "-m", "experiments.tensile_multi", "--probe", opts.device],
                          capture_output=True, text=True, env=_child_env(opts), cwd=ROOT,
                          timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX):])
    raise RuntimeError(f"probing the {opts.device} device failed (exit code {proc.returncode}):\n"
                       f"{proc.stderr[-2000:]}")


# --------------------------------------------------------------------------- command line

def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _int_list(text: str) -> list[int]:
    try:
        return [_positive_int(t) for t in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, e.g. 1,2,3; got {text!r}") from None


def _name_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected model names separated by commas, e.g. "
                                         f"vgg16,resnet50; got {text!r}")
    return names


def _parse_budget(text: str) -> int:
    from tensile.server import _parse_bytes  # the scheduler's own --budget parser
    return _parse_bytes(text)


def _resident_arg(text: str) -> int | str:
    """``--stream-resident``: a number of groups or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of groups or {AUTO!r}, got {text!r}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.tensile_multi",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=SCENARIOS, help="copies | mdw | dynamic (required)")
    ap.add_argument("--models", type=_name_list, default=None,
                    help=f"comma-separated model names (default: {','.join(PAPER_MODELS)}; "
                         f"on cpu {','.join(SMOKE_MODELS)})")
    ap.add_argument("--copies", type=_int_list, default=[1, 2, 3],
                    help="copies per model for --scenario copies (default 1,2,3)")
    ap.add_argument("--batch", type=_positive_int, default=2, help="batch size (default 2)")
    ap.add_argument("--iters", type=_positive_int, default=50,
                    help="measured steps (default 50, as the TENSILE authors)")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up steps, >= 2 (default 5)")
    ap.add_argument("--budget", type=_parse_budget, default=None,
                    help="the scheduler's memory budget for all jobs, e.g. 60G (default none)")
    ap.add_argument("--budget-share", type=float, default=None,
                    help="instead of --budget: the scheduler's budget at every re-plan is this "
                         "share (0, 1] of the jobs' joint peak without plans, so the plans "
                         "move only what that cut needs (default none)")
    ap.add_argument("--max-overhead", type=float, default=0.0,
                    help="the scheduler's recompute allowance without a budget (--budget, "
                         "--budget-share), a share of each "
                         "job's iteration time (default 0: swaps only)")
    ap.add_argument("--memory-gb", type=_positive_float, default=None,
                    help="emulate a GPU of this many GiB: caps every job process (cuda only)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--image-size", type=_positive_int, default=None,
                    help="input side (default 224 on cuda, 32 on cpu)")
    ap.add_argument("--arrive-every", type=_positive_int, default=5,
                    help="dynamic: a job arrives every K steps of the first job (default 5)")
    ap.add_argument("--timeout", type=_positive_float, default=900.0,
                    help="seconds for one setting, both phases (default 900)")
    ap.add_argument("--gpu-index", type=int, default=None,
                    help="NVML/CUDA index of the GPU (default: CUDA_VISIBLE_DEVICES, else 0)")
    ap.add_argument("--results-dir", type=Path, default=Path("results"))
    ap.add_argument("--redo", action="store_true", help="measure stored settings again")
    ap.add_argument("--captured", action="store_true",
                    help="every job's step captured in a CUDA graph (vanilla and TENSILE; "
                         "TENSILE's jobs re-capture when a new plan comes; cuda only)")
    ap.add_argument("--optimizer", choices=("adam", "adam_fused"), default="adam",
                    help="every job's optimizer: adam (default, PyTorch's foreach Adam, as the "
                         "authors trained) or adam_fused (Adam(fused=True): the same update in "
                         "one kernel per call; a streamed optimizer calls it once per group)")
    ap.add_argument("--stream-optimizer", type=int, default=0, metavar="GROUPS",
                    help="TENSILE's jobs update in backward with Adam's state streamed from "
                         "host memory (tensile.stream_optimizer) in GROUPS groups (default 0: not)")
    ap.add_argument("--stream-prefetch", type=int, default=DEFAULT_PREFETCH, metavar="K",
                    help=f"with --stream-optimizer: groups whose state is copied in ahead "
                         f"(default {DEFAULT_PREFETCH})")
    ap.add_argument("--stream-resident", type=_resident_arg, default=0, metavar="K|auto",
                    help="with --stream-optimizer: the first K groups backward updates keep their "
                         "state on the device (default 0), or auto: the fewest whose streaming, "
                         "with all the setting's jobs on one link, delays a step by at most "
                         "--stream-overhead (tensile.tune_resident)")
    ap.add_argument("--stream-overhead", type=float, default=DEFAULT_STREAM_OVERHEAD, metavar="F",
                    help="with --stream-resident auto: the delay allowed, a share of the step "
                         f"(default {DEFAULT_STREAM_OVERHEAD})")
    ap.add_argument("--stream-chunk", type=_positive_float, default=None, metavar="MB",
                    help="with --stream-optimizer: each update on at most MB MiB of parameters at "
                         "a time, larger ones in slices (bounds the optimizer's temporaries; "
                         "default: a group at once)")
    ap.add_argument("--bn-from-stats", action="store_true",
                    help="TENSILE's jobs recompute a training-mode batch norm from the batch "
                         "statistics its forward returned, with the residual add and ReLU after "
                         "it, in one kernel (tensile.Scheduler(batch_norm_from_stats=True): "
                         "fewer kernels a recompute, equal to rounding, not bit for bit)")
    ap.add_argument("--trim-stack", choices=tuple(PHASES), default="none",
                    help="jobs give back their CUDA context's thread-stack reservation after "
                         "their first step (tensile.trim_stack): none, tensile (TENSILE's jobs) "
                         "or all (vanilla's too, so the NVML MSR is the plans' own saving)")
    ap.add_argument("--trim-blas", choices=tuple(PHASES), default="none",
                    help="jobs give back their cuBLAS workspaces after their first step and use "
                         "1 MiB ones from then on (tensile.trim_blas_workspace): none, tensile "
                         "or all")
    ap.add_argument("--compact", choices=tuple(PHASES), default="none",
                    help="jobs allocate their parameters, gradients, buffers and optimizer state "
                         "again side by side after their first step, so the holes it left in the "
                         "allocator's segments go back (tensile.compact): none, tensile or all")
    ap.add_argument("--mps", action="store_true",
                    help="the jobs of both phases share the GPU through a private MPS daemon "
                         "(experiments.mps) instead of time slices (cuda only)")
    ap.add_argument("--job", type=Path, default=None, help=argparse.SUPPRESS)   # a job process
    ap.add_argument("--probe", choices=("cuda", "cpu"), default=None, help=argparse.SUPPRESS)
    return ap


def _options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Options, list[Setting]]:
    """Check the arguments (``ap.error``: exit code 2 naming what was expected)."""
    from experiments.models import MODELS, check_image_size
    if args.scenario is None:
        ap.error(f"--scenario is required; valid: {', '.join(SCENARIOS)}")
    if args.models is None:
        args.models = list(PAPER_MODELS if args.device == "cuda" else SMOKE_MODELS)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; valid: {', '.join(MODELS)}")
    size = args.image_size or IMAGE_SIZE[args.device]
    for m in args.models:   # ap.error exits at the first
        try:
            check_image_size(m, size)
        except ValueError as e:
            ap.error(f"{e} (--image-size; default {IMAGE_SIZE[args.device]} with --device "
                     f"{args.device})")
    if args.scenario != "dynamic" and len(set(args.models)) != len(args.models):
        ap.error(f"--models lists a model twice: {args.models} (repeats are for --scenario dynamic)")
    if args.scenario in ("mdw", "dynamic") and len(args.models) < 2:
        ap.error(f"--scenario {args.scenario} needs at least 2 models, got {args.models}")
    if args.warmup < 2:
        ap.error(f"--warmup must be >= 2 (the first step creates the optimizer state, the "
                 f"second times every op for the first re-plan), got {args.warmup}")
    if args.gpu_index is not None and args.gpu_index < 0:
        ap.error(f"--gpu-index must be >= 0, got {args.gpu_index}")
    if args.device == "cpu" and (args.memory_gb is not None or args.gpu_index is not None
                                 or args.captured or args.mps or args.trim_stack != "none"
                                 or args.trim_blas != "none"):
        ap.error("--memory-gb, --gpu-index, --captured, --mps, --trim-stack and --trim-blas are "
                 "for --device cuda")
    if args.mps and not mps_available():
        ap.error("--mps starts a CUDA MPS daemon: nvidia-cuda-mps-control is not on PATH")
    if args.device == "cuda":
        import importlib.util

        import torch
        if not torch.cuda.is_available():  # the driver only: no CUDA context in this process
            ap.error("--device cuda, but this host has no usable CUDA GPU; for a smoke run use "
                     "--device cpu")
        if importlib.util.find_spec("pynvml") is None:
            ap.error("--device cuda samples GPU memory through NVML: install nvidia-ml-py "
                     "(the pynvml module)")
    if args.stream_optimizer < 0:
        ap.error(f"--stream-optimizer must be a number of parameter groups >= 0 (0: not), got "
                 f"{args.stream_optimizer}")
    if args.stream_prefetch < 1:
        ap.error(f"--stream-prefetch must be a number of groups >= 1, got {args.stream_prefetch}")
    if args.stream_resident != AUTO and not 0 <= args.stream_resident <= args.stream_optimizer:
        ap.error(f"--stream-resident must be a number of groups from 0 to --stream-optimizer, or "
                 f"auto, got {args.stream_resident} (--stream-optimizer {args.stream_optimizer})")
    if args.stream_resident == AUTO and not args.stream_optimizer:
        ap.error("--stream-resident auto chooses among --stream-optimizer's groups: give "
                 "--stream-optimizer too")
    if not 0 <= args.stream_overhead < 1:
        ap.error(f"--stream-overhead must be a share of the step in [0, 1), got {args.stream_overhead}")
    if args.stream_chunk is not None and not args.stream_optimizer:
        ap.error("--stream-chunk bounds the streamed optimizer's updates: give --stream-optimizer too")
    if not 0 <= args.max_overhead < 1:
        ap.error(f"--max-overhead must be a share of the iteration time in [0, 1), got {args.max_overhead}")
    if args.budget_share is not None:
        if args.budget is not None:
            ap.error(f"give --budget or --budget-share, not both (got {args.budget} bytes and "
                     f"{args.budget_share})")
        if not 0 < args.budget_share <= 1:
            ap.error(f"--budget-share must be a share of the joint peak in (0, 1], got "
                     f"{args.budget_share}")
    budget = args.budget
    if budget is None and args.budget_share is None and args.memory_gb is not None:
        from experiments.tensile_run import EMULATED_HEADROOM
        budget = int(EMULATED_HEADROOM * args.memory_gb * 2**30)
    opts = Options(device=args.device, batch=args.batch, warmup=args.warmup, iters=args.iters,
                   image_size=args.image_size or IMAGE_SIZE[args.device], budget_bytes=budget,
                   budget_share=args.budget_share,
                   max_overhead=args.max_overhead,
                   memory_gb=args.memory_gb, gpu_index=args.gpu_index, timeout_s=args.timeout,
                   results_dir=args.results_dir, redo=args.redo, arrive_every=args.arrive_every,
                   captured=args.captured, optimizer=args.optimizer,
                   stream_optimizer=args.stream_optimizer,
                   stream_prefetch=args.stream_prefetch, stream_resident=args.stream_resident,
                   stream_overhead=args.stream_overhead, stream_chunk_mb=args.stream_chunk,
                   bn_from_stats=args.bn_from_stats, mps=args.mps, trim_stack=args.trim_stack,
                   trim_blas=args.trim_blas, compact=args.compact)
    return opts, build_settings(args.scenario, args.models, args.copies, opts)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.job is not None:  # a job process: its result is the last JSON line
        _emit({"event": "done", "result": run_job(json.loads(args.job.read_text()))})
        return 0
    if args.probe is not None:
        _emit(_probe(args.probe))
        return 0
    opts, settings = _options(ap, args)
    probe = _probe(opts.device) if opts.device == "cpu" else _probe_in_child(opts)
    total = probe.get("total_memory")
    if opts.memory_gb is not None and total and opts.memory_gb * 2**30 > total:
        ap.error(f"--memory-gb {opts.memory_gb:g} is more than this GPU's {total / 2**30:.1f} GiB")
    run(settings, opts, probe)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
