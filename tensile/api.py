"""The few lines a training job adds: :class:`Scheduler`.

    sched = tensile.Scheduler(model, optimizer, (x, y), loss_fn, budget=0.5)
    for x, y in loader:
        loss = sched.step(x, y)   # forward + backward + optimizer.step under the plan
    print(sched.report())

Lifecycle (TENSILE's cold start and re-planning, reference §3.3):

1. construction records one training step on the example batch (after a warm-up step
   if the optimizer has no state yet), then restores the model, the optimizer and the
   RNG exactly, so the job trains as if the scheduler had not looked;
2. the first plan uses estimated op times (roofline against measured peak rates);
3. the first steady step is timed op by op (CUDA events), the estimates are updated by
   EWMA and the job is re-planned; afterwards only the iteration time is watched, and a
   drift of more than 30 % triggers another timed step and re-plan.
"""
from __future__ import annotations

import functools

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .estimate import OpTimeModel, estimate_op_times, measure_copy_bandwidth, measure_peak_rates
from .plan import Plan
from .planner import plan as make_plan
from .record import Recording, record_step
from .runtime import PlanRunner, RuntimeStats
from .step import training_step
from .timeline import AccessTimeline

__all__ = ["Scheduler", "SchedulerReport", "resolve_budget"]


@dataclass
class SchedulerReport:
    """What the scheduler did so far (``str()`` gives a readable block)."""

    steps: int
    replans: int
    drift_events: int
    planner_ms_total: float
    planner_ms_last: float
    budget_bytes: int | None
    feasible: bool
    peak_before: int
    peak_after: int
    est_overhead_ms: float
    swaps_planned: int
    recomputes_planned: int
    swap_outs: int
    swap_ins: int
    passive_swap_ins: int
    passive_share: float
    recomputes: int
    bytes_d2h: int
    bytes_h2d: int
    ineffective_releases: int
    host_pool_bytes: int
    stall_ms: float

    def __str__(self) -> str:
        mib = 1 << 20
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / mib:.1f} MiB"
        return "\n".join([
            f"TENSILE after {self.steps} steps: {self.replans} re-plans "
            f"({self.drift_events} on drift), planner {self.planner_ms_total:.1f} ms total",
            f"  planned peak {self.peak_before / mib:.1f} -> {self.peak_after / mib:.1f} MiB, "
            f"budget {budget}, feasible {self.feasible}, est. overhead {self.est_overhead_ms:.3f} ms",
            f"  plan: {self.swaps_planned} swaps, {self.recomputes_planned} recomputes; "
            f"host pool {self.host_pool_bytes / mib:.1f} MiB",
            f"  done: {self.swap_outs} swap-outs, {self.swap_ins} swap-ins "
            f"({self.passive_swap_ins} passive, {100 * self.passive_share:.1f} %), "
            f"{self.recomputes} recomputes",
            f"  moved {self.bytes_d2h / mib:.1f} MiB D2H, {self.bytes_h2d / mib:.1f} MiB H2D; "
            f"ineffective releases {self.ineffective_releases}; "
            f"compute waited {self.stall_ms:.2f} ms for copy-ins (timed steps)",
        ])


def resolve_budget(budget: int | float | None, device: torch.device, vanilla_peak: int,
                   simulate: bool) -> int | None:
    """Bytes from a budget given as bytes (int) or a fraction in (0, 1] (float).

    A fraction is of the GPU's total memory; in simulation mode (no GPU) it is of the
    simulated vanilla peak. The planner compares it with the traced tensor bytes, which
    leave out the CUDA context and allocator fragmentation.
    """
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be bytes (int), a fraction in (0, 1] (float) or None; "
                        f"got {type(budget).__name__}")
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"a float budget is a fraction in (0, 1]; got {budget} "
                             "(pass bytes as an int)")
        whole = vanilla_peak if simulate else torch.cuda.get_device_properties(device).total_memory
        return max(1, int(budget * whole))
    if budget <= 0:
        raise ValueError(f"budget in bytes must be positive, got {budget}")
    return budget


