"""Could any plan reach 1.2x over a built-in at its peak? A bound, worked out on the CPU.

    python -m experiments.tensile_bounds [--models inception_v4,resnet50,densenet121] [--gpu h200]
        [--results results] [--out results/analysis]

Per model, the latest equal-peak job measured on ``--gpu`` that saved its planning snapshot,
else the latest one (``+sweep=tensile_equal_peak``,
``tensile_graph(match_peak=checkpoint_graph,…,bn_from_stats)`` rows of
``results/<gpu>/tensile.csv``): the budget its plan fitted, the captured vanilla step
(``graph``) and the built-in (``checkpoint_graph``) of the same job, and the batch-norm
rebuild share the GPU measured (median). Where the job saved its planning snapshot
(``experiment.snapshot=true``, :class:`tensile.PlanningSnapshot`, beside the rows), its
timeline is the one the GPU planned with: op times measured there (``op_times`` = "gpu").
Otherwise the step is recorded on the CPU and timed as
:func:`experiments.tensile_plans.recorded_timeline` does (roofline shape scaled to that
captured step, the job's copy bandwidths, every batch norm at that share; "cpu"). At the
budget:

* ``allowed_ms``: what 1.2x over the built-in leaves over the captured vanilla step;
* ``measured_ms``: what the job's plan added over it on the GPU;
* ``greedy_ms``: what TENSILE's planner estimates its plan adds (within the iteration, as
  a captured step needs; with swaps as the job allowed them): with a snapshot, the plan the
  GPU ran, as it priced it;
* ``bound_ms`` / ``bound_swaps_ms``: the least any plan of rebuilds (and swaps at the
  measured bandwidths, each copy and swap priced as the job's plan priced them) can add
  (:func:`tensile.bound.extra_time_bound`).

``reachable``: whether the bound with swaps is within the allowance. Where it is not, no
plan of TENSILE's moves reaches 1.2x at that peak in the planner's own cost model; where
the greedy plan lies far above the bound, a better planner could still win. Writes
``tensile_bounds.csv`` and ``.md`` (with the environment).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from experiments.analysis import environment, model_names, per_model, say_written
from experiments.report import (EQUAL_PEAK_TARGET, earlier_in_job, equal_peak_allowance, load_rows,
                                ok_tensile_rows, row_method, snapshot_file)
from experiments.tensile_plans import recorded_timeline
from tensile.bound import extra_time_bound
from tensile.planner import COPY_LATENCY_MS, plan
from tensile.snapshot import PlanningSnapshot

__all__ = ["COLUMNS", "equal_peak_job", "bound_model", "run_bounds"]

MB = 2 ** 20
DEFAULT_MODELS = ("inception_v4", "resnet50", "densenet121")   # the equal-peak sweep's
COLUMNS = [
    "model", "batch_size", "tensile", "builtin", "budget_mb", "step_ms", "builtin_ms",
    "allowed_ms", "measured_ms", "bn_share", "d2h_gbps", "h2d_gbps", "op_times", "snapshot", "greedy_ms",
    "greedy_feasible", "bound_ms", "bound_swaps_ms", "reachable", "job_commit", "job_date",
    "status", "error", "torch", "torchvision", "timm", "commit", "date",
]


def equal_peak_job(gpu_dir: Path, model: str, batch_size: int) -> dict | None:
    """The latest full-protocol equal-peak job of ``model`` at ``batch_size`` in
    ``gpu_dir`` whose ``tensile_graph`` rebuilt batch norms from their statistics and saved
    its planning snapshot there, else the latest such job without one, with its job's
    captured vanilla step and built-in; None when there is none."""
    fallback = None
    ok = ok_tensile_rows(load_rows(gpu_dir, every_row=True))
    ok = ok[(ok["model"] == model) & (ok["batch_size"] == batch_size)]
    ours = ok[ok["backend"].astype(str).str.startswith("tensile_graph(match_peak=")
              & ok["backend"].astype(str).str.contains("bn_from_stats", regex=False)]
    for idx in reversed(ours.index):
        r = ok.loc[idx]
        extra = json.loads(r["extra"]) if r["extra"] else {}
        job = earlier_in_job(ok, r)
        builtin = extra.get("match_peak")
        graph, ck = job[job["backend"] == "graph"], job[job["backend"] == builtin]
        if not len(graph) or not len(ck) or not extra.get("match_met") \
                or extra.get("bn_rerun_share_median") is None:
            continue
        found = {"tensile": row_method(r), "builtin": builtin, "budget": int(extra["budget"]),
                "step_ms": float(graph.iloc[-1]["mean_ms"]), "builtin_ms": float(ck.iloc[-1]["mean_ms"]),
                "tensile_ms": float(r["mean_ms"]), "bn_share": float(extra["bn_rerun_share_median"]),
                "d2h_gbps": extra.get("d2h_gbps_measured") or extra.get("d2h_gbps"),
                "h2d_gbps": extra.get("h2d_gbps_measured") or extra.get("h2d_gbps"),
                "allow_swaps": "allow_swaps=false" not in r["backend"],
                "snapshot": snapshot_file(extra),   # beside the rows, or None
                "commit": str(r["commit"])[:7], "date": str(r["date"])}
        if found["snapshot"] and (gpu_dir / found["snapshot"]).exists():
            return found
        fallback = fallback or found
    return fallback


def bound_model(name: str, batch_size: int, gpu_dir: Path) -> dict:
    """One row: the equal-peak job of ``name`` and, at its budget, the greedy plan's and
    the bound's extra time on its GPU snapshot's timeline, or else on the CPU-recorded step
    (module notes)."""
    base = {"model": name, "batch_size": batch_size}
    job = equal_peak_job(gpu_dir, name, batch_size)
    if job is None:
        return {**base, "status": "skipped",
                "error": f"no equal-peak job with bn_from_stats in {gpu_dir} (+sweep=tensile_equal_peak)"}
    allowed = equal_peak_allowance(job["builtin_ms"], job["step_ms"])
    row = {**base, "tensile": job["tensile"], "builtin": job["builtin"],
           "budget_mb": round(job["budget"] / MB, 1), "step_ms": round(job["step_ms"], 3),
           "builtin_ms": round(job["builtin_ms"], 3), "allowed_ms": round(allowed, 3),
           "measured_ms": round(job["tensile_ms"] - job["step_ms"], 3),
           "bn_share": round(job["bn_share"], 3), "job_commit": job["commit"], "job_date": job["date"]}
    snapshot = gpu_dir / job["snapshot"] if job["snapshot"] else None
    try:
        if snapshot is not None and snapshot.exists():   # the GPU's own timeline and plan
            snap = PlanningSnapshot.load(snapshot)
            tl, d2h, h2d, min_bytes, greedy = (snap.timeline, snap.d2h_bw / 1e9, snap.h2d_bw / 1e9,
                                               snap.min_bytes, snap.plan)
            latency = snap.copy_latency_ms
            swap_price = {k: (snap.options or {}).get(k, 0.0) for k in ("swap_cost_ms", "swap_copy_share")}
            row.update(op_times="gpu", snapshot=snapshot.name)
        else:
            measured = {"step_ms": job["step_ms"], "d2h_gbps": job["d2h_gbps"], "h2d_gbps": job["h2d_gbps"]}
            tl, _, d2h, h2d = recorded_timeline(name, batch_size, measured, bn_share=job["bn_share"])
            min_bytes, latency, swap_price = 1 << 16, COPY_LATENCY_MS, {}
            greedy = plan(tl, budget_bytes=job["budget"], d2h_bw=d2h * 1e9, h2d_bw=h2d * 1e9,
                          allow_cross_iteration=False, allow_swaps=job["allow_swaps"], min_bytes=min_bytes,
                          copy_latency_ms=latency)
            row.update(op_times="cpu", snapshot="")
        alone = extra_time_bound(tl, job["budget"], min_bytes=min_bytes)
        swapped = extra_time_bound(tl, job["budget"], d2h_bw=d2h * 1e9, h2d_bw=h2d * 1e9,
                                   min_bytes=min_bytes, copy_latency_ms=latency, **swap_price)
    except Exception as exc:  # noqa: BLE001 - a model that fails is a row, never a crash
        return {**row, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}

    def ms(b):
        return None if b.extra_ms is None else round(b.extra_ms, 3)
    return {**row, "d2h_gbps": round(d2h, 2), "h2d_gbps": round(h2d, 2),
            "greedy_ms": round(greedy.est_overhead_ms, 3), "greedy_feasible": greedy.feasible,
            "bound_ms": ms(alone), "bound_swaps_ms": ms(swapped),
            "reachable": swapped.extra_ms is not None and swapped.extra_ms <= allowed,
            "status": "ok", "error": ""}


def run_bounds(names: list[str], gpu_dir: str | Path, out_dir: str | Path,
               batch_size: int = 16) -> pd.DataFrame:
    """Bound ``names`` in order; write ``tensile_bounds.csv`` and ``.md`` into ``out_dir``."""
    rows = per_model(names, batch_size, "TENSILE bounds",
                     lambda name: bound_model(name, batch_size, Path(gpu_dir)))
    env = environment()
    df = pd.DataFrame([{**r, **env} for r in rows], columns=COLUMNS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "tensile_bounds.csv", index=False)
    shown = df[["model", "batch_size", "builtin", "budget_mb", "step_ms", "builtin_ms", "allowed_ms",
                "measured_ms", "op_times", "greedy_ms", "bound_ms", "bound_swaps_ms", "reachable",
                "job_commit", "status"]]
    (out / "tensile_bounds.md").write_text(
        f"# At a built-in's peak: TENSILE's plan against the best any plan could do\n\n"
        f"Written by `python -m experiments.tensile_bounds` (commit {env['commit']}, {env['date']}, "
        f"torch {env['torch']}) from the equal-peak jobs in `{gpu_dir}`. ms added over the "
        f"captured vanilla step: allowed = built-in / {EQUAL_PEAK_TARGET} − step; measured = the job's "
        "plan on the GPU; op_times = whose op times price the plan and the bound: gpu = the job's "
        "planning snapshot (what the GPU measured and planned with), cpu = the step recorded "
        "here, roofline-shaped; greedy = the planner's estimate of its plan; bound = the least "
        "any plan of rebuilds (and swaps) can add there (`tensile.bound`). A bound in the "
        "planner's cost model, not a measurement: see the module docstring.\n\n"
        + shown.to_markdown(index=False) + "\n")
    return df


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated names")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--gpu", default="h200", help="results/<gpu>/ whose equal-peak jobs to bound")
    parser.add_argument("--results", default="results", help="the results folder")
    parser.add_argument("--out", default="results/analysis", help="output folder")
    args = parser.parse_args(argv)
    names = model_names(parser, args.models)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    gpu_dir = Path(args.results) / args.gpu
    if not (gpu_dir / "tensile.csv").exists():
        parser.error(f"no {gpu_dir / 'tensile.csv'}: run +sweep=tensile_equal_peak on that GPU first")
    df = run_bounds(names, gpu_dir, args.out, args.batch_size)
    say_written(df, Path(args.out) / "tensile_bounds.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
