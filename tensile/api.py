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
   drift of more than 30 % (median of the last 5 iterations) triggers another timed
   step and re-plan.

Several jobs on one GPU (reference §3.6): start ``python -m tensile.server`` once and
give every job ``scheduler_socket=``. The job then registers its access timeline with
the scheduler process, reports every iteration time (and the op times of its timed
steps) and runs its part of one joint plan, switched between steps only. Without a
plan (scheduler unreachable, killed, not answered yet) the job trains vanilla and keeps
trying to re-register; no step is lost or changed by it (see :mod:`tensile.client`).
"""
from __future__ import annotations

import collections
import copy
import functools
import logging
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from nimble.allocator import expandable_segments
from nimble.training import step_state_kept

from .bound import extra_time_bound
from .client import SchedulerError, TensileClient
from .estimate import (OpTimeModel, estimate_op_times, measure_copy_bandwidth, measure_peak_rates,
                       scaled_op_times)
from .graph import GraphStep
from .optimes import batch_norm_rerun_shares, step_op_profile
from .plan import Plan
from .planner import COPY_LATENCY_MS, check_swap_copy_share, check_swap_cost, check_swap_search
from .planner import plan as make_plan
from .record import Recording, record_step
from .runtime import PlanRunner, RuntimeStats, StepResult, bytes_per_s
from .scale import batch_size_of, scale_recording, slice_batch, valid_record_batches
from .simulate import held_at
from .simulate import simulate as simulate_plan
from .snapshot import PlanningSnapshot
from .step import training_step
from .streamed import streamed_of
from .timeline import AccessTimeline, base_name

__all__ = ["Scheduler", "SchedulerReport", "fragmentation_hint", "resolve_budget", "gb_per_s"]


def gb_per_s(rate: float | None) -> float | None:
    """Bytes per second as GB/s, to 2 decimals (None stays None)."""
    return None if rate is None else round(rate / 1e9, 2)


def _gbps(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate / 1e9:.1f} GB/s"

log = logging.getLogger("tensile.api")

# Without an iteration time to report, contact the scheduler at most this often (s).
_HEARTBEAT_S = 1.0
_RETIME_WAIT_S = 30.0   # capture() in a scheduled job: how long to wait for the new plan
# capture(): the vanilla step's time, the quietest of rounds spread over about half a second
# (GraphStep.replay_ms: other processes on the GPU make a single round time their bursts)
_TIMING_ROUNDS, _TIMING_REPLAYS, _TIMING_GAP_S = 10, 3, 0.03


@dataclass
class SchedulerReport:
    """What the scheduler did so far (``str()`` gives a readable block)."""

    steps: int
    replans: int          # local re-plans (0 with a scheduler process: see plans_received)
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
    # What the plan assumed against what the timed steps measured: a plan made for a
    # shorter iteration or faster copies than the GPU gives hides fewer of its copies.
    plan_iteration_ms: float
    plan_d2h_bytes_per_s: float
    plan_h2d_bytes_per_s: float
    timed_steps: int
    timed_d2h_bytes: int
    timed_d2h_ms: float
    timed_h2d_bytes: int
    timed_h2d_ms: float
    # With a scheduler process (``scheduler_socket``); ``None`` when planning locally.
    scheduler_socket: str | None = None
    connected: bool | None = None
    job_id: str | None = None
    plan_version: int | None = None   # the scheduler's version of the plan now running
    plan_reason: str | None = None    # why the scheduler made it
    plans_received: int = 0           # plan switches ordered by the scheduler
    chained_recomputes: dict = field(default_factory=dict)  # Plan.chained_recomputes
    # batch_norm_from_stats: the median share of a batch norm's time its rebuild costs
    # (Scheduler.rerun_share, what the planner priced those recomputes at); None when off
    bn_rerun_share_median: float | None = None
    # what the plan recomputes, by the producing op's name (``cudnn_batch_norm``: 27, ...)
    recomputes_by_op: dict = field(default_factory=dict)
    # the largest workspace an op holds while it runs, counted in the plan's peaks
    # (Scheduler.scratch, measured by capture(); 0 before)
    scratch_max_bytes: int = 0
    # what the plan's estimated extra time (est_overhead_ms) prices its swaps at beside their
    # hidden copies (tensile.planner.swap_price_ms); the rest is its rebuilds
    swaps_priced_ms: float = 0.0

    def plan_figures(self) -> dict:
        """The current plan as the result rows give it (MiB, ms): planned swaps and
        recomputes, the planned peaks without and with the plan, the planned MSR, whether
        it is feasible, its estimated extra time and the budget."""
        mib = 2**20
        return {"swaps_planned": self.swaps_planned, "recomputes_planned": self.recomputes_planned,
                "planned_peak_vanilla_mb": self.peak_before / mib,
                "planned_peak_mb": self.peak_after / mib,
                "msr_planned": 1 - self.peak_after / self.peak_before if self.peak_before else None,
                "plan_feasible": self.feasible, "plan_overhead_ms": self.est_overhead_ms,
                "budget_mb": None if self.budget_bytes is None else self.budget_bytes / mib,
                "bn_rerun_share_median": self.bn_rerun_share_median,
                "recomputes_by_op": dict(self.recomputes_by_op),
                "scratch_max_mb": self.scratch_max_bytes / mib,
                "plan_swaps_priced_ms": self.swaps_priced_ms,
                **{f"recomputes_{k}": v for k, v in self.chained_recomputes.items()}}

    def plan_check(self) -> dict:
        """What the plan assumed beside what its timed steps measured: the iteration it
        was made for (ms), the copies' bandwidths (GB/s, None before a timed step with
        copies) and the compute stream's wait for copy-ins per timed step (ms)."""
        return {"plan_iteration_ms": self.plan_iteration_ms, "timed_steps": self.timed_steps,
                "d2h_gbps_measured": gb_per_s(bytes_per_s(self.timed_d2h_bytes, self.timed_d2h_ms)),
                "h2d_gbps_measured": gb_per_s(bytes_per_s(self.timed_h2d_bytes, self.timed_h2d_ms)),
                "stall_ms_per_timed_step": (self.stall_ms / self.timed_steps
                                            if self.timed_steps else None)}

    def __str__(self) -> str:
        mib = 1 << 20
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / mib:.1f} MiB"
        lines = []
        if self.scheduler_socket is not None:
            state = "connected" if self.connected else "not connected (running vanilla)"
            version = "none" if self.plan_version is None or self.plan_version < 0 \
                else f"v{self.plan_version} ({self.plan_reason})"
            lines.append(f"  scheduler {self.scheduler_socket}: {state}, job {self.job_id}, "
                         f"plan {version}, {self.plans_received} plans taken")
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
            f"  plan made for a {self.plan_iteration_ms:.2f} ms iteration, copies at "
            f"{_gbps(self.plan_d2h_bytes_per_s)} D2H / {_gbps(self.plan_h2d_bytes_per_s)} H2D; "
            f"timed steps ({self.timed_steps}) measured "
            f"{_gbps(bytes_per_s(self.timed_d2h_bytes, self.timed_d2h_ms))} D2H / "
            f"{_gbps(bytes_per_s(self.timed_h2d_bytes, self.timed_h2d_ms))} H2D",
            *lines,
        ])


