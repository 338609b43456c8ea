"""vDNN and Capuchin as plans for TENSILE's runtime (the baselines the TENSILE authors ran).

Both papers' systems are not available for PyTorch, so, as the TENSILE authors did on their
engine, we re-implement their *policies* and run them on our own runtime
(:class:`tensile.runtime.PlanRunner`): the same recording, copy streams, pinned pool and
saved-tensor hooks as TENSILE, so only the decision of what to move, and when, differs.

* :func:`vdnn_plan`: vDNN (Rhu et al., "vDNN: Virtualized Deep Neural Networks for
  Scalable, Memory-Efficient Neural Network Design", MICRO'16). Static, layer-wise rule:
  during forward, offload the input feature maps of every CONV layer (``vDNN_conv``) or
  of every layer (``vDNN_all``), the copy starting when the layer starts and the device
  copy freed once the layer is done with it; during backward, when a layer's backward
  starts, prefetch the offloaded input of the next layer backward will reach ("one
  layer ahead"). No budget, no recomputation.
* :func:`capuchin_plan`: Capuchin (Peng et al., "Capuchin: Tensor-based GPU Memory
  Management for Deep Learning", ASPLOS'20). Under a memory budget, per tensor, from its
  measured accesses: evict after the *evicted-access* (last forward use); swap when the
  copies fit into the tensor's *free time* ``FT = (back-access start - swap-in time) -
  (evicted-access end + swap-out time)``, largest FT first; otherwise take whichever of
  swap and recompute costs least per byte, i.e. the largest memory saving per second
  (MSPS, with swap overhead ``-FT`` and recompute overhead the producer's time). The
  swap-in is triggered so that it ends just before the back-access. Differences, which
  our runtime imposes: one level of recomputation (the producer and the in-place ops
  after it, :func:`tensile.planner.recompute_of`; sources must stay resident, as in
  TENSILE's own planner) and no on-line feedback on swap-in timing beyond TENSILE's
  re-plan with measured op times.

Op indices, times and residency rules are those of :mod:`tensile.timeline`; a plan is
checked against :func:`tensile.simulate.simulate`, whose peak is the plan's ``peak_after``.
Copies are timed as one FIFO queue per direction (one CUDA stream each, as the runtime
issues them), so contention shows in the simulated peak.

``tensile.Scheduler(..., planner=vdnn_plan)`` runs a policy on TENSILE's runtime (recording,
cold start and the re-plan with measured op times unchanged).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .plan import Plan, Recompute, Swap
from .planner import recompute_of
from .simulate import simulate
from .timeline import FORWARD_PHASES, AccessTimeline

__all__ = ["CONV_OPS", "is_conv", "vdnn_plan", "capuchin_plan", "POLICIES"]

# ATen names of a convolution's forward as a dispatch mode sees them (CPU and CUDA).
CONV_OPS = frozenset({"convolution", "_convolution", "conv2d", "cudnn_convolution",
                      "mkldnn_convolution", "_convolution_mode"})


def is_conv(op_name: str) -> bool:
    """``aten.convolution.default`` → True (the forward of a conv layer)."""
    parts = op_name.split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1] in CONV_OPS


# --------------------------------------------------------------------------- vDNN

def vdnn_plan(tl: AccessTimeline, *, d2h_bw: float, h2d_bw: float, layers: str = "conv",
              budget_bytes: int | None = None, copy_latency_ms: float = 0.01,
              min_bytes: int = 1) -> Plan:
    """vDNN's static offload/prefetch plan (see the module docstring).

    ``layers``: ``"conv"`` offloads the inputs of convolutions only (vDNN_conv), ``"all"``
    the activation inputs of every forward op (vDNN_all). ``budget_bytes`` is recorded
    but not used: vDNN has no budget. Only activations autograd saved for backward
    (``swappable``) can move; the network input is never offloaded.
    """
    if layers not in ("conv", "all"):
        raise ValueError(f"layers must be 'conv' (vDNN_conv) or 'all' (vDNN_all), got {layers!r}")
    t0 = time.perf_counter()
    swaps: dict[int, Swap] = {}
    for k, (name, phase) in enumerate(zip(tl.names, tl.phases)):
        if phase not in FORWARD_PHASES or (layers == "conv" and not is_conv(name)):
            continue
        for sid in tl.reads[k]:
            t = tl.tensors[sid]
            if sid in swaps or t.persistent or not t.swappable or t.nbytes < min_bytes:
                continue
            i, j = tl.backward_gap(sid)
            # The copy starts when the layer starts; it waits for a later in-place update
            # of the tensor (its host copy must hold the final forward value).
            out = max(k - 1, tl.last_write_at_or_before(sid, i))
            swaps[sid] = _swap(sid, t.nbytes, out_issue=out, release=max(i, out), use=j)
    # Prefetch one layer ahead: when backward reaches the offloaded tensor used just
    # before this one, start bringing this one back (the first one at backward's start).
    bwd_start = next((k for k, p in enumerate(tl.phases) if p == "backward"), tl.num_ops)
    uses = sorted({s.use_op for s in swaps.values()})
    for s in swaps.values():
        earlier = [u for u in uses if u < s.use_op]
        s.in_issue_op = max((earlier[-1] if earlier else bwd_start) - 1, s.release_after_op)
    return _finish(tl, list(swaps.values()), [], budget_bytes, d2h_bw, h2d_bw,
                   copy_latency_ms, t0)


# --------------------------------------------------------------------------- Capuchin

def capuchin_plan(tl: AccessTimeline, *, budget_bytes: int | None, d2h_bw: float,
                  h2d_bw: float, copy_latency_ms: float = 0.01, min_bytes: int = 1) -> Plan:
    """Capuchin's swap/recompute choice under ``budget_bytes`` (see the module docstring).

    Works round by round on the current peak op ``p`` until the budget is met or no
    resident activation can leave at ``p`` (then the plan is marked infeasible).
    """
    if budget_bytes is None:
        raise ValueError("Capuchin plans to a memory budget: give budget_bytes (the TENSILE "
                         "authors used TENSILE's own peak, (1 - MSR) x vanilla peak)")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)) \
            or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    t0 = time.perf_counter()
    out_ms = lambda n: copy_latency_ms + 1e3 * n / d2h_bw  # noqa: E731
    in_ms = lambda n: copy_latency_ms + 1e3 * n / h2d_bw  # noqa: E731
    mem = tl.vanilla_curve()
    # Candidates: activations autograd saved, with their forward->backward gap (i, j).
    cand = [(sid, *tl.backward_gap(sid)) for sid, t in tl.tensors.items()
            if not t.persistent and t.swappable and t.nbytes >= min_bytes]
    sids = np.array([c[0] for c in cand], dtype=np.int64)
    gap_i = np.array([c[1] for c in cand], dtype=np.int64)
    gap_j = np.array([c[2] for c in cand], dtype=np.int64)
    free = np.ones(len(cand), dtype=bool)  # neither moved nor pinned as a source
    row = {int(s): r for r, s in enumerate(sids)}
    moved: set[int] = set()  # swapped or recomputed
    swaps: list[Swap] = []
    recomputes: list[Recompute] = []
    while tl.num_ops:
        p = int(np.argmax(mem))
        if mem[p] <= budget_bytes:
            break
        options = []  # (hidden swap?, score, action, absent range)
        for r in np.nonzero(free & (gap_i < p) & (p < gap_j))[0]:
            sid, i, j = int(sids[r]), int(gap_i[r]), int(gap_j[r])
            nbytes = tl.tensors[sid].nbytes
            # Swap: out after the evicted-access, in timed to end at the back-access.
            d_out, d_in = out_ms(nbytes), in_ms(nbytes)
            ft = float(tl.start[j] - d_in) - float(tl.end[i] + d_out)
            k_in = max(tl.last_op_ending_by(float(tl.start[j]) - d_in), i)
            lo = tl.first_op_starting_at_or_after(float(tl.end[i]) + d_out)
            if lo <= p <= k_in:
                s = _swap(sid, nbytes, out_issue=i, release=i, use=j)
                s.in_issue_op = k_in
                score = ft if ft >= 0 else nbytes / -ft
                options.append((ft >= 0, score, s, (lo, k_in)))
            rc = recompute_of(tl, sid, i, j, moved)
            if rc is not None:
                options.append((False, nbytes / rc.cost_ms, rc, (i + 1, j - 1)))
        if not options:
            break
        # Hidden swaps first, largest free time first; otherwise the best MSPS.
        _, _, act, (lo, hi) = max(options, key=lambda o: (o[0], o[1]))
        lo_v, hi_v = tl.vanilla_range(act.sid)
        mem[max(lo, lo_v):min(hi, hi_v) + 1] -= act.nbytes
        moved.add(act.sid)
        free[row[act.sid]] = False
        if isinstance(act, Swap):
            swaps.append(act)
        else:
            recomputes.append(act)
            for src in act.sources:  # they must stay put until the recompute
                if src in row:
                    free[row[src]] = False
    return _finish(tl, swaps, recomputes, budget_bytes, d2h_bw, h2d_bw, copy_latency_ms, t0)


# --------------------------------------------------------------------------- shared

def _swap(sid: int, nbytes: int, *, out_issue: int, release: int, use: int) -> Swap:
    """A transient swap whose copy times :func:`_finish` fills in."""
    return Swap(sid=sid, nbytes=nbytes, cross_iteration=False, out_issue_op=out_issue,
                out_start_ms=0.0, out_end_ms=0.0, release_after_op=release, in_issue_op=use - 1,
                in_start_ms=0.0, in_end_ms=0.0, use_op=use)


def _finish(tl: AccessTimeline, swaps: list[Swap], recomputes: list[Recompute],
            budget_bytes: int | None, d2h_bw: float, h2d_bw: float, latency: float,
            t0: float) -> Plan:
    """Time the copies as two FIFO queues, replay the plan, and package it."""
    for name, bw in (("d2h_bw", d2h_bw), ("h2d_bw", h2d_bw)):
        if not (isinstance(bw, (int, float)) and bw > 0 and np.isfinite(bw)):
            raise ValueError(f"{name} must be a positive number of bytes/s, got {bw!r}")
    free = 0.0
    for s in sorted(swaps, key=lambda s: (s.out_issue_op, s.sid)):
        s.out_start_ms = max(float(tl.end[s.out_issue_op]), free)
        s.out_end_ms = free = s.out_start_ms + latency + 1e3 * s.nbytes / d2h_bw
    free = 0.0
    for s in sorted(swaps, key=lambda s: (s.in_issue_op, s.use_op, s.sid)):
        s.in_start_ms = max(float(tl.end[s.in_issue_op]), free)
        s.in_end_ms = free = s.in_start_ms + latency + 1e3 * s.nbytes / h2d_bw
    plan = Plan(num_ops=tl.num_ops, budget_bytes=budget_bytes, d2h_bytes_per_s=float(d2h_bw),
                h2d_bytes_per_s=float(h2d_bw),
                swaps=sorted(swaps, key=lambda s: (s.out_issue_op, s.out_start_ms, s.sid)),
                recomputes=sorted(recomputes, key=lambda r: (r.before_op, r.sid)),
                iteration_ms=tl.iteration_ms)
    plan.peak_before = int(tl.vanilla_curve().max()) if tl.num_ops else 0
    plan.peak_after = simulate(tl, plan).peak
    plan.feasible = budget_bytes is None or plan.peak_after <= budget_bytes
    # Swap-ins that end after their use stall the compute stream; recomputes cost their op.
    late = sum(max(0.0, s.in_end_ms - float(tl.start[s.use_op])) for s in swaps)
    plan.est_overhead_ms = float(late + sum(r.cost_ms for r in recomputes))
    plan.planner_ms = (time.perf_counter() - t0) * 1e3
    return plan


Policy = Callable[..., Plan]

POLICIES: dict[str, Policy] = {
    "vdnn": vdnn_plan,
    "vdnn_all": lambda tl, **kw: vdnn_plan(tl, layers="all", **kw),
    "capuchin": capuchin_plan,
}
