"""The report: tables, plots and claim verdicts derived from the raw rows, never edited by hand.

    python -m experiments.report                 # every results/<gpu>/ folder found
    python -m experiments.report --gpu h200      # one GPU

Reads ``results/<gpu>/*.csv`` (rows of :mod:`experiments.store`), ``results/analysis/streams.csv``
(the stream analysis), ``results/analysis/tensile_plans.csv`` (TENSILE's plans worked out on the
CPU) and ``results/paper/*.csv`` (the papers' figures as data) and writes
``results/<gpu>/report.md`` with PNG plots beside it.

Smoke rows — CPU runs, or fewer warm-ups / timed iterations than the protocol (timing=quick) —
appear in tables marked ``*`` but never decide a claim's verdict.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from pathlib import Path
from typing import Iterable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from experiments.store import COLUMNS, KEY_COLUMNS, row_allocator

__all__ = [
    "load_rows", "speedups", "claim_verdicts", "concurrency_ceiling", "latency_table",
    "speedup_table", "paper_comparison",
    "settings", "gpu_dirs", "md_table",
    "plot_inference_speedup", "plot_training_speedup", "plot_multistream", "plot_stream_timeline",
    "plot_tensile_multi_msr", "plot_tensile_multi_tradeoff", "plot_tensile_tradeoff",
    "write_report", "main", "tensile_metrics", "tensile_verdicts", "tensile_multi_table",
    "tensile_multi_runs", "tensile_multi_latest", "tensile_multi_targets", "row_method",
    "tensile_authors_split_table",
    "tensile_price_gap_table",
    "nimble_memory_table",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
NOT_GPU_DIRS = {"paper", "analysis"}
PROTOCOL_WARMUP, PROTOCOL_ITERS = 50, 200  # conf/timing/default.yaml; fewer = smoke
# Per-experiment protocols where they differ: TENSILE's is 5 warm-up and 50 measured steps
# (conf/experiment/tensile.yaml), as the TENSILE authors ran it.
PROTOCOL = {"tensile": (5, 50), "tensile_multi": (5, 50)}
NUMERIC = ["batch_size", "median_ms", "p10_ms", "p90_ms", "mean_ms", "std_ms", "wall_ms", "warmup",
           "iters", "prepare_s", "peak_mem_mb", "graph_mem_mb"]
GROUP = ["experiment", "mode", "model", "batch_size"]  # rows compared with each other
# Ratios prefer these baselines as measured in the row's own process (see load_rows).
SAME_RUN_BASELINES = ("eager", "nimble-single")
# Bar order in plots and columns in tables: baselines first, this project last.
BACKEND_ORDER = ["eager", "torchscript", "onnxruntime", "inductor", "cudagraph", "inductor-cudagraphs",
                 "inductor-max-autotune", "tensorrt", "tvm", "nimble-single", "nimble", "nimble-mem", "nimble-cl", "nimble-split", "nimble-auto", "nimble-inductor", "nimble-select",
                 "nimble-fuse", "nimble-cl-fuse", "nimble-inductor-freeze"]


# --------------------------------------------------------------------------- loading

def gpu_dirs(results_dir: str | Path) -> list[Path]:
    """The ``results/<gpu>/`` folders that hold result CSVs (not ``paper/`` or ``analysis/``)."""
    root = Path(results_dir)
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir()
                  if d.is_dir() and d.name not in NOT_GPU_DIRS and any(d.glob("*.csv")))


def _is_smoke(df: pd.DataFrame) -> pd.Series:
    protocol = df["experiment"].map(lambda e: PROTOCOL.get(e, (PROTOCOL_WARMUP, PROTOCOL_ITERS)))
    warmup = protocol.map(lambda p: p[0])
    iters = protocol.map(lambda p: p[1])
    return ((df["device"] != "cuda") | (df["warmup"].fillna(0) < warmup)
            | (df["iters"].fillna(0) < iters))


def _run_id(extra: str) -> str:
    """The process a row was measured in (``extra.run_id``, written since 2026-11-29), or ''."""
    try:
        value = json.loads(extra).get("run_id", "") if extra else ""
    except (ValueError, AttributeError):
        return ""
    return str(value or "")


def _host_load(extra: str) -> tuple[float, float] | None:
    """``(host_load_1m, cpus)`` of a row that recorded them (since 2026-11-29), else None."""
    try:
        e = json.loads(extra) if extra else {}
        return float(e["host_load_1m"]), float(e["cpus"])
    except (ValueError, AttributeError, KeyError, TypeError):
        return None


def _loaded(extra: str) -> bool:
    """Whether the row was measured with more runnable tasks than its process's CPUs."""
    load = _host_load(extra)
    return load is not None and load[0] > load[1]


def _same_run_baselines(df: pd.DataFrame) -> pd.DataFrame:
    """Add ``<baseline>_same_run_ms`` for each of SAME_RUN_BASELINES: the median of that
    baseline's full-protocol ok row measured in the same process as the row (NaN if none),
    looked up among all rows, including ones a later measurement of the same key replaced."""
    ok = df[(df["status"] == "ok") & ~df["smoke"]]
    for baseline in SAME_RUN_BASELINES:
        base = ok[ok["backend"] == baseline].drop_duplicates(GROUP + ["run_id"], keep="last")
        base = base[GROUP + ["run_id", "median_ms", "loaded"]].rename(
            columns={"median_ms": f"{baseline}_same_run_ms", "loaded": f"{baseline}_same_run_loaded"})
        df = df.merge(base, on=GROUP + ["run_id"], how="left")  # no baseline in that run: NaN
    return df


def load_rows(gpu_dir: str | Path, every_run: bool = False, every_row: bool = False,
              allocator: str | None = "native") -> pd.DataFrame:
    """All rows of one GPU folder, typed, one per measurement key, with a ``smoke`` column.

    ``allocator``: keep the rows measured under that CUDA allocator backend (and CPU rows),
    so that every table and claim compares like with like; the default is PyTorch's
    (``native``), ``None`` keeps every allocator (the graph-memory table shows them side by
    side, its ``allocator`` column telling them apart).

    When a key was measured more than once (``redo=true``, or another session's run), a
    full-protocol row wins over a smoke row and, among equals, the last appended wins; with
    ``every_run`` each run's row of the key is kept (the claims' spread over runs, see
    :func:`claim_verdicts`), with ``every_row`` every row, in the order measured (several
    jobs of one process may measure a key each: :func:`tensile_equal_peak_table`). Files
    that are not result CSVs are
    skipped. Every row gets ``<baseline>_same_run_ms``: the baseline measured in the same process
    (``extra.run_id``; rows written before run ids: the same commit), so ratios use it even when
    a later run replaced the baseline's row.
    """
    frames = []
    for path in sorted(Path(gpu_dir).glob("*.csv")):
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
        if list(df.columns) != COLUMNS:
            continue
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=COLUMNS + ["smoke"])
    df = pd.concat(frames, ignore_index=True)
    df["allocator"] = [row_allocator(r) for r in df[["device", "extra"]].to_dict("records")]
    if allocator is not None:
        df = df[df["allocator"].isin([allocator, ""])].reset_index(drop=True)
    for col in NUMERIC:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    df["batch_size"] = df["batch_size"].astype("Int64")
    df["smoke"] = _is_smoke(df)
    df["run_id"] = df["extra"].map(_run_id)
    # Rows from before run ids: the rows of one commit count as one run. Those sessions measured
    # every backend of a setting in one process, one host session per commit; without this, an
    # old row would be divided by whatever baseline was measured last, on another host.
    legacy = df["run_id"] == ""
    df.loc[legacy, "run_id"] = "commit:" + df.loc[legacy, "commit"]
    df["loaded"] = df["extra"].map(_loaded)
    df["_order"] = np.arange(len(df))
    df = _same_run_baselines(df)
    df = df.sort_values(["smoke", "_order"], ascending=[False, True])
    if not every_row:
        df = df.drop_duplicates(subset=list(KEY_COLUMNS) + ["allocator"]
                                + (["run_id"] if every_run else []), keep="last")
    return df.sort_values("_order").drop(columns="_order").reset_index(drop=True)


def _read_csv(path: Path) -> pd.DataFrame | None:
    """A derived CSV (analysis, paper figures); ``commit`` as text: a hash such as 3e52123
    would otherwise read as a number (inf)."""
    return pd.read_csv(path, dtype={"commit": str}) if path.exists() else None


# --------------------------------------------------------------------------- derived tables

def speedups(df: pd.DataFrame, baseline: str = "eager") -> pd.DataFrame:
    """Per ok row: ``speedup`` = baseline median / row median within the same experiment, mode,
    model and batch size. ``smoke`` is set if either row is a smoke row."""
    ok = df[df["status"] == "ok"]
    base = ok[ok["backend"] == baseline][GROUP + ["median_ms", "smoke"]]
    merged = ok.merge(base, on=GROUP, suffixes=("", "_base"))
    same_run = f"{baseline}_same_run_ms"
    if same_run in merged:  # the baseline of the row's own process, where there is one
        merged["median_ms_base"] = merged[same_run].fillna(merged["median_ms_base"])
    merged["speedup"] = merged["median_ms_base"] / merged["median_ms"]
    merged["smoke"] = merged["smoke"] | merged["smoke_base"]
    return merged[GROUP + ["backend", "median_ms", "median_ms_base", "speedup", "smoke"]]


def _ordered(backends: Iterable[str]) -> list[str]:
    backends = list(dict.fromkeys(backends))
    known = [b for b in BACKEND_ORDER if b in backends]
    return known + sorted(b for b in backends if b not in BACKEND_ORDER)


def _cell(row: pd.Series | None, value: str) -> str:
    if row is None:
        return ""
    if row["status"] == "unavailable":
        return "n/a"
    if row["status"] == "error":
        return "error"
    return value + ("*" if row["smoke"] else "")