class Scheduler:
    """Plans swaps/recomputation for one training job and applies them every step.

    ``example_batch`` is ``(inputs..., target)`` with a ``loss_fn`` (called as
    ``loss_fn(model(*inputs), target)``), or ``(inputs...)`` when the model returns the
    loss. Every later batch must have the same shapes (the op sequence is checked).
    ``budget``: bytes, a fraction of the GPU, or ``None`` to minimise the peak at no
    extra simulated time. Rates and bandwidths are measured unless given.
    ``simulate`` (default: model on CPU) runs the CPU bookkeeping mode of the runtime.
    ``replan=False`` keeps the cold-start plan (no timed step, no drift re-plans).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 example_batch: Sequence, loss_fn: Callable | None = None,
                 budget: int | float | None = None, *,
                 simulate: bool | None = None,
                 allow_recompute: bool = True, allow_cross_iteration: bool = True,
                 peak_flops: float | None = None, peak_bytes_per_s: float | None = None,
                 d2h_bw: float | None = None, h2d_bw: float | None = None,
                 min_swap_bytes: int | None = None, copy_latency_ms: float = 0.01,
                 replan: bool = True, planner: Callable[..., Plan] | None = None) -> None:
        params = list(model.parameters())
        if not params:
            raise ValueError("the model has no parameters")
        self.device = params[0].device
        self.simulate = self.device.type != "cuda" if simulate is None else simulate
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.allow_recompute, self.allow_cross = allow_recompute, allow_cross_iteration
        self.min_bytes = min_swap_bytes if min_swap_bytes is not None else (1 if self.simulate else 1 << 16)
        self.copy_latency_ms = copy_latency_ms
        self.replan_enabled = replan
        # planner(timeline, *, budget_bytes, d2h_bw, h2d_bw, copy_latency_ms, min_bytes) -> Plan:
        # TENSILE's greedy peak shaving by default; tensile.policies has vDNN and Capuchin.
        self.planner = planner or functools.partial(
            make_plan, allow_recompute=allow_recompute, allow_cross_iteration=allow_cross_iteration)

        self._example = _signature(example_batch)
        self.recording = self._record(example_batch)
        self._init_pending = self._fresh_optimizer
        dtype = params[0].dtype
        if peak_flops is None or peak_bytes_per_s is None:
            f, b = measure_peak_rates(self.device, dtype)
            peak_flops, peak_bytes_per_s = peak_flops or f, peak_bytes_per_s or b
        if d2h_bw is None or h2d_bw is None:
            d, h = measure_copy_bandwidth(self.device)
            d2h_bw, h2d_bw = d2h_bw or d, h2d_bw or h
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the measurement's buffers would skew memory readings
        self.d2h_bw, self.h2d_bw = float(d2h_bw), float(h2d_bw)
        self.times = OpTimeModel(estimate_op_times(self.recording.graph, peak_flops, peak_bytes_per_s))
        vanilla_peak = int(self.recording.timeline(self.times.op_ms).vanilla_curve().max())
        self.budget_bytes = resolve_budget(budget, self.device, vanilla_peak, self.simulate)

        self.replans = 0
        self.drift_events = 0
        self.planner_ms_total = 0.0
        self.plan = self._plan()  # cold start: estimated op times only
        self.runner = PlanRunner(self.recording, model, optimizer, loss_fn, self.plan,
                                 simulate=self.simulate)
        self._measure_next = replan

    # ------------------------------------------------------------------ public
    @property
    def timeline(self) -> AccessTimeline:
        """The access timeline with the current op-time estimates."""
        return self.recording.timeline(self.times.op_ms)

    def step(self, *batch) -> torch.Tensor:
        """One training step under the current plan; returns the (detached) loss."""
        if _signature(batch) != self._example:
            raise ValueError(f"batch {_signature(batch)} differs from the example batch "
                             f"{self._example}: the plan is for one op sequence, so every "
                             "batch needs the example's shapes, dtypes and devices")
        init = self._init_pending
        measure = self._measure_next and not init
        res = self.runner.step(batch, measure_ops=measure, init_step=init)
        self._init_pending = False
        if res.op_ms is not None:
            self.times.update(res.op_ms)
            self._measure_next = False
            self.plan = self._plan()
            self.runner.set_plan(self.plan)
            self.replans += 1
        elif (self.replan_enabled and not init and res.iter_ms is not None
              and self.times.drifted(res.iter_ms)):
            self.drift_events += 1
            self._measure_next = True
        return res.loss

    def restore_parameters(self) -> None:
        """Keep parameters and optimizer state on the device from now on.

        Between steps they are on the device anyway (swapped ones leave when the next
        :meth:`step` starts); this cancels those pending moves, e.g. before handing the
        model to code that does not go through the scheduler.
        """
        self.runner.restore_all()

    def report(self) -> SchedulerReport:
        s: RuntimeStats = self.runner.stats
        return SchedulerReport(
            steps=s.steps, replans=self.replans, drift_events=self.drift_events,
            planner_ms_total=self.planner_ms_total, planner_ms_last=self.plan.planner_ms,
            budget_bytes=self.budget_bytes, feasible=self.plan.feasible,
            peak_before=self.plan.peak_before, peak_after=self.plan.peak_after,
            est_overhead_ms=self.plan.est_overhead_ms, swaps_planned=len(self.plan.swaps),
            recomputes_planned=len(self.plan.recomputes), swap_outs=s.swap_outs,
            swap_ins=s.swap_ins, passive_swap_ins=s.passive_swap_ins,
            passive_share=s.passive_share, recomputes=s.recomputes, bytes_d2h=s.bytes_d2h,
            bytes_h2d=s.bytes_h2d, ineffective_releases=s.ineffective_releases,
            host_pool_bytes=s.host_pool_bytes, stall_ms=s.stall_ms)

    # ------------------------------------------------------------------ internals
    def _plan(self) -> Plan:
        p = self.planner(self.timeline, budget_bytes=self.budget_bytes, d2h_bw=self.d2h_bw,
                         h2d_bw=self.h2d_bw, copy_latency_ms=self.copy_latency_ms,
                         min_bytes=self.min_bytes)
        self.planner_ms_total += p.planner_ms
        return p

    def _record(self, batch: Sequence) -> Recording:
        """Record a steady-state step, then put model, optimizer and RNG back as they were."""
        snap = _snapshot(self.model, self.optimizer, self.device)
        self._fresh_optimizer = len(self.optimizer.state) == 0
        try:
            if self._fresh_optimizer:  # the first step creates the optimizer state: other ops
                training_step(self.model, self.optimizer, batch, self.loss_fn)
            return record_step(self.model, self.optimizer, batch, self.loss_fn)
        finally:
            _restore(self.model, self.optimizer, snap)


def _signature(batch: Sequence) -> list:
    """Shapes, dtypes and devices of a batch's tensors (other elements by type)."""
    return [(tuple(x.shape), str(x.dtype).removeprefix("torch."), str(x.device))
            if isinstance(x, torch.Tensor) else type(x).__name__ for x in batch]


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    return (_to_cpu(model.state_dict()), _to_cpu(optimizer.state_dict()),
            torch.get_rng_state(), cuda_rng)


def _restore(model: nn.Module, optimizer: torch.optim.Optimizer, snap) -> None:
    model_state, opt_state, rng, cuda_rng = snap
    model.load_state_dict(model_state)
    optimizer.load_state_dict(opt_state)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
