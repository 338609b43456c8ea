"""``experiment=tensile``: TENSILE, vDNN, Capuchin and PyTorch's memory savers on one model × batch.

    python -m experiments.run experiment=tensile model=resnet50 batch_size=16
    python -m experiments.run +sweep=tensile_single      # the paper's batch-16 table

One job builds a fresh model and Adam for every method in ``experiment.methods``
(:func:`tensile.baselines.make_method`), runs ``warmup`` steps, then ``repeats`` × ``iters``
measured steps: per step the CUDA-event time (``perf_counter`` on CPU), per repeat the peak
``max_memory_allocated`` / ``max_memory_reserved`` (reset after the warm-up). The vanilla step
is always measured first in the same process, so every row carries TENSILE's metrics
against it (reference §3.7, with allocator peaks instead of NVML):

* MSR = 1 - peak / peak_vanilla, for allocated (``msr``) and reserved (``msr_reserved``) peaks;
* EOR = time / time_vanilla - 1 (mean step times); CBR = MSR / EOR (empty when EOR <= 0);
* for tensile/vdnn/capuchin: passive swap-in share, bytes moved per step and planner time
  over the measured steps, from ``Scheduler.report()``.

They go into the row's ``extra`` JSON (:mod:`experiments.store`). ``memory_gb`` (or
``memory_fraction``) caps the process with ``torch.cuda.set_per_process_memory_fraction`` to
emulate a smaller GPU; an out-of-memory method is an error row ("out of memory at ..."),
never a crash. On CPU (``timing=quick`` only) memory is not measured and the tensile
runtime runs in its simulation mode: a smoke test of the whole path.
"""
from __future__ import annotations

import gc
import hashlib
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from omegaconf import ListConfig, OmegaConf

from experiments.optim import OPTIMIZERS, make_optimizer
from experiments.run import RUN_ID, ConfigError, validate_model_and_batch, write_trace
from experiments.timing import summarize_ms
from experiments.store import ResultStore, date_stamp, file_slug, row_key
from experiments.timing import measure
from nimble.allocator import expandable_segments
from tensile.baselines import METHODS, make_method
from tensile.estimate import measure_copy_bandwidth, measure_peak_rates
from tensile.api import SchedulerReport, gb_per_s
from tensile.planner import CAPTURED_SWAP_COST_MS, COPY_LATENCY_MS, SWAP_SEARCH
from tensile.step import training_step
from tensile.resident import AUTO, DEFAULT_STREAM_OVERHEAD
from tensile.scale import valid_record_batches
from tensile.streamed import DEFAULT_PREFETCH

log = logging.getLogger(__name__)

# the TENSILE authors' single-job figures (experiment.match_msr=paper)
PAPER_SINGLE = Path(__file__).resolve().parents[1] / "results" / "paper" / "tensile_single_b16.csv"

__all__ = ["validate", "protocol", "setting", "method_label", "derived_metrics",
           "classification_loss", "measure_method", "machine_rates", "run", "EMULATED_HEADROOM"]

MB = 2**20
# With an emulated smaller GPU and no explicit budget, TENSILE and Capuchin plan to this
# share of it: the planner counts tensor bytes only, the allocator's rounding, fragmentation
# and cuDNN workspaces need the rest.
EMULATED_HEADROOM = 0.9
SCHEDULED = ("tensile", "vdnn", "vdnn_all", "capuchin")  # run on TENSILE's runtime
# one CUDA graph per step: capturable optimizer, CUDA only
GRAPHED = ("graph", "tensile_graph", "checkpoint_graph", "streamed_graph")
# judged against graph too (*_vs_graph)
AGAINST_GRAPH = ("tensile_graph", "checkpoint_graph", "streamed_graph")
STREAMED = ("tensile_graph", "streamed_graph")   # take the stream_* options
PLANNED = ("tensile", "tensile_graph")  # TENSILE's own planner: budget and max_overhead apply
RATED = (*SCHEDULED, "tensile_graph")   # planned with this machine's measured rates


# --------------------------------------------------------------------------- configuration