def nimble_memory_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per Nimble row: the graph's memory beside eager's, and the distance to the limit.

    From what the capture recorded (``extra``): the graph's pool, the graph's total (weights +
    pool), eager's footprint measured on the uncaptured run before the capture (weights + its
    peak; for whole-step training that run also creates the optimizer's state, which the
    graph's pool does not hold), and, where it was computed, the critical-path kernel time
    and the latency over it (inference: Nimble's graph; training: :mod:`experiments.limit`).
    Empty where no row carries them.
    """
    out = []
    for _, r in df[(df["status"] == "ok") & df["backend"].str.startswith("nimble")].iterrows():
        e = json.loads(r["extra"]) if r["extra"] else {}
        if "graph_pool_mb" not in e:
            continue
        eager = e.get("eager_peak_mb") or math.nan   # 0: not measured (rows before 2026-11-29)
        total = e.get("graph_mem_mb", math.nan)
        out.append({"experiment": r["experiment"], "mode": r["mode"], "batch_size": r["batch_size"],
                    "model": r["model"], "backend": r["backend"],
                    "allocator": r.get("allocator") or "native", "median_ms": r["median_ms"],
                    "streams": e.get("streams"), "graph_pool_mb": e["graph_pool_mb"],
                    "graph_total_mb": total, "eager_peak_mb": eager,
                    "graph_over_eager": round(total / eager, 2) if eager == eager else math.nan,
                    "critical_path_ms": e.get("critical_path_ms", math.nan),
                    "over_critical_path": e.get("over_critical_path", math.nan)})
    cols = ["experiment", "mode", "batch_size", "model", "backend", "allocator", "median_ms",
            "streams", "graph_pool_mb", "graph_total_mb", "eager_peak_mb", "graph_over_eager",
            "critical_path_ms", "over_critical_path"]
    return pd.DataFrame(out, columns=cols).sort_values(cols[:6], ignore_index=True)


def _latest_rows(path: Path, keys: list[str]) -> pd.DataFrame | None:
    """An experiment's own table (``headroom.csv``, ``kernels.csv``): its last row per
    ``keys``, sorted by them; None when there is no such file or no row."""
    if not path.exists():
        return None
    df = pd.read_csv(path, dtype={"commit": str})   # "17e2523" is a commit, not 1.7e2524
    if not len(df):
        return None
    return df.drop_duplicates(keys, keep="last").sort_values(keys)


def _columns(df: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    return df[[c for c in cols if c in df.columns]].round(3).reset_index(drop=True)


def headroom_table(path: Path) -> pd.DataFrame | None:
    """The rows of ``headroom.csv`` (last measurement per model, batch and K), or None."""
    keys = ["model", "batch_size", "copies"]
    df = _latest_rows(path, keys)
    if df is None:
        return None
    return _columns(df, keys + ["one_copy_ms", "one_stream_ms", "k_streams_ms", "overlap",
                                "host_load_1m", "commit"])


def stack_trim_table(path: Path) -> pd.DataFrame | None:
    """The rows of ``stack_trim.csv`` (last measurement per model and batch), or None.
    Rows without ``outside_source`` (22a9be9) took the device's used memory from
    cudaMemGetInfo and the idle GPU's from NVML, which reads 618 MiB low on the H200: their
    memory outside the allocator is left blank (``saved_mb``, a difference, stands)."""
    keys = ["model", "batch_size"]
    df = _latest_rows(path, keys)
    if df is None:
        return None
    source = df["outside_source"] if "outside_source" in df else pd.Series(pd.NA, index=df.index)
    df.loc[source.isna(), ["outside_mb_before", "outside_mb_after"]] = float("nan")
    return _columns(df, keys + ["stack_bytes_per_thread_before", "stack_mb_before", "released_mb",
                                "stack_bytes_per_thread_after", "outside_mb_before",
                                "outside_mb_after", "saved_mb", "step_ms_before", "step_ms_after",
                                "step_ratio", "blas_released_mb", "step_ms_blas",
                                "blas_step_ratio", "commit"])


def kernels_table(path: Path) -> pd.DataFrame | None:
    """The rows of ``kernels.csv`` (last census per model, batch and backend), or None."""
    keys = ["model", "batch_size", "backend"]
    df = _latest_rows(path, keys)
    if df is None:
        return None
    df["costliest kernel"] = df["top_kernels"].map(
        lambda t: json.loads(t)[0][0][:60] if isinstance(t, str) and t.startswith("[[") else "")
    return _columns(df, keys + ["status", "median_ms", "kernels", "kernel_ms", "busy_ms", "span_ms",
                                "busy_share", "costliest kernel", "commit"])


def conv_workspace_table(path: Path) -> pd.DataFrame | None:
    """The rows of ``conv_workspace.csv`` (last per model, batch, layer and cap), or None."""
    keys = ["model", "batch_size", "layer", "cap_mb"]
    df = _latest_rows(path, keys)
    if df is None:
        return None
    df["cap_mb"] = df["cap_mb"].map(lambda c: "none" if pd.isna(c) else f"{c:g}")
    return _columns(df, keys + ["layer_name", "input_shape", "status", "bwd_median_ms",
                                "bwd_p10_ms", "bwd_p90_ms", "workspace_mb", "commit"])


def slice_cost_table(path: Path) -> pd.DataFrame | None:
    """The rows of ``slice_cost.csv`` (last per model, batch, case and slice size), each with
    what it takes over the same case's whole (one slice) and that per extra slice, or None."""
    keys = ["model", "batch_size", "case", "slices"]
    df = _latest_rows(path, keys)
    if df is None:
        return None
    whole = df[df["slices"] == 1].set_index(["model", "batch_size", "case"])["median_ms"]
    at = list(zip(df["model"], df["batch_size"], df["case"]))
    df["over_whole_ms"] = [m - whole.get(k, float("nan")) for m, k in zip(df["median_ms"], at)]
    df["per_extra_slice_us"] = [1e3 * o / (n - 1) if n > 1 else float("nan")
                                for o, n in zip(df["over_whole_ms"], df["slices"])]
    return _columns(df, ["model", "batch_size", "layer_name", "weight_shape", "case", "slice_mb",
                         "slices", "median_ms", "p10_ms", "p90_ms", "over_whole_ms",
                         "per_extra_slice_us", "rows_equal", "commit"])


def join_cost_tables(gpu_dir: Path) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """The rows of ``join_cost.csv`` and of the older ``join_cost_at_<commit>*.csv`` (written
    before the ``side`` column: all side=copy), last per chain setting, and of
    ``join_cost_training.csv`` (last per model, batch and side operation), or None where not
    measured."""
    chain_keys = ["kernels", "swaps", "nbytes", "side", "forks", "timed", "group", "joins"]
    paths = sorted(gpu_dir.glob("join_cost_at_*.csv")) + [gpu_dir / "join_cost.csv"]
    frames = [pd.read_csv(p, dtype={"commit": str}) for p in paths if p.exists()]
    frames = [f.assign(side=f["side"] if "side" in f else "copy") for f in frames if len(f)]
    chain = None
    if frames:
        chain = pd.concat(frames).drop_duplicates(chain_keys, keep="last").sort_values(chain_keys)
        chain = chain.assign(mib=chain["nbytes"] / 2**20)
        chain = _columns(chain, ["kernels", "swaps", "mib", "side", "forks", "timed", "group",
                                 "joins", "waits", "median_ms", "p10_ms", "p90_ms",
                                 "per_wait_us", "commit"])
    training = _latest_rows(gpu_dir / "join_cost_training.csv", ["model", "batch_size", "side"])
    if training is not None:
        training = _columns(training, ["model", "batch_size", "side", "waits", "median_ms",
                                       "p10_ms", "p90_ms", "extra_ms", "commit"])
    return chain, training


def latency_table(df: pd.DataFrame, experiment: str, mode: str, batch_size: int) -> pd.DataFrame:
    """Model × backend: ``median (p10–p90)`` in ms; ``n/a`` unavailable, ``error``, ``*`` smoke."""
    sel = df[(df["experiment"] == experiment) & (df["mode"] == mode) & (df["batch_size"] == batch_size)]
    backends = _ordered(sel["backend"])
    out = []
    for model, rows in sel.groupby("model", sort=False):
        by = {r["backend"]: r for _, r in rows.iterrows()}
        line = {"model": model}
        for b in backends:
            r = by.get(b)
            line[b] = _cell(r, "" if r is None or r["status"] != "ok" else
                            f"{r['median_ms']:.3f} ({r['p10_ms']:.3f}–{r['p90_ms']:.3f})")
        out.append(line)
    return pd.DataFrame(out, columns=["model"] + backends)


def speedup_table(df: pd.DataFrame, experiment: str, mode: str, batch_size: int) -> pd.DataFrame:
    """Model × backend: speedup over eager (``x``), with the same markers as the latency table."""
    sel = df[(df["experiment"] == experiment) & (df["mode"] == mode) & (df["batch_size"] == batch_size)]
    sp = speedups(sel)
    backends = [b for b in _ordered(sel["backend"]) if b != "eager"]
    out = []
    for model, rows in sel.groupby("model", sort=False):
        by = {r["backend"]: r for _, r in rows.iterrows()}
        spm = sp[sp["model"] == model].set_index("backend")["speedup"]
        line = {"model": model}
        for b in backends:
            r = by.get(b)
            value = f"{spm[b]:.2f}x" if b in spm.index else "no eager row"
            line[b] = _cell(r, value)
        out.append(line)
    return pd.DataFrame(out, columns=["model"] + backends)


def paper_comparison(df: pd.DataFrame, paper: pd.DataFrame, experiment: str, mode: str) -> pd.DataFrame:
    """Per model and batch: each paper system's V100 speedup beside ours for the matching backend.

    Columns ``<system> paper`` (``~`` = estimated from bar height) and ``<system> ours (<backend>)``
    (``*`` = smoke; a status when the backend did not run; empty when not measured).
    """
    sel = df[(df["experiment"] == experiment) & (df["mode"] == mode)]
    sp = speedups(sel)
    out: dict[tuple, dict] = {}
    for _, p in paper.iterrows():
        at = (sel["model"] == p["model"]) & (sel["backend"] == p["backend"]) & (sel["batch_size"] == p["batch_size"])
        mine = sp[(sp["model"] == p["model"]) & (sp["backend"] == p["backend"])
                  & (sp["batch_size"] == p["batch_size"])]
        if len(mine):
            ours = f"{mine['speedup'].iloc[0]:.2f}x" + ("*" if mine["smoke"].iloc[0] else "")
        else:
            ours = sel[at]["status"].iloc[0] if at.any() else ""
        est = "~" if str(p["estimated"]).lower() == "true" else ""
        line = out.setdefault((p["model"], p["batch_size"]), {"model": p["model"], "batch": p["batch_size"]})
        line[f"{p['system']} paper"] = f"{est}{p['speedup_over_pytorch']:.2f}x"
        line[f"{p['system']} ours ({p['backend']})"] = ours
    return pd.DataFrame(list(out.values()))


# --------------------------------------------------------------------------- claims

def _pick(df: pd.DataFrame, claim: pd.Series, backend: str) -> pd.DataFrame:
    sel = df[(df["experiment"] == claim["experiment"]) & (df["mode"] == claim["mode"])
             & (df["batch_size"] == int(claim["batch_size"])) & (df["backend"] == backend)]
    return sel if claim["model"] == "*" else sel[sel["model"] == claim["model"]]


def _why_not(rows: pd.DataFrame, backend: str) -> str | None:
    """Why these rows cannot decide a claim, or None if a full-protocol ok row is there."""
    if rows.empty:
        return f"no rows for {backend}"
    bad = rows[rows["status"] != "ok"]
    if len(bad) == len(rows):
        r = bad.iloc[0]
        return f"{backend} {r['status']}: {r['reason']}"
    if rows[rows["status"] == "ok"]["smoke"].all():
        return f"only smoke rows for {backend} (CPU or quick timing)"
    return None


def _speedup(df: pd.DataFrame, claim: pd.Series, backend: str) -> tuple[float | None, str]:
    """(baseline ms / backend ms, note), or (None, why not). The baseline is the one measured in
    the backend row's own process when that row names its run, else the stored baseline row."""
    rows, base = _pick(df, claim, backend), _pick(df, claim, claim["baseline"])
    why = _why_not(rows, backend) or _why_not(base, claim["baseline"])
    if why:
        return None, why
    a = rows[(rows["status"] == "ok") & ~rows["smoke"]].iloc[0]
    b = base[(base["status"] == "ok") & ~base["smoke"]].iloc[0]
    b_ms, loaded = float(b["median_ms"]), bool(b["loaded"])
    same_run = a.get(f"{claim['baseline']}_same_run_ms", np.nan)
    if not pd.isna(same_run):
        b_ms, loaded = float(same_run), bool(a.get(f"{claim['baseline']}_same_run_loaded"))
    return b_ms / float(a["median_ms"]), _ratio_note(claim["baseline"], b_ms, loaded, backend,
                                                     float(a["median_ms"]))


def _ratio_note(baseline: str, base_ms: float, loaded: bool, backend: str, ms: float) -> str:
    """A speedup claim's note: both medians, and whether the baseline's host was loaded."""
    note = f"{baseline} {base_ms:.3f} ms / {backend} {ms:.3f} ms"
    if loaded:   # a CPU-bound baseline on a busy host is slow: the ratio comes out high
        note += f"; {baseline} measured on a loaded host (load above its CPUs)"
    return note


def _speedup_per_run(runs: pd.DataFrame, claim: pd.Series) -> dict[str, tuple[float, str, str]]:
    """Per run (process) that measured the claim's baseline and one of its backends: the
    fastest backend's ratio to that run's own baseline, the run's date and a note."""
    baseline = claim["baseline"]
    same_run = f"{baseline}_same_run_ms"
    best: dict[str, tuple[float, str, str]] = {}
    for backend in claim["backend"].split("|"):
        rows = _pick(runs, claim, backend)
        if same_run not in rows:
            continue
        rows = rows[(rows["status"] == "ok") & ~rows["smoke"] & rows[same_run].notna()]
        for _, r in rows.iterrows():
            ratio = float(r[same_run] / r["median_ms"])
            if ratio > best.get(r["run_id"], (0.0,))[0]:
                # bool(): a column without gaps holds numpy bools, which `is True` misses
                note = _ratio_note(baseline, float(r[same_run]),
                                   bool(r[f"{baseline}_same_run_loaded"]), backend,
                                   float(r["median_ms"]))
                best[r["run_id"]] = (ratio, str(r["date"]), note)
    return best


def _runs_verdict(k: int, n: int) -> str:
    """A target over ``n`` runs of which ``k`` meet it: reproduced only when every run does."""
    return "not reproduced" if not k else "reproduced" if k == n else f"in {k} of {n} runs"


def _across_runs(per_run: dict[str, tuple[float, str, str]], target: float,
                 cmp: str) -> tuple[float, str, str]:
    """(ours, verdict, note) of a speedup claim from every run that measured it: ours is the
    latest run's ratio; reproduced only when every run meets the figure. Ratios over eager
    move with the host's CPU (eager is CPU-bound at small batches): one run's fast or slow
    eager must not decide a claim."""
    ours, _, note = max(per_run.values(), key=lambda v: v[1])
    ratios = [v[0] for v in per_run.values()]
    met = sum((r >= target) if cmp == ">=" else (r <= target) for r in ratios)
    verdict = _runs_verdict(met, len(ratios))
    if len(ratios) > 1:
        note += f"; {len(ratios)} runs: {min(ratios):.2f}–{max(ratios):.2f}x, {met} meet it"
    return ours, verdict, note


def _verdict(df: pd.DataFrame, claim: pd.Series,
             runs: pd.DataFrame | None = None) -> tuple[float | None, str, str]:
    """(our value, verdict, note) for one claim row of ``nimble_claims.csv``; ``runs``
    (:func:`load_rows` with ``every_run``) weighs a speedup claim over every run, not only
    the latest."""
    target, cmp = float(claim["value"]), claim["comparison"]
    if claim["metric"] == "max_prepare_s":
        rows = _pick(df, claim, claim["backend"])
        why = _why_not(rows, claim["backend"])
        if why:
            return None, "not measured", why
        ok = rows[(rows["status"] == "ok") & ~rows["smoke"]]
        worst = ok.loc[ok["prepare_s"].idxmax()]
        ours, note = float(worst["prepare_s"]), f"slowest: {worst['model']} of {len(ok)} model(s)"
    elif claim["metric"] == "speedup":
        # backend may name several modes ("nimble|nimble-inductor"): the fastest one decides,
        # each against the baseline of its own run, and the note names it
        results = [_speedup(df, claim, backend) for backend in claim["backend"].split("|")]
        measured = [r for r in results if r[0] is not None]
        if not measured:
            return None, "not measured", results[0][1]
        ours, note = max(measured, key=lambda r: r[0])
        if len(results) > 1:
            note = f"fastest of {claim['backend'].replace('|', ', ')}: {note}"
    else:
        raise ValueError(f"claim {claim['claim_id']}: unknown metric {claim['metric']!r}; "
                         "expected speedup or max_prepare_s")
    per_run = _speedup_per_run(runs, claim) if claim["metric"] == "speedup" and runs is not None else {}
    if per_run:        # every run's own ratio; a row without its run's baseline is left out
        ours, verdict, note = _across_runs(per_run, target, cmp)
        if "|" in claim["backend"]:
            note = f"fastest of {claim['backend'].replace('|', ', ')}: {note}"
        return ours, verdict, note
    met = ours >= target if cmp == ">=" else ours <= target
    return ours, "reproduced" if met else "not reproduced", note


def concurrency_ceiling(headroom: pd.DataFrame | None, model: str,
                        batch_size: int) -> tuple[float, int] | None:
    """(overlap, K) of the best-overlapping K independent copies of ``model`` on K streams at
    ``batch_size`` (:func:`headroom_table`), or None if not measured. A measured ceiling, not
    a proof: one model's branches are fewer, shorter and more unequal than K whole copies, so
    a multi-stream schedule of it gains less; once more copies stop adding overlap the GPU is
    full."""
    if headroom is None:
        return None
    rows = headroom[(headroom["model"] == model) & (headroom["batch_size"] == batch_size)]
    if rows.empty:
        return None
    best = rows.loc[rows["overlap"].idxmax()]
    return float(best["overlap"]), int(best["copies"])


def _with_ceiling(claim: pd.Series, verdict: str, note: str,
                  headroom: pd.DataFrame | None) -> tuple[str, str]:
    """A multi-stream claim (baseline ``nimble-single``) gets the GPU's measured ceiling in its
    note, and a verdict that says so when the target lies above it."""
    if claim["baseline"] != "nimble-single" or claim["comparison"] != ">=":
        return verdict, note
    ceiling = concurrency_ceiling(headroom, claim["model"], int(claim["batch_size"]))
    if ceiling is None:
        return verdict, note
    overlap, k = ceiling
    note += f"; ceiling {overlap:.2f}x: {k} independent copies on {k} streams (headroom.csv)"
    if overlap < float(claim["value"]) and verdict not in ("reproduced", "not measured"):
        verdict += " (ceiling below target)"
    return verdict, note


def claim_verdicts(df: pd.DataFrame, claims: pd.DataFrame,
                   runs: pd.DataFrame | None = None,
                   headroom: pd.DataFrame | None = None) -> pd.DataFrame:
    """One line per claim: the paper's figure, ours (the latest run), and reproduced / not
    reproduced / not measured. With ``runs`` (``load_rows(..., every_run=True)``), a speedup
    claim is reproduced only if every run that measured it meets it ("in k of n runs" when
    some do), and the note gives the spread. With ``headroom`` (:func:`headroom_table`), a
    multi-stream claim's note gives the GPU's concurrency ceiling at its batch size
    (:func:`concurrency_ceiling`) and its verdict says when the target lies above it."""
    out = []
    for _, c in claims.iterrows():
        ours, verdict, note = _verdict(df, c, runs)
        verdict, note = _with_ceiling(c, verdict, note, headroom)
        unit = " s" if c["metric"] == "max_prepare_s" else "x"
        out.append({"claim": c["claim_id"], "text": c["text"], "setting": c["setting"],
                    "paper": f"{c['comparison']} {float(c['value']):g}{unit}",
                    "ours": "" if ours is None else f"{ours:.2f}{unit}", "verdict": verdict,
                    "note": note, "provenance": c["provenance"]})
    return pd.DataFrame(out)


# --------------------------------------------------------------------------- plots

# PyTorch's own memory savers, for TENSILE's "1.2x the best built-in at equal memory" target.
BUILTIN_MEMORY_METHODS = ["checkpoint", "sac", "save_on_cpu", "compile_budget", "checkpoint_graph"]


# From a TENSILE row's extra; *_vs_graph: tensile_graph against the captured vanilla step.
TENSILE_METRICS = ("msr", "msr_reserved", "eor", "cbr", "passive_share", "planner_ms",
                   "msr_vs_graph", "eor_vs_graph")


def ok_tensile_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The full-protocol ok TENSILE-experiment rows of ``df``."""
    return df[(df["experiment"] == "tensile") & (df["status"] == "ok") & ~df["smoke"]]


def _tensile_rows(df: pd.DataFrame):
    """Each full-protocol ok TENSILE-experiment row, with its ``extra`` JSON as a dict."""
    for _, r in ok_tensile_rows(df).iterrows():
        yield r, json.loads(r["extra"]) if r["extra"] else {}


# a TENSILE job: one process's measurements of one model, batch and setting
_JOB = ["run_id", "model", "batch_size", "mode"]


def earlier_in_job(ok: pd.DataFrame, r: pd.Series) -> pd.DataFrame:
    """The rows of ``ok`` measured before row ``r`` in its job (:func:`load_rows` with
    ``every_row`` keeps the order measured)."""
    job = ok.loc[:r.name - 1]
    return job[(job[_JOB] == r[_JOB]).all(axis=1)]


def _last_graph(job: pd.DataFrame) -> pd.Series | None:
    """The last captured vanilla step (``graph``) row of ``job`` (:func:`earlier_in_job`),
    or None where it has none."""
    graph = job[job["backend"] == "graph"]
    return graph.iloc[-1] if len(graph) else None


def _plan_floor(backend: str, extra: dict) -> float | None:
    """The least any plan of a ``tensile_graph`` row's moves is priced at (``tensile.bound``,
    as its run recorded it): rebuilds only where the row forbade swaps (``allow_swaps=false``),
    else rebuilds and swaps; None where the row did not record it."""
    return extra.get("bound_ms" if "allow_swaps=false" in backend else "bound_swaps_ms")


def tensile_metrics(df: pd.DataFrame) -> pd.DataFrame:
    """One line per full-protocol ok TENSILE-experiment row: model, batch, mode, method and
    the MSR / EOR / CBR / passive-share figures from its ``extra`` JSON, and the commit that
    measured it (rows of older code stay until a setting is measured again)."""
    out = []
    for r, extra in _tensile_rows(df):
        out.append({"model": r["model"], "batch_size": r["batch_size"], "mode": r["mode"],
                    "method": r["backend"], "mean_ms": r["mean_ms"], "peak_mem_mb": r["peak_mem_mb"],
                    **{k: extra.get(k) for k in TENSILE_METRICS}, "commit": str(r["commit"])[:7],
                    "date": str(r["date"])})
    return pd.DataFrame(out, columns=["model", "batch_size", "mode", "method", "mean_ms", "peak_mem_mb",
                                      *TENSILE_METRICS, "commit", "date"])


def tensile_capped_table(df: pd.DataFrame) -> pd.DataFrame:
    """Settings run under a memory cap (a smaller GPU emulated, ``mem=`` in the mode): per
    model, batch and setting, each method's median step (ms) and allocated peak (MiB), or
    ``out of memory`` — which methods train the job at all on that GPU. The latest
    full-protocol row of each method wins."""
    rows = df[(df["experiment"] == "tensile") & df["mode"].str.contains("mem=", regex=False)
              & ~df["smoke"]]
    out = []
    for (model, batch, mode), group in rows.groupby(["model", "batch_size", "mode"], sort=True):
        line = {"model": model, "batch_size": batch, "setting": mode}
        for _, r in group.iterrows():
            if r["status"] == "ok":
                line[r["backend"]] = f"{r['median_ms']:.1f} ms, {r['peak_mem_mb']:.0f} MiB"
            else:
                line[r["backend"]] = "out of memory" if "out of memory" in str(r["reason"]) \
                    else str(r["status"])
        out.append(line)
    table = pd.DataFrame(out)
    return table.fillna("") if len(table) else table


# What a TENSILE-planned row assumed (its plan) beside what its timed steps measured.
# *_captured: the copies inside a replay of a captured plan (tensile_graph).
PLAN_CHECK_COLUMNS = ["model", "batch_size", "method", "time_vanilla_ms", "mean_ms", "plan_iteration_ms",
                      "d2h_gbps", "d2h_gbps_measured", "d2h_gbps_captured", "h2d_gbps",
                      "h2d_gbps_measured", "h2d_gbps_captured", "stall_ms_per_timed_step",
                      "moved_mb_per_step"]


def tensile_plan_check(df: pd.DataFrame) -> pd.DataFrame:
    """Per scheduled TENSILE row that recorded it: the iteration time and copy bandwidths
    its plan was made for, beside vanilla's step time, the bandwidths its timed steps'
    copies measured and the compute stream's wait for copy-ins per timed step.

    A plan hides a copy only if the channel moves it within the op times the plan
    assumed; a measured bandwidth below the planned one, or stalls, say why it did not.
    """
    out = []
    for r, extra in _tensile_rows(df):
        if extra.get("plan_iteration_ms") is None:
            continue
        moved = extra.get("bytes_moved_per_step")
        out.append({"model": r["model"], "batch_size": r["batch_size"], "method": r["backend"],
                    "mean_ms": r["mean_ms"],
                    "moved_mb_per_step": None if moved is None else moved / 2**20,
                    **{k: extra.get(k) for k in PLAN_CHECK_COLUMNS
                       if k not in ("model", "batch_size", "method", "mean_ms", "moved_mb_per_step")}})
    return pd.DataFrame(out, columns=PLAN_CHECK_COLUMNS)


def _captured_against_graph(metrics: pd.DataFrame) -> pd.DataFrame:
    """``metrics`` with every captured row (``tensile_graph(...)``, ``streamed_graph(...)``,
    ``checkpoint_graph``)
    judged against the captured vanilla step: its EOR becomes ``eor_vs_graph`` (empty
    without a ``graph`` row), its MSR the lower of ``msr`` (against the eager vanilla step)
    and ``msr_vs_graph``, and its method reads "... vs graph".

    The lower MSR: before a6a8dd2, the first graphed job of a process counted the capture
    streams' cuBLAS workspaces (130 MB on an H200) in the ``graph`` row's peak and not in
    ``tensile_graph``'s, which made ``msr_vs_graph`` look better than it was; the eager
    step is measured before any capture.
    """
    m = metrics.copy()
    captured = m["method"].str.match(r"(tensile|checkpoint|streamed)_graph($|\()").to_numpy()
    msr = pd.to_numeric(m["msr"], errors="coerce")
    msr_graph = pd.to_numeric(m["msr_vs_graph"], errors="coerce")
    m["msr"] = np.where(captured, np.fmin(msr, msr_graph).where(msr_graph.notna()), msr)
    m["eor"] = np.where(captured, pd.to_numeric(m["eor_vs_graph"], errors="coerce"),
                        pd.to_numeric(m["eor"], errors="coerce"))
    m["method"] = np.where(captured, m["method"] + " vs graph", m["method"])
    return m


def tensile_verdicts(metrics: pd.DataFrame, paper: pd.DataFrame,
                     every: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per paper model: our TENSILE MSR/EOR at the paper's batch beside the authors', the
    verdict (MSR at least theirs and EOR at most half theirs: "reproduced" when every
    measurement of the variant shown meets it, "in k of n runs" when only some do), and the
    throughput ratio over the fastest PyTorch built-in whose peak is no higher than TENSILE's.
    ``metrics``: :func:`tensile_metrics` of the latest row per key (the built-ins);
    ``every``: the same of every row (:func:`load_rows` with ``every_row``), which TENSILE's
    variants and their runs are taken from (default ``metrics``)."""
    lines = []
    every = metrics if every is None else every

    def whole_steps(m: pd.DataFrame, p) -> pd.DataFrame:
        return m[(m["model"] == p["model"]) & (m["batch_size"] == p["batch_size"])
                 & m["mode"].astype(str).str.fullmatch(AUTHORS_MODES)]

    for _, p in paper.iterrows():
        mine = whole_steps(metrics, p)
        # TENSILE's variants: tensile, tensile(max_overhead=...) against eager vanilla, and
        # tensile_graph(...) and streamed_graph(...) (the streamed optimizer alone) against
        # the captured vanilla step (the same mode: host out of both); a variant with fused
        # Adam is its own, named so
        ours = _captured_against_graph(whole_steps(every, p))
        ours = ours[ours["method"].str.match(r"tensile($|\()|(tensile|streamed)_graph")
                    & ours["msr"].notna() & ours["eor"].notna()]
        ours = _name_fused_adam(ours)
        line = {"model": p["model"], "batch": int(p["batch_size"]), "paper MSR": p["msr"],
                "paper EOR": p["eor"], "method": "", "MSR": None, "EOR": None,
                "verdict": "not measured", "vs best built-in": ""}
        if len(ours):
            # of TENSILE's variants, the one that meets the target in the largest share of its
            # runs (``every`` holds a row per run), its run that saves the most; else the one
            # that saves the most memory
            meets = (ours["msr"] >= p["msr"]) & (ours["eor"] <= p["eor"] / 2)
            runs = meets.groupby(ours["method"]).agg(["sum", "count"])
            if meets.any():
                share = (runs["sum"] / runs["count"]).sort_values(ascending=False, kind="stable")
                best = ours[meets & (ours["method"] == share.index[0])]
                t = best.sort_values("msr").iloc[-1]
            else:
                t = ours.sort_values("msr").iloc[-1]
            line.update({"method": t["method"], "MSR": round(t["msr"], 3), "EOR": round(t["eor"], 3)})
            k, n = (int(v) for v in runs.loc[t["method"]])
            line["verdict"] = _runs_verdict(k, n)
            mine = mine[_fused_adam(mine) == t["method"].endswith(FUSED_ADAM)]  # its optimizer
            builtins = mine[mine["method"].isin(BUILTIN_MEMORY_METHODS)
                            & (mine["peak_mem_mb"] <= t["peak_mem_mb"])]
            if len(builtins):
                best = builtins.loc[builtins["mean_ms"].idxmin()]
                line["vs best built-in"] = f"{best['mean_ms'] / t['mean_ms']:.2f}x ({best['method']})"
                # not like for like: say so (checkpoint_graph is the captured built-in)
                captured_ours = t["method"].startswith(("tensile_graph", "streamed_graph"))
                captured_best = best["method"] == "checkpoint_graph"
                if captured_ours and not captured_best:
                    line["vs best built-in"] += ", a captured step against an eager one"
                elif captured_best and not captured_ours:
                    line["vs best built-in"] += ", an eager step against a captured one"
            else:
                line["vs best built-in"] = "no built-in reaches TENSILE's peak"
            line["at a built-in's peak"] = _at_builtin_peaks(mine)
        lines.append(line)
    return pd.DataFrame(lines)


