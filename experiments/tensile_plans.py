"""What TENSILE's planner promises for a captured training step, worked out on the CPU.

    python -m experiments.tensile_plans [--models vgg16,inception_v3,inception_v4,resnet50,densenet121]
        [--batch-size 16] [--max-overhead 0,0.05,0.1,0.3] [--gpu h200] [--out results/analysis]
        [--stream-optimizer 16]

Per model: one training step (Adam; inputs and classes of ``conf/experiment/tensile.yaml``;
random weights and batch) is recorded on the CPU (:func:`tensile.record_step`); every op
gets its roofline time, scaled so that the step lasts as long as the captured vanilla step
measured on ``--gpu`` (its ``tensile_graph`` rows in ``results/<gpu>/tensile.csv``:
``mean_ms / (1 + eor_vs_graph)``; without one, the eager vanilla step), and the copies run
at the bandwidths those rows measured. Then TENSILE plans it for each
``max_overhead`` as a captured step needs it (no swaps across iterations) and the planned
peak, planned MSR and estimated extra time are written to ``tensile_plans.csv`` (one row
per model × max_overhead, with the environment) and ``tensile_plans.md``. With
``--stream-optimizer N`` the step is recorded with :func:`tensile.stream_optimizer` (Adam's
update in backward in N groups, its moments in host memory), into
``tensile_plans_streamed.csv``/``.md``; the step time is then still the plain captured step's.

These are promises, not measurements: the GPU rows say what a plan keeps (the report's
"What the plans assumed against what the GPU did"). They show where the planner stands
without a GPU, and what a change to it is worth before a GPU runs it.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import OmegaConf

from experiments.analysis import environment, model_names, per_model, say_written
from experiments.models import build_model, example_input
from experiments.report import load_rows
from experiments.tensile_run import _drop_aux_head
from tensile.estimate import estimate_op_times, scaled_op_times
from tensile.optimes import batch_norm_rerun_shares
from tensile.planner import plan
from tensile.record import record_step
from tensile.step import training_step
from tensile.streamed import DEFAULT_PREFETCH, stream_optimizer
from tensile.timeline import AccessTimeline

__all__ = ["COLUMNS", "captured_step", "recorded_timeline", "plan_model", "run_plans"]

MB = 2 ** 20
TENSILE_CONF = Path(__file__).resolve().parents[1] / "conf" / "experiment" / "tensile.yaml"
DEFAULT_MODELS = ("vgg16", "inception_v3", "inception_v4", "resnet50", "densenet121")  # the paper's
DEFAULT_OVERHEADS = (0.0, 0.05, 0.1, 0.3)
# Roofline rates that shape the op times when no GPU row gives them (H200 nominal: fp32
# ~60 TFLOP/s, HBM3e 4.8 TB/s); only the shape matters once the step is scaled.
DEFAULT_TFLOPS, DEFAULT_TBPS, DEFAULT_GBPS = 60.0, 4.8, 50.0

COLUMNS = [
    "model", "batch_size", "stream_optimizer", "max_overhead", "step_ms", "step_source", "d2h_gbps", "h2d_gbps",
    "ops", "vanilla_peak_mb", "planned_peak_mb", "planned_msr", "est_eor", "swaps", "recomputes",
    "with_in_place", "rebuilt_first", "on_scratch", "planner_ms", "record_s", "status", "error",
    "torch", "torchvision", "timm", "commit", "date",
]


def captured_step(gpu_dir: Path, model: str, batch_size: int) -> dict | None:
    """The step to plan for, from the latest full-protocol rows of ``model`` at ``batch_size``
    in ``gpu_dir`` (as the report reads them: smoke rows never): the captured vanilla step of a
    ``tensile_graph`` row (its time, the copy bandwidths measured, the peak rate), else the
    eager ``vanilla`` step (its time includes the host's gaps between kernels); ``source``
    says which. None when there is neither."""
    df = load_rows(gpu_dir)
    df = df[(df["experiment"] == "tensile") & (df["model"] == model)
            & (df["batch_size"] == batch_size) & (df["status"] == "ok") & ~df["smoke"]]
    df = df.sort_values("date", ascending=False, kind="stable")
    for _, r in df[df["backend"].astype(str).str.match(r"tensile_graph($|\()")].iterrows():
        extra = json.loads(r["extra"]) if r["extra"] else {}
        if extra.get("eor_vs_graph") is None:
            continue
        return {"step_ms": float(r["mean_ms"]) / (1 + float(extra["eor_vs_graph"])),
                "d2h_gbps": extra.get("d2h_gbps_measured") or extra.get("d2h_gbps"),
                "h2d_gbps": extra.get("h2d_gbps_measured") or extra.get("h2d_gbps"),
                "tflops": extra.get("peak_tflops"),
                "source": f"captured vanilla step, tensile_graph row of {r['date'][:10]}"}
    for _, r in df[df["backend"] == "vanilla"].iterrows():
        return {"step_ms": float(r["mean_ms"]), "d2h_gbps": None, "h2d_gbps": None, "tflops": None,
                "source": f"eager vanilla step, row of {r['date'][:10]} (no tensile_graph row)"}
    return None


def recorded_timeline(name: str, batch_size: int, measured: dict | None, stream_groups: int = 0,
                      bn_share: float | None = None) -> tuple[AccessTimeline, float, float, float]:
    """One training step of ``name`` recorded on the CPU and timed for planning: (timeline,
    step ms, d2h GB/s, h2d GB/s). Op times have their roofline shape, scaled to the step of
    ``measured`` (:func:`captured_step`; None: the roofline sum), copies its bandwidths.
    ``stream_groups``: the optimizer streamed (:func:`tensile.stream_optimizer`);
    ``bn_share``: batch norms rebuilt from their statistics at that share of their time
    (``Scheduler(..., batch_norm_from_stats=True)``, a share the GPU measured)."""
    torch.manual_seed(0)
    exp = OmegaConf.load(TENSILE_CONF)   # the TENSILE experiment's inputs and classes
    model = _drop_aux_head(build_model(name, num_classes=exp.num_classes)).train()
    opt = torch.optim.Adam(model.parameters(), lr=exp.lr)
    if stream_groups:
        stream_optimizer(opt, groups=stream_groups)
    batch = (example_input(name, batch_size, "cpu", image_size=exp.image_size),
             torch.randint(0, exp.num_classes, (batch_size,)))
    training_step(model, opt, batch, torch.nn.functional.cross_entropy)  # Adam's state exists
    rec = record_step(model, opt, batch, torch.nn.functional.cross_entropy)
    tflops = (measured or {}).get("tflops") or DEFAULT_TFLOPS
    shape = estimate_op_times(rec.graph, tflops * 1e12, DEFAULT_TBPS * 1e12)
    step_ms = measured["step_ms"] if measured else sum(shape)
    shares = None if bn_share is None else batch_norm_rerun_shares(rec.graph, "cpu", share=bn_share)
    tl = rec.timeline(scaled_op_times(shape, step_ms), shares)
    d2h = float((measured or {}).get("d2h_gbps") or DEFAULT_GBPS)
    h2d = float((measured or {}).get("h2d_gbps") or DEFAULT_GBPS)
    return tl, step_ms, d2h, h2d


def plan_model(name: str, batch_size: int, overheads: list[float], gpu_dir: Path | None,
               stream_groups: int = 0) -> list[dict]:
    """Record ``name`` on the CPU and plan it for every ``max_overhead``: one row each
    (``stream_groups``: the optimizer streamed, :func:`tensile.stream_optimizer`)."""
    base = {"model": name, "batch_size": batch_size, "stream_optimizer": stream_groups}
    try:
        measured = captured_step(gpu_dir, name, batch_size) if gpu_dir is not None else None
        t0 = time.perf_counter()
        tl, step_ms, d2h, h2d = recorded_timeline(name, batch_size, measured, stream_groups)
        record_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a model that fails is a row, never a crash
        return [{**base, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}]
    source = measured["source"] if measured else "roofline (no GPU row)"
    rows = []
    for mo in overheads:
        p = plan(tl, d2h_bw=d2h * 1e9, h2d_bw=h2d * 1e9, max_overhead=mo,
                 allow_cross_iteration=False, min_bytes=1 << 16)
        chains = p.chained_recomputes
        rows.append({
            **base, "max_overhead": mo, "step_ms": round(step_ms, 3), "step_source": source,
            "d2h_gbps": round(d2h, 2), "h2d_gbps": round(h2d, 2), "ops": tl.num_ops,
            "vanilla_peak_mb": round(p.peak_before / MB, 1),
            "planned_peak_mb": round(p.peak_after / MB, 1),
            "planned_msr": round(1 - p.peak_after / p.peak_before, 4),
            "est_eor": round(p.est_overhead_ms / tl.iteration_ms, 4),
            "swaps": len(p.swaps), "recomputes": len(p.recomputes),
            "with_in_place": chains["in_place"], "rebuilt_first": chains["rebuild_first"],
            "on_scratch": chains["scratch"],
            "planner_ms": round(p.planner_ms, 1), "record_s": round(record_s, 1),
            "status": "ok", "error": ""})
    return rows


def output_stem(stream_groups: int) -> str:
    """The name (no suffix) of the files :func:`run_plans` writes."""
    return "tensile_plans_streamed" if stream_groups else "tensile_plans"


def run_plans(names: list[str], out_dir: str | Path, batch_size: int = 16,
              overheads: list[float] = list(DEFAULT_OVERHEADS), gpu_dir: str | Path | None = None,
              stream_groups: int = 0) -> pd.DataFrame:
    """Plan ``names`` in order; write ``tensile_plans.csv`` and ``.md`` into ``out_dir``
    (``tensile_plans_streamed.*`` with ``stream_groups``)."""
    if stream_groups < 0:
        raise ValueError(f"stream_groups must be >= 0 (0: not streamed), got {stream_groups}")
    if not overheads or any(not 0 <= mo for mo in overheads):
        raise ValueError(f"max_overhead values must be fractions >= 0, got {overheads}")
    gpu = Path(gpu_dir) if gpu_dir is not None else None
    env = environment()
    rows = [row for model_rows in per_model(
        names, batch_size, "TENSILE plans",
        lambda name: plan_model(name, batch_size, overheads, gpu, stream_groups)) for row in model_rows]
    df = pd.DataFrame([{**r, **env} for r in rows], columns=COLUMNS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = output_stem(stream_groups)
    df.to_csv(out / f"{stem}.csv", index=False)
    shown = df[["model", "batch_size", "stream_optimizer", "max_overhead", "step_ms", "vanilla_peak_mb", "planned_peak_mb",
                "planned_msr", "est_eor", "swaps", "recomputes", "with_in_place", "rebuilt_first",
                "on_scratch", "status"]]
    streamed = (f" with the optimizer streamed ({stream_groups} groups, {DEFAULT_PREFETCH} copied in "
                f"ahead, none resident)" if stream_groups else "")
    (out / f"{stem}.md").write_text(
        f"# TENSILE plans of captured steps{streamed}, worked out on the CPU\n\n"
        f"Written by `python -m experiments.tensile_plans` (commit {env['commit']}, {env['date']}, "
        f"torch {env['torch']}). Promises of the planner, not measurements: see the module "
        "docstring.\n\n" + shown.to_markdown(index=False) + "\n")
    return df


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated names")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-overhead", default=",".join(map(str, DEFAULT_OVERHEADS)),
                        help="comma-separated fractions of the step time (default %(default)s)")
    parser.add_argument("--gpu", default="h200",
                        help="results/<gpu>/ whose tensile_graph rows give step time and bandwidths")
    parser.add_argument("--results", default="results", help="the results folder")
    parser.add_argument("--out", default="results/analysis", help="output folder")
    parser.add_argument("--stream-optimizer", type=int, default=0, metavar="GROUPS",
                        help="record the step with tensile.stream_optimizer in GROUPS groups "
                             "(default 0: not)")
    args = parser.parse_args(argv)
    names = model_names(parser, args.models)
    try:
        overheads = [float(x) for x in args.max_overhead.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--max-overhead takes comma-separated numbers, got {args.max_overhead!r}")
    if args.batch_size < 1 or not overheads or min(overheads) < 0 or args.stream_optimizer < 0:
        parser.error(f"--batch-size must be >= 1, --max-overhead values and --stream-optimizer "
                     f">= 0, got {args.batch_size}, {args.max_overhead!r} and {args.stream_optimizer}")
    df = run_plans(names, args.out, args.batch_size, overheads, Path(args.results) / args.gpu,
                   args.stream_optimizer)
    say_written(df, Path(args.out) / f"{output_stem(args.stream_optimizer)}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
