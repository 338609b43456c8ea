"""The optimizer-phase floor of TENSILE's plans at small batches, in the planner's simulation.

    python -m experiments.optimizer_floor [--models resnet50] [--batch-size 2] [--groups 1,4,16]

By default a plan brings all optimizer state it keeps on the host back before
``optimizer.step()``, so the optimizer's peak holds weights, gradients and all the state.
With ``optimizer_state_at_first_use`` each piece comes back just before its own first op;
that pays when the optimizer's ops touch part of the state at a time (Adam in several
parameter groups, or ``foreach=False``). For each model and optimizer layout this records
one training step on the CPU (:func:`tensile.record.record_step`), gives every op its
roofline time against H200-like rates (``--flops``, ``--mem-bw``, stretched by
``--slowdown`` for a step slower than the roofline) and plans without a budget at
``--copy-gbps`` per direction, both ways. Rows: ``<out>/optimizer_floor.csv`` with the
planned peak before/after and the planner's MSR. These are the planner's figures on a
simulated timeline, not measurements.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch
from torch import nn

from experiments.analysis import REPO_ROOT, environment
from experiments.models import MODELS, build_model, example_input
from experiments.tensile_run import _drop_aux_head, classification_loss
from tensile.estimate import estimate_op_times
from tensile.planner import plan as make_plan
from tensile.record import record_step
from tensile.step import training_step

__all__ = ["floor_rows", "main"]


def _adam(model: nn.Module, groups: int) -> torch.optim.Optimizer:
    """Adam over ``model``'s parameters: ``groups`` >= 1 parameter groups (foreach kernels
    per group), or a loop over the parameters when ``groups`` is 0."""
    params = list(model.parameters())
    if groups == 0:
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    n = min(groups, len(params))
    return torch.optim.Adam([{"params": params[i::n]} for i in range(n)], lr=1e-3, foreach=True)


def floor_rows(model_name: str, batch_size: int, groups: Sequence[int], *, flops: float,
               mem_bw: float, slowdown: float, copy_bps: float,
               image_size: int | None = None) -> list[dict]:
    """One row per optimizer layout and per state-return rule (see the module notes)."""
    rows = []
    for g in groups:
        model = _drop_aux_head(build_model(model_name)).train()   # as the TENSILE experiments
        opt = _adam(model, g)
        batch = (example_input(model_name, batch_size, image_size=image_size),
                 torch.randint(0, 10, (batch_size,)))
        training_step(model, opt, batch, classification_loss)   # the optimizer state exists
        for at_first_use in (False, True):
            rec = record_step(model, opt, batch, classification_loss,
                              state_at_first_use=at_first_use)
            op_ms = [t * slowdown for t in estimate_op_times(rec.graph, flops, mem_bw)]
            p = make_plan(rec.timeline(op_ms), budget_bytes=None, d2h_bw=copy_bps, h2d_bw=copy_bps)
            rows.append({"model": model_name, "batch_size": batch_size,
                         "optimizer": "adam, foreach=False" if g == 0 else f"adam, {g} group(s)",
                         "state_back": "at first use" if at_first_use else "before step()",
                         "peak_before_mb": round(p.peak_before / 2**20, 1),
                         "peak_after_mb": round(p.peak_after / 2**20, 1),
                         "planned_msr": round(1 - p.peak_after / p.peak_before, 3)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50", help="comma-separated (default resnet50)")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--groups", default="1,4,16,0",
                    help="Adam parameter groups to try; 0 = foreach=False (default 1,4,16,0)")
    ap.add_argument("--flops", type=float, default=50e12, help="peak FLOP/s (default 50e12)")
    ap.add_argument("--mem-bw", type=float, default=4.0e12, help="memory bytes/s (default 4e12)")
    ap.add_argument("--slowdown", type=float, default=4.0,
                    help="op times over the roofline's (default 4)")
    ap.add_argument("--copy-gbps", type=float, default=53.0,
                    help="host<->device copy GB/s per direction (default 53, the H200's measured)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "analysis")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; valid: {', '.join(MODELS)}")
    try:
        groups = [int(g) for g in args.groups.split(",")]
    except ValueError:
        ap.error(f"--groups: expected comma-separated integers >= 0, got {args.groups!r}")
    if any(g < 0 for g in groups) or args.batch_size < 1:
        ap.error(f"--groups must be >= 0 and --batch-size >= 1; got {groups}, {args.batch_size}")
    rows = [r for m in models for r in floor_rows(
        m, args.batch_size, groups, flops=args.flops, mem_bw=args.mem_bw,
        slowdown=args.slowdown, copy_bps=args.copy_gbps * 1e9)]
    env = environment()
    df = pd.DataFrame([{**r, "commit": env["commit"], "torch": env["torch"], "date": env["date"]}
                       for r in rows])
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "optimizer_floor.csv", index=False)
    print(df.drop(columns=["commit", "torch", "date"]).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
