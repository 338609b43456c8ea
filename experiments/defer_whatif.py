"""What deferring a layer's weight gradient would do to a recorded step, worked out offline.

    python -m experiments.defer_whatif results/h200/snapshot_tensile_vgg16_b16_…json.gz --ops 95-113

A planning snapshot (:class:`tensile.PlanningSnapshot`) holds the step TENSILE planned from.
``--ops A-B`` names the ops that make a layer's weight gradient and update it (in VGG-16's
H200 snapshot at batch 16: 95-113, fc6's product, bias sum and streamed Adam update); this
moves them to the end of the step, where :func:`tensile.defer_weight_grads` puts them, and
plans both timelines to the snapshot's budget with its options (and ``--search``: the swap
search of ``swap_search: always``). It prints each one's unplanned peak and the plan's, what
is held at each, the plan's price, and the least any plan could be priced at
(``tensile.bound``): the planner's cost model, not a measurement. The step measured on the GPU with
``experiment.defer_wgrad_mb`` is the test of it.

A snapshot whose timeline records no op workspaces (``scratch``: recorded before they were
counted, or with ``count_workspaces=false``) understates every peak by them, and they can
decide it: VGG-16's first conv backward takes 394 MiB of cuDNN workspace at batch 16 on an
H100. The command says so before its figures; on VGG-16's H200 snapshot of 2026-12-04 it
found a plan that fits, which the GPU then could not (66th session, results/h100-80gb-hbm3).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from tensile.bound import extra_time_bound
from tensile.simulate import held_at, simulate
from tensile.snapshot import PlanningSnapshot
from tensile.timeline import AccessTimeline

MIB = 2**20
NO_WORKSPACES = ("note: this snapshot records no op workspaces (made before they were counted, or "
                 "with count_workspaces=false): every peak below leaves them out, and a plan "
                 "that fits here may not fit on the GPU")


def move_to_end(tl: AccessTimeline, ops: list[int]) -> AccessTimeline:
    """``tl`` with ``ops`` (in their order) after every other op: each tensor's accesses,
    writes and op marks follow their ops, op times and per-op facts too."""
    if not ops or len(set(ops)) != len(ops) or not all(0 <= k < tl.num_ops for k in ops):
        raise ValueError(f"ops: expected distinct op indices in [0, {tl.num_ops}), got {ops!r}")
    moved = set(ops)
    order = [k for k in range(tl.num_ops) if k not in moved] + list(ops)
    new = {old: i for i, old in enumerate(order)}

    def at(k):
        return None if k is None else new[k]
    tensors = {sid: replace(t, accesses=sorted(new[k] for k in t.accesses),
                            writes=sorted(new[k] for k in t.writes), needed_by=at(t.needed_by),
                            held_to=at(t.held_to), forward_hold=at(t.forward_hold))
               for sid, t in tl.tensors.items()}
    return AccessTimeline(
        names=[tl.names[k] for k in order], phases=[tl.phases[k] for k in order],
        op_ms=tl.op_ms[order], random=[tl.random[k] for k in order],
        reads=[tl.reads[k] for k in order], writes=[tl.writes[k] for k in order],
        tensors=tensors, transfers=tuple((new[k], d, b) for k, d, b in tl.transfers),
        rerun_share={new[k]: v for k, v in tl.rerun_share.items()},
        scratch={new[k]: v for k, v in tl.scratch.items()})


def parse_ops(spec: str) -> list[int]:
    """``"95-113,73-91"`` -> those ops, in that order."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"--ops: expected ranges like 95-113 or 95-113,73-91, got {spec!r}") from None
        out += range(a, b + 1)
    return out


def _held_mib(tl: AccessTimeline, plan, op: int) -> dict[str, int]:
    """What ``tl`` holds during ``op`` under ``plan`` (None: unplanned), by role, in whole MiB."""
    return {role: round(b / MIB) for role, b in held_at(tl, plan, op).items() if b}


def report(snap: PlanningSnapshot, tl: AccessTimeline, search: bool) -> dict:
    """Unplanned peak and the plan's, what each holds, the plan's price, and the floor, on ``tl``."""
    vanilla = simulate(tl, None)
    options = {**(snap.options or {}), **({"swap_search": "always"} if search else {})}
    plan = replace(snap, timeline=tl).replan(**options)
    planned = simulate(tl, plan)
    bound = extra_time_bound(tl, snap.budget_bytes, d2h_bw=snap.d2h_bw, h2d_bw=snap.h2d_bw,
                             min_bytes=snap.min_bytes, copy_latency_ms=snap.copy_latency_ms,
                             swap_cost_ms=options.get("swap_cost_ms", 0.0),
                             swap_copy_share=options.get("swap_copy_share", 0.0))
    return {"peak_mib": vanilla.peak / MIB, "peak_op": tl.names[vanilla.peak_op],
            "held_mib": _held_mib(tl, None, vanilla.peak_op),
            "plan_peak_mib": planned.peak / MIB, "plan_peak_op": tl.names[planned.peak_op],
            "plan_held_mib": _held_mib(tl, plan, planned.peak_op),
            "feasible": plan.feasible,
            "priced_ms": plan.est_overhead_ms, "swaps": len(plan.swaps),
            "recomputes": len(plan.recomputes), "floor_ms": bound.extra_ms}


def plan_summary(r: dict) -> str:
    """The plan part of a :func:`report` line: whether it fits, its price, what it moves and
    the floor."""
    floor = "none reaches the budget" if r["floor_ms"] is None else f"{r['floor_ms']:.3f} ms"
    return (f"({'fits' if r['feasible'] else 'does not fit'}), priced {r['priced_ms']:.3f} ms, "
            f"{r['swaps']} swaps, {r['recomputes']} recomputes; floor {floor}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("--ops", required=True, help="the ops to move to the step's end: 95-113[,73-91]")
    ap.add_argument("--search", action="store_true", help="plan with swap_search=always")
    args = ap.parse_args(argv)
    snap = PlanningSnapshot.load(args.snapshot)
    moved = move_to_end(snap.timeline, parse_ops(args.ops))
    print(f"budget {snap.budget_bytes / MIB:.1f} MiB; {snap.meta.get('model')} b={snap.meta.get('batch_size')}")
    if not snap.timeline.scratch:
        print(NO_WORKSPACES)
    for name, tl in (("as recorded", snap.timeline), (f"ops {args.ops} last", moved)):
        r = report(snap, tl, args.search)
        print(f"{name}: unplanned peak {r['peak_mib']:.0f} MiB at {r['peak_op']} {r['held_mib']}; "
              f"plan {r['plan_peak_mib']:.0f} MiB at {r['plan_peak_op']} {r['plan_held_mib']} "
              f"{plan_summary(r)}")


if __name__ == "__main__":
    main()