def fragmentation_hint(budget_bytes: int | None, device: torch.device,
                       expandable: Callable[[], bool]) -> str | None:
    """A warning for a budget on a CUDA device without expandable segments, else None
    (``expandable()`` says whether they are on; asked only for a budget on CUDA).

    A plan counts allocated bytes; a memory cap (a smaller GPU,
    ``set_per_process_memory_fraction``) counts what the caching allocator reserves, which
    fragmentation makes larger. Measured on the H200: ResNet-50 and VGG-16 at batch 256
    under a 16 GiB cap, planned to about 14,500 MiB, ran out of memory with the default
    allocator and trained with expandable segments (16,124 of 16,384 MiB reserved at most).
    """
    if budget_bytes is None or device.type != "cuda" or expandable():
        return None
    return (f"tensile: a memory budget ({budget_bytes / 2**20:.0f} MiB) counts allocated bytes, "
            "and the caching allocator's fragmentation can reserve 10-40 % more; under a memory "
            "cap that can run out of memory where the plan fits. Start the process with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (newer PyTorch also reads "
            "PYTORCH_ALLOC_CONF, but some releases ignored it for this setting).")


# :func:`unmet_budget_message`'s names of the tensor roles (tensile.timeline.ROLES)
_HELD_LABELS = {"param": "parameters", "opt_state": "optimizer state",
                "activation": "activations and gradients", "workspace": "workspaces"}


