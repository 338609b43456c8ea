"""Every way the TENSILE experiment runs one training step, behind one signature.

    step = make_method("checkpoint", model, optimizer, loss_fn, (x, y))
    loss = step((x, y))          # forward + loss + backward + optimizer.step()
    step.stats()                 # method-specific numbers (TENSILE: its report)

Methods (issue 6's baselines, measured in the same runs as TENSILE):

* ``vanilla``: plain PyTorch (:func:`tensile.step.training_step`, which all methods share,
  so they run the same step);
* ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around each block of the
  model (:func:`checkpoint_blocks` finds them);
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every tensor
  saved for backward goes to (pinned) host memory;
* ``sac``: selective activation checkpointing on the same blocks: outputs of convolutions
  and matrix products are kept, everything else is recomputed;
* ``compile_budget``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``
  (the min-cut partitioner recomputes until activations fit that fraction);
* ``tensile``: :class:`tensile.Scheduler`;
* ``vdnn``, ``vdnn_all``, ``capuchin``: the vDNN and Capuchin policies
  (:mod:`tensile.policies`) on TENSILE's runtime;
* ``graph``: the vanilla step captured into one CUDA graph (:mod:`tensile.graph`), and
  ``tensile_graph``: TENSILE's plan captured with it (two ordinary steps first: the
  optimizer's state, then a timed step whose copies give the row's measured bandwidths;
  the capture then re-plans with the op times of a graph of the vanilla step, see
  ``Scheduler.capture``). Both need CUDA and a
  capturable optimizer; they take the host out of the step, so what the plan costs is
  what it costs the GPU (``tensile_graph`` against ``graph``). ``tensile_graph``'s option
  ``stream_optimizer=<groups>`` first installs :func:`tensile.stream_optimizer` (the update
  in backward, Adam's state streamed from the host; 0: not; ``stream_prefetch``: its groups
  copied in ahead; ``stream_resident``: its first groups whose state stays on the device, or
  ``"auto"``: chosen by :func:`tensile.tune_resident` within ``stream_overhead`` of the step,
  for ``stream_jobs`` jobs sharing the link; ``stream_chunk_mb``: each update on at most that
  many MiB of parameters at a time); ``defer_wgrad_mb``: the weight gradients of linear
  layers of at least that many MiB made at backward's end (:func:`tensile.defer_weight_grads`;
  also ``streamed_graph``'s); ``time_copies=True``: timing events around
  the graph's copies (the row's ``*_gbps_captured``; they slow each wait for a copy, see
  ``Scheduler.capture``);
* ``streamed_graph``: the vanilla step captured with :func:`tensile.stream_optimizer`
  installed and no plan: what the streaming alone saves and costs (same options);
* ``checkpoint_graph``: ``checkpoint``'s step captured the same way, the like-for-like
  built-in for ``tensile_graph`` (CUDA, capturable optimizer; refused for a model with
  dropout or other random ops, see :func:`random_ops`).

``make_method`` changes ``model`` in place for ``checkpoint`` and ``sac`` (block forwards
are wrapped): give it a fresh model. Caveat of ``checkpoint`` and ``sac``: a BatchNorm
layer recomputed in backward updates its running statistics a second time, as
``torch.utils.checkpoint`` always does; parameters and gradients are exact.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from .api import Scheduler, gb_per_s
from .graph import GraphStep
from .defer import defer_weight_grads
from .policies import POLICIES
from .planner import CAPTURED_SWAP_COST_MS
from .step import training_step
from .resident import DEFAULT_STREAM_OVERHEAD, install_streamed
from .snapshot import PlanningSnapshot
from .streamed import DEFAULT_PREFETCH

__all__ = ["METHODS", "StepFn", "make_method", "checkpoint_blocks", "LayerRuns", "SAC_SAVE_OPS",
           "random_ops"]


@dataclass
class StepFn:
    """One training step of a method: ``step(batch)`` returns the detached loss."""

    name: str
    run: Callable[[Sequence], torch.Tensor]
    stats: Callable[[], dict] = field(default=lambda: {})
    # methods run on TENSILE's runtime: their plan with what it was planned from
    # (:meth:`tensile.Scheduler.snapshot`); None for the others
    snapshot: Callable[..., PlanningSnapshot] | None = None

    def __call__(self, batch: Sequence) -> torch.Tensor:
        return self.run(batch)


# --------------------------------------------------------------------------- blocks

_LAYERS = (nn.modules.conv._ConvNd, nn.Linear)


def _layers(m: nn.Module) -> int:
    """Convolutions and linear layers in ``m``: the unit of "how big is this block"."""
    return sum(isinstance(x, _LAYERS) for x in m.modules())


def _is_leaf(m: nn.Module) -> bool:
    return next(m.children(), None) is None


@dataclass
class LayerRuns:
    """An ``nn.Sequential`` of plain layers cut into runs, each run checkpointed as a unit."""

    seq: nn.Sequential
    runs: list[list[nn.Module]]


def checkpoint_blocks(model: nn.Module, layers_per_block: int | None = None
                      ) -> list[nn.Module | LayerRuns]:
    """The units to checkpoint: whole modules, or runs of layers of an ``nn.Sequential``.

    Walks the module tree from the top: a child with at most ``layers_per_block``
    conv/linear layers is one unit (a ResNet bottleneck, an Inception block, a DenseNet
    layer); an ``nn.Sequential`` of plain layers (VGG's ``features``) is cut into runs of
    that many layers, each run starting at a conv/linear layer so that no unit starts
    with an in-place op on its input; any other larger child is searched further. Single
    layers outside any unit stay as they are. The default size, ``round(sqrt(L))`` for
    ``L`` layers in the model, is the classic sqrt(n) segmenting.
    """
    total = _layers(model)
    if total == 0:
        raise ValueError("the model has no conv or linear layers to checkpoint around")
    if layers_per_block is not None and layers_per_block < 1:
        raise ValueError(f"layers_per_block must be >= 1, got {layers_per_block}")
    cap = layers_per_block or max(1, round(math.sqrt(total)))
    units: list[nn.Module | LayerRuns] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            n = _layers(child)
            if n == 0 or _is_leaf(child):
                continue
            if n <= cap:
                units.append(child)
            elif _is_chain(child):
                units.append(LayerRuns(child, _runs(child, cap)))
            else:
                visit(child)

    if _is_chain(model):
        units.append(LayerRuns(model, _runs(model, cap)))
    else:
        visit(model)
    return units


def _is_chain(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and all(_is_leaf(c) for c in m)


def _runs(seq: nn.Sequential, cap: int) -> list[list[nn.Module]]:
    """Consecutive layers of ``seq``, a new run starting at every ``cap``-th conv/linear."""
    runs: list[list[nn.Module]] = [[]]
    count = 0
    for layer in seq:
        if isinstance(layer, _LAYERS):
            if count == cap:
                runs.append([])
                count = 0
            count += 1
        runs[-1].append(layer)
    return runs


def _wrap_blocks(model: nn.Module, context_fn: Callable | None,
                 layers_per_block: int | None, preserve_rng_state: bool = True) -> int:
    """Make every unit of :func:`checkpoint_blocks` run under ``checkpoint``; returns how many."""
    kw = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if context_fn is not None:
        kw["context_fn"] = context_fn
    count = 0
    for u in checkpoint_blocks(model, layers_per_block):
        # An instance attribute shadows the class's forward; module hooks still run.
        if isinstance(u, LayerRuns):
            def forward(x, _runs=u.runs):
                for run in _runs:
                    x = checkpoint(_run_layers, run, x, **kw)
                return x
            u.seq.forward = forward
            count += len(u.runs)
        else:
            u.forward = _checkpointed(u.forward, kw)
            count += 1
    return count


def _checkpointed(fn: Callable, kw: dict) -> Callable:
    def forward(*args, **kwargs):
        # Recomputation calls fn again with these very argument objects. DenseNet appends to
        # the list of features it passed in right after the call: freeze lists as they are.
        args = tuple(list(a) if isinstance(a, list) else a for a in args)
        return checkpoint(fn, *args, **kw, **kwargs)
    return forward


def _run_layers(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


# Selective activation checkpointing: keep what is expensive to recompute.
SAC_SAVE_OPS = frozenset({
    torch.ops.aten.convolution.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
})


def _sac_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# --------------------------------------------------------------------------- methods

def _vanilla(model, optimizer, loss_fn, example_batch) -> StepFn:
    return StepFn("vanilla", lambda b: training_step(model, optimizer, b, loss_fn))


def _checkpoint(model, optimizer, loss_fn, example_batch, *,
                layers_per_block: int | None = None) -> StepFn:
    n = _wrap_blocks(model, None, layers_per_block)
    return StepFn("checkpoint", lambda b: training_step(model, optimizer, b, loss_fn),
                  lambda: {"blocks": n})


def _sac(model, optimizer, loss_fn, example_batch, *,
         layers_per_block: int | None = None) -> StepFn:
    # SAC refuses in-place updates of an output it keeps (VGG's ReLU(inplace=True) right
    # after each conv): activation modules of the model run out of place.
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
    ctx = functools.partial(create_selective_checkpoint_contexts, _sac_policy)
    n = _wrap_blocks(model, ctx, layers_per_block)
    return StepFn("sac", lambda b: training_step(model, optimizer, b, loss_fn),
                  lambda: {"blocks": n})


def _save_on_cpu(model, optimizer, loss_fn, example_batch, *,
                 pin_memory: bool | None = None) -> StepFn:
    cuda = next(model.parameters()).device.type == "cuda"
    pin = cuda if pin_memory is None else pin_memory
    if pin and not cuda:
        raise ValueError("pin_memory=True needs a CUDA model (pinned memory is for copies to a GPU)")

    def run(b):
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return training_step(model, optimizer, b, loss_fn)
    return StepFn("save_on_cpu", run, lambda: {"pin_memory": pin})


def _compile_budget(model, optimizer, loss_fn, example_batch, *,
                    activation_memory_budget: float = 0.5) -> StepFn:
    b = activation_memory_budget
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 1:
        raise ValueError(f"activation_memory_budget must be in [0, 1], got {b!r}")
    compiled = torch.compile(model)

    def run(batch):
        # Read when the backward graph is partitioned, i.e. at (re)compilation inside a step.
        with torch._functorch.config.patch(activation_memory_budget=float(b)):
            return training_step(compiled, optimizer, batch, loss_fn)
    return StepFn("compile_budget", run, lambda: {"activation_memory_budget": float(b)})


def _graph_stats(graph: GraphStep) -> dict:
    mib = 2**20
    return {"graph_peak_mb": graph.peak_bytes / mib, "graph_pool_mb": graph.pool_bytes / mib,
            "graph_reserved_mb": graph.reserved_bytes / mib,
            "capture_s": _seconds(graph.setup_s)}


def _seconds(phases: dict[str, float]) -> dict[str, float]:
    """A capture's set-up seconds by part, to the millisecond."""
    return {k: round(v, 3) for k, v in phases.items()}


class _SeededOps(TorchDispatchMode):
    """Names the ops that draw random numbers (tagged ``nondeterministic_seeded``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.names.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def random_ops(model: nn.Module, example_batch: Sequence) -> set[str]:
    """The random ops (dropout, ...) one forward of ``model`` on ``example_batch[0]`` runs.

    The module's state (batch-norm statistics) and the RNGs are as before afterwards.
    """
    device = example_batch[0].device
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.no_grad(), _SeededOps() as seeded:
        model(example_batch[0])
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(saved[k])
    return seeded.names


def _checkpoint_graph(model, optimizer, loss_fn, example_batch, *,
                      layers_per_block: int | None = None) -> StepFn:
    """``checkpoint``'s step captured into one CUDA graph: the built-in that saves memory the
    way TENSILE's recomputes do, with the host out of the step as in ``tensile_graph``.

    Refused for a model that draws random numbers: ``torch.utils.checkpoint`` restores the
    CUDA RNG for a recompute by reading its state, which a capture does not allow (on the
    torch versions we support), and without that a recomputed dropout mask would differ.
    """
    drawn = random_ops(model, example_batch)
    if drawn:
        raise ValueError(f"checkpoint_graph needs a model that draws no random numbers in its "
                         f"forward (its recompute could not replay them inside a CUDA graph); "
                         f"this one runs {', '.join(sorted(drawn))}")
    n = _wrap_blocks(model, None, layers_per_block, preserve_rng_state=False)
    captured = _graph(model, optimizer, loss_fn, example_batch)   # the wrapped step, captured
    return StepFn("checkpoint_graph", captured.run, lambda: {"blocks": n, **captured.stats()})


def _graph(model, optimizer, loss_fn, example_batch) -> StepFn:
    graph = GraphStep(lambda b, capturing: training_step(model, optimizer, b, loss_fn),
                      example_batch, model, optimizer)
    return StepFn("graph", lambda b: graph(*b), lambda: _graph_stats(graph))


def _streamed_graph(model, optimizer, loss_fn, example_batch, *, stream_optimizer: int = 16,
                    stream_prefetch: int = DEFAULT_PREFETCH, stream_resident: int | str = 0,
                    stream_overhead: float = DEFAULT_STREAM_OVERHEAD, stream_jobs: int = 1,
                    stream_chunk_mb: float | None = None, stream_slice_mb: float | None = None,
                    stream_slice_resident: int = 0, stream_pace: bool = False,
                    defer_wgrad_mb: float | None = None) -> StepFn:
    """The vanilla step captured with the optimizer streamed (:func:`tensile.stream_optimizer`)
    and no TENSILE plan: the streaming's own saving and cost, beside ``graph``."""
    device = next(model.parameters()).device
    if device.type != "cuda":   # said before the optimizer is changed
        raise ValueError(f"streamed_graph captures a CUDA graph: it needs a CUDA model (model on {device})")
    _defer(model, defer_wgrad_mb)
    streamed = install_streamed(model, optimizer, example_batch, loss_fn, groups=stream_optimizer,
                                prefetch=stream_prefetch, resident=stream_resident,
                                max_overhead=stream_overhead, jobs=stream_jobs,
                                update_chunk_mb=stream_chunk_mb, slice_mb=stream_slice_mb,
                                slice_resident=stream_slice_resident, pace=stream_pace)
    captured = _graph(model, optimizer, loss_fn, example_batch)
    return StepFn("streamed_graph", captured.run,
                  lambda: {**captured.stats(), **_stream_stats(streamed)})


def _tensile_graph(model, optimizer, loss_fn, example_batch, *, budget=None, simulate=None,
                   stream_optimizer: int = 0, stream_prefetch: int = DEFAULT_PREFETCH,
                   stream_resident: int | str = 0, stream_overhead: float = DEFAULT_STREAM_OVERHEAD,
                   stream_jobs: int = 1, stream_chunk_mb: float | None = None,
                   stream_slice_mb: float | None = None, stream_slice_resident: int = 0,
                   stream_pace: bool = False, defer_wgrad_mb: float | None = None,
                   time_copies: bool = False,
                   **scheduler_kwargs) -> StepFn:
    device = next(model.parameters()).device
    if simulate or device.type != "cuda":
        raise ValueError(f"tensile_graph captures a CUDA graph: it needs a CUDA model and no "
                         f"simulation (model on {device}, simulate={simulate})")
    _defer(model, defer_wgrad_mb)
    scheduler_kwargs.setdefault("allow_cross_iteration", False)  # a graph keeps their addresses
    scheduler_kwargs.setdefault("swap_cost_ms", CAPTURED_SWAP_COST_MS)  # its joins, per swap
    if stream_optimizer:   # the update in backward, state streamed from the host (groups)
        streamed = install_streamed(model, optimizer, example_batch, loss_fn,
                                    groups=stream_optimizer, prefetch=stream_prefetch,
                                    resident=stream_resident, max_overhead=stream_overhead,
                                    jobs=stream_jobs, h2d_bw=scheduler_kwargs.get("h2d_bw"),
                                    d2h_bw=scheduler_kwargs.get("d2h_bw"),
                                    update_chunk_mb=stream_chunk_mb, slice_mb=stream_slice_mb,
                                    slice_resident=stream_slice_resident, pace=stream_pace)
    # The search pays off only in the plan the graph keeps; the eager steps plan without it
    # ("always" takes a minute a plan on Inception-v4, and they plan twice).
    search = scheduler_kwargs.pop("swap_search", None)
    sched = Scheduler(model, optimizer, example_batch, loss_fn, budget, **scheduler_kwargs)
    for _ in range(2):  # the optimizer's state, then a timed step (its copies' bandwidths)
        sched.step(*example_batch)
    graph = sched.capture(*example_batch, time_copies=time_copies, swap_search=search)
    report = sched.report()   # the captured plan's (the graph keeps it: no later re-plan)
    # the least any plan could have been priced at (budgeted plans): a linear program that
    # takes up to a second, solved when first asked, so it stays out of the prepare time
    bound = functools.cache(sched.bound)

    def stats() -> dict:
        copies = sched.runner.captured_copy_rates()   # in the latest replay
        return {**_graph_stats(graph), **report.plan_figures(), **report.plan_check(), **bound(),
                "d2h_gbps_captured": gb_per_s(copies["d2h_bytes_per_s"]),
                "h2d_gbps_captured": gb_per_s(copies["h2d_bytes_per_s"]),
                "copy_ms_captured": copies["copy_ms"],
                # every replay repeats the captured step's copies: the plan's
                "bytes_moved_per_step": sched.plan.bytes_moved,
                # the replay time of the captured vanilla step the plan was made for
                "captured_vanilla_ms": sched.captured_vanilla_ms,
                # where the capture's set-up went: timing, profiling, planning too
                "capture_s": _seconds(sched.capture_s[-1]),
                **(_stream_stats(streamed) if stream_optimizer else {})}
    return StepFn("tensile_graph", lambda b: graph(*b), stats, sched.snapshot)


def _defer(model: nn.Module, min_mb: float | None) -> None:
    """``defer_wgrad_mb``: large linear layers' weight gradients at backward's end
    (:func:`tensile.defer_weight_grads`); None: not."""
    if min_mb is not None:
        defer_weight_grads(model, min_mb=min_mb)


def _stream_stats(streamed) -> dict:
    """A streamed method's figures: its groups, and what tune_resident chose if it ran."""
    return {"stream_groups": len(streamed.groups), "stream_resident_groups": streamed.resident,
            "stream_slices": sum(g.rows is not None for g in streamed.groups),
            "stream_slices_kept": streamed.slice_resident,
            **({"stream_paced": streamed.paced} if streamed.paced else {}),
            **({"stream_tuned": streamed.tuned} if streamed.tuned else {})}


def _scheduled(sched: Scheduler, name: str) -> StepFn:
    return StepFn(name, lambda b: sched.step(*b), lambda: dataclasses.asdict(sched.report()),
                  sched.snapshot)


def _tensile(model, optimizer, loss_fn, example_batch, *, budget=None, simulate=None,
             **scheduler_kwargs) -> StepFn:
    sched = Scheduler(model, optimizer, example_batch, loss_fn, budget, simulate=simulate,
                      **scheduler_kwargs)
    return _scheduled(sched, "tensile")


def _policy(name: str):
    def build(model, optimizer, loss_fn, example_batch, *, budget=None, simulate=None,
              **scheduler_kwargs) -> StepFn:
        if name == "capuchin" and budget is None:
            raise ValueError("capuchin needs a budget (bytes, or a fraction of the GPU); the "
                             "TENSILE authors gave it TENSILE's own planned peak")
        sched = Scheduler(model, optimizer, example_batch, loss_fn, budget, simulate=simulate,
                          planner=POLICIES[name], **scheduler_kwargs)
        return _scheduled(sched, name)
    return build


_BUILDERS: dict[str, Callable[..., StepFn]] = {
    "vanilla": _vanilla,
    "checkpoint": _checkpoint,
    "save_on_cpu": _save_on_cpu,
    "sac": _sac,
    "compile_budget": _compile_budget,
    "tensile": _tensile,
    "graph": _graph,
    "tensile_graph": _tensile_graph,
    "streamed_graph": _streamed_graph,
    "checkpoint_graph": _checkpoint_graph,
    "vdnn": _policy("vdnn"),
    "vdnn_all": _policy("vdnn_all"),
    "capuchin": _policy("capuchin"),
}
METHODS: tuple[str, ...] = tuple(_BUILDERS)

_SCHEDULER_OPTS = {n for n in inspect.signature(Scheduler.__init__).parameters
                   if n not in ("self", "model", "optimizer", "example_batch", "loss_fn")}


def make_method(name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                loss_fn: Callable | None, example_batch: Sequence, **opts) -> StepFn:
    """The training step of method ``name`` for this model (see the module docstring).

    ``opts`` are the method's own options: ``layers_per_block`` (checkpoint, sac,
    checkpoint_graph),
    ``pin_memory`` (save_on_cpu), ``activation_memory_budget`` (compile_budget),
    ``budget``, ``simulate`` and any :class:`tensile.Scheduler` keyword (tensile, vdnn,
    vdnn_all, capuchin; capuchin needs a ``budget``).
    """
    build = _BUILDERS.get(name)
    if build is None:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(METHODS)}")
    params = inspect.signature(build).parameters
    allowed = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        allowed |= _SCHEDULER_OPTS
    unknown = sorted(set(opts) - allowed)
    if unknown:
        raise ValueError(f"method {name!r} takes options {sorted(allowed) or 'none'}; "
                         f"got unknown {unknown}")
    return build(model, optimizer, loss_fn, example_batch, **opts)
