"""What keeping a streamed optimizer's last slices on the device would do to a recorded step,
worked out offline.

    python -m experiments.slice_whatif results/h100-80gb-hbm3/snapshot_tensile_vgg16_b16_…_stream_slice_32_…json.gz --kept 0,2,4,6,8 --budget-mib 2191.4

A planning snapshot (:class:`tensile.PlanningSnapshot`) of a step whose optimizer streamed a
large parameter's state in row slices (``experiment.stream_slice_mb``) has those copies in its
timeline (``AccessTimeline.transfers``, in the order they were issued). For each ``k`` this
drops the copies of the last ``k`` slices, which are the last ``entries * k`` copies each way
(Adam's two moments a slice by default). Their state would stay on the device for the whole
step (``experiment.stream_slice_resident=k``), so its bytes come off the budget. The step is
then planned with the snapshot's options. The other copies stay where the recording issued
them. With slices kept, :func:`tensile.stream_optimizer` spreads them over the whole rest of
backward instead, which this does not model.

It prints, for each ``k``: the state kept, the bytes still streamed each way, the peak without a
plan and the plan's (both with the kept state), whether the plan fits, its price, what it
moves, and the least any plan could be priced at (``tensile.bound``). The op times are the
recorded step's own, its waits on the copies included. This is the planner's cost model, not a
measurement: the GPU run with ``stream_slice_resident`` is the test of it. On VGG-16 it was
right about memory and wrong about time (H100, 69th session): 6 kept fit the budget as it said,
but the step took 22.2-22.3 ms where the copies' time alone put it at 19-21. Every slice's
update, kept or streamed, is one row product and one optimizer call, and those cost the step
about 1.8 ms over updating fc6 in 64 MiB chunks, which this does not model.

``--budget-mib`` replaces the snapshot's budget. A run that matched a memory saving
(``experiment.match_msr``) saves the last budget it tried, not the target.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from tqdm import tqdm

from experiments.cli import int_list
from experiments.defer_whatif import MIB, NO_WORKSPACES, plan_summary, report
from tensile.snapshot import PlanningSnapshot
from tensile.timeline import AccessTimeline


def keep_last(tl: AccessTimeline, kept: int, entries: int = 2) -> tuple[AccessTimeline, int]:
    """``tl`` without the copies of its last ``kept`` slices (``entries`` copies each way a
    slice), and the bytes of state they would keep on the device."""
    into = [i for i, (_, direction, _) in enumerate(tl.transfers) if direction == "h2d"]
    out = [i for i, (_, direction, _) in enumerate(tl.transfers) if direction == "d2h"]
    if entries < 1 or kept < 0 or kept * entries > min(len(into), len(out)):
        raise ValueError(f"kept: expected 0 to {min(len(into), len(out)) // max(entries, 1)} slices "
                         f"of {entries} copies each way (the step has {len(into)} copies in and "
                         f"{len(out)} out), got {kept} slices of {entries}")
    n = kept * entries
    dropped = set(into[len(into) - n:] if n else []) | set(out[len(out) - n:] if n else [])
    kept_bytes = sum(tl.transfers[i][2] for i in dropped if tl.transfers[i][1] == "h2d")
    left = tuple(t for i, t in enumerate(tl.transfers) if i not in dropped)
    return replace(tl, transfers=left), kept_bytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("--kept", type=int_list, default=[0, 2, 4, 6, 8],
                    help="numbers of last slices kept on the device (default 0,2,4,6,8)")
    ap.add_argument("--entries", type=int, default=2,
                    help="state entries a slice copies each way (Adam: 2, the default)")
    ap.add_argument("--budget-mib", type=float, default=None,
                    help="the budget to plan to (default: the snapshot's)")
    ap.add_argument("--search", action="store_true", help="plan with swap_search=always")
    args = ap.parse_args(argv)
    snap = PlanningSnapshot.load(args.snapshot)
    tl = snap.timeline
    if not tl.transfers:
        ap.error(f"{args.snapshot}: its step made no copies of its own (no streamed optimizer): "
                 f"nothing to keep on the device")
    budget = snap.budget_bytes if args.budget_mib is None else int(args.budget_mib * MIB)
    if budget is None:
        ap.error(f"{args.snapshot} was planned without a budget: give --budget-mib")
    streamed = sum(b for _, d, b in tl.transfers if d == "d2h")
    print(f"budget {budget / MIB:.1f} MiB; {snap.meta.get('model')} b={snap.meta.get('batch_size')}; "
          f"{len(tl.transfers)} copies, {streamed / MIB:.0f} MiB each way")
    if not tl.scratch:
        print(NO_WORKSPACES)
    for k in tqdm(args.kept, desc="slices kept", unit="k", leave=False):
        try:
            left, kept = keep_last(tl, k, args.entries)
        except ValueError as exc:
            ap.error(str(exc))
        r = report(replace(snap, timeline=left, budget_bytes=budget - kept), left, args.search)
        moved = sum(b for _, d, b in left.transfers if d == "d2h")
        tqdm.write(f"{k} kept: state {kept / MIB:.0f} MiB on the device, {moved / MIB:.0f} MiB each "
                   f"way; unplanned peak {(r['peak_mib'] + kept / MIB):.0f} MiB; plan "
                   f"{(r['plan_peak_mib'] + kept / MIB):.0f} MiB at {r['plan_peak_op']} "
                   f"{plan_summary(r)}")


if __name__ == "__main__":
    main()