# the modes of rows judged against the TENSILE authors' single-job figures: whole steps on the
# whole GPU; a TENSILE budget (``budget=``) changes only TENSILE's and Capuchin's plans; Adam,
# foreach (the authors') or fused (``opt=adam_fused``: every method of that job), not SGD
AUTHORS_MODES = r"whole-step(,budget=[^,]+)?(,opt=adam_fused)?"
FUSED_ADAM = ", fused Adam"   # how a variant of a fused-Adam job is named
_FUSED_MODE = re.compile(r"(?:^|,)opt=adam_fused(?:,|$)")


def _fused_adam(rows: pd.DataFrame) -> pd.Series:
    """Which rows' job trained with fused Adam (``opt=adam_fused`` in the mode)."""
    return rows["mode"].astype(str).str.contains(_FUSED_MODE)


def row_method(row: pd.Series) -> str:
    """A results row's method, named as :func:`_name_fused_adam` names it."""
    return row["backend"] + (FUSED_ADAM if _FUSED_MODE.search(str(row["mode"])) else "")


def _name_fused_adam(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with :data:`FUSED_ADAM` after the method of each fused-Adam job's row: a
    variant of its own, never counted with the foreach runs of the same method."""
    return rows.assign(method=rows["method"] + np.where(_fused_adam(rows), FUSED_ADAM, ""))


def _at_builtin_peaks(mine: pd.DataFrame) -> str:
    """At each built-in's own peak, TENSILE's throughput over it: for every built-in row, the
    fastest TENSILE variant of the same kind (captured against ``checkpoint_graph``, eager
    against the eager built-ins) whose peak is no higher. Per kind, the built-in TENSILE
    beats by the least (a built-in whose peak no TENSILE variant reaches counts as lost)."""
    method = mine["method"]
    kinds = {"captured": (method == "checkpoint_graph",
                          method.str.match(r"(tensile|streamed)_graph($|\()")),
             "eager": (method.isin([m for m in BUILTIN_MEMORY_METHODS if m != "checkpoint_graph"]),
                       method.str.match(r"tensile($|\()"))}
    parts = []
    for kind, (is_builtin, is_ours) in kinds.items():
        ours, worst = mine[is_ours], None
        for _, b in mine[is_builtin].iterrows():
            fits = ours[ours["peak_mem_mb"] <= b["peak_mem_mb"]]
            ratio = b["mean_ms"] / fits["mean_ms"].min() if len(fits) else 0.0
            if worst is None or ratio < worst[0]:
                worst = (ratio, b["method"])
        if worst is None or not len(ours):
            continue
        ratio, name = worst
        parts.append(f"{kind} {ratio:.2f}x ({name})" if ratio else
                     f"{kind}: none reaches {name}'s peak")
    return "; ".join(parts)


EQUAL_PEAK_TARGET = 1.2   # issue 6: TENSILE's throughput over the best built-in at equal peak


def equal_peak_allowance(builtin_ms: float, graph_ms: float) -> float:
    """What :data:`EQUAL_PEAK_TARGET` over a built-in's step leaves a plan to add over the
    captured vanilla step (ms; below 0 where no plan can meet it)."""
    return builtin_ms / EQUAL_PEAK_TARGET - graph_ms


def tensile_equal_peak_table(rows: pd.DataFrame) -> pd.DataFrame:
    """TENSILE planned to a built-in's measured peak in the same job (``experiment.match_peak``):
    per such row, the built-in row whose peak it matched (same process, model, batch and
    setting, the latest measured before it with that peak) and the captured vanilla step
    (``graph``) before it. ``speedup`` = built-in time / TENSILE time (mean steps);
    ``ceiling`` = built-in time / graph time, the most any plan reaches (a plan adds work to
    the unplanned step, never removes it). ``planned MiB``: the plan's own peak, which the
    measured one (``TENSILE MiB``) exceeds by what the plan did not count (the allocator's
    rounding; before the forty-sixth session, the ops' workspaces too). Over the graph
    step: ``allowed ms`` what the
    target leaves, ``priced ms`` what the planner priced its plan at, ``bound ms`` the least
    any plan of its moves could be priced at (:meth:`tensile.Scheduler.bound`, on the same op
    times; rows from before it was recorded leave it empty). ``rows``: :func:`load_rows`
    with ``every_row``."""
    ok = ok_tensile_rows(rows)
    lines = []
    for r, extra in _tensile_rows(rows):
        target = extra.get("match_peak")
        if not target:
            continue
        job = earlier_in_job(ok, r)
        builtin = job[(job["backend"] == target) & (job["peak_mem_mb"] == extra.get("match_target_mb"))]
        if not len(builtin):
            continue
        b, graph = builtin.iloc[-1], _last_graph(job)
        graph_ms = None if graph is None else graph["mean_ms"]
        line = {"model": r["model"], "batch": int(r["batch_size"]), "TENSILE": row_method(r),
                "built-in": target, "built-in ms": round(b["mean_ms"], 3),
                "built-in MiB": b["peak_mem_mb"], "TENSILE ms": round(r["mean_ms"], 3),
                "TENSILE MiB": r["peak_mem_mb"], "planned MiB": _round(extra.get("planned_peak_mb"), 1),
                "peak met": bool(extra.get("match_met")),
                "tries": len(extra.get("match_tries", [])),
                "speedup": round(b["mean_ms"] / r["mean_ms"], 3),
                "graph ms": _round(graph_ms),
                "ceiling": None if graph_ms is None else round(b["mean_ms"] / graph_ms, 3),
                "allowed ms": (None if graph_ms is None
                               else round(equal_peak_allowance(b["mean_ms"], graph_ms), 3)),
                "priced ms": _round(extra.get("plan_overhead_ms")),
                "bound ms": _round(_plan_floor(r["backend"], extra)),
                "commit": str(r["commit"])[:7]}
        met = line["peak met"] and line["speedup"] >= EQUAL_PEAK_TARGET
        line["verdict"] = ("met" if met else
                           f"not met (ceiling below {EQUAL_PEAK_TARGET}x)"
                           if line["ceiling"] is not None and line["ceiling"] < EQUAL_PEAK_TARGET
                           else "not met")
        lines.append(line)
    cols = ["model", "batch", "TENSILE", "built-in", "built-in ms", "built-in MiB", "TENSILE ms",
            "TENSILE MiB", "planned MiB", "peak met", "tries", "speedup", "graph ms", "ceiling",
            "allowed ms", "priced ms", "bound ms", "verdict", "commit"]
    return pd.DataFrame(lines, columns=cols)


def tensile_census_table(rows: pd.DataFrame) -> pd.DataFrame:
    """``experiment.census``: per captured method counted under the profiler, beside the
    captured vanilla step (``graph``) of its own job (the latest measured before it, same
    run, model, batch and setting): its step (mean ms) and, per step, the time it adds over
    ``graph``, split into kernel time added (its summed kernels, copies not counted) and
    compute idle time added (step minus the time a kernel runs: the compute units waiting
    on copies, events or the host), the time its copies take (beside the kernels), and the
    kernel names whose time grew most. Rows counted before copies were told apart from
    kernels (no ``census_compute_busy_ms``) are left out. ``rows``: :func:`load_rows` with
    ``every_row``."""
    from experiments.kernels import is_copy, kernel_diff
    ok = ok_tensile_rows(rows)
    lines = []
    for r, extra in _tensile_rows(rows):
        if r["backend"] == "graph" or extra.get("census_compute_busy_ms") is None:
            continue
        g = _last_graph(earlier_in_job(ok, r))
        if g is None:
            continue
        base = json.loads(g["extra"]) if g["extra"] else {}
        if base.get("census_compute_busy_ms") is None:
            continue
        idle = r["mean_ms"] - extra["census_compute_busy_ms"]
        base_idle = g["mean_ms"] - base["census_compute_busy_ms"]
        kernels = extra["census_kernel_ms"] - extra["census_copy_ms"]
        base_kernels = base["census_kernel_ms"] - base["census_copy_ms"]
        grown = kernel_diff(*({n: v for n, v in e.get("census_by_name", {}).items() if not is_copy(n)}
                              for e in (base, extra)), top=3)
        lines.append({"model": r["model"], "batch": int(r["batch_size"]), "method": row_method(r),
                      "step ms": round(r["mean_ms"], 3), "graph ms": round(g["mean_ms"], 3),
                      "added ms": round(r["mean_ms"] - g["mean_ms"], 3),
                      "kernels added ms": round(kernels - base_kernels, 3),
                      "idle added ms": round(idle - base_idle, 3),
                      "copies ms": round(extra["census_copy_ms"], 3),
                      "kernels grown most (us per step)": "; ".join(
                          f"{name[:48]} {us:+.0f}" for name, _, us in grown),
                      "commit": str(r["commit"])[:7]})
    cols = ["model", "batch", "method", "step ms", "graph ms", "added ms", "kernels added ms",
            "idle added ms", "copies ms", "kernels grown most (us per step)", "commit"]
    return pd.DataFrame(lines, columns=cols)


def tensile_authors_split_table(rows: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """Each run of ``tensile_graph`` at the authors' MSR that recorded its plan's price and
    floor, its time over the captured vanilla step (``graph``, mean ms) split in two at the
    step the scheduler captured without a plan (``unplanned``: with its optimizer streamed,
    if it is; ``Scheduler.capture`` times it as the quietest of ten rounds, which reads
    about 0.1-0.2 ms under a mean): ``unplanned − graph`` (the streaming's cost) and
    ``TENSILE − unplanned`` (the plan's), beside what the target allows over ``graph``
    (half the authors' EOR of it), the plan's price and the least any plan of its moves is
    priced at (``floor``, :mod:`tensile.bound`). ``in reach``: the streaming plus the floor
    within the allowance, in the planner's cost model. ``rows``: :func:`load_rows` with
    ``every_row``."""
    ok = ok_tensile_rows(rows)
    theirs = paper.set_index(["model", "batch_size"])
    lines = []
    for r, extra in _tensile_rows(rows):
        if "match_msr=" not in r["backend"] or (r["model"], r["batch_size"]) not in theirs.index \
                or not re.fullmatch(AUTHORS_MODES, str(r["mode"])):
            continue
        floor = _plan_floor(r["backend"], extra)
        unplanned, priced = extra.get("captured_vanilla_ms"), extra.get("plan_overhead_ms")
        graph = _last_graph(earlier_in_job(ok, r))
        if floor is None or unplanned is None or priced is None or graph is None:
            continue
        graph_ms = float(graph["mean_ms"])
        allowed = theirs.loc[(r["model"], r["batch_size"]), "eor"] / 2 * graph_ms
        streaming = unplanned - graph_ms
        lines.append({"model": r["model"], "batch": int(r["batch_size"]),
                      "variant": row_method(r).replace("tensile_graph(", "("),
                      "graph ms": round(graph_ms, 3), "TENSILE ms": round(r["mean_ms"], 3),
                      "allowed ms": round(allowed, 3),
                      "unplanned − graph ms": round(streaming, 3),
                      "TENSILE − unplanned ms": round(r["mean_ms"] - unplanned, 3),
                      "priced ms": round(priced, 3), "floor ms": round(floor, 3),
                      "in reach": streaming + floor <= allowed,
                      "commit": str(r["commit"])[:7]})
    cols = ["model", "batch", "variant", "graph ms", "TENSILE ms", "allowed ms",
            "unplanned − graph ms", "TENSILE − unplanned ms", "priced ms", "floor ms", "in reach",
            "commit"]
    return pd.DataFrame(lines, columns=cols)


def tensile_price_gap_table(rows: pd.DataFrame) -> pd.DataFrame:
    """How far each captured TENSILE plan ran over the planner's price, with and without
    swaps: per model, batch and kind of plan (``swaps`` or ``rebuilds only``), over every
    ``tensile_graph`` run that recorded the step captured without a plan (``unplanned``,
    ``captured_vanilla_ms``), its plan's price and how many swaps it made, the gap
    ``TENSILE − unplanned − priced`` (mean step, ms): median and range, beside the median
    bytes the plan copied each way a step. The planner prices a swap's copies as hidden
    behind compute (plus ``swap_cost_ms`` each, and ``swap_copy_share`` of their time where
    set); a gap that grows with the bytes copied is copy time the step paid. For swap
    plans, ``copy share`` is that excess as a share of the copies' own time (bytes over the
    planner's bandwidths, out and in): per run, its gap less the median gap of the same
    model and batch's rebuild-only runs, over its copies' time; the median of the runs (what
    ``swap_copy_share`` would have priced; NaN without rebuild-only runs or recorded bytes).
    ``rows``: :func:`load_rows` with ``every_row``."""
    from tensile.planner import swap_price_ms   # what swap_copy_share=1 prices: the copies' time
    runs = []
    for r, extra in _tensile_rows(rows):
        unplanned, priced = extra.get("captured_vanilla_ms"), extra.get("plan_overhead_ms")
        swaps = extra.get("swaps_planned")
        if not str(r["backend"]).startswith("tensile_graph") or None in (unplanned, priced, swaps):
            continue
        moved = extra.get("bytes_moved_per_step")   # unrecorded: not counted as nothing moved
        gbps = [extra.get("d2h_gbps"), extra.get("h2d_gbps")]
        copy_ms = (float("nan") if moved is None or not all(gbps)
                   else swap_price_ms(moved / 2, *(g * 1e9 for g in gbps), swap_copy_share=1.0))
        runs.append({"model": r["model"], "batch": int(r["batch_size"]),
                     "plan": "swaps" if swaps else "rebuilds only",
                     "gap": r["mean_ms"] - unplanned - priced,
                     "each way": float("nan") if moved is None else moved / 2 / 2**20,
                     "copy ms": copy_ms})
    cols = ["model", "batch", "plan", "runs", "median gap ms", "gap range ms",
            "median MiB each way", "copy share"]
    if not runs:
        return pd.DataFrame(columns=cols)
    runs = pd.DataFrame(runs)
    rebuild_gap = runs[runs["plan"] == "rebuilds only"].groupby(["model", "batch"])["gap"].median()
    lines = []
    for (model, batch, kind), g in runs.groupby(["model", "batch", "plan"]):
        share = float("nan")
        if kind == "swaps" and (model, batch) in rebuild_gap.index:
            share = ((g["gap"] - rebuild_gap[(model, batch)]) / g["copy ms"]).median()
        lines.append({"model": model, "batch": batch, "plan": kind, "runs": len(g),
                      "median gap ms": round(g["gap"].median(), 3),
                      "gap range ms": f"{g['gap'].min():.2f} to {g['gap'].max():.2f}",
                      "median MiB each way": round(g["each way"].median(), 1),
                      "copy share": round(share, 3)})
    return pd.DataFrame(lines, columns=cols)


def tensile_authors_saving_table(rows: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """``tensile_graph`` planned to the authors' MSR (``experiment.match_msr``,
    ``+sweep=tensile_authors``): per model and variant, over its runs, the MSR (the lower of
    those against the eager and the captured vanilla step), the EOR against the captured
    vanilla step (``graph``) beside half the authors' (the target's limit), how many runs
    reached the saving (``saved``: the captured peak at most the target) and how many met
    the whole target. ``rows``: :func:`load_rows` with ``every_row``."""
    metrics = tensile_metrics(rows)
    metrics = metrics[metrics["method"].str.contains("match_msr=", regex=False)
                      & metrics["mode"].astype(str).str.fullmatch(AUTHORS_MODES)]
    metrics = _name_fused_adam(_captured_against_graph(metrics))
    lines = []
    theirs = paper.set_index(["model", "batch_size"])
    for (model, batch, method), g in metrics.groupby(["model", "batch_size", "method"], sort=False):
        if (model, batch) not in theirs.index:
            continue
        p = theirs.loc[(model, batch)]
        meets = (g["msr"] >= p["msr"]) & (g["eor"] <= p["eor"] / 2)
        # the peak fitted the target: at least the saving asked for against both references
        saved = g["msr"] >= g["method"].str.extract(r"match_msr=([0-9.]+)")[0].astype(float) - 1e-9
        k, n = int(meets.sum()), len(g)
        lines.append({"model": model, "batch": int(batch), "paper MSR": p["msr"],
                      "EOR limit": round(p["eor"] / 2, 4),
                      "variant": method.replace("tensile_graph(", "(").replace(" vs graph", ""),
                      "runs": n, "MSR": _span(g["msr"]), "EOR vs graph": _span(g["eor"]),
                      "saved": f"{int(saved.sum())} of {n}",
                      "verdict": _runs_verdict(k, n),
                      "commit": ", ".join(sorted(set(g["commit"])))})
    cols = ["model", "batch", "paper MSR", "EOR limit", "variant", "runs", "MSR", "EOR vs graph",
            "saved", "verdict", "commit"]
    table = pd.DataFrame(lines, columns=cols)
    order = {m: i for i, m in enumerate(paper["model"])}   # the authors' order, then variant
    return table.sort_values(["model", "variant"], key=lambda c: c.map(order) if c.name == "model" else c,
                             kind="stable").reset_index(drop=True)


def _round(value: float | None, places: int = 3) -> float | None:
    """``value`` rounded, or None where it is missing."""
    return None if value is None else round(value, places)


def _span(values: pd.Series) -> str:
    """``lo–hi`` of ``values`` to three places (one value: itself)."""
    lo, hi = float(values.min()), float(values.max())
    return f"{lo:.3f}" if round(lo, 3) == round(hi, 3) else f"{lo:.3f}–{hi:.3f}"


def tensile_cpu_plans(plans: pd.DataFrame, paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """The plans of ``results/analysis/tensile_plans.csv`` (:mod:`experiments.tensile_plans`),
    one line per ok row, beside the authors' MSR / EOR at the same model and batch."""
    ok = plans[plans["status"] == "ok"]
    cols = ["model", "batch_size", "max_overhead", "step_ms", "vanilla_peak_mb", "planned_peak_mb",
            "planned_msr", "est_eor", "recomputes", "with_in_place", "rebuilt_first", "commit"]
    out = ok[[c for c in cols if c in ok.columns]].copy()
    if paper is not None:
        theirs = paper[["model", "batch_size", "msr", "eor"]].rename(
            columns={"msr": "paper_msr", "eor": "paper_eor"})
        out = out.merge(theirs, on=["model", "batch_size"], how="left")
    return out


def tensile_multi_runs(df: pd.DataFrame, paper: pd.DataFrame | None = None,
                       timelines: Path | None = None) -> pd.DataFrame:
    """One line per run of the several-jobs experiment (its ``GPU`` row), in the order measured:
    device-level MSR and EOR, re-plans, and means over its jobs of the allocator MSR, cold-start
    MSR and iterations to a steady state; for ``copies`` settings the authors' figures
    (``paper``: ``tensile_multi_b2.csv``) and ``met``: MSR at least theirs and EOR no worse
    (None where the run cannot be judged: failed, smoke, or a figure missing). A run's job rows
    carry its GPU row's date. With ``timelines`` (the folder of the runs' memory timelines) the
    device-level memory figures (NVML MSR, idle and steady peaks, and from them the allocator
    share and what lies outside the allocators) are derived again from the run's timeline by
    the current rule (:func:`experiments.tensile_multi.memory_figures`), else they are the row's;
    so is ``first capture s (jobs)``: the mean over TENSILE's jobs of their first capture's
    seconds (``--captured`` runs; :func:`experiments.tensile_multi.capture_seconds`)."""
    from experiments.tensile_multi import capture_seconds, memory_figures, read_timeline
    rows = df[df["experiment"] == "tensile_multi"]
    out = []
    for _, g in rows[rows["backend"] == "GPU"].sort_values("date", kind="stable").iterrows():
        e = json.loads(g["extra"]) if g["extra"] else {}
        jobs = rows[(rows["mode"] == g["mode"]) & (rows["batch_size"] == g["batch_size"])
                    & (rows["date"] == g["date"]) & (rows["backend"] != "GPU")]
        extras = [json.loads(x) if x else {} for x in jobs["extra"]]

        def mean(key: str) -> float | None:
            vals = [x[key] for x in extras if x.get(key) is not None]
            return round(float(np.mean(vals)), 3) if vals else None

        first_capture = None
        if timelines is not None and e.get("timeline_csv") and (timelines / e["timeline_csv"]).exists():
            samples = read_timeline(timelines / e["timeline_csv"])
            e = {**e, **memory_figures(samples)}
            firsts = [spans[0] for spans in capture_seconds(samples, "tensile").values()]
            first_capture = round(float(np.mean(firsts)), 1) if firsts else None
        msr, eor = e.get("msr_nvml"), e.get("eor")
        line = {"setting": g["mode"] + ("*" if g["smoke"] else ""), "batch": g["batch_size"],
                "run": str(g["date"])[:16].replace("T", " "), "plot": e.get("plot_png"),
                "status": g["status"], "MSR (NVML)": None if msr is None else round(msr, 3),
                "allocator share": _allocator_share(e, extras),
                "outside allocators MB": _outside_allocators(e, extras),
                "EOR": None if eor is None else round(eor, 3), "re-plans": e.get("replans"),
                "first capture s (jobs)": first_capture,
                "MSR alloc (jobs)": mean("msr_alloc"), "MSR reserved (jobs)": mean("msr_reserved"),
                "cold-start MSR (jobs)": mean("cold_start_msr"),
                "iters to steady (jobs)": mean("iters_to_steady"),
                "planned step / vanilla (jobs)": _planned_over_vanilla(extras),
                "plans moved": _plans_moved(g["mode"], extras), "met": None, "one-sided": ""}
        p = None if paper is None or e.get("scenario") != "copies" else paper[
            (paper["model"] == g["model"]) & (paper["batch_size"] == g["batch_size"])
            & (paper["copies"] == e.get("copies"))]
        if p is not None and len(p):
            p = p.iloc[0]
            line.update({"model": g["model"], "copies": int(e["copies"]), "paper MSR": p["msr"],
                         "paper EOR": p["eor"], "paper cold-start MSR": p["cold_start_msr"]})
            if g["status"] == "ok" and not g["smoke"] and msr is not None and eor is not None:
                line["met"] = bool(msr >= p["msr"] and eor <= p["eor"])
                line["one-sided"] = " and ".join(_one_sided(extras))
        out.append(line)
    return pd.DataFrame(out)


def tensile_multi_table(df: pd.DataFrame, paper: pd.DataFrame | None = None,
                        timelines: Path | None = None) -> pd.DataFrame:
    """One line per setting of the several-jobs experiment: its latest run of
    :func:`tensile_multi_runs` (the ``run`` column; earlier runs stay in the CSV), ``runs``
    counting them when ``df`` holds every row (:func:`load_rows` with ``every_row``; else each
    setting has one), and for ``copies`` settings a verdict over every judged run: MSR at least
    the authors' and EOR no worse ("in k of n runs" when only some are), naming what TENSILE's
    jobs did beside their plan that the vanilla jobs did not (:func:`_one_sided`); runs whose
    plans moved nothing are not counted as met but named apart (:func:`_met_by`)."""
    return tensile_multi_latest(tensile_multi_runs(df, paper, timelines))


def tensile_multi_latest(runs: pd.DataFrame) -> pd.DataFrame:
    """:func:`tensile_multi_table` from the runs of :func:`tensile_multi_runs`, for a caller that
    has them already."""
    if runs.empty:
        return runs
    out = []
    for _, group in runs.groupby(["setting", "batch"], sort=False):
        line = group.iloc[-1].to_dict()
        line["runs"] = len(group)
        if "paper MSR" in group and pd.notna(line.get("paper MSR")):
            n = int(group["met"].notna().sum())
            by_plan, by_trims = _met_by(group)
            line["verdict"] = _runs_verdict(int(by_plan.sum()), n) if n else "not measured"
            one_sided = [x for x in group.loc[by_plan, "one-sided"] if x]
            if one_sided:
                line["verdict"] += f" ({one_sided[-1]} on TENSILE's side only)"
            if by_trims.any():
                line["verdict"] += (f"; met in {int(by_trims.sum())} of {n} runs by the trims "
                                    "alone (the plans moved nothing)")
        out.append(line)
    table = pd.DataFrame(out)   # without the runs' own columns (model, copies, met, one-sided)
    return table[[c for c in ("setting", "batch", "run", "runs", "plot", "status", "MSR (NVML)",
                              "allocator share", "outside allocators MB", "EOR", "re-plans",
                              "first capture s (jobs)",
                              "MSR alloc (jobs)", "MSR reserved (jobs)", "cold-start MSR (jobs)",
                              "iters to steady (jobs)", "planned step / vanilla (jobs)",
                              "paper MSR", "paper EOR", "paper cold-start MSR", "verdict")
                  if c in table.columns]]


def tensile_multi_targets(runs: pd.DataFrame) -> pd.DataFrame:
    """Per model and copy count of the ``copies`` runs (:func:`tensile_multi_runs`) that the
    authors measured: how many judged runs met their figures (MSR at least theirs, EOR no
    worse) with a plan that moved something and how many more by the trims alone
    (:func:`_met_by`), the met run that saved most (at the least EOR), and where none did the
    two nearest misses: the most MSR within their EOR and the least EOR at their MSR; and the
    run that saved most at any EOR."""
    if runs.empty or "met" not in runs:
        return pd.DataFrame()

    def point(r: pd.Series | None) -> str:
        return "" if r is None else f"{r['MSR (NVML)']:.3f} @ {r['EOR']:.3f}"

    def options(r: pd.Series | None) -> str:
        return "" if r is None else r["setting"].partition(",")[2] or "(defaults)"

    judged = runs[runs["met"].notna()]
    out = []
    for (model, copies), g in judged.groupby(["model", "copies"], sort=False):
        theirs_msr, theirs_eor = g["paper MSR"].iloc[0], g["paper EOR"].iloc[0]
        by_plan, by_trims = _met_by(g)
        met = g[by_plan]
        # most MSR, then least EOR; of equal runs the earliest
        met = met.sort_values(["MSR (NVML)", "EOR"], ascending=[False, True], kind="stable")
        best = met.iloc[0] if len(met) else None
        within = g[g["EOR"] <= theirs_eor]
        above = g[g["MSR (NVML)"] >= theirs_msr]
        out.append({"model": model, "copies": int(copies),
                    "authors (MSR @ EOR)": f"{theirs_msr:.3f} @ {theirs_eor:.3f}",
                    "runs": len(g), "met": len(met), "met by the trims alone": int(by_trims.sum()),
                    "best met (MSR @ EOR)": point(best),
                    "its options": options(best),
                    "most MSR within their EOR": "" if best is not None or within.empty else
                    point(within.loc[within["MSR (NVML)"].idxmax()]),
                    "least EOR at their MSR": "" if best is not None or above.empty else
                    point(above.loc[above["EOR"].idxmin()]),
                    "most MSR at any EOR": point(g.loc[g["MSR (NVML)"].idxmax()])})
    table = pd.DataFrame(out)
    return table.sort_values(["model", "copies"], kind="stable").reset_index(drop=True) if len(table) else table


def _plans_moved(setting: str, jobs: list[dict]) -> bool | None:
    """Whether TENSILE's plans did anything in a run: a job planned a swap or a recomputation,
    or the jobs ran the streamed optimizer (``stream_optimizer`` in the setting: each group
    updated in backward and its gradients dropped, its state in host memory unless kept
    resident). False when every job did none of these (its saving is then only what the trims
    gave back); None for rows that did not record what was planned."""
    if "stream_optimizer=" in setting:
        return True
    planned = [(j.get("swaps_planned"), j.get("recomputes_planned")) for j in jobs]
    if not planned or any(None in p for p in planned):
        return None
    return any(s or r for s, r in planned)


def _met_by(runs: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(met with a plan that moved something, met by the trims alone) per run of
    :func:`tensile_multi_runs`: a run whose plans moved nothing (:func:`_plans_moved`) does
    not count as the scheduler meeting the authors' figures."""
    met = runs["met"].eq(True)
    idle = runs["plans moved"].eq(False) if "plans moved" in runs else pd.Series(False, runs.index)
    return met & ~idle, met & idle


def _planned_over_vanilla(jobs: list[dict]) -> float | None:
    """Mean over the jobs of the step time each one's plan was made for (``plan_iteration_ms``)
    over its vanilla step time beside the same co-runners (``iter_ms_mean_vanilla``); None
    where no job has both. Far from 1, the plan priced its ops for another GPU than the one
    the jobs shared: its allowance in ms, and the copies it hid, with them."""
    ratios = [j["plan_iteration_ms"] / j["iter_ms_mean_vanilla"] for j in jobs
              if j.get("plan_iteration_ms") and j.get("iter_ms_mean_vanilla")]
    return round(float(np.mean(ratios)), 2) if ratios else None


def _one_sided(jobs: list[dict]) -> list[str]:
    """What TENSILE's jobs did to their processes' memory beside the plan and the vanilla
    jobs did not: gave back their thread stacks (``--trim-stack tensile``) or their cuBLAS
    workspaces (``--trim-blas tensile``), compacted their long-lived tensors (``--compact
    tensile``). Part of such an NVML MSR is that, not the plan."""
    def released(key: str, phase: str) -> bool:
        return any((j.get(f"{key}_{phase}") or 0) > 0 for j in jobs)

    def compacted(phase: str) -> bool:
        return any(j.get(f"compacted_{phase}") for j in jobs)
    done = []
    if released("stack_released_mb", "tensile") and not released("stack_released_mb", "vanilla"):
        done.append("thread stacks trimmed")
    if released("blas_released_mb", "tensile") and not released("blas_released_mb", "vanilla"):
        done.append("cuBLAS workspaces trimmed")
    if compacted("tensile") and not compacted("vanilla"):
        done.append("memory compacted")
    return done


def _used_and_held(gpu: dict, jobs: list[dict], phase: str) -> tuple[float, float] | None:
    """In one phase: the GPU memory used above idle (NVML peak) and the sum of the jobs'
    allocator reserved peaks, in MB; None when a figure is missing."""
    peak, idle = gpu.get(f"peak_{phase}_mb"), gpu.get(f"idle_{phase}_mb")
    held = [j.get(f"peak_reserved_{phase}_mb") for j in jobs]
    if peak is None or idle is None or not held or any(h is None for h in held):
        return None
    return peak - idle, sum(held)


def _outside_allocators(gpu: dict, jobs: list[dict]) -> str | None:
    """``vanilla → tensile``: the GPU memory the jobs' processes used above idle (NVML peak)
    that their caching allocators did not hold (the jobs' reserved peaks), per phase. It is
    CUDA contexts, loaded kernels and library handles: memory no plan moves. A phase whose
    figures are missing gives None."""
    phases = [_used_and_held(gpu, jobs, phase) for phase in ("vanilla", "tensile")]
    if None in phases:
        return None
    (used_v, held_v), (used_t, held_t) = phases
    return f"{used_v - held_v:.0f} → {used_t - held_t:.0f}"


def _allocator_share(gpu: dict, jobs: list[dict]) -> float | None:
    """What the jobs' caching allocators held (reserved peaks, vanilla) of the GPU memory
    used above idle (NVML, vanilla): the part a plan can act on. The rest is each
    process's CUDA context, loaded kernels and library handles."""
    vanilla = _used_and_held(gpu, jobs, "vanilla")
    if vanilla is None or vanilla[0] <= 0:
        return None
    used, held = vanilla
    return round(held / used, 3)


def _prefer_full(sp: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Full-protocol rows if there are any, else the smoke rows (and say so in the title)."""
    full = sp[~sp["smoke"]]
    return (full, "") if len(full) else (sp, " (smoke rows: CPU / quick timing)")


def plot_inference_speedup(df: pd.DataFrame, paper: pd.DataFrame | None = None,
                           batch_size: int = 1) -> Figure | None:
    """Grouped bars: speedup over eager per model and backend (the paper's inference figure),
    with the paper's V100 Nimble bars as markers. None when there is nothing to plot."""
    sp = speedups(df[(df["experiment"] == "inference") & (df["batch_size"] == batch_size)])
    sp, note = _prefer_full(sp[sp["backend"] != "eager"])
    if sp.empty:
        return None
    models = list(dict.fromkeys(sp["model"]))
    backends = _ordered(sp["backend"])
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(models) + 2), 4.5))
    width = 0.8 / len(backends)
    x = np.arange(len(models))
    for i, b in enumerate(backends):
        vals = sp[sp["backend"] == b].set_index("model")["speedup"].reindex(models)
        ax.bar(x + (i - (len(backends) - 1) / 2) * width, vals.to_numpy(dtype=float), width, label=b)
    if paper is not None:
        nimble = paper[(paper["system"] == "Nimble") & (paper["batch_size"] == batch_size)]
        pv = nimble.set_index("model")["speedup_over_pytorch"].reindex(models)
        if pv.notna().any():
            ax.scatter(x, pv.to_numpy(dtype=float), marker="_", s=400, color="black", zorder=3,
                       label="paper Nimble (V100)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(x, models, rotation=30, ha="right")
    ax.set_ylabel("speedup over eager PyTorch")
    ax.set_title(f"Inference, batch {batch_size}{note}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_training_speedup(df: pd.DataFrame) -> Figure | None:
    """Training speedup over eager per batch size: one panel per model, bars per backend."""
    sp = speedups(df[df["experiment"] == "training"])
    sp, note = _prefer_full(sp[sp["backend"] != "eager"])
    if sp.empty:
        return None
    models = list(dict.fromkeys(sp["model"]))
    # one bar series per (mode, backend): fwd-bwd and whole-step share backend names
    series = [(mode, b) for mode in sorted(sp["mode"].unique())
              for b in _ordered(sp[sp["mode"] == mode]["backend"])]
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        m = sp[sp["model"] == model]
        batches = sorted(m["batch_size"].unique())
        x = np.arange(len(batches))
        width = 0.8 / len(series)
        for i, (mode, b) in enumerate(series):
            sel = m[(m["mode"] == mode) & (m["backend"] == b)]
            vals = sel.set_index("batch_size")["speedup"].reindex(batches)
            label = b if len(sp["mode"].unique()) == 1 else f"{b} ({mode})"
            ax.bar(x + (i - (len(series) - 1) / 2) * width, vals.to_numpy(dtype=float), width,
                   label=label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(x, [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_title(f"{model} ({', '.join(sorted(m['mode'].unique()))})")
    axes[0][0].set_ylabel("speedup over eager")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"Training step{note}")
    fig.tight_layout()
    return fig


def plot_multistream(df: pd.DataFrame, headroom: pd.DataFrame | None = None) -> Figure | None:
    """Multi-stream ablation: Nimble (multi-stream) over Nimble single-stream, per model and
    batch. With ``headroom`` (:func:`headroom_table`), a marker on each bar shows how much two
    independent copies of that model overlap at that batch: the GPU's concurrency there."""
    sp = speedups(df[df["experiment"] == "inference"], baseline="nimble-single")
    sp, note = _prefer_full(sp[sp["backend"] == "nimble"])
    if sp.empty:
        return None
    batches = sorted(sp["batch_size"].unique())
    models = list(dict.fromkeys(sp["model"]))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(models) + 2), 4))
    width = 0.8 / len(batches)
    x = np.arange(len(models))
    for i, b in enumerate(batches):
        vals = sp[sp["batch_size"] == b].set_index("model")["speedup"].reindex(models)
        pos = x + (i - (len(batches) - 1) / 2) * width
        ax.bar(pos, vals.to_numpy(dtype=float), width, label=f"batch {b}")
        if headroom is not None:
            two = headroom[(headroom["batch_size"] == b) & (headroom["copies"] == 2)]
            overlap = two.set_index("model")["overlap"].reindex(models).to_numpy(dtype=float)
            ax.scatter(pos, overlap, marker="_", s=200, color="black", zorder=3,
                       label="2 independent copies" if i == 0 else None)
    for target in (1.3, 1.5):
        ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, models, rotation=30, ha="right")
    ax.set_ylabel("nimble / nimble-single speedup")
    ax.set_title(f"Multi-stream ablation (targets 1.3x / 1.5x){note}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_kernel_census(kernels: pd.DataFrame) -> Figure | None:
    """One panel per model and batch: each backend's call latency (median ms) split into the
    time the GPU runs something (busy) and the rest, with the GPU tasks per call at the bar's
    end (:func:`kernels_table`)."""
    ok = kernels[kernels["status"] == "ok"]
    if ok.empty:
        return None
    groups = list(ok.groupby(["model", "batch_size"], sort=True))
    cols = min(3, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 0.5 + 1.9 * rows), squeeze=False)
    for ax, ((model, batch), g) in zip(axes.flat, groups):
        y = np.arange(len(g))
        busy = np.minimum(g["busy_ms"].to_numpy(float), g["median_ms"].to_numpy(float))
        ax.barh(y, busy, color="tab:green", label="GPU busy")
        ax.barh(y, g["median_ms"].to_numpy(float) - busy, left=busy, color="lightgrey",
                label="GPU idle")
        for yi, (ms, k) in enumerate(zip(g["median_ms"], g["kernels"])):
            ax.text(ms, yi, f" {k:.0f}", va="center", fontsize=7)
        ax.set_yticks(y, g["backend"], fontsize=7)
        ax.set_title(f"{model}, batch {batch}", fontsize=9)
        ax.set_xlabel("ms per call", fontsize=8)
        ax.set_xlim(0, g["median_ms"].max() * 1.25)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper right")
    fig.suptitle("Kernel census: latency = GPU busy + idle (numbers: GPU tasks per call)", fontsize=10)
    fig.tight_layout()
    return fig


GPU_EVENT_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}


def plot_tensile_tradeoff(metrics: pd.DataFrame, paper: pd.DataFrame | None = None,
                          plans: pd.DataFrame | None = None) -> Figure | None:
    """One panel per model at the paper's batch (16): memory saved (MSR) against extra time
    (EOR) for every method, one colour per method family (its options aside: the table has
    them), the TENSILE authors' point, and the target region (MSR at least theirs, EOR at most
    half of theirs) shaded. A captured TENSILE step is placed by its figures against the
    captured vanilla step; one measured by older code than its model's newest is a hollow grey
    point. ``plans`` (``tensile_plans.csv``): what the planner promises for the captured step,
    as hollow points joined by a dashed line."""
    m = _captured_against_graph(metrics[(metrics["mode"] == "whole-step") & (metrics["batch_size"] == 16)])
    m = m[m["msr"].notna() & m["eor"].notna() & ~m["method"].isin(["vanilla", "graph"])]  # references
    if m.empty:
        return None
    m = m.assign(family=m["method"].map(_method_family))
    ours = ("tensile", "streamed")
    families = sorted(m["family"].unique(), key=lambda f: (not f.startswith(ours), f))
    style = {f: (f"C{i % 10}", "o" if f.startswith(ours) else "s") for i, f in enumerate(families)}
    models = list(dict.fromkeys(m["model"]))
    cols = min(3, len(models))
    rows_n = -(-len(models) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols + 2.5, 3.6 * rows_n), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        rows = m[m["model"] == model]
        captured = rows["method"].str.startswith("tensile_graph")
        newest = rows[captured].sort_values("date")["commit"].iloc[-1] if captured.any() else None
        older = captured & (rows["commit"] != newest)
        for family, some in rows[~older].groupby("family"):
            color, marker = style[family]
            ax.scatter(some["eor"], some["msr"], marker=marker, s=30, color=color, label=family)
        if older.any():
            ax.scatter(rows.loc[older, "eor"], rows.loc[older, "msr"], marker="o", s=30,
                       facecolors="none", edgecolors="gray", label="tensile_graph, older code")
        planned = None if plans is None else plans[
            (plans["model"] == model) & (plans["batch_size"] == 16) & (plans["status"] == "ok")]
        if planned is not None and len(planned):
            planned = planned.sort_values("est_eor")
            ax.plot(planned["est_eor"], planned["planned_msr"], "o--", mfc="none", color="gray",
                    label="planned (CPU)")
        p = None if paper is None else paper[paper["model"] == model]
        if p is not None and len(p):
            p = p.iloc[0]
            ax.scatter(p["eor"], p["msr"], marker="*", s=120, color="black", label="TENSILE authors")
            ax.fill_between([min(0.0, rows["eor"].min()) - 0.05, p["eor"] / 2], p["msr"], 1.0,
                            color="green", alpha=0.12, label="target")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("EOR (extra time)")
        ax.set_ylim(min(-0.1, rows["msr"].min() - 0.05), 1.0)
    for row in axes:
        row[0].set_ylabel("MSR (memory saved)")
    _figure_legend(fig, axes, families)
    fig.suptitle("TENSILE, one job, batch 16: memory saved against extra time", fontsize=10)
    return fig


def _method_family(method: str) -> str:
    """``tensile_graph(max_overhead=0.1) vs graph`` -> ``tensile_graph``: a method without its
    options and without the note that it was judged against the captured vanilla step."""
    return method.split("(")[0].removesuffix(" vs graph")


def _figure_legend(fig: Figure, axes: np.ndarray, order: list[str] | None = None) -> None:
    """One legend for all panels, right of them, an entry per label (first in ``order``,
    then as first drawn)."""
    handles = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}
    first = [label for label in order or [] if label in handles]
    labels = first + [label for label in handles if label not in first]
    fig.legend([handles[label] for label in labels], labels, fontsize=8, loc="outside right center")   # upper: over the title


def snapshot_file(extra: dict) -> str | None:
    """The file name of the planning snapshot a row's ``extra`` names (``experiment.snapshot
    =true``: ``snapshot_file``; rows before 2026-12-01 08:00: ``snapshot_path``, the path on
    the host that wrote it), beside the row's CSV; None without one."""
    name = extra.get("snapshot_file") or extra.get("snapshot_path")
    return Path(name).name if name else None


def equal_peak_snapshots(gpu_dir: str | Path,
                         every_row: pd.DataFrame) -> dict[str, tuple[Path, float | None]]:
    """Per model, the planning snapshot (``experiment.snapshot=true``) of its latest equal-peak
    ``tensile_graph`` row that saved one and has it in ``gpu_dir``, with the floor on any plan
    of that row's moves (:func:`_plan_floor`; None where the row did not record it);
    ``every_row``: the rows of :func:`load_rows` with ``every_row``, in the order measured."""
    found: dict[str, tuple[Path, float | None]] = {}
    for r, extra in _tensile_rows(every_row):
        name = snapshot_file(extra)
        if str(r["backend"]).startswith("tensile_graph(match_peak=") and name \
                and (Path(gpu_dir) / name).exists():
            found[r["model"]] = (Path(gpu_dir) / name, _plan_floor(r["backend"], extra))
    return found


def plot_plan_memory(snapshots: dict[str, tuple[Path, float | None]]) -> Figure | None:
    """One panel per model (:func:`equal_peak_snapshots`): the resident bytes over its step
    without a plan and with the plan its GPU ran (:func:`tensile.simulate` on the saved
    timeline, op times measured there), and the budget, with the plan's priced extra time
    and the floor on any plan of its moves (rebuilds, and swaps where the row allowed them)."""
    if not snapshots:
        return None
    from tensile import PlanningSnapshot, simulate          # torch: only when there is one
    fig, axes = plt.subplots(1, len(snapshots), figsize=(5.0 * len(snapshots), 3.4), squeeze=False)
    for ax, (model, (path, floor)) in zip(axes[0], snapshots.items()):
        snap = PlanningSnapshot.load(path)
        tl, plan = snap.timeline, snap.plan
        t = np.asarray(tl.start)
        ax.plot(t, simulate(tl).curve / 2**20, lw=1, color="gray", label="no plan")
        ax.plot(t, simulate(tl, plan).curve / 2**20, lw=1, label="the plan the GPU ran")
        ax.axhline(snap.budget_bytes / 2**20, ls="--", color="black", lw=0.8, label="budget")
        ax.set_title(f"{model}: priced {plan.est_overhead_ms:.3f} ms, floor "
                     f"{'none' if floor is None else f'{floor:.3f}'} ms", fontsize=9)
        ax.set_xlabel("ms into the step (measured op times)")
        ax.legend(fontsize=7, loc="upper right")
    axes[0][0].set_ylabel("resident MiB")
    fig.suptitle("TENSILE at a built-in's peak: memory over the step, from the jobs' planning "
                 "snapshots", fontsize=10)
    fig.tight_layout()
    return fig


# colour and legend label of a several-jobs run by what its jobs did to their processes'
# memory beside the plan: the thread-stack trim (--trim-stack), the compaction (--compact)
# and the cuBLAS workspace trim (--trim-blas)
TRIM_COLORS = {"none": ("C0", "ours, no trim"), "tensile": ("C1", "ours, TENSILE's jobs trimmed"),
               "all": ("C2", "ours, every job trimmed"),
               "tensile,compact=tensile": ("C5", "ours, TENSILE's jobs trimmed and compacted"),
               "tensile,compact=all": ("C6", "ours, TENSILE's jobs trimmed, every job compacted"),
               "all,compact=all": ("C7", "ours, every job trimmed and compacted"),
               "tensile,compact=tensile,trim_blas=tensile": (
                   "C8", "ours, TENSILE's jobs trimmed (also cuBLAS) and compacted"),
               "all,compact=all,trim_blas=all": (
                   "C9", "ours, every job trimmed (also cuBLAS) and compacted"),
               "other": ("0.5", "ours, another trim and compaction")}


def _plotted_settings(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of :func:`tensile_multi_runs` or :func:`tensile_multi_table` a plot draws (a
    measured MSR, no smoke rows), with ``base`` (the setting without its options) and ``trim``
    (its ``--trim-stack``, ``--compact`` and ``--trim-blas``: a key of :data:`TRIM_COLORS`)."""
    t = table[table["MSR (NVML)"].notna() & ~table["setting"].str.endswith("*")].copy()
    t["base"] = t["setting"].str.split(",").str[0]
    key = t["setting"].str.extract(r"trim_stack=(\w+)", expand=False).fillna("none")
    for option in ("compact", "trim_blas"):
        chosen = t["setting"].str.extract(rf"({option}=\w+)", expand=False)
        key = key.where(chosen.isna(), key + "," + chosen.fillna(""))
    t["trim"] = key.where(key.isin(list(TRIM_COLORS)), "other")
    return t


def plot_tensile_multi_msr(table: pd.DataFrame) -> Figure | None:
    """Per several-jobs setting (:func:`tensile_multi_table`), its options aside: the best
    MSR on NVML memory of its runs of each kind of :data:`TRIM_COLORS` (no thread-stack trim,
    TENSILE's jobs trimmed, every job trimmed, and those with a compaction), beside the
    allocator share (the most any plan could save there) and the authors' MSR; below, the EOR
    of each of those runs and the authors'."""
    t = _plotted_settings(table)
    if t.empty:
        return None
    bases = sorted(dict.fromkeys(t["base"]), key=_setting_order)
    best = (t.sort_values("MSR (NVML)").groupby(["base", "trim"]).tail(1)
            .set_index(["base", "trim"]))

    def series(trim: str, col: str) -> np.ndarray:
        return np.array([best[col].get((b, trim), np.nan) for b in bases], dtype=float)

    def per_setting_max(col: str) -> np.ndarray:
        return np.array([t.loc[t["base"] == b, col].max() if col in t else np.nan for b in bases],
                        dtype=float)

    trims = [(trim, label) for trim, (_, label) in TRIM_COLORS.items() if (t["trim"] == trim).any()]
    msr_bars = [(series(trim, "MSR (NVML)"), label) for trim, label in trims]
    msr_bars.append((per_setting_max("allocator share"), "allocator share (upper bound)"))
    eor_bars = [(series(trim, "EOR"), label) for trim, label in trims]
    if "paper MSR" in t and t["paper MSR"].notna().any():
        msr_bars.append((per_setting_max("paper MSR"), "TENSILE authors"))
        eor_bars.append((per_setting_max("paper EOR"), "TENSILE authors"))
    x = np.arange(len(bases))
    # constrained layout leaves room for the legend outside the axes; tight_layout cannot
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, layout="constrained",
                                      figsize=(max(7, 0.8 * len(bases) + 3), 7))
    colors = {label: color for color, label in TRIM_COLORS.values()} | \
        {"allocator share (upper bound)": "C3", "TENSILE authors": "C4"}
    for ax, bars in ((top, msr_bars), (bottom, eor_bars)):
        width = 0.8 / len(bars)
        for i, (values, label) in enumerate(bars):
            ax.bar(x + (i - (len(bars) - 1) / 2) * width, values, width, label=label,
                   color=colors[label])
        ax.axhline(0, color="black", linewidth=0.6)
    top.set_ylabel("MSR (NVML), share of used GPU memory")
    bottom.set_ylabel("EOR (of the run above)")
    bottom.set_xticks(x, [_short_setting(b) for b in bases], rotation=30, ha="right")
    top.set_title("TENSILE, several jobs: memory saved (NVML), best run per setting, and its "
                  "extra time")
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_tensile_multi_tradeoff(table: pd.DataFrame) -> Figure | None:
    """One panel per model and copy count of the ``copies`` settings: every run
    (:func:`tensile_multi_runs`; or each setting's latest, :func:`tensile_multi_table`) as
    memory saved (MSR on NVML memory) against extra time (EOR), coloured by its thread-stack
    trim and compaction (:data:`TRIM_COLORS`), beside the authors' point and the target region
    (MSR at least theirs at no worse EOR) shaded. The target is a corner of this plane, so a run
    that saves more at more cost is seen as such, which one best bar per setting hides."""
    t = _plotted_settings(table)
    t = t[t["EOR"].notna()]
    found = t["base"].str.extract(r"^copies:(.+)x(\d+)$")
    t["model"], t["copies"] = found[0], pd.to_numeric(found[1])
    t = t[t["model"].notna()].astype({"copies": int})
    if t.empty:
        return None
    models, counts = sorted(t["model"].unique()), sorted(t["copies"].unique())
    fig, axes = plt.subplots(len(models), len(counts), squeeze=False, layout="constrained",
                             figsize=(3.4 * len(counts) + 2, 2.6 * len(models)))
    for (i, model), (j, count) in itertools.product(enumerate(models), enumerate(counts)):
        ax, runs = axes[i][j], t[(t["model"] == model) & (t["copies"] == count)]
        for trim, (color, label) in TRIM_COLORS.items():
            some = runs[runs["trim"] == trim]
            if len(some):
                ax.scatter(some["EOR"], some["MSR (NVML)"], s=22, color=color, label=label)
        theirs = runs[["paper MSR", "paper EOR"]].dropna() if "paper MSR" in runs else pd.DataFrame()
        if len(theirs):
            msr, eor = theirs.iloc[0]
            ax.scatter([eor], [msr], marker="*", s=130, color="black", label="TENSILE authors")
            left = min(0.0, runs["EOR"].min()) - 0.05
            ax.fill_between([left, eor], msr, 1.0, color="green", alpha=0.12, label="target")
        low, high = runs["MSR (NVML)"].min(), runs["MSR (NVML)"].max()   # NaN for an empty panel
        ax.set_ylim(min(-0.05, low - 0.05) if len(runs) else -0.05,
                    max(0.6, high + 0.05) if len(runs) else 0.6)
        ax.set_title(f"{model} x{count}", fontsize=9)
        ax.axhline(0, color="black", linewidth=0.5)
    for ax in axes[-1]:
        ax.set_xlabel("EOR (extra time)")
    for row in axes:
        row[0].set_ylabel("MSR (NVML)")
    _figure_legend(fig, axes, [label for _, label in TRIM_COLORS.values()])
    fig.suptitle("TENSILE, several jobs, batch 2: memory saved (NVML) against extra time, "
                 "every run", fontsize=10)
    return fig


def _setting_order(base: str) -> tuple:
    """Sort key of a setting without its options: copies settings first, by model and then
    count (``copies:resnet50x2`` before ``copies:resnet50x10``); then the others by name."""
    count = re.search(r"x(\d+)$", base)
    return (not base.startswith("copies:"), base[:count.start()] if count else base,
            int(count.group(1)) if count else 0, base)


def _short_setting(setting: str) -> str:
    """``copies:resnet50x2`` -> ``resnet50x2``; ``mdw:a+b+c`` -> ``mdw (3 models)``;
    ``dynamic:a+b:every=5`` -> ``dynamic (2 models, every=5)``."""
    kind, _, rest = setting.partition(":")
    if kind == "copies":
        return rest
    models, _, knob = rest.partition(":")
    n = len(models.split("+"))
    return f"{kind} ({n} models{', ' + knob if knob else ''})"


def plot_stream_timeline(trace_json_path: str | Path, out_png: str | Path | None = None) -> Figure:
    """Per-stream timeline (Gantt) of the GPU events of a torch.profiler chrome trace.

    Draws one row per CUDA stream (``args.stream``, else the event's ``tid``), one bar per kernel
    or memory operation, time in ms from the first GPU event. Saves to ``out_png`` if given.
    """
    data = json.loads(Path(trace_json_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_EVENT_CATS and "dur" in e]
    if not gpu:
        raise ValueError(f"{trace_json_path}: no GPU kernel/memcpy events (cat in {sorted(GPU_EVENT_CATS)}); "
                         "was the trace recorded with ProfilerActivity.CUDA on a GPU?")
    t0 = min(float(e["ts"]) for e in gpu)
    streams = sorted({e.get("args", {}).get("stream", e.get("tid")) for e in gpu},
                     key=lambda s: (not str(s).isdigit(), int(s) if str(s).isdigit() else 0, str(s)))
    row = {s: i for i, s in enumerate(streams)}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(streams) + 1.5))
    colors = plt.get_cmap("tab10")
    for s in streams:
        spans = [((float(e["ts"]) - t0) / 1e3, float(e["dur"]) / 1e3) for e in gpu
                 if e.get("args", {}).get("stream", e.get("tid")) == s]
        ax.broken_barh(spans, (row[s] - 0.4, 0.8), color=colors(row[s] % 10))
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.invert_yaxis()  # first stream on top
    ax.set_xlabel("time (ms)")
    ax.set_title(f"GPU timeline per stream: {Path(trace_json_path).stem} ({len(gpu)} GPU events)")
    fig.tight_layout()
    if out_png is not None:
        fig.savefig(out_png, dpi=120)
    return fig


# --------------------------------------------------------------------------- markdown

def md_table(df: pd.DataFrame) -> str:
    """A GitHub markdown table (no tabulate dependency; ``|`` in cells escaped)."""
    if df.empty:
        return "_(no rows)_"
    cols = [str(c) for c in df.columns]

    def esc(v: object) -> str:
        return "" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v).replace("|", "\\|")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(esc(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _environment_lines(df: pd.DataFrame) -> list[str]:
    def values(col: str) -> str:
        return ", ".join(sorted({str(v) for v in df[col] if str(v)})) or "?"
    drivers = sorted({json.loads(e).get("driver", "") for e in df["extra"] if e} - {""})
    dates = sorted(str(d) for d in df["date"] if str(d))
    where = (f"- CPU only (no GPU); host {values('host')}" if set(df["device"]) == {"cpu"} else
             f"- GPU: {values('gpu')}; driver {', '.join(drivers) or '?'}; host {values('host')}")
    return [
        where,
        f"- torch {values('torch')}, CUDA {values('cuda')}, cuDNN {values('cudnn')}, Python {values('python')}",
        f"- TF32 matmul {values('tf32_matmul')}, TF32 cuDNN {values('tf32_cudnn')}, "
        f"cudnn.benchmark {values('cudnn_benchmark')}",
        f"- commits {values('commit')}; measured {dates[0] if dates else '?'} … {dates[-1] if dates else '?'}",
        *_load_line(df),
    ]


def _load_line(df: pd.DataFrame) -> list[str]:
    """The host's 1-minute load average over the rows that recorded it (since 2026-11-29):
    eager timings at small batches are CPU-bound, so a loaded host makes eager slower and
    every speedup over it larger."""
    loads = [load for load, _ in filter(None, map(_host_load, df["extra"]))]
    if not loads:
        return []
    busy = int(df["loaded"].sum())       # load_rows' column: the same rule, once
    return [f"- host load (1-min average) {min(loads):g}–{max(loads):g} over {len(loads)} rows; "
            f"{busy} measured with more runnable tasks than the process's CPUs"]


def _not_measured(df: pd.DataFrame) -> pd.DataFrame:
    bad = df[df["status"] != "ok"]
    if bad.empty:
        return pd.DataFrame()
    grouped = bad.groupby(["backend", "status", "reason"], sort=False)
    return pd.DataFrame([{"backend": b, "status": s, "reason": r,
                          "rows": ", ".join(f"{m} b={bs}" for m, bs in zip(g["model"], g["batch_size"]))}
                         for (b, s, r), g in grouped])


def settings(df: pd.DataFrame) -> list[tuple[str, str, int]]:
    """The (experiment, mode, batch size) combinations present, one table each."""
    keys = df[["experiment", "mode", "batch_size"]].drop_duplicates()
    return [(e, m, int(b)) for e, m, b in keys.sort_values(["experiment", "batch_size"]).itertuples(index=False)]


def write_report(gpu_dir: str | Path, results_dir: str | Path | None = None) -> Path:
    """Write ``report.md`` and the PNGs into ``gpu_dir``; returns the report's path."""
    gpu_dir = Path(gpu_dir)
    results_dir = Path(results_dir) if results_dir is not None else gpu_dir.parent
    paper_dir = results_dir / "paper"
    df = load_rows(gpu_dir)
    # TENSILE's tables read each job's row and count runs of one key: every row, read once
    every_row = (load_rows(gpu_dir, every_row=True)
                 if df["experiment"].isin(["tensile", "tensile_multi"]).any() else None)
    claims = _read_csv(paper_dir / "nimble_claims.csv")
    paper_inf = _read_csv(paper_dir / "nimble_inference_v100.csv")
    paper_train = _read_csv(paper_dir / "nimble_training_v100.csv")
    streams = _read_csv(results_dir / "analysis" / "streams.csv")
    headroom = headroom_table(gpu_dir / "headroom.csv")
    kernels = kernels_table(gpu_dir / "kernels.csv")
    conv_ws = conv_workspace_table(gpu_dir / "conv_workspace.csv")
    slice_cost = slice_cost_table(gpu_dir / "slice_cost.csv")

    n_smoke = int(df["smoke"].sum())
    md = [f"# Reproduction report: {gpu_dir.name}", "",
          f"Derived by `python -m experiments.report` from {len(df)} raw rows in `{gpu_dir.name}/*.csv` "
          f"({n_smoke} smoke rows). Do not edit: re-run the report.", ""]
    if len(df):
        md += _environment_lines(df) + [""]
    if n_smoke:
        md += [f"`*` marks smoke rows (CPU, or fewer than {PROTOCOL_WARMUP} warm-ups / {PROTOCOL_ITERS} "
               "timed iterations): shown, never used for a verdict.", ""]
    if n_smoke == len(df) and len(df):
        md += ["**Every row here is a smoke row: no claim can be decided from this folder.**", ""]

    if claims is not None and n_smoke < len(df):
        md += ["## The papers' claims", "",
               "Reproduced: our ratio on this GPU is at least the paper's (V100) figure "
               "(at most, for `<=`) in every run that measured it, each ratio within one process "
               "(\"in k of n runs\" when only some do: ratios over eager move with the host's "
               "CPU); ours = the latest run. Not measured: the reason is given.", "",
               md_table(claim_verdicts(df, claims, load_rows(gpu_dir, every_run=True), headroom)), ""]

    figures: dict[str, Figure | None] = {}
    for exp, mode, batch in settings(df):
        if exp in ("tensile", "tensile_multi"):   # memory experiments: own sections below
            continue
        md += [f"## {exp} ({mode}), batch {batch}", "", "Median latency in ms (p10–p90):", "",
               md_table(latency_table(df, exp, mode, batch)), "", "Speedup over eager:", "",
               md_table(speedup_table(df, exp, mode, batch)), ""]
    if paper_inf is not None and len(df):
        md += ["## Paper (V100) beside ours: inference speedup over PyTorch", "",
               "`~` marks paper bars estimated from bar heights. Caffe2 no longer exists; ONNX Runtime "
               "stands in for it.", "", md_table(paper_comparison(df, paper_inf, "inference", "inference")), ""]
        figures["inference_speedup.png"] = plot_inference_speedup(df, paper_inf)
    if paper_train is not None and (df["experiment"] == "training").any():
        md += ["## Paper (V100) beside ours: training speedup over PyTorch", "",
               md_table(paper_comparison(df, paper_train, "training", "fwd-bwd")), ""]
        figures["training_speedup.png"] = plot_training_speedup(df)
    if len(df):
        figures["multistream_ablation.png"] = plot_multistream(df, headroom)

    memory = nimble_memory_table(load_rows(gpu_dir, allocator=None)) if len(df) else pd.DataFrame()
    if len(memory):
        md += ["## Nimble: graph memory beside eager's, and the distance to the limit", "",
               "MiB. graph total = weights + the graph's pool; eager peak = weights + the peak of "
               "the uncaptured run before the capture (whole-step: that run also creates the "
               "optimizer's state, which the pool does not hold). allocator = the process's CUDA "
               "allocator: `native` (the caching allocator: a multi-stream graph keeps one working "
               "set per stream) or `cudaMallocAsync` (`device.allocator=cudaMallocAsync`: graph "
               "memory nodes, reused across streams by the graph's order; eager and the graph's "
               "ratio are of that process). critical path = single-stream "
               "kernel time along the heaviest dependency path (inference: Nimble's task graph; "
               "training: the recorded step, `experiments/limit.py`); over_critical_path = median "
               "latency / critical path.", "", md_table(memory), ""]

    if (df["experiment"] == "tensile").any():
        metrics = tensile_metrics(df)
        md += ["## TENSILE: memory saving (MSR) and extra time (EOR) per method", "",
               "MSR = 1 − peak/peak_vanilla (allocated); EOR = time/time_vanilla − 1; vanilla measured "
               "in the same process; *_vs_graph: a captured TENSILE step against the captured "
               "vanilla step (`graph`).", "",
               md_table(metrics.drop(columns="date").dropna(axis=1, how="all").round(3)), ""]
        capped = tensile_capped_table(df)
        if len(capped):
            md += ["### Smaller GPUs emulated: which methods train the job", "",
                   "`experiment.memory_gb` caps the process's memory "
                   "(`torch.cuda.set_per_process_memory_fraction`); TENSILE plans to 90 % of the cap. "
                   "Each cell: median step and allocated peak, or out of memory. `uncapped-setup`: "
                   "TENSILE recorded its step before the cap was set (the recording runs one vanilla "
                   "step); `expandable`: the allocator ran with expandable segments.", "",
                   md_table(capped), ""]
        paper_tensile = _read_csv(paper_dir / "tensile_single_b16.csv")
        if paper_tensile is not None:
            md += ["### Against the TENSILE authors' single-job figures", "",
                   "Target: MSR at least the authors', EOR at most half of theirs, and at least 1.2x the "
                   "throughput of the fastest PyTorch built-in whose peak is no higher. Of TENSILE's "
                   "variants (`tensile`, `tensile(max_overhead=…)`, and the captured "
                   "`tensile_graph(…)` and `streamed_graph(…)`, the streamed optimizer without a "
                   "plan) the line shows the one that meets the target in the largest share of "
                   "its measured rows (\"in k of n runs\" when only some meet it), else the one "
                   "that saves the most memory. A captured variant's EOR is against the captured "
                   "vanilla step (`graph`, the host out of both), its MSR the lower of those against "
                   "the eager and the captured vanilla step. The last column turns it around: at "
                   "each built-in's own peak, the fastest TENSILE variant of the same kind "
                   "(captured or eager) with a peak no higher, over that built-in; per kind the "
                   "built-in TENSILE beats by the least.", "",
                   md_table(tensile_verdicts(metrics, paper_tensile, tensile_metrics(every_row))), ""]
            saving = tensile_authors_saving_table(every_row, paper_tensile)
            if len(saving):
                md += ["### TENSILE at the authors' memory saving", "",
                       "`+sweep=tensile_authors`: `tensile_graph` planned to the authors' MSR "
                       "(`experiment.match_msr=paper`) against the lower of the vanilla and captured "
                       "vanilla peaks, re-planned and captured until its peak fits; per variant "
                       "over its runs: MSR (the lower of those against the eager and the captured "
                       "vanilla step), EOR against the captured vanilla step beside the target's "
                       "limit (half the authors' EOR), the runs whose peak reached the saving "
                       "(`saved`) and the verdict (MSR and EOR both met).", "",
                       md_table(saving), ""]
            split = tensile_authors_split_table(every_row, paper_tensile)
            if len(split):
                md += ["Where each run's time over the captured vanilla step goes (runs that "
                       "recorded their plan's price and floor): `unplanned` is the step the "
                       "scheduler captured without a plan, its optimizer streamed where the "
                       "variant streams it, timed as the quietest of ten rounds (about 0.1-0.2 ms "
                       "under a mean), so `unplanned − graph` is the streaming's cost and "
                       "`TENSILE − unplanned` the plan's; allowed = half the authors' EOR of "
                       "`graph`'s step; priced = the planner's price of its plan; floor = the least "
                       "any plan of its moves is priced at (`tensile.bound`, as the row's commit "
                       "computed it); in reach = the "
                       "streaming plus the floor within the allowance, in the planner's cost "
                       "model, not a measurement.", "", md_table(split), ""]
        gap = tensile_price_gap_table(every_row)
        if len(gap):
            md += ["### Captured plans against their price, with and without swaps", "",
                   "Every `tensile_graph` run that recorded its plan's price and the step the "
                   "scheduler captured without a plan (`unplanned`): gap = TENSILE − unplanned − "
                   "priced (mean step, ms), per kind of plan; MiB each way = what the plan's swaps "
                   "copy out (and back in) a step. The planner prices swapped copies as hidden "
                   "behind compute (plus `swap_cost_ms` each, and `swap_copy_share` of their time "
                   "where set), so a gap that grows with the bytes copied is copy time the step "
                   "paid. `unplanned` is the quietest of ten rounds (about 0.1-0.2 ms under a "
                   "mean), so both kinds of plan read that much high. copy share = a swap plan's "
                   "gap over the median of the same model's rebuild-only plans, as a share of its "
                   "copies' own time (bytes over the planner's bandwidths, out and in): the median "
                   "of its runs, what `experiment.swap_copy_share` would price.",
                   "", md_table(gap), ""]
        census = tensile_census_table(every_row)
        if len(census):
            md += ["### Where a captured step's extra time goes", "",
                   "`experiment.census=true`: ten steps of each captured method under the "
                   "profiler, against the captured vanilla step (`graph`) of the same job. added = "
                   "step − graph's step (mean ms); kernels added = summed kernel time (copies not "
                   "counted) over graph's; idle added = (step − time a kernel runs) over graph's: "
                   "the compute units waiting on copies, events or the host; copies = the summed "
                   "time of the step's memory copies, which run beside the kernels.", "", md_table(census), ""]
        equal = tensile_equal_peak_table(every_row)
        if len(equal):
            md += ["### TENSILE at a built-in's memory, same job", "",
                   "`+sweep=tensile_equal_peak`: `tensile_graph` planned to the peak the built-in "
                   "measured earlier in the same process (`experiment.match_peak`; re-planned and "
                   "captured until its peak is no higher, `tries`). speedup = built-in ms / TENSILE "
                   f"ms (mean steps; target {EQUAL_PEAK_TARGET}x); ceiling = built-in ms / captured "
                   "vanilla (`graph`) ms, the most any plan can reach. Over the graph step: allowed "
                   f"= built-in ms / {EQUAL_PEAK_TARGET} − graph ms (what the target leaves); priced "
                   "= what the planner priced its plan at; bound = the least any plan of rebuilds "
                   "(and swaps, where allowed) could be priced at on the same op times "
                   "(`tensile.bound`).", "", md_table(equal), ""]
            figures["tensile_plan_memory.png"] = plot_plan_memory(equal_peak_snapshots(gpu_dir, every_row))
        bounds = _read_csv(results_dir / "analysis" / "tensile_bounds.csv")
        if bounds is not None and (bounds["status"] == "ok").any():
            cols = ["model", "batch_size", "builtin", "budget_mb", "allowed_ms", "measured_ms",
                    "op_times", "greedy_ms", "bound_ms", "bound_swaps_ms", "reachable", "job_commit",
                    "commit"]
            shown = bounds[bounds["status"] == "ok"]
            md += ["### The equal-peak jobs against the floor on any plan, worked out on the CPU", "",
                   "`python -m experiments.tensile_bounds`: each model's latest equal-peak job, on "
                   "the timeline its GPU planned with where the job saved its planning snapshot "
                   "(op_times gpu), else on its step recorded on the CPU and timed as "
                   "`experiments.tensile_plans` does (cpu: roofline shape scaled to the job's "
                   "captured vanilla step, batch norms at the job's measured rebuild share). ms over "
                   "the captured vanilla step: allowed (what 1.2x leaves), measured (the job's plan "
                   "on the GPU), greedy (the planner's estimate of its plan), bound (the least any "
                   "plan of rebuilds, or of rebuilds and swaps, adds there: `tensile.bound`). In the "
                   "planner's cost model, not measured: `reachable` says only whether the floor lies "
                   "within the allowance.", "",
                   md_table(shown[[c for c in cols if c in shown.columns]]), ""]
        plans = _read_csv(results_dir / "analysis" / "tensile_plans.csv")
        figures["tensile_tradeoff.png"] = plot_tensile_tradeoff(metrics, paper_tensile, plans)
        if plans is not None and (plans["status"] == "ok").any():
            md += ["### What the planner promises for a captured step, worked out on the CPU", "",
                   "`python -m experiments.tensile_plans`: a step recorded on the CPU, op times scaled "
                   "to the captured vanilla step measured here, copies at the bandwidths measured "
                   "here, planned without swaps across iterations (as a captured step needs). "
                   "Planned, not measured: the rows above say what plans keep on the GPU. "
                   "with_in_place = recomputes that rerun in-place updates too; rebuilt_first = "
                   "recomputes that rebuild a dropped input first.", "",
                   md_table(tensile_cpu_plans(plans, paper_tensile).round(3)), ""]
        check = tensile_plan_check(df)
        if len(check):
            md += ["### What the plans assumed against what the GPU did", "",
                   "plan_iteration_ms = the step the plan was made for (sum of its op times); "
                   "d2h/h2d_gbps = the bandwidths the planner was given, `_measured` = what the copies "
                   "of the timed steps moved (each timed on its stream), `_captured` = what the copies "
                   "inside a replay of a captured plan moved; stall = the compute stream's "
                   "wait for copy-ins per timed step. Copies the plan counted as hidden cost time when "
                   "the measured bandwidth is lower or the step is shorter than planned.", "",
                   md_table(check.dropna(axis=1, how="all").round(2)), ""]

    if (df["experiment"] == "tensile_multi").any():
        runs = tensile_multi_runs(every_row, _read_csv(paper_dir / "tensile_multi_b2.csv"), gpu_dir)
        table = tensile_multi_latest(runs)
        plots = [name for name in table.pop("plot") if name and (gpu_dir / name).exists()]
        md += ["## TENSILE: several jobs on one GPU", ""]
        targets = tensile_multi_targets(runs)
        if len(targets):
            md += ["### Against the TENSILE authors' multi-job figures (batch 2)", "",
                   "Every judged run of every setting of a model and copy count (MSR on NVML "
                   "memory, EOR as in the table below): how many met the authors' figures (MSR at "
                   "least theirs, EOR no worse) with a plan that moved something (a swap, a "
                   "recomputation or the streamed optimizer; runs whose plans moved nothing "
                   "and still met them, by the process trims alone, are counted apart), the met "
                   "run that saved most and its options; "
                   "where none met them, the nearest misses either way; and the run that saved "
                   "most at any extra time.", "", md_table(targets), "",
                   "### Every setting", ""]
        md += ["runs = how often the setting was measured (the latest is shown); "
               "MSR (NVML) = 1 − peak/peak_vanilla of the GPU's used memory above idle, job start-ups "
               "(and, in `captured` settings, the steps that captured a graph) left out and, for jobs "
               "that measure together, only from the last one's first measured step to the first "
               "exit (derived again from each run's stored timeline; empty when no such sample is "
               "left, as in a run whose jobs re-captured through all their measured steps); allocator share = the jobs' allocator peaks (reserved, vanilla) over that "
               "used memory: the part any plan can act on (the rest is each process's CUDA context, "
               "kernels and library handles), so MSR (NVML) ≤ allocator share; outside allocators = "
               "that rest in MB, vanilla → tensile (used above idle minus the jobs' reserved peaks): "
               "what a TENSILE process adds there offsets what its plan saves; EOR = sum of the jobs' mean step times, tensile / vanilla − 1; "
               "first capture s = how long a TENSILE job's first captured step took (it times and "
               "profiles the vanilla step and waits for the plan made for the graph; from the "
               "timeline, `captured` settings only); the (jobs) "
               "columns are means over the setting's jobs (allocator peaks over the measured steps; "
               "in `captured` settings without the steps that captured a graph, whose time is left "
               "out of EOR too, and with a replayed graph counted at its capture's allocated peak, "
               "as replays allocate nothing: rows from before 2026-11-30 11:40 counted the captures, "
               "so their MSR alloc is about 0); run = the setting's latest "
               "run (earlier ones stay in tensile_multi.csv); verdict = over every run of the "
               "setting (\"in k of n runs\" when only some meet the authors' figures). "
               "`trim_stack=tensile` settings: TENSILE's jobs gave back their CUDA context's thread-stack reservation after their "
               "first step (`tensile.trim_stack`, 264 MiB per process on an H200), the vanilla jobs "
               "did not, so part of their NVML MSR is that trim and not the plan; `trim_stack=all`: "
               "both phases' jobs trimmed, so the MSR is the plans' own. `compact=tensile` "
               "settings: TENSILE's jobs also allocated their long-lived tensors again side by "
               "side after that step (`tensile.compact`), giving back the holes in the allocator's "
               "segments that the first step and the streamed optimizer left; `compact=all`: "
               "the vanilla jobs too. `trim_blas=tensile` settings: TENSILE's jobs also gave back "
               "their cuBLAS workspaces after that step and used 1 MiB ones from then on "
               "(`tensile.trim_blas_workspace`, 130 MiB per job on an H200: 64 per stream it ran on); "
               "`trim_blas=all`: the vanilla jobs too. planned step / vanilla (jobs) = the step time each job's plan was "
               "made for over its vanilla step beside the same co-runners (far from 1: the plan "
               "priced its ops for a GPU busier or quieter than the one the jobs shared). "
               "`*` = smoke.", "",
               md_table(table), ""]
        md += [f"![{name}]({name})" for name in plots] + [""]
        figures["tensile_jobs_msr.png"] = plot_tensile_multi_msr(table)
        figures["tensile_jobs_tradeoff.png"] = plot_tensile_multi_tradeoff(runs)

    if headroom is not None:
        md += ["## Concurrency headroom: K model copies on one stream vs K streams", "",
               "One CUDA graph of K independent copies (`python -m experiments.headroom`); overlap = "
               "one-stream / K-stream time, K = perfect. A multi-stream schedule of one model, whose "
               "branches are fewer and unequal, gains less than this.", "", md_table(headroom), ""]

    chain, training = join_cost_tables(gpu_dir)
    if chain is not None or training is not None:
        md += ["## Waits in a captured graph (TENSILE's swaps)", "",
               "`python -m experiments.join_cost`: a captured chain of matrix products with copies "
               "out and back on side streams, each done long before the compute stream waits for "
               "it; per_wait_us = step time over the same chain's without waits, per wait "
               "(group: copies to one wait; timed: each copy between timing events; side: kernel "
               "= a side kernel instead of the copy, inline = the copies on the compute stream). "
               "With `--models`: one side operation and a wait for it in a captured training "
               "step (extra_ms over the step as captured).", ""]
        for table in (chain, training):
            if table is not None:
                md += [md_table(table), ""]

    stack = stack_trim_table(gpu_dir / "stack_trim.csv")
    if stack is not None:
        md += ["## Memory a training process holds beside its tensors: thread stacks "
               "(`tensile.trim_stack`) and cuBLAS workspaces (`tensile.trim_blas_workspace`)", "",
               "`python -m experiments.stack_trim`: a fresh process per row trains the TENSILE "
               "workload (Adam, captured step), then gives back its CUDA context's thread-stack "
               "reservation (stack bytes per thread x the threads the GPU holds), and captures "
               "the step again (a graph captured before a trim faults when replayed after it). "
               "After = after the replays timed after the trim, which grow the stack to what their "
               "kernels need; outside = the device's used memory (NVML) above the idle GPU's, "
               "minus the allocator's reservation (blank for 22a9be9's rows, which read 618 MiB "
               "low; saved_mb, a difference, stands); step_ratio = the captured step's median "
               "after over before, same process. Then the cuBLAS workspaces go "
               "(blas_released_mb; later ones are 1 MiB) and the step is captured a third "
               "time: step_ms_blas, blas_step_ratio = its median over after's (blank: rows from "
               "before the workspace trim).", "",
               md_table(stack), ""]

    if kernels is not None:
        md += ["## Kernel census: where a backend's time goes on the GPU", "",
               "`python -m experiments.kernels`: calls one at a time under the profiler. kernels = GPU "
               "tasks per call; kernel_ms = their summed time; busy_ms = time at least one runs; "
               "span_ms = first start to last end under the profiler (which slows launches); "
               "busy_share = busy_ms / median_ms, the call's latency by the timing protocol in the "
               "same process (near 1: the kernels themselves bound the call, not the host or the "
               "schedule).", "",
               md_table(kernels), "", "![kernel_census.png](kernel_census.png)", ""]
        figures["kernel_census.png"] = plot_kernel_census(kernels)

    if conv_ws is not None:
        md += ["## A convolution's backward under a cuDNN workspace cap", "",
               "`python -m experiments.conv_workspace`: the layer's first backward may reserve "
               "only its operands, its gradients and the cap (MiB; none: no cap), so PyTorch "
               "keeps the first of cuDNN's plans, fastest first, whose workspace it could "
               "allocate; then it is timed without the limit. The cap bounds new reservations: "
               "room free in segments already reserved comes on top. workspace_mb = that "
               "backward's peak above its operands and gradients.", "",
               md_table(conv_ws), ""]

    if slice_cost is not None:
        md += ["## A large weight's update in row slices, piece by piece", "",
               "`python -m experiments.slice_cost`: the model's largest linear weight, its "
               "deferred gradient's row products and Adam's update (foreach / fused, "
               "capturable), whole and in the streamed optimizer's row slices, each case one "
               "captured CUDA graph. over_whole_ms = the case's time over the same case whole; "
               "per_extra_slice_us = that over each slice past the first; rows_equal = the "
               "slices' rows equal the whole product's bit for bit.", "",
               md_table(slice_cost), ""]

    if streams is not None:
        cols = [c for c in ["model", "ops", "edges", "streams", "syncs", "width",
                            "critical_path_flop_share", "live_peak_mb", "arena_one_stream_mb",
                            "arena_plan_mb", "plan_lower_bound_mb", "status"] if c in streams.columns]
        md += ["## Stream analysis (CPU trace, `results/analysis/streams.csv`)", "",
               md_table(streams[cols].round(3)), ""]
    for trace in sorted(gpu_dir.glob("trace_*.json")):
        name = f"timeline_{trace.stem.removeprefix('trace_')}.png"
        try:
            figures[name] = plot_stream_timeline(trace)
        except (ValueError, KeyError, json.JSONDecodeError) as exc:
            md += [f"- timeline of `{trace.name}` not drawn: {exc}"]

    drawn = {k: v for k, v in figures.items() if v is not None}
    if drawn:
        md += ["## Plots", ""]
        for name, fig in drawn.items():
            fig.savefig(gpu_dir / name, dpi=120)
            plt.close(fig)
            md += [f"![{name}]({name})", ""]
    missing = _not_measured(df)
    if len(missing):
        md += ["## Not measured", "", "Rows with status unavailable or error, and why:", "",
               md_table(missing), ""]
    out = gpu_dir / "report.md"
    out.write_text("\n".join(md))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="results folder")
    parser.add_argument("--gpu", help="only this GPU folder, e.g. h200 (default: every one found)")
    args = parser.parse_args(argv)
    plt.switch_backend("Agg")  # files only, no window (a notebook keeps its inline backend)
    found = gpu_dirs(args.results)
    if args.gpu:
        found = [d for d in found if d.name == args.gpu]
        if not found:
            parser.error(f"no results for --gpu {args.gpu}; found: "
                         f"{', '.join(d.name for d in gpu_dirs(args.results)) or 'none'}")
    if not found:
        print(f"no result CSVs under {args.results}/<gpu>/; run a sweep first")
        return 1
    for d in found:
        print(f"wrote {write_report(d, args.results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