def validate(cfg, models: dict) -> None:
    """Fail fast with the valid choices (:class:`experiments.run.ConfigError`)."""
    exp = cfg.experiment
    validate_model_and_batch(cfg, models)
    methods = list(exp.methods or [])
    if not methods:
        raise ConfigError(f"experiment.methods is empty; valid: {', '.join(METHODS)}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; valid: {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"experiment.methods lists a method twice: {methods}")
    if "streamed_graph" in methods and not exp.get("stream_optimizer", 0):
        raise ConfigError("method streamed_graph streams the optimizer: set "
                          "experiment.stream_optimizer to a number of groups (16, say)")
    _check_match_peak(exp, methods)
    _check_match_msr(exp, methods, cfg.model.name, cfg.batch_size)
    if exp.optimizer not in OPTIMIZERS:
        raise ConfigError(f"experiment.optimizer={exp.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    warmup, iters, repeats = protocol(cfg)
    if iters < 1 or repeats < 1:
        raise ConfigError(f"need iters >= 1 and repeats >= 1, got iters={iters}, repeats={repeats}")
    if set(methods) & set(GRAPHED) and cfg.device.name != "cuda":
        raise ConfigError(f"methods {sorted(set(methods) & set(GRAPHED))} capture CUDA graphs: "
                          "they need device=cuda")
    if warmup < 2 and set(methods) & set(SCHEDULED):
        raise ConfigError(f"warmup={warmup}: the scheduled methods need >= 2 warm-up steps (the "
                          "first creates the optimizer state, the second times every op to re-plan)")
    _check_budget(exp.budget)
    mo = exp.get("max_overhead", 0.0)
    if not isinstance(mo, (int, float)) or isinstance(mo, bool) or not 0 <= mo < 1:
        raise ConfigError(f"experiment.max_overhead must be a fraction of the iteration time in "
                          f"[0, 1), got {mo!r}")
    lat = exp.get("copy_latency_ms", COPY_LATENCY_MS)
    if not isinstance(lat, (int, float)) or isinstance(lat, bool) or not 0 <= lat < 1000:
        raise ConfigError(f"experiment.copy_latency_ms must be a time in ms >= 0, got {lat!r}")
    sc = exp.get("swap_cost_ms")
    if sc is not None and (not isinstance(sc, (int, float)) or isinstance(sc, bool)
                           or not 0 <= sc < 1000):
        raise ConfigError(f"experiment.swap_cost_ms must be a time in ms >= 0, or null for each "
                          f"method's own (tensile_graph: {CAPTURED_SWAP_COST_MS:g}, tensile: 0), "
                          f"got {sc!r}")
    share = exp.get("swap_copy_share", 0.0)
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share <= 1:
        raise ConfigError(f"experiment.swap_copy_share must be a share of a swap's copy time in "
                          f"[0, 1], got {share!r}")
    ss = exp.get("swap_search", "unmet")
    if ss not in SWAP_SEARCH:
        raise ConfigError(f"experiment.swap_search must be one of {', '.join(SWAP_SEARCH)} (when "
                          f"the planner searches for swaps across its peak), got {ss!r}")
    cw = exp.get("count_workspaces", True)
    if not isinstance(cw, bool):
        raise ConfigError(f"experiment.count_workspaces must be true or false (whether the plan "
                          f"counts the workspaces ops hold while they run), got {cw!r}")
    ra = exp.get("rebuild_ahead", 0)
    if not isinstance(ra, (int, float)) or isinstance(ra, bool) or not 0 <= ra < 1000:
        raise ConfigError(f"experiment.rebuild_ahead must be a number of rerun times >= 0 (0: "
                          f"rebuild on demand), got {ra!r}")
    so = exp.get("stream_optimizer", 0)
    if not isinstance(so, int) or isinstance(so, bool) or so < 0:
        raise ConfigError(f"experiment.stream_optimizer must be a number of parameter groups "
                          f">= 0 (0: off), got {so!r}")
    pf = exp.get("stream_prefetch", DEFAULT_PREFETCH)
    if not isinstance(pf, int) or isinstance(pf, bool) or pf < 1:
        raise ConfigError(f"experiment.stream_prefetch must be a number of groups >= 1, got {pf!r}")
    rs = exp.get("stream_resident", 0)
    if rs != AUTO and (not isinstance(rs, int) or isinstance(rs, bool) or rs < 0 or (so and rs > so)):
        raise ConfigError(f"experiment.stream_resident must be a number of groups from 0 to "
                          f"stream_optimizer, or {AUTO!r}, got {rs!r} (stream_optimizer={so!r})")
    sov = exp.get("stream_overhead", DEFAULT_STREAM_OVERHEAD)
    if not isinstance(sov, (int, float)) or isinstance(sov, bool) or not 0 <= sov < 1:
        raise ConfigError(f"experiment.stream_overhead must be a fraction of the step in [0, 1), "
                          f"got {sov!r}")
    for key, what in (("stream_chunk_mb", "the most parameter bytes one optimizer update call "
                                          "takes"),
                      ("stream_slice_mb", "larger parameters stream their state in row slices "
                                          "of about that size")):
        mb = exp.get(key)
        if mb is not None and (not isinstance(mb, (int, float)) or isinstance(mb, bool)
                               or not mb > 0):
            raise ConfigError(f"experiment.{key} must be MiB > 0 ({what}) or null, got {mb!r}")
    if exp.get("stream_slice_mb") is not None and rs == AUTO:
        raise ConfigError("experiment.stream_slice_mb cannot go with stream_resident=auto "
                          "(tensile.tune_resident times whole groups): give a number of groups")
    kept = exp.get("stream_slice_resident", 0)
    if not isinstance(kept, int) or isinstance(kept, bool) or kept < 0:
        raise ConfigError(f"experiment.stream_slice_resident must be a number of slices >= 0 "
                          f"(the last ones keep their state on the device), got {kept!r}")
    if kept and exp.get("stream_slice_mb") is None:
        raise ConfigError(f"experiment.stream_slice_resident={kept} keeps slices' state on the "
                          f"device: it needs experiment.stream_slice_mb, which makes the slices")
    if exp.get("stream_pace", False) is True and exp.get("stream_slice_mb") is None:
        raise ConfigError("experiment.stream_pace=true times when row slices update: it needs "
                          "experiment.stream_slice_mb, which makes them")
    dw = exp.get("defer_wgrad_mb")
    if dw is not None and (not isinstance(dw, (int, float)) or isinstance(dw, bool) or not dw >= 0):
        raise ConfigError(f"experiment.defer_wgrad_mb must be MiB >= 0 (linear layers with a weight "
                          f"at least that large make its gradient at backward's end) or null, "
                          f"got {dw!r}")
    for flag in ("allow_swaps", "batch_norm_from_stats", "census", "snapshot", "stream_pace",
                 "time_captured_copies"):
        if not isinstance(exp.get(flag, flag == "allow_swaps"), bool):
            raise ConfigError(f"experiment.{flag} must be true or false, got {exp.get(flag)!r}")
    if exp.get("census", False) and cfg.device.name != "cuda":
        raise ConfigError("experiment.census counts the CUDA kernels of the captured methods' "
                          "replays: it needs device=cuda")
    rb = exp.get("record_batches")
    if rb is not None:
        if not isinstance(rb, (list, tuple, ListConfig)) or \
                not valid_record_batches(list(rb), cfg.batch_size):
            raise ConfigError(f"experiment.record_batches must be null or three or more different "
                              f"batch sizes below batch_size={cfg.batch_size}, e.g. [2, 4, 8]; "
                              f"got {rb!r}")
    amb = exp.activation_memory_budget
    if not isinstance(amb, (int, float)) or isinstance(amb, bool) or not 0 <= amb <= 1:
        raise ConfigError(f"experiment.activation_memory_budget must be in [0, 1], got {amb!r}")
    device = cfg.device.name
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"unknown device {device!r}; valid: cuda, cpu")
    if device == "cpu":
        if cfg.timing.name != "quick":
            raise ConfigError("experiment=tensile on device=cpu is a smoke run only (no GPU memory "
                              "to measure, simulated runtime): add timing=quick")
        if exp.memory_fraction is not None or exp.memory_gb is not None:
            raise ConfigError("experiment.memory_fraction / memory_gb cap GPU memory: they need "
                              "device=cuda")
    elif not torch.cuda.is_available():
        raise ConfigError("device=cuda, but this host has no usable CUDA GPU "
                          "(torch.cuda.is_available() is False); for a smoke run use device=cpu "
                          "timing=quick")
    if exp.memory_fraction is not None and exp.memory_gb is not None:
        raise ConfigError("give experiment.memory_fraction or experiment.memory_gb, not both")
    f = exp.memory_fraction
    if f is not None and (not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1):
        raise ConfigError(f"experiment.memory_fraction must be in (0, 1], got {f!r}")
    g = exp.memory_gb
    if g is not None and (not isinstance(g, (int, float)) or isinstance(g, bool) or g <= 0):
        raise ConfigError(f"experiment.memory_gb must be a positive number of GiB, got {g!r}")


def _check_budget(b) -> None:
    ok = b is None or (isinstance(b, float) and 0 < b <= 1) or \
        (isinstance(b, int) and not isinstance(b, bool) and b > 0)
    if not ok:
        raise ConfigError(f"experiment.budget must be null, a fraction in (0, 1] of the GPU "
                          f"(a float) or bytes (a positive int); got {b!r}")


def _check_match_peak(exp, methods: list[str]) -> None:
    target = exp.get("match_peak")
    if target is None:
        return
    if "tensile_graph" not in methods:
        raise ConfigError(f"experiment.match_peak={target!r} plans tensile_graph to that method's "
                          f"peak: add tensile_graph to experiment.methods (got {methods})")
    if target not in methods or target == "tensile_graph":
        others = [m for m in methods if m != "tensile_graph"]
        raise ConfigError(f"experiment.match_peak must name another method of this job, measured "
                          f"before tensile_graph (one of {others}); got {target!r}")
    if exp.budget is not None:
        raise ConfigError(f"experiment.match_peak={target!r} sets tensile_graph's budget: leave "
                          f"experiment.budget null (got {exp.budget!r})")
    if exp.get("max_overhead", 0.0):
        raise ConfigError(f"experiment.max_overhead={exp.max_overhead!r} has no effect under a "
                          f"budget (match_peak={target!r} sets one): leave it 0")


def paper_msr(model: str, batch_size: int) -> float | None:
    """The TENSILE authors' single-job MSR for ``model`` at ``batch_size``
    (``results/paper/tensile_single_b16.csv``), or None where they give none."""
    table = pd.read_csv(PAPER_SINGLE)
    hit = table[(table["model"] == model) & (table["batch_size"] == batch_size)]
    return float(hit["msr"].iloc[0]) if len(hit) else None


def target_msr(exp, model: str, batch_size: int) -> float | None:
    """``experiment.match_msr`` as a number: ``paper`` becomes the authors' MSR for this
    model and batch. None when unset."""
    m = exp.get("match_msr")
    if m is None:
        return None
    if m == "paper":
        found = paper_msr(model, batch_size)
        if found is None:
            table = pd.read_csv(PAPER_SINGLE)
            have = ", ".join(f"{r.model} at batch {r.batch_size}" for r in table.itertuples())
            raise ConfigError(f"experiment.match_msr=paper: the TENSILE authors give no MSR for "
                              f"{model} at batch {batch_size} (they give {have}); give a number")
        return found
    return float(m)


def _check_match_msr(exp, methods: list[str], model: str, batch_size: int) -> None:
    m = exp.get("match_msr")
    if m is None:
        return
    if m != "paper" and (not isinstance(m, (int, float)) or isinstance(m, bool) or not 0 < m < 1):
        raise ConfigError(f"experiment.match_msr must be null, a memory saving in (0, 1) or "
                          f"'paper' (the authors' figure for this model and batch); got {m!r}")
    if exp.get("match_peak") is not None:
        raise ConfigError(f"experiment.match_msr={m!r} and match_peak={exp.match_peak!r} both set "
                          f"tensile_graph's target peak: give one")
    if "tensile_graph" not in methods or "vanilla" not in methods:
        raise ConfigError(f"experiment.match_msr={m!r} plans tensile_graph to a saving against "
                          f"vanilla's peak: experiment.methods needs vanilla and tensile_graph "
                          f"(got {methods})")
    if exp.budget is not None or exp.get("max_overhead", 0.0):
        raise ConfigError(f"experiment.match_msr={m!r} sets tensile_graph's budget: leave "
                          f"experiment.budget null and max_overhead 0 (got {exp.budget!r}, "
                          f"{exp.get('max_overhead')!r})")
    target_msr(exp, model, batch_size)   # "paper" must name a figure


def protocol(cfg) -> tuple[int, int, int]:
    """``(warmup, iters, repeats)``: the experiment's (TENSILE: 5, 50, 3); ``timing=quick``
    (smoke) takes the quick group's warm-up and iterations and one repeat instead."""
    exp = cfg.experiment
    if cfg.timing.name == "quick":
        return int(cfg.timing.warmup), int(cfg.timing.iters), 1
    return int(exp.warmup), int(exp.iters), int(exp.repeats)


def setting(exp) -> str:
    """The row's ``mode``: ``whole-step`` plus every knob that changes what all methods see."""
    parts = [str(exp.mode)]
    if exp.memory_gb is not None:
        parts.append(f"mem={exp.memory_gb:g}GiB")
    if exp.memory_fraction is not None:
        parts.append(f"memfrac={exp.memory_fraction:g}")
    if exp.budget is not None:  # a fraction, or exact bytes
        parts.append(f"budget={exp.budget:g}" if isinstance(exp.budget, float) else f"budget={exp.budget}")
    if not exp.cap_setup and (exp.memory_gb is not None or exp.memory_fraction is not None):
        parts.append("uncapped-setup")
    if expandable_segments():
        parts.append("expandable")   # the allocator maps pages as needed: less fragmentation
    if exp.optimizer != "adam":     # rows from before this option trained with adam
        parts.append(f"opt={exp.optimizer}")
    return ",".join(parts)


def record_knobs(name: str, exp) -> list[str]:
    """``record_batches=2-4-8`` for a method run on TENSILE's runtime that records so."""
    if name in SCHEDULED and exp.get("record_batches"):
        return ["record_batches=" + "-".join(str(b) for b in exp.record_batches)]
    return []


def method_label(name: str, exp) -> str:
    """The row's ``backend``: the method, with its own knob where it has one."""
    if name == "compile_budget":
        return f"compile_budget={exp.activation_memory_budget:g}"
    if name in PLANNED:
        knobs = []
        if name == "tensile_graph" and exp.get("match_peak"):
            knobs.append(f"match_peak={exp.match_peak}")
        if name == "tensile_graph" and exp.get("match_msr") is not None:
            knobs.append(f"match_msr={exp.match_msr:g}")   # run() resolves "paper" first
        if exp.get("max_overhead", 0.0):
            knobs.append(f"max_overhead={exp.max_overhead:g}")
        if exp.get("copy_latency_ms", COPY_LATENCY_MS) != COPY_LATENCY_MS:
            knobs.append(f"copy_latency_ms={exp.copy_latency_ms:g}")
        if not exp.get("allow_swaps", True):
            knobs.append("allow_swaps=false")
        if exp.get("batch_norm_from_stats", False):
            knobs.append("bn_from_stats")
        if exp.get("rebuild_ahead", 0):
            knobs.append(f"rebuild_ahead={exp.rebuild_ahead:g}")
        if exp.get("swap_cost_ms") is not None:
            knobs.append(f"swap_cost_ms={exp.swap_cost_ms:g}")
        if exp.get("swap_copy_share", 0.0):
            knobs.append(f"swap_copy_share={exp.swap_copy_share:g}")
        if exp.get("swap_search", "unmet") != "unmet":
            knobs.append(f"swap_search={exp.swap_search}")
        if not exp.get("count_workspaces", True):
            knobs.append("count_workspaces=false")
        if name == "tensile_graph" and exp.get("time_captured_copies", False):
            knobs.append("time_copies")
        knobs += stream_knobs(name, exp) + defer_knobs(name, exp) + record_knobs(name, exp)
        return f"{name}({','.join(knobs)})" if knobs else name
    recorded = record_knobs(name, exp)       # vdnn, capuchin: their only knob
    if recorded:
        return f"{name}({','.join(recorded)})"
    if name == "streamed_graph":
        return f"{name}({','.join(stream_knobs(name, exp) + defer_knobs(name, exp))})"
    return name


def defer_opts(name: str, exp) -> dict[str, float]:
    """``defer_wgrad_mb`` for a method that takes it (tensile_graph, streamed_graph), if set."""
    dw = exp.get("defer_wgrad_mb")
    return {"defer_wgrad_mb": float(dw)} if name in STREAMED and dw is not None else {}


def defer_knobs(name: str, exp) -> list[str]:
    """How a label names ``defer_wgrad_mb`` (``defer_wgrad=64``), where the method takes it."""
    return [f"defer_wgrad={v:g}" for v in defer_opts(name, exp).values()]


def _resident(exp) -> int | str:
    rs = exp.get("stream_resident", 0)
    return rs if rs == AUTO else int(rs)


def stream_opts(exp) -> dict[str, Any]:
    """``make_method``'s options of a streamed method (:func:`tensile.stream_optimizer`'s)."""
    return {"stream_optimizer": int(exp.stream_optimizer),
            "stream_prefetch": int(exp.get("stream_prefetch", DEFAULT_PREFETCH)),
            "stream_resident": _resident(exp),
            "stream_overhead": float(exp.get("stream_overhead", DEFAULT_STREAM_OVERHEAD)),
            "stream_chunk_mb": _mb(exp, "stream_chunk_mb"),
            "stream_slice_mb": _mb(exp, "stream_slice_mb"),
            "stream_slice_resident": int(exp.get("stream_slice_resident", 0)),
            "stream_pace": bool(exp.get("stream_pace", False))}


def _mb(exp, key: str) -> float | None:
    """``experiment.<key>``, MiB or None."""
    mb = exp.get(key)
    return None if mb is None else float(mb)


def stream_knobs(name: str, exp) -> list[str]:
    """The ``stream_*`` options of a streamed method, as its label shows them."""
    if name not in STREAMED or not exp.get("stream_optimizer", 0):
        return []
    o = stream_opts(exp)
    return stream_label(o["stream_optimizer"], o["stream_prefetch"], o["stream_resident"],
                        o["stream_overhead"], o["stream_chunk_mb"], o["stream_slice_mb"],
                        o["stream_slice_resident"], o["stream_pace"])


def stream_label(groups: int, prefetch: int, resident: int | str,
                 overhead: float = DEFAULT_STREAM_OVERHEAD, chunk_mb: float | None = None,
                 slice_mb: float | None = None, slice_resident: int = 0,
                 pace: bool = False) -> list[str]:
    """How a label names :func:`tensile.stream_optimizer`'s options (``groups`` > 0): prefetch
    unless 1 (rows from before the default became 2 meant 1), resident unless 0, with
    ``resident="auto"`` the streaming's allowance (:func:`tensile.tune_resident`), and the
    update's chunk, the large parameters' slices, the slices kept on the device and their
    pace when there are. Also ``experiments.tensile_multi``'s settings."""
    knobs = [f"stream_optimizer={groups}"]
    if prefetch != 1:
        knobs.append(f"stream_prefetch={prefetch}")
    if resident:
        knobs.append(f"stream_resident={resident}")
    if resident == AUTO:
        knobs.append(f"stream_overhead={overhead:g}")
    if chunk_mb is not None:
        knobs.append(f"stream_chunk={chunk_mb:g}")
    if slice_mb is not None:
        knobs.append(f"stream_slice={slice_mb:g}")
    if slice_resident:
        knobs.append(f"stream_slice_resident={slice_resident}")
    if pace:
        knobs.append("stream_pace")
    return knobs


# --------------------------------------------------------------------------- metrics

def derived_metrics(fields: dict, ref: dict | None) -> dict:
    """MSR (allocated, reserved), EOR and CBR of ``fields`` against the vanilla ``ref``.

    Values that cannot be computed (no vanilla, no memory on CPU) are ``None``; CBR is
    ``None`` when EOR <= 0 (no overhead: the ratio is unbounded).
    """
    out: dict[str, Any] = {"peak_vanilla_mb": None, "peak_vanilla_reserved_mb": None,
                           "time_vanilla_ms": None, "msr": None, "msr_reserved": None,
                           "eor": None, "cbr": None, "cbr_reserved": None}
    if not ref or ref.get("status") != "ok" or fields.get("status") != "ok":
        return out
    extra, ref_extra = fields.get("extra", {}), ref.get("extra", {})
    out["peak_vanilla_mb"] = ref.get("peak_mem_mb")
    out["peak_vanilla_reserved_mb"] = ref_extra.get("peak_reserved_mb")
    out["time_vanilla_ms"] = ref["mean_ms"]
    out["msr"] = _saving(fields.get("peak_mem_mb"), ref.get("peak_mem_mb"))
    out["msr_reserved"] = _saving(extra.get("peak_reserved_mb"), ref_extra.get("peak_reserved_mb"))
    out["eor"] = fields["mean_ms"] / ref["mean_ms"] - 1
    for key, msr in (("cbr", out["msr"]), ("cbr_reserved", out["msr_reserved"])):
        out[key] = msr / out["eor"] if msr is not None and out["eor"] > 0 else None
    return out


def _against_graph(fields: dict, graph: dict | None) -> dict:
    """MSR and EOR of a captured method (``tensile_graph``, ``checkpoint_graph``) against
    ``graph`` (both captured, so the host's share of the step is out of both): what the
    method saves and costs on the GPU."""
    if not graph or graph.get("status") != "ok" or fields.get("status") != "ok":
        return {"msr_vs_graph": None, "eor_vs_graph": None}
    return {"msr_vs_graph": _saving(fields.get("peak_mem_mb"), graph.get("peak_mem_mb")),
            "eor_vs_graph": fields["mean_ms"] / graph["mean_ms"] - 1}


def _saving(peak: float | None, vanilla: float | None) -> float | None:
    if peak is None or vanilla is None or not vanilla > 0:
        return None
    return 1 - peak / vanilla


def _scheduler_metrics(before: dict, after: dict) -> dict:
    """What a scheduled method did over the measured steps (deltas of two reports)."""
    d = {k: after[k] - before[k] for k in ("steps", "swap_ins", "passive_swap_ins", "recomputes",
                                           "bytes_d2h", "bytes_h2d", "ineffective_releases")}
    steps = d["steps"] or 1
    report = SchedulerReport(**after)
    return {
        "passive_share": d["passive_swap_ins"] / d["swap_ins"] if d["swap_ins"] else None,
        "bytes_moved_per_step": (d["bytes_d2h"] + d["bytes_h2d"]) / steps,
        "swap_ins_per_step": d["swap_ins"] / steps,
        "recomputes_per_step": d["recomputes"] / steps,
        "ineffective_releases": d["ineffective_releases"],
        "planner_ms": after["planner_ms_total"], "planner_ms_last": after["planner_ms_last"],
        "replans": after["replans"], "drift_events": after["drift_events"],
        **report.plan_figures(),
        "host_pool_mb": after["host_pool_bytes"] / MB,
        "stall_ms": after["stall_ms"] - before["stall_ms"],   # timed (measuring) steps only
        # the plan's assumptions against every timed step so far, warm-up included (beside
        # d2h_gbps/h2d_gbps, the bandwidths the planner was given): where hidden copies stop hiding
        **report.plan_check(),
    }


# --------------------------------------------------------------------------- one method

def classification_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the logits (Inception-v3's train-mode output is ``(logits, aux)``)."""
    return F.cross_entropy(out[0] if isinstance(out, (tuple, list)) else out, target)


def _drop_aux_head(model: torch.nn.Module) -> torch.nn.Module:
    """Inception-v3 without its auxiliary classifier: in training it needs 299-pixel inputs
    (at TENSILE's 224 its 5x5 conv sees 3x3), and the loss uses the main logits only."""
    if getattr(model, "AuxLogits", None) is not None:
        model.AuxLogits = None
        model.aux_logits = False
    return model


def _optimizer(model: torch.nn.Module, exp, capturable: bool = False) -> torch.optim.Optimizer:
    """``capturable``: Adam keeps its step count on the device (a CUDA graph needs that)."""
    return make_optimizer(model, exp.optimizer, exp.lr, exp.momentum, capturable)


def _release(device: str) -> None:
    gc.collect()
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def match_budget(target_mb: float, captured_peak_mb: Callable[[int], tuple[float, bool]],
                 attempts: int = 5) -> tuple[int, list[dict]]:
    """The budget (bytes) under which TENSILE's captured step peaks at most ``target_mb``,
    as close under it as ``attempts`` tries find.

    The planner counts tensor bytes; a captured step also holds the allocator's rounding and
    library workspaces, so the same budget peaks 10-70 MB higher on an H200, by an amount
    that changes with the plan. Starting from the target, each try that peaks above it
    lowers the budget by the excess plus 0.5 % of the target (never to or above a budget
    that fitted). A try that fits with more than 1 % of the target to spare raises the
    budget by the spare less 0.5 % (never to or above a budget that peaked above): memory
    left unused is recomputation paid for nothing. ``captured_peak_mb(budget)`` plans and
    captures under ``budget`` and returns (peak MB, plan feasible). Stops when the next
    budget would bring nothing new, at an infeasible plan (a lower budget cannot help), or
    after ``attempts``. Returns the highest budget that fitted (else the last one tried)
    and every try (``budget_mb``, ``peak_mb``, ``feasible``): the caller checks the
    measured peak.
    """
    budget, tries = int(target_mb * MB), []
    fitted, over = None, None          # highest budget within the target, lowest above it
    for _ in range(attempts):
        peak_mb, feasible = captured_peak_mb(budget)
        tries.append({"budget_mb": round(budget / MB, 1), "peak_mb": round(peak_mb, 1),
                      "feasible": bool(feasible)})
        if not feasible:
            break
        margin = 0.005 * target_mb
        if peak_mb <= target_mb:
            fitted = max(fitted or 0, budget)
            spare = target_mb - peak_mb
            if spare <= 2 * margin:
                break
            nxt = budget + int((spare - margin) * MB)
            if over is not None:
                nxt = min(nxt, (budget + over) // 2)
        else:
            over = budget if over is None else min(over, budget)
            nxt = budget - int((peak_mb - target_mb + margin) * MB)
            if fitted is not None:
                nxt = max(nxt, (budget + fitted) // 2)
        if nxt <= 0 or nxt == budget or (fitted is not None and nxt <= fitted) \
                or (over is not None and nxt >= over) or len(tries) == attempts:
            break
        budget = nxt
    return (fitted if fitted is not None else budget), tries


@dataclass
class _Built:
    """A method built for one job (its step holds model and optimizer): what
    :func:`measure_method` times, with what was allocated (and reserved) before it existed,
    which its peaks are counted above."""
    step: Callable
    prepare_s: float
    resident_mb: float
    resident_reserved_mb: float


def _build_method(name: str, build: Callable[[], torch.nn.Module], batch: tuple, exp,
                  device: str, opts: dict) -> _Built:
    """Build the model and ``make_method`` it, timing the preparation."""
    cuda = device == "cuda"
    # What is allocated before the model exists (the batch, anything an earlier job of this
    # process left behind) is not the method's: peaks are counted above it.
    resident_mb = torch.cuda.memory_allocated() / MB if cuda else 0.0
    resident_reserved_mb = torch.cuda.memory_reserved() / MB if cuda else 0.0
    model = build()
    opt = _optimizer(model, exp, capturable=name in GRAPHED)
    t0 = time.perf_counter()
    step = make_method(name, model, opt, classification_loss, batch, **opts)
    return _Built(step, time.perf_counter() - t0, resident_mb, resident_reserved_mb)


def match_target(match_peak: str | None, msr: float | None,
                 peaks: dict[str, float]) -> tuple[float, dict]:
    """tensile_graph's target peak (MB) in this job, and what the row keeps of it: the peak
    ``match_peak`` measured (``experiment.match_peak``), or ``1 - msr`` of the lower of the
    vanilla and captured vanilla (``graph``) peaks (``experiment.match_msr``), so the row's
    MSR is at least ``msr`` against either."""
    if match_peak:
        if match_peak not in peaks:
            raise ValueError(f"match_peak={match_peak!r}: {match_peak} has no measured peak in this "
                             f"job (it failed or did not run): nothing to plan tensile_graph to")
        return peaks[match_peak], {"match_peak": match_peak}
    if "vanilla" not in peaks:
        raise ValueError(f"match_msr={msr:g}: vanilla has no measured peak in this job (it "
                         f"failed): no saving to plan tensile_graph to")
    refs = [peaks[m] for m in ("vanilla", "graph") if m in peaks]
    return (1 - msr) * min(refs), {"match_msr": msr}


def _matched_budget(target_mb: float, build: Callable[[], torch.nn.Module], batch: tuple, exp,
                    device: str, opts: dict) -> tuple[dict, _Built | None]:
    """tensile_graph's budget for a captured peak of at most ``target_mb`` (``experiment.
    match_peak`` / ``match_msr``), found by planning and capturing (:func:`match_budget`),
    with what the row keeps of the search, and the captured step of the try at that budget
    if it fitted (None if none did): the row measures that graph itself, since planning
    again at the same budget may plan differently (the op times are measured anew) and
    peak tens of MB off. That try stays alive while later ones run."""
    best: tuple[int, _Built] | None = None     # the try of the highest budget that fitted

    def captured_peak_mb(budget: int) -> tuple[float, bool]:
        nonlocal best
        _release(device)
        built = _build_method("tensile_graph", build, batch, exp, device, {**opts, "budget": budget})
        built.step(batch)   # one replay: the stats read its copies' timings (none before it)
        stats = built.step.stats()
        peak_mb = stats["graph_peak_mb"] - built.resident_mb
        if peak_mb <= target_mb and (best is None or budget > best[0]):
            best = (budget, built)
        return peak_mb, stats.get("plan_feasible", True)

    budget, tries = match_budget(target_mb, captured_peak_mb)
    kept = best[1] if best is not None and best[0] == budget else None
    best = None
    _release(device)   # the other tries' graphs and models: not in the measured method's memory
    return {"budget": budget, "match_target_mb": target_mb, "match_tries": tries}, kept


def measure_method(name: str, build: Callable[[], torch.nn.Module], batch: tuple, exp,
                   device: str, warmup: int, iters: int, repeats: int, opts: dict,
                   fraction: float | None = None, cap_setup: bool = True,
                   trace_path: Path | None = None, built: _Built | None = None,
                   census: bool = False, snapshot: tuple[Path, dict] | None = None) -> dict:
    """Build, warm up and time one method; returns the row's measured fields.

    ``fraction`` caps the process's GPU memory from the start (``cap_setup``) or only for
    the training steps (after ``make_method``: TENSILE's recording step, for one, runs a
    vanilla step). ``trace_path``: also write a torch.profiler trace of three steps there,
    after the timed ones (where a method's extra time goes). ``built``: time this method,
    built already (the try ``experiment.match_peak`` found), instead of building it; a cap
    then holds from the training steps on. ``census``: also count the GPU tasks of ten steps
    of a captured method (:func:`step_census`). ``snapshot``: (path, facts): write a method
    run on TENSILE's runtime's plan with what it was planned from there
    (:class:`tensile.PlanningSnapshot`, the facts as its ``meta``). Raises what the method
    raises (the caller turns it into an error row).
    """
    cuda = device == "cuda"
    if built is None:
        if fraction is not None and cap_setup:
            torch.cuda.set_per_process_memory_fraction(fraction)
        built = _build_method(name, build, batch, exp, device, opts)
    else:
        cap_setup = False
    step, prepare_s, resident_mb = built.step, built.prepare_s, built.resident_mb
    resident_reserved_mb = built.resident_reserved_mb
    del built                       # the step holds model and optimizer
    if fraction is not None and not cap_setup:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(fraction)
    last: dict[str, torch.Tensor] = {}
    phase = "warm-up"

    def call(b):
        try:
            last["loss"] = step(b)
        except torch.OutOfMemoryError as exc:
            # what the method had planned, for the error row (see _error_fields)
            stats = step.stats()
            if name in SCHEDULED:
                stats = SchedulerReport(**stats).plan_figures()
            exc.method_stats = {"oom_phase": phase, **stats}
            raise

    for _ in range(warmup):
        call(batch)
    phase = "timed steps"
    if cuda:  # blocks cached during warm-up (recording, compilation) would inflate reserved
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    before = step.stats()
    samples, walls, peaks, reserved, means = [], [], [], [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = measure(call, (batch,), warmup=0, iters=iters, device=device)
        samples += t.samples
        walls.append(t.wall_ms)
        means.append(t.mean_ms)
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated() / MB - resident_mb)
            reserved.append(torch.cuda.max_memory_reserved() / MB - resident_reserved_mb)
        loss = float(last["loss"])
        if not math.isfinite(loss):
            return {"status": "error", "reason": f"non-finite loss {loss} after measured steps",
                    "prepare_s": round(prepare_s, 3)}
    stats = step.stats()
    if trace_path is not None:
        write_trace(call, (batch,), trace_path)
    kernels = step_census(call, batch) if census and cuda and name in GRAPHED else {}
    saved = (step.snapshot(**snapshot[1]).save(snapshot[0])
             if snapshot is not None and step.snapshot is not None else None)
    extra = {"repeats": repeats, "repeat_mean_ms": [round(m, 4) for m in means],
             "repeat_std_ms": float(np.std(means, ddof=1)) if len(means) > 1 else 0.0,
             "loss": loss}
    extra.update(_scheduler_metrics(before, stats) if name in SCHEDULED else stats)
    extra.update(kernels)
    if saved is not None:   # beside the rows' CSV
        extra["snapshot_file"] = saved.name
    if cuda and name in GRAPHED:   # a replay allocates nothing: the capture's peak is every step's
        peaks = [stats["graph_peak_mb"] - resident_mb]
        reserved = [stats["graph_reserved_mb"] - resident_reserved_mb]
    if cuda:
        extra.update(resident_before_mb=round(resident_mb, 1),
                     resident_reserved_before_mb=round(resident_reserved_mb, 1),
                     peak_reserved_mb=round(max(reserved), 1),
                     repeat_peak_mb=[round(p, 1) for p in peaks],
                     repeat_peak_reserved_mb=[round(r, 1) for r in reserved])
    return {"status": "ok", "reason": "", **summarize_ms(samples),
            "wall_ms": round(float(np.median(walls)), 4), "prepare_s": round(prepare_s, 3),
            "peak_mem_mb": round(max(peaks), 1) if cuda else None, "extra": extra}


# kernel names the row keeps: those taking at least this many us per step
CENSUS_MIN_US = 1.0


def step_census(call: Callable[[tuple], None], batch: tuple, steps: int = 10) -> dict:
    """Where a captured step's time goes on the GPU (:func:`experiments.kernels.census` of
    ``steps`` steps, each alone): per step the GPU tasks (``census_kernels``), their summed
    time (``census_kernel_ms``), of which memory copies (``census_copy_ms``), the time at
    least one runs (``census_busy_ms``), the time at least one task other than a copy runs
    (``census_compute_busy_ms``: a step's time beyond it is the compute units waiting, on
    copies, events or the host) and, per kernel name taking at least ``CENSUS_MIN_US``,
    launches and us (``census_by_name``), for the report's comparison with the captured
    vanilla step of the same job."""
    from experiments.kernels import census
    found = census(lambda *b: call(b), batch, calls=steps, warmup=2, no_grad=False)
    return {"census_kernels": round(found.kernels, 1), "census_kernel_ms": round(found.kernel_ms, 4),
            "census_copy_ms": round(found.copy_ms, 4), "census_busy_ms": round(found.busy_ms, 4),
            "census_compute_busy_ms": round(found.compute_busy_ms, 4),
            "census_span_ms": round(found.span_ms, 4),
            "census_by_name": census_by_name(found.by_name)}


# a kernel name longer than this is cut, a short hash of the whole name ending the cut
CENSUS_NAME_CHARS = 120


def census_by_name(by_name: dict[str, tuple[float, float]]) -> dict[str, list[float]]:
    """Launches and us per step of every kernel name taking at least ``CENSUS_MIN_US``.

    A name over :data:`CENSUS_NAME_CHARS` characters is cut there and ends with a hash of the
    whole name: templated kernels often differ only past the cut (at::native's elementwise
    kernels of add, mul, ... share their first 120 characters), and cut alone they would
    share one key, the last of them overwriting the others (rows before this fix)."""
    out: dict[str, tuple[float, float]] = {}
    for name, (n, us) in by_name.items():
        key = name
        if len(name) > CENSUS_NAME_CHARS:
            digest = hashlib.blake2s(name.encode(), digest_size=4).hexdigest()
            key = f"{name[:CENSUS_NAME_CHARS - len(digest) - 1]}…{digest}"
        k, u = out.get(key, (0.0, 0.0))
        out[key] = (k + n, u + us)
    return {key: [round(n, 2), round(us, 2)] for key, (n, us) in out.items() if us >= CENSUS_MIN_US}


def warm_capture_streams(device: str) -> None:
    """Capture one tiny training step, so that the streams a capture uses have their cuBLAS
    workspaces before any method is measured.

    cuBLAS keeps a workspace per stream for the life of the process (65 MiB on an H200):
    the first graphed method of a process would count that of the warm-up stream (which
    the capture runs on too, ``tensile.graph.warmup_stream``), the next one not, and ``msr_vs_graph`` of a process's first job
    would favour ``tensile_graph`` by that much.
    """
    model = torch.nn.Linear(64, 8, device=device)
    opt = torch.optim.Adam(model.parameters(), capturable=True)
    batch = (torch.randn(16, 64, device=device), torch.randint(0, 8, (16,), device=device))
    training_step(model, opt, batch, F.cross_entropy)   # the compute stream's workspace too
    make_method("graph", model, opt, F.cross_entropy, batch)


def machine_rates(device: str) -> dict[str, float]:
    """Peak rates and copy bandwidths for the scheduled methods, measured once per job.

    Measured before any memory cap (the probes use a few GiB on a GPU) and shared, so all
    scheduled methods plan with the same numbers.
    """
    flops, bw = measure_peak_rates(device)
    d2h, h2d = measure_copy_bandwidth(device)
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"peak_flops": flops, "peak_bytes_per_s": bw, "d2h_bw": d2h, "h2d_bw": h2d}


def _method_opts(name: str, exp, device: str, fraction: float | None,
                 tensile_peak: int | None, rates: dict) -> dict:
    """The options ``make_method`` gets for ``name`` under this job's config."""
    budget = exp.budget
    if budget is None and fraction is not None:
        budget = EMULATED_HEADROOM * fraction
    if name in ("checkpoint", "sac", "checkpoint_graph"):
        return {"layers_per_block": exp.layers_per_block}
    if name == "compile_budget":
        return {"activation_memory_budget": float(exp.activation_memory_budget)}
    if name == "streamed_graph":
        return {**stream_opts(exp), **defer_opts(name, exp)}
    if name in RATED:
        opts: dict[str, Any] = {"simulate": device != "cuda", **rates}
        if name == "capuchin" and budget is None:
            if tensile_peak is None:
                raise ValueError("capuchin needs a budget: set experiment.budget, or measure "
                                 "tensile in the same job (its planned peak is the budget, as "
                                 "the TENSILE authors did)")
            budget = int(tensile_peak)
        if name in ("tensile", "capuchin", "tensile_graph"):
            opts["budget"] = budget
        if name in STREAMED and exp.get("stream_optimizer", 0):
            opts.update(stream_opts(exp))
        opts.update(defer_opts(name, exp))
        if name in SCHEDULED and exp.get("record_batches"):
            opts["record_batches"] = tuple(int(b) for b in exp.record_batches)
        if name in PLANNED and exp.get("max_overhead", 0.0):
            opts["max_overhead"] = float(exp.max_overhead)
        if name in PLANNED:
            opts["copy_latency_ms"] = float(exp.get("copy_latency_ms", COPY_LATENCY_MS))
            if not exp.get("allow_swaps", True):
                opts["allow_swaps"] = False
            if exp.get("batch_norm_from_stats", False):
                opts["batch_norm_from_stats"] = True
            if exp.get("rebuild_ahead", 0):
                opts["rebuild_ahead"] = float(exp.rebuild_ahead)
            if exp.get("swap_cost_ms") is not None:
                opts["swap_cost_ms"] = float(exp.swap_cost_ms)
            if exp.get("swap_copy_share", 0.0):
                opts["swap_copy_share"] = float(exp.swap_copy_share)
            if exp.get("swap_search", "unmet") != "unmet":
                opts["swap_search"] = str(exp.swap_search)
            if not exp.get("count_workspaces", True):
                opts["count_workspaces"] = False
        if name == "tensile_graph" and exp.get("time_captured_copies", False):
            opts["time_copies"] = True
        return opts
    return {}


# --------------------------------------------------------------------------- one job

def _memory_fraction(exp, device: str) -> float | None:
    """The per-process memory fraction this job caps the GPU to (None: uncapped)."""
    if device != "cuda":
        return None
    if exp.memory_gb is not None:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        f = exp.memory_gb * 2**30 / total
        if f > 1:
            raise ConfigError(f"experiment.memory_gb={exp.memory_gb} is more than this GPU's "
                              f"{total / 2**30:.1f} GiB")
        return f
    return None if exp.memory_fraction is None else float(exp.memory_fraction)


def _error_fields(exc: BaseException, fraction: float | None) -> dict:
    """An error row's fields; an out-of-memory error during the steps also keeps, in
    ``extra``, the phase and what the method had planned (planned peak, budget, ...)."""
    if isinstance(exc, torch.OutOfMemoryError):
        at = "memory_fraction=1 (the whole GPU)" if fraction is None else f"memory_fraction={fraction:.4g}"
        fields = {"status": "error", "reason": f"out of memory at {at}"}
        if getattr(exc, "method_stats", None):
            fields["extra"] = dict(exc.method_stats)
        return fields
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return {"status": "error", "reason": (text[0] if text else type(exc).__name__)[:300]}


def method_order(todo: list[str], capuchin_after_tensile: bool,
                 match_peak: str | None = None) -> list[str]:
    """The order a job measures its methods in: ``todo`` plus what they need measured first.

    Vanilla first (the reference of every row); tensile right before capuchin when capuchin
    takes TENSILE's planned peak as its budget (``capuchin_after_tensile``); the method whose
    peak tensile_graph plans to (``match_peak``) before tensile_graph; graph right before the
    first of tensile_graph and checkpoint_graph (their reference, the captured vanilla step).
    """
    order = ["vanilla"] + [m for m in todo if m != "vanilla"]
    if "capuchin" in order and capuchin_after_tensile:
        order.remove("capuchin")
        if "tensile" not in order:
            order.append("tensile")
        order.insert(order.index("tensile") + 1, "capuchin")
    if match_peak and "tensile_graph" in order and match_peak != "vanilla":
        if match_peak in order:
            order.remove(match_peak)
        order.insert(order.index("tensile_graph"), match_peak)
    captured = [m for m in order if m in AGAINST_GRAPH]
    if captured:
        if "graph" in order:
            order.remove("graph")
        order.insert(order.index(captured[0]), "graph")
    return order


def run(cfg, models, device: str, env: dict, out_dir: Path,
        on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Measure every method of ``cfg.experiment.methods`` not stored yet; returns the rows written.

    ``models`` is the model registry module (``build_model``, ``example_input``); ``env`` the
    row environment (:func:`experiments.env.environment`). Rows go to ``out_dir/tensile.csv``.
    """
    exp = cfg.experiment
    msr = target_msr(exp, cfg.model.name, cfg.batch_size)
    if exp.get("match_msr") == "paper":   # the row's label names the figure planned to
        exp = OmegaConf.merge(exp, {"match_msr": msr})
    warmup, iters, repeats = protocol(cfg)
    store = ResultStore(out_dir / "tensile.csv")
    common = {"experiment": "tensile", "mode": setting(exp), "model": cfg.model.name,
              "batch_size": cfg.batch_size, "warmup": warmup, "iters": iters,
              "run_id": RUN_ID}   # the process: the report counts runs by it (extra.run_id)
    done = store.done_keys(redo=cfg.redo, min_iters=iters)
    methods = list(exp.methods)
    todo = [m for m in methods
            if row_key({**common, **env, "backend": method_label(m, exp)}) not in done]
    if not todo:
        log.info("already measured (redo=true to measure again): %s b=%s %s", cfg.model.name,
                 cfg.batch_size, common["mode"])
        return []
    if set(todo) & set(AGAINST_GRAPH) and "graph" not in todo:
        todo.append("graph")   # measured anyway as their reference: keep its row
    match_peak = exp.get("match_peak") if "tensile_graph" in todo else None
    matching = "tensile_graph" in todo and (match_peak is not None or msr is not None)
    if match_peak and match_peak not in todo:
        todo.append(match_peak)   # its peak is tensile_graph's target: measured again, kept
    fraction = _memory_fraction(exp, device)
    order = method_order(todo, capuchin_after_tensile=exp.budget is None and fraction is None,
                         match_peak=match_peak)

    classes = exp.num_classes or cfg.model.num_classes
    x = models.example_input(cfg.model.name, cfg.batch_size, device,
                             image_size=exp.image_size or cfg.model.image_size)
    y = torch.randint(0, classes, (cfg.batch_size,), generator=torch.Generator().manual_seed(0))
    batch = (x, y.to(device))

    def build():
        return _drop_aux_head(models.build_model(cfg.model.name, num_classes=classes)).to(device).train()

    rows: list[dict] = []
    ref: dict | None = None
    tensile_peak: int | None = None
    rates = machine_rates(device) if set(order) & set(RATED) else {}
    if device == "cuda" and set(order) & set(GRAPHED):
        warm_capture_streams(device)
    graph_row: dict | None = None   # the captured vanilla step: AGAINST_GRAPH's reference
    peaks: dict[str, float] = {}    # measured peaks of this job's ok methods (match_* targets)
    for name in order:
        _release(device)
        opts: dict = {}
        matched: dict = {}
        found: _Built | None = None     # match_peak's / match_msr's try, measured as it is
        try:
            opts = _method_opts(name, exp, device, fraction, tensile_peak, rates)
            if name == "tensile_graph" and matching:
                target_mb, matched = match_target(match_peak, msr, peaks)
                searched, found = _matched_budget(target_mb, build, batch, exp, device, opts)
                matched.update(searched)
                opts["budget"] = matched["budget"]
            trace = (out_dir / f"trace_tensile_{cfg.model.name}_{name}.json"
                     if cfg.get("trace") else None)
            snap = None
            if exp.get("snapshot", False):
                label = method_label(name, exp)
                stamp = date_stamp(env["date"]) if env.get("date") else ""
                snap = (out_dir / f"snapshot_tensile_{cfg.model.name}_b{cfg.batch_size}_{file_slug(label)}"
                                  f"_{stamp}.json.gz",
                        {"model": cfg.model.name, "batch_size": int(cfg.batch_size),
                         "backend": label, **{k: env.get(k) for k in ("gpu", "torch", "commit", "date")}})
            fields = measure_method(name, build, batch, exp, device, warmup, iters, repeats, opts,
                                    fraction, bool(exp.cap_setup), trace, found,
                                    census=bool(exp.get("census", False)), snapshot=snap)
        except Exception as exc:  # noqa: BLE001 - a failing method is a row, never a crash
            if not isinstance(exc, torch.OutOfMemoryError):
                log.exception("%s on %s failed", name, cfg.model.name)
            fields = _error_fields(exc, fraction)
        finally:
            found = None
            if fraction is not None:  # uncapped between methods (and for later jobs of a worker)
                torch.cuda.set_per_process_memory_fraction(1.0)
        _release(device)  # after the except block: the traceback held the method's tensors
        extra = fields.setdefault("extra", {})
        if matched:
            extra.update({k: v for k, v in matched.items() if k != "budget"})
            if fields["status"] == "ok":   # the measured peak, not the calibration's, decides
                extra["match_met"] = fields["peak_mem_mb"] <= matched["match_target_mb"]
        if fields["status"] == "ok" and fields.get("peak_mem_mb") is not None:
            peaks[name] = fields["peak_mem_mb"]
        extra.update(memory_fraction=fraction,
                     **{k: v for k, v in opts.items() if k in ("budget", "layers_per_block")})
        if name in RATED and rates:   # what the planner believed about the machine
            extra.update(d2h_gbps=gb_per_s(rates["d2h_bw"]), h2d_gbps=gb_per_s(rates["h2d_bw"]),
                         peak_tflops=round(rates["peak_flops"] / 1e12, 1))
        if name == "vanilla":
            ref = fields
        if name == "graph":
            graph_row = fields
        if name == "tensile" and fields["status"] == "ok":
            tensile_peak = int(extra["planned_peak_mb"] * MB)
        if name not in todo:
            continue
        extra.update(derived_metrics(fields, ref))
        if name in AGAINST_GRAPH:   # the method's own cost: against the captured vanilla step
            extra.update(_against_graph(fields, graph_row))
        if ref is not None and ref["status"] != "ok":
            extra["vanilla_reason"] = ref["reason"]
        row = store.append({**env, **common, **fields, "backend": method_label(name, exp)})
        rows.append(row)
        on_row(row)
    return rows