def unmet_budget_message(timeline: AccessTimeline, plan: Plan, *, allow_recompute: bool = True,
                         streamed: bool = False) -> str:
    """The warning for a plan that misses its budget: where its peak is, what is resident
    there (:func:`tensile.simulate.held_at`), and what could meet it (recomputation where
    ``allow_recompute`` is off, the optimizer's state on the host where it is held there and
    the optimizer is not ``streamed``)."""
    def size(nbytes: int) -> str:
        for unit, shift in (("MiB", 20), ("KiB", 10)):
            if nbytes >= 1 << shift:
                return f"{nbytes / (1 << shift):.1f} {unit}"
        return f"{nbytes} B"
    sim = simulate_plan(timeline, plan)
    k = sim.peak_op
    held = held_at(timeline, plan, k)
    parts = [(label, held[role]) for role, label in _HELD_LABELS.items()]
    parts.append(("other", sum(b for role, b in held.items() if role not in _HELD_LABELS)))
    shown = ", ".join(f"{label} {size(b)}" for label, b in parts if b)
    # an op's workspace is part of the op: no plan moves it (a slower library plan with a
    # smaller one is the only way down, experiments.conv_workspace measures it for a conv)
    fixed = (f" Its workspaces ({size(held['workspace'])}) are the op's own: no plan moves them."
             if held.get("workspace") else "")
    ways = ["a larger budget"]   # what could meet it
    if not allow_recompute:
        ways.append("recomputation (allow_recompute=True)")
    if held["opt_state"] and not streamed:
        ways.append("the optimizer's state kept on the host (tensile.stream_optimizer)")
    return (f"tensile: no plan meets the budget of {size(plan.budget_bytes)}; the best peaks at "
            f"{size(sim.peak)} ({size(plan.peak_before)} without a plan) during op {k} "
            f"({base_name(timeline.names[k])}, {timeline.phases[k]}), which holds "
            f"{shown or 'nothing'}.{fixed} Training goes on under that plan, above the budget. "
            f"Consider {', or '.join(ways)}.")


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
    extra simulated time, or, with ``max_overhead`` (a fraction of the iteration time,
    e.g. 0.05), with recomputation that adds at most that much. A budget no plan meets is
    said in a warning (:func:`unmet_budget_message`), once until a plan meets it again.
    Rates and bandwidths are measured unless given.
    ``simulate`` (default: model on CPU) runs the CPU bookkeeping mode of the runtime.
    ``replan=False`` keeps the cold-start plan (no timed step, no drift re-plans).
    ``allow_swaps=False`` plans recomputation only (local planning). ``rebuild_ahead``
    (local planning; e.g. 2): rebuild dropped activations that many times their rerun
    time before backward needs them, on a side stream, within the plan's peak
    (:func:`tensile.planner.schedule_ahead`), so that reruns overlap backward's kernels;
    0 (default): each when backward first needs it, on the compute stream. For captured
    steps (:meth:`capture`): uncaptured, an ahead rebuild between two autograd hooks puts
    the backward under the runtime's dispatch mode (host time per op).
    ``swap_cost_ms``: what each swap costs the step beside its hidden copies, priced into
    the plan (:func:`tensile.planner.plan`; with ``scheduler_socket`` it goes to the
    scheduler process as the job's option, for the joint plan); a captured step's are
    :data:`tensile.planner.CAPTURED_SWAP_COST_MS`, which ``tensile_graph`` plans with.
    ``swap_copy_share``: the share of its copies' own time each swap adds beside that,
    priced likewise (:func:`tensile.planner.plan` says what was measured; 0, the default:
    nothing).
    ``swap_search`` (local planning): ``"always"`` also plans again seeded with the swaps of
    the bound's relaxation, and searches over which tensors to swap, where the budget is
    met, for a cheaper plan (seconds to a few minutes of planning more); ``"unmet"``
    (default) only where no plan meets it; ``"never"``
    (:func:`tensile.planner.plan`).
    ``record_batches`` (e.g. ``(2, 4, 8)``): record the step on the first 2, 4 and 8
    samples of the example batch, not on all of it, and scale the recording to the
    example's batch size (:mod:`tensile.scale`): for a job that does not fit the GPU
    without its plan.
    Refused (``ScaleError``) for a model whose step is not linear in the batch size.
    ``batch_norm_from_stats=True``: recompute a training-mode batch norm's output from the
    batch mean and inverse std its forward returned (one elementwise kernel on CUDA) instead
    of rerunning the op (a statistics pass more), together with the residual add and
    ``ReLU(inplace=True)`` that overwrote it (:mod:`tensile.fused`). The planner prices such
    a recompute at the share of the op's time that the rebuild took when measured here on a
    tensor of its shape (``rerun_share``, sent to a scheduler process too). Faster (H200,
    b=16, captured, at checkpointing's peak, against checkpointing: ResNet-50 1.167x ->
    1.184x, Inception-v4 1.103x -> 1.180x, DenseNet-121 1.046x -> 1.095x), but equal to
    rounding only: a ReLU after it may then pass a gradient the exact rerun stops, so
    training matches vanilla within tolerance instead of bit for bit.
    ``count_workspaces`` (default True): plan with the bytes each op holds only while it
    runs (cuDNN's workspaces: :attr:`scratch`, measured when the step is captured), so that
    the captured step's peak is the plan's; False plans as if ops held none (as before the
    forty-sixth session: the budget is then overshot by up to the largest workspace, 78 MiB
    on ResNet-50 at b=16 on the H200), while :attr:`scratch` is still measured and reported.

    ``scheduler_socket``: plan jointly with the other jobs of the GPU through the
    scheduler process listening there (``python -m tensile.server --socket PATH``)
    instead of locally. The memory budget is then the server's ``--budget`` for all jobs
    together, so ``budget`` (and a custom ``planner``) must be left out. ``job_id``
    names the job (``None``: the scheduler picks one); ``weight`` (> 0) is its priority
    (higher keeps more resident); ``client_kwargs`` go to :class:`TensileClient`
    (``timeout_s``, ``register_timeout_s``, ``retry_s``). Construction waits for the
    cold-start plan (at most ``register_timeout_s``); when no plan comes the job runs
    vanilla until one does; a refusal (an error reply, e.g. the scheduler's planner
    failed) raises :class:`SchedulerError` here, while during training it only logs a
    warning and the job trains on. The scheduler drops a job silent for its
    ``--heartbeat-timeout`` (default 60 s): every step reports, so set it above the
    longest step, or call :meth:`heartbeat` during long pauses between steps (a dropped
    job runs vanilla and re-registers by itself). Call :meth:`close` (or use ``with``)
    to leave the scheduler.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 example_batch: Sequence, loss_fn: Callable | None = None,
                 budget: int | float | None = None, *,
                 simulate: bool | None = None,
                 allow_recompute: bool = True, allow_cross_iteration: bool = True,
                 allow_swaps: bool = True, rebuild_ahead: float = 0.0, swap_cost_ms: float = 0.0,
                 swap_copy_share: float = 0.0, swap_search: str = "unmet",
                 peak_flops: float | None = None, peak_bytes_per_s: float | None = None,
                 d2h_bw: float | None = None, h2d_bw: float | None = None,
                 min_swap_bytes: int | None = None, copy_latency_ms: float = COPY_LATENCY_MS,
                 max_overhead: float = 0.0,
                 replan: bool = True, planner: Callable[..., Plan] | None = None,
                 scheduler_socket: str | os.PathLike | None = None, job_id: str | None = None,
                 weight: float = 1.0, client_kwargs: dict | None = None,
                 record_batches: Sequence[int] | None = None,
                 batch_norm_from_stats: bool = False, count_workspaces: bool = True) -> None:
        params = list(model.parameters())
        if not params:
            raise ValueError("the model has no parameters")
        if scheduler_socket is not None and budget is not None:
            raise ValueError(f"budget={budget!r} with scheduler_socket: the scheduler process "
                             "plans all its jobs against one budget, its --budget; leave "
                             "budget=None (or drop scheduler_socket to plan locally)")
        if scheduler_socket is not None and planner is not None:
            raise ValueError("planner= with scheduler_socket: the scheduler process does the "
                             "planning; leave planner=None (or drop scheduler_socket)")
        if planner is not None or scheduler_socket is not None:
            # options of local planning with TENSILE's own planner: (value, default); a
            # scheduler process takes the swaps' price as the job's options
            local = {"max_overhead": (max_overhead, 0.0), "allow_swaps": (allow_swaps, True),
                     "rebuild_ahead": (rebuild_ahead, 0.0), "swap_search": (swap_search, "unmet")}
            if planner is not None:
                local["swap_cost_ms"] = (swap_cost_ms, 0.0)
                local["swap_copy_share"] = (swap_copy_share, 0.0)
            for name, (value, default) in local.items():
                if value != default:
                    raise _not_for_this_planner(name, value)
        check_swap_cost(swap_cost_ms)
        check_swap_copy_share(swap_copy_share)
        check_swap_search(swap_search)
        if scheduler_socket is None and (job_id is not None or weight != 1.0 or client_kwargs):
            raise ValueError("job_id, weight and client_kwargs are for a scheduler process; "
                             "give scheduler_socket too")
        self.device = params[0].device
        self.simulate = self.device.type != "cuda" if simulate is None else simulate
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.allow_recompute, self.allow_cross = allow_recompute, allow_cross_iteration
        self.min_bytes = min_swap_bytes if min_swap_bytes is not None else (1 if self.simulate else 1 << 16)
        self.copy_latency_ms = copy_latency_ms
        if not isinstance(count_workspaces, bool):
            raise ValueError(f"count_workspaces: expected True or False, got {count_workspaces!r}")
        self.count_workspaces = count_workspaces
        self.replan_enabled = replan
        # planner(timeline, *, budget_bytes, d2h_bw, h2d_bw, copy_latency_ms, min_bytes) -> Plan:
        # TENSILE's greedy peak shaving by default; tensile.policies has vDNN and Capuchin.
        self.planner = planner or functools.partial(
            make_plan, allow_recompute=allow_recompute, allow_cross_iteration=allow_cross_iteration,
            max_overhead=max_overhead, allow_swaps=allow_swaps, rebuild_ahead=rebuild_ahead,
            swap_cost_ms=swap_cost_ms, swap_copy_share=swap_copy_share, swap_search=swap_search)

        self._example = _signature(example_batch)
        if record_batches is None:
            self.recording = self._record(example_batch)
        else:
            self.recording = self._record_scaled(example_batch, record_batches)
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
        # what rebuilding each batch norm from its statistics costs beside the op: the
        # planner prices those recomputes with it (measured here, on tensors of their shapes)
        self.rerun_share = (batch_norm_rerun_shares(self.recording.graph, self.device)
                            if batch_norm_from_stats else {})
        # the bytes each op holds only while it runs (workspaces): measured with the captured
        # step's op times (capture()); until then unknown, so none
        self.scratch: dict[int, int] = {}
        # the roofline estimates: the cold start's op times (and capture's fallback)
        self.estimated_op_ms = estimate_op_times(self.recording.graph, peak_flops, peak_bytes_per_s)
        self.times = OpTimeModel(self.estimated_op_ms)
        self.captured_vanilla_ms: float | None = None   # see capture()
        self._graph: GraphStep | None = None            # see replay()
        self._graph_plan: Plan | None = None
        self.captures = 0                               # graphs captured by capture()
        self.capture_s: list[dict[str, float]] = []     # each capture's set-up: see capture()
        vanilla_peak = int(self.recording.timeline(self.times.op_ms).vanilla_curve().max())
        self.budget_bytes = resolve_budget(budget, self.device, vanilla_peak, self.simulate)
        hint = fragmentation_hint(self.budget_bytes, self.device, expandable_segments)
        if hint:
            warnings.warn(hint, stacklevel=2)

        self.replans = 0
        self.drift_events = 0
        self.planner_ms_total = 0.0
        self._warned_unmet = False   # see _plan()
        self.client: TensileClient | None = None
        self.plans_received = 0
        # cold start: estimated op times only (the scheduler's plan, if any, comes below)
        self.plan = self._plan() if scheduler_socket is None else self._vanilla_plan()
        self.runner = PlanRunner(self.recording, model, optimizer, loss_fn, self.plan,
                                 simulate=self.simulate,
                                 batch_norm_from_stats=batch_norm_from_stats)
        self._measure_next = replan
        if scheduler_socket is not None:  # registered last: nothing after it can fail
            options = {"allow_recompute": allow_recompute,
                       "allow_cross_iteration": allow_cross_iteration,
                       "min_swap_bytes": self.min_bytes}
            if swap_cost_ms:
                options["swap_cost_ms"] = float(swap_cost_ms)
            if swap_copy_share:
                options["swap_copy_share"] = float(swap_copy_share)
            self.client = TensileClient(scheduler_socket, job_id, weight,
                                        **(client_kwargs or {}), options=options)
            self._server_plan: Plan | None = None
            self._last_contact = time.monotonic()
            self._take(self.client.register(self.timeline, bandwidths=(self.d2h_bw, self.h2d_bw)))

    # ------------------------------------------------------------------ public
    @property
    def timeline(self) -> AccessTimeline:
        """The access timeline with the current op-time estimates."""
        return self.recording.timeline(self.times.op_ms, self.rerun_share, self._planned_scratch)

    @property
    def _planned_scratch(self) -> dict[int, int] | None:
        """The workspaces plans count: :attr:`scratch`, or None with ``count_workspaces=False``."""
        return self.scratch if self.count_workspaces else None

    def bound(self) -> dict:
        """How little extra time any plan of this step's moves could cost under the budget
        (:func:`tensile.bound.extra_time_bound` on :attr:`timeline`, the op times the
        current plan was priced with): ``bound_ms`` with rebuilds only, ``bound_swaps_ms``
        with swaps too (at the plan's bandwidths), beside the plan's own
        ``plan_overhead_ms`` in :meth:`SchedulerReport.plan_figures`, each copy and swap
        priced as the planner prices them; None where no plan of these moves fits. Empty
        without a budget (nothing to bound)."""
        if self.budget_bytes is None:
            return {}
        tl = self.timeline
        alone = extra_time_bound(tl, self.budget_bytes, min_bytes=self.min_bytes)
        options = self._planner_options() or {}
        swapped = extra_time_bound(tl, self.budget_bytes, d2h_bw=self.plan.d2h_bytes_per_s,
                                   h2d_bw=self.plan.h2d_bytes_per_s, min_bytes=self.min_bytes,
                                   copy_latency_ms=self.copy_latency_ms,
                                   swap_cost_ms=options.get("swap_cost_ms", 0.0),
                                   swap_copy_share=options.get("swap_copy_share", 0.0))
        return {"bound_ms": alone.extra_ms, "bound_swaps_ms": swapped.extra_ms}

    def snapshot(self, **meta) -> PlanningSnapshot:
        """The current plan with what it was planned from (:attr:`timeline`, budget, copy
        bandwidths): :meth:`PlanningSnapshot.save` it to plan again offline, on the CPU,
        with this machine's op times. ``meta``: facts to keep with it (model, GPU, ...)."""
        return PlanningSnapshot(timeline=self.timeline, budget_bytes=self.budget_bytes,
                                d2h_bw=self.d2h_bw, h2d_bw=self.h2d_bw,
                                copy_latency_ms=self.copy_latency_ms, min_bytes=self.min_bytes,
                                plan=self.plan, meta=dict(meta),
                                options=self._planner_options())

    def _planner_options(self) -> dict | None:
        """The options TENSILE's planner plans with here; None for another planner."""
        ours = isinstance(self.planner, functools.partial) and self.planner.func is make_plan
        return dict(self.planner.keywords) if ours else None

    def step(self, *batch) -> torch.Tensor:
        """One training step under the current plan; returns the (detached) loss."""
        if _signature(batch) != self._example:
            raise ValueError(f"batch {_signature(batch)} differs from the example batch "
                             f"{self._example}: the plan is for one op sequence, so every "
                             "batch needs the example's shapes, dtypes and devices")
        init = self._init_pending
        measure = self._measure_next and not init
        start_s = time.monotonic()
        if init and streamed_of(self.optimizer) is not None:
            # A streamed optimizer (tensile.streamed) without state updates after backward,
            # not in it: this first step's backward differs from the recording, so it runs
            # unplanned (it creates the state, which then moves to the host).
            res = StepResult(loss=training_step(self.model, self.optimizer, batch, self.loss_fn))
        else:
            res = self.runner.step(batch, measure_ops=measure, init_step=init)
        self._init_pending = False
        if res.op_ms is not None:
            self.times.update(res.op_ms)
            self._measure_next = False
            if self.client is None:
                self.plan = self._plan()
                self.runner.set_plan(self.plan)
                self.replans += 1
        elif (self.replan_enabled and not init and res.iter_ms is not None
              and self.times.drifted(res.iter_ms)):
            # With a scheduler process this only times the next step's ops; the
            # scheduler re-plans on its own drift test of the reported iteration times.
            self.drift_events += 1
            self._measure_next = True
        if self.client is not None:
            self._talk_to_scheduler(res.iter_ms if not init else None, res.op_ms, start_s)
        return res.loss

    def capture(self, *batch, warmup: int = 1, plan_for_graph: bool = True,
                time_copies: bool = False, swap_search: str | None = None) -> GraphStep:
        """This scheduled step captured into one CUDA graph (:mod:`tensile.graph`): calling
        the result with a batch runs forward, backward and ``optimizer.step()`` with the
        plan's copies and recomputes, and no host work.

        Run one ordinary :meth:`step` first: it creates the optimizer's state (the graph
        must not). ``plan_for_graph`` (default) re-plans for the captured step's own
        timing first: the vanilla step is captured and timed (``captured_vanilla_ms``),
        and each op's time in a graph of it replaces the eager-measured one.
        Op times measured in eager mode include the host's gaps between kernels; on a
        host-bound step they make the iteration several times longer than the replay
        (ResNet-50 b=16 on an H200: 38 ms planned, 11 ms captured), and a plan made with
        them expects copies to hide that cannot. ``plan_for_graph=False`` captures the
        current plan as it is.

        The graph keeps the plan it was captured with (no re-plan, no drift test); the
        optimizer must be capturable and the plan must keep parameters and optimizer
        state on the device (``allow_cross_iteration=False``). A job planned by a scheduler
        process sends the captured step's op times to it (``retimed``), captures the plan
        that comes back, and should train with :meth:`replay`, which captures again when
        the scheduler sends a new plan (another job came or left).

        ``time_copies=True`` records timing events around every copy in the graph, so that
        ``runner.captured_copy_rates()`` tells the copies' bandwidths after a replay; they
        slow each wait for a copy (about 10 µs against 1-3 on the H200), so they are off by
        default.

        ``swap_search`` (local planning, with ``plan_for_graph``): the graph's plan searches
        this way (see the class), and later plans too. The search pays off only in the plan
        the graph keeps: with ``"always"`` here and the default at construction, the eager
        steps before the capture plan in seconds (Inception-v4 at b=16: a minute a plan
        with the search).

        Each capture appends where its set-up time went to :attr:`capture_s`, in seconds:
        with ``plan_for_graph``, ``time_vanilla`` (the vanilla step captured and timed),
        ``profile_ops`` (its op times) and ``plan`` (planning, or waiting for the scheduler
        process's plan); always ``warmup`` and ``capture`` (:attr:`GraphStep.setup_s`).
        """
        if swap_search is not None:
            check_swap_search(swap_search)
            if self._planner_options() is None or self.client is not None:
                raise _not_for_this_planner("swap_search", swap_search)
            if not plan_for_graph:
                raise ValueError(f"swap_search={swap_search!r} plans for the graph; it needs "
                                 "plan_for_graph=True")
        if self.simulate:
            raise ValueError("capture needs CUDA; this scheduler simulates on the CPU")
        if self.client is not None and self.allow_cross:
            raise ValueError("a job planned by a scheduler process captures its step only with "
                             "allow_cross_iteration=False (a graph keeps the addresses of "
                             "parameters and optimizer state)")
        if self._init_pending:
            raise ValueError("run one step() first: it creates the optimizer's state, which "
                             "must exist before the capture")
        if _signature(batch) != self._example:
            raise ValueError(f"batch {_signature(batch)} differs from the example batch "
                             f"{self._example}")
        self.runner.check_capturable()
        phases: dict[str, float] = {}
        if plan_for_graph:
            if swap_search is not None:   # a partial of the partial: its keywords merged
                self.planner = functools.partial(self.planner, swap_search=swap_search)
            phases = self._plan_for_captured_step(batch, warmup)
        self._graph_plan = self.plan
        self.runner.time_captured_copies = time_copies
        graph = GraphStep(lambda b, capturing: self.runner.step(b, capturing=capturing).loss,
                          batch, self.model, self.optimizer, warmup=warmup)
        self.captures += 1
        self.capture_s.append({**phases, **graph.setup_s})
        return graph

    @property
    def graph(self) -> GraphStep | None:
        """The graph :meth:`replay` replays now (None before its first capture)."""
        return self._graph

    @property
    def graph_is_current(self) -> bool:
        """Whether the next :meth:`replay` replays the graph it has, without capturing: a
        graph exists and the current plan is its plan or does what it does."""
        return self._graph is not None and not self._graph.stale and (
            self.plan is self._graph_plan or self.plan.same_actions(self._graph_plan))

    def replay(self, *batch) -> torch.Tensor:
        """One training step as a CUDA graph replay; returns the loss (overwritten by the
        next call).

        The first call runs an ordinary :meth:`step` if none ran yet, then captures
        (:meth:`capture`); later calls replay, and capture again whenever the plan has
        changed since (a scheduler process pushed a new one: it is asked at most every
        second, between replays) or :func:`tensile.trim_stack`, :func:`tensile.compact` or
        :func:`tensile.trim_blas_workspace` ran since the capture (the graph is ``stale``).
        The graph's memory goes back before a new capture.
        """
        if self._init_pending:
            return self.step(*batch)
        if self.client is not None and time.monotonic() - self._last_contact >= _HEARTBEAT_S:
            self.heartbeat()
        if self._graph is not None and self.plan is not self._graph_plan \
                and self.plan.same_actions(self._graph_plan):
            self._graph_plan = self.plan   # a new plan that does the same: the graph serves it
        if self._graph is None or self._graph.stale or self.plan is not self._graph_plan:
            # the graph's op times are measured once; a new plan is captured as it comes,
            # and a stale graph (captured before a trim or compaction) is captured again
            graph_timed = self._graph is not None or self.captured_vanilla_ms is not None
            self._graph = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._graph = self.capture(*batch, plan_for_graph=not graph_timed)
        return self._graph(*batch)

    def _plan_for_captured_step(self, batch: Sequence, warmup: int) -> dict[str, float]:
        """Re-plan with the op times of the step as a CUDA graph runs it; returns the seconds
        each part took (see :meth:`capture`).

        Each op's time comes from one graph of the vanilla step with an event after every
        op (:func:`tensile.optimes.step_op_profile`): no host gaps. They are scaled to add
        up to the plain graph's replay time (the events slow the instrumented graph down),
        the quietest of several rounds (:meth:`tensile.GraphStep.replay_ms`). The same
        capture measures each op's workspace (:attr:`scratch`), which the plan counts.
        Should that step's op count differ from the recording's, the roofline estimates
        scaled the same way stand in. The timing steps train: model, optimizer state and
        the CUDA RNG are put back afterwards. With a scheduler process, the op times go to
        it (``retimed``) and its new plan is awaited (at most ``_RETIME_WAIT_S``).
        """
        t0 = time.perf_counter()
        vanilla = GraphStep(lambda b, capturing: training_step(self.model, self.optimizer, b,
                                                               self.loss_fn),
                            batch, self.model, self.optimizer, warmup=warmup)
        self.captured_vanilla_ms = vanilla.replay_ms(_TIMING_REPLAYS, _TIMING_ROUNDS, _TIMING_GAP_S)
        del vanilla                    # its private pool goes back before the real capture
        t1 = time.perf_counter()
        with step_state_kept(self.model, self.optimizer):
            profile = step_op_profile(self.model, self.optimizer, batch, self.loss_fn)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        t2 = time.perf_counter()
        op_ms = profile.op_ms
        if len(op_ms) != len(self.estimated_op_ms):
            log.warning("the captured step ran %d ops, the recording has %d: planning with the "
                        "roofline estimates scaled to its replay time, and without workspaces",
                        len(op_ms), len(self.estimated_op_ms))
            op_ms = self.estimated_op_ms
        else:
            self.scratch = profile.scratch
        # The events between the ops cost the instrumented graph some of its overlap (of a
        # streamed optimizer's copies with compute above all): its op times add up to more
        # than the plain replay (1.03-1.10x unstreamed, 1.17-1.47x streamed). The plan is for
        # the replay, so they are scaled to add up to it: an allowance of max_overhead x the
        # step is then one of the step the GPU runs.
        self.times.reset(scaled_op_times([max(t, 1e-6) for t in op_ms],   # an op may time at
                                         self.captured_vanilla_ms))        # 0 after the gap
        if self.client is not None:
            before = self.client.version
            self._ask(functools.partial(self.client.report, self.captured_vanilla_ms,
                                        self.times.op_ms, retimed=True,
                                        scratch=self._planned_scratch))
            self._take(self.client.wait_for_plan(before, _RETIME_WAIT_S))
            self._last_contact = time.monotonic()
            if self.client.version <= before:
                log.warning("no plan for the captured step within %g s; capturing the current one",
                            _RETIME_WAIT_S)
        else:
            self.plan = self._plan()
            self.runner.set_plan(self.plan)
            self.replans += 1
        self.runner.check_capturable()   # a custom planner might move state across iterations
        return {"time_vanilla": t1 - t0, "profile_ops": t2 - t1, "plan": time.perf_counter() - t2}

    def heartbeat(self) -> None:
        """Tell the scheduler process the job is alive (during long pauses between steps).

        Also takes a plan the scheduler pushed meanwhile. No-op when planning locally.
        """
        if self.client is not None:
            self._ask(self.client.heartbeat)
            self._last_contact = time.monotonic()

    def close(self) -> None:
        """Leave the scheduler process (the other jobs are re-planned) and run vanilla.

        Every parameter is back on the device afterwards. Planning locally, only that.
        Later :meth:`step` calls still train, without a plan when a scheduler was used.
        """
        if self.client is not None:
            self.client.close()
            self._take(None)
        self.restore_parameters()

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
            host_pool_bytes=s.host_pool_bytes, stall_ms=s.stall_ms,
            plan_iteration_ms=self.plan.iteration_ms,
            plan_d2h_bytes_per_s=self.plan.d2h_bytes_per_s,
            plan_h2d_bytes_per_s=self.plan.h2d_bytes_per_s, timed_steps=s.timed_steps,
            timed_d2h_bytes=s.timed_d2h_bytes, timed_d2h_ms=s.timed_d2h_ms,
            timed_h2d_bytes=s.timed_h2d_bytes, timed_h2d_ms=s.timed_h2d_ms,
            chained_recomputes=self.plan.chained_recomputes,
            bn_rerun_share_median=self._bn_rerun_share_median(),
            recomputes_by_op=dict(collections.Counter(
                base_name(self.recording.graph.nodes[r.producer_op].name) for r in self.plan.recomputes)),
            scratch_max_bytes=max(self.scratch.values(), default=0),
            swaps_priced_ms=max(0.0, self.plan.est_overhead_ms
                                - sum(r.cost_ms for r in self.plan.recomputes)),
            **self._server_fields())

    # ------------------------------------------------------------------ internals
    def _talk_to_scheduler(self, iter_ms: float | None, op_ms: list[float] | None,
                           start_s: float) -> None:
        """Report the finished step and switch to the plan the scheduler sends, if new."""
        c = self.client
        now = time.monotonic()
        if iter_ms is not None and iter_ms > 0:
            # op_ms only with its own step's iter_ms (a timed step reports both). On the
            # GPU an untimed step's iter_ms is the previous step's; start_s still serves
            # the scheduler, which uses iteration starts modulo the period (the phase).
            self._ask(functools.partial(c.report, iter_ms, op_ms, iter_start_s=start_s))
        elif now - self._last_contact >= _HEARTBEAT_S:
            # No iteration time (init step; on the GPU the last one may not be done yet):
            # a heartbeat keeps the job registered and picks up pushed plans.
            self._ask(c.heartbeat)
        else:
            return
        self._last_contact = now

    def _ask(self, call: Callable[[], Plan | None]) -> None:
        """Make one client call and take the plan it returns.

        The client returns ``None`` on connection faults by itself; an error *reply*
        (e.g. the scheduler's planner failed on our re-registration) must not stop
        training either: the job keeps the plan the client holds and trains on.
        """
        try:
            plan = call()
        except SchedulerError as e:
            log.warning("TENSILE scheduler error (%s); training on with %s", e,
                        "its last plan" if self.client.plan is not None else "no plan")
            plan = self.client.plan
        self._take(plan)

    def _take(self, plan: Plan | None) -> None:
        """Run ``plan`` (``None``: vanilla) from the next step on, if it is a new one."""
        if plan is self._server_plan:  # the client keeps the object while nothing changed
            return
        self._server_plan = plan
        self.plan = plan if plan is not None else self._vanilla_plan()
        try:
            self.runner.set_plan(self.plan)  # between steps: parameters come back first
        except ValueError as e:  # does not fit the recording: a scheduler bug, never run it
            log.error("TENSILE scheduler sent a plan this job cannot run (%s); running vanilla", e)
            self.plan = self._vanilla_plan()
            self.runner.set_plan(self.plan)
            return
        self.plans_received += plan is not None

    def _bn_rerun_share_median(self) -> float | None:
        """The median share of a batch norm's time its rebuild costs (None: none priced)."""
        names = self.recording.graph.nodes
        bn = [v for k, v in self.rerun_share.items() if "batch_norm" in names[k].name]
        return statistics.median(bn) if bn else None

    def _vanilla_plan(self) -> Plan:
        """No swaps, no recomputation: what runs while the scheduler has no plan for us."""
        tl = self.timeline
        peak = int(tl.vanilla_curve().max())
        return Plan(num_ops=tl.num_ops, budget_bytes=None, d2h_bytes_per_s=self.d2h_bw,
                    h2d_bytes_per_s=self.h2d_bw, peak_before=peak, peak_after=peak,
                    iteration_ms=float(sum(tl.op_ms)))

    def _server_fields(self) -> dict:
        c = self.client
        if c is None:
            return {}
        return dict(scheduler_socket=str(c.socket_path), connected=c.connected,
                    job_id=c.job_id, plan_version=c.version if c.version >= 0 else None,
                    plan_reason=c.reason, plans_received=self.plans_received)

    def _plan(self) -> Plan:
        tl = self.timeline
        p = self.planner(tl, budget_bytes=self.budget_bytes, d2h_bw=self.d2h_bw,
                         h2d_bw=self.h2d_bw, copy_latency_ms=self.copy_latency_ms,
                         min_bytes=self.min_bytes)
        self.planner_ms_total += p.planner_ms
        unmet = p.budget_bytes is not None and not p.feasible
        if unmet and not self._warned_unmet:   # once, until a plan meets the budget again
            # (allow_recompute is an option of TENSILE's planner, not of a planner= given)
            recompute = (self._planner_options() or {}).get("allow_recompute", True)
            streamed = streamed_of(self.optimizer) is not None
            warnings.warn(unmet_budget_message(tl, p, allow_recompute=recompute,
                                               streamed=streamed), stacklevel=3)
        self._warned_unmet = unmet
        return p

    def _record_scaled(self, batch: Sequence, sizes: Sequence[int]) -> Recording:
        """The step at ``batch``'s size, scaled from steps recorded on its first ``sizes``
        samples (:mod:`tensile.scale`): a job that does not fit unplanned never runs whole
        before its plan does."""
        full = batch_size_of(batch)
        sizes = list(sizes)
        if not valid_record_batches(sizes, full):
            raise ValueError(f"record_batches: expected three or more different batch sizes "
                             f"between 1 and {full - 1} (the example batch has {full}); got {sizes}")
        recordings = [(b, self._record(slice_batch(batch, b))) for b in sizes]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return scale_recording(recordings, full)

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


def _not_for_this_planner(name: str, value) -> ValueError:
    """The error for an option of TENSILE's own planner given where another plans (a
    ``planner=``, or a scheduler process)."""
    return ValueError(f"{name}={value!r} is an option of TENSILE's own planner here; it does "
                      "not apply with planner= or scheduler_socket")


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
