"""Execute a :class:`~tensile.plan.Plan` during real training steps.

Mechanism (reference §9, §11):

* the plan's "after op k" actions run between op ``k`` and op ``k + 1``, at the last
  *anchor* there: an event the recording located without intercepting ops (see
  :mod:`tensile.record`): a phase change, a module call (forward pre-/post-hook), a
  tensor autograd saves (pack hook), a backward node about to run (node pre-hook) or a
  saved tensor it unpacks (unpack hook). That is where a dispatch mode that sees op
  ``k + 1`` start would run them; where no anchor exists, the mode does. A managed
  activation is bound by output position (size checked): at the post-hook of the
  module that returns it, or else (and always when it has a recompute recipe, which
  needs the op's arguments) in its producing op, which a ``TorchDispatchMode`` must see;
* that mode costs ~15 us of host time per ATen op even when it does nothing
  (``python -m tensile.overhead`` measures it on the CPU; a GPU host pays as much or
  more), which dominates the overhead of host-bound models. So it is on only in short
  *windows* in forward and loss, opened and closed by forward hooks of the modules
  around the ops that need it (module hooks run between ops; switching the mode inside
  an op's dispatch would hide that op from it), and for the whole backward or optimizer
  phase if one of its ops needs it (backward keeps the modes that were on when it
  started; the optimizer has no anchors). Within the mode, an op with nothing planned
  costs one identity compare of its ``OpOverload`` with the recorded one, then the call;
* op-sequence check (:class:`PlanMismatchError`): the first step after every
  (re)plan, timed steps, the step that creates the optimizer state and every step with
  ``check_every_step`` run entirely under the mode and compare every op, and every
  anchor's op count, with the recording. Other steps compare the ops inside windows,
  the backward graph's node types (breadth-first from the loss), that every hooked node
  ran and, where autograd's pack/unpack hooks are installed (only when the plan needs
  them: ~1 us per saved tensor), the number of tensors saved and unpacked at every
  phase change. Trade-off: an op outside the windows that changes without changing the
  autograd graph or the saved tensors (e.g. one op under ``no_grad`` replaced by
  another) goes unnoticed on those steps; the bindings still check storage sizes;
* ``saved_tensors_hooks`` hand autograd a small handle instead of a managed activation,
  so the device copy can be dropped; unpacking in backward brings it back;
* swap-outs are copied on a dedicated device→host stream into one pinned host pool
  (allocated once, sized from the plan), swap-ins on a host→device stream; CUDA events
  order the copies against the compute stream, never host timers;
* a tensor that is not back when backward unpacks it is swapped in synchronously on the
  compute stream: a *passive* swap-in, counted (TENSILE's plan-quality measure); on
  timed steps the compute stream's waits for copy-ins are timed with events (stalls);
* recomputation reruns the producing op from the inputs it read, kept by reference
  (the planner checked they stay resident and unmodified), then the in-place ops that
  updated the tensor in forward (``ReLU(inplace=True)``, a residual ``add_``: noted
  when they run, the tensor itself kept as a placeholder). A batch norm reruns on
  copies of its running statistics (it updated the real ones once already), or, with
  ``batch_norm_from_stats``, a training-mode one's output is rebuilt from the batch mean
  and inverse std the op returned, with no statistics pass (:func:`_batch_norm_apply`:
  faster, equal to rounding, not bit for bit; with the residual ``add_`` and
  ``ReLU(inplace=True)`` after it, one kernel, :func:`tensile.fused.batch_norm_act`). An input
  that is itself a managed activation is kept as a reference to its entry, not to its
  memory, and brought back first (recomputed or copied in) when the recompute runs, or,
  where the plan says so (``Recompute.transient``), rebuilt for that recompute alone;
* a recompute with an ``issue_op`` (``plan(rebuild_ahead=...)``) runs right after that op on
  a third side stream instead of when backward first needs it; the compute stream waits on
  an event before its first use (:meth:`PlanRunner._rebuild_ahead` says why that is safe);
* parameters swapped across the iteration boundary are copied out after their update
  and become pinned host tensors (``p.data``) when the *next* step starts, so between
  steps every parameter is the valid device tensor and no host synchronisation is
  needed (the copy-in waits for the copy-out with an event; ``record_stream`` keeps the
  old block from reuse until the copy has read it). They return in their module's
  forward pre-hook; optimizer state returns just before ``optimizer.step()``.

Capture (``step(..., capturing=True)`` inside ``torch.cuda.graph``, see
:mod:`tensile.graph`) records the same work once into a CUDA graph. Two things change,
because the caching allocator defers every block with a side-stream use to the end of
a capture (so ``record_stream`` would keep every swapped tensor's memory for the whole
step): a release makes the compute stream wait for that tensor's copy-out before it
drops the tensor, and a copied-in buffer is used only after the compute stream waited
for its copy, so neither needs ``record_stream``; at the end the copy streams join the
compute stream, as a capture requires. Plans that move parameters or optimizer state
across iterations are refused (a graph keeps their addresses), and so are timed steps.

Simulation mode (``simulate=True``, CPU tensors) does the same bookkeeping with plain
copies and no streams: it tests handles, positions, recomputation and counting on a
machine without a GPU. Memory and time are only meaningful on CUDA.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from .fused import batch_norm_act
from .plan import Plan, Recompute, Swap
from .record import Recording, autograd_nodes, device_tensors, is_counted, op_name
from .step import training_step
from .streams import side_stream

__all__ = ["PlanMismatchError", "RuntimeStats", "StepResult", "PlanRunner", "bytes_per_s"]

_ALIGN = 512  # host regions start on this many bytes (covers every dtype's alignment)


class PlanMismatchError(RuntimeError):
    """The step's ops differ from the recorded ones (data-dependent model?)."""


@dataclass
class RuntimeStats:
    """Counters over all steps run under a plan."""

    steps: int = 0
    swap_outs: int = 0
    swap_ins: int = 0          # all swap-ins, passive ones included
    passive_swap_ins: int = 0  # brought back on demand because not issued in time
    recomputes: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    ineffective_releases: int = 0  # released, but something else still held the memory
    host_pool_bytes: int = 0
    stall_ms: float = 0.0          # compute waiting for copy-ins, summed over timed steps
    # The copies of timed steps, each timed on its own stream (a copy's time starts when
    # its stream reaches it, so waiting for the compute stream or an earlier copy is not
    # counted): what the channels really deliver, against the plan's bandwidths.
    timed_steps: int = 0
    timed_d2h_bytes: int = 0
    timed_d2h_ms: float = 0.0
    timed_h2d_bytes: int = 0
    timed_h2d_ms: float = 0.0

    @property
    def passive_share(self) -> float:
        return self.passive_swap_ins / self.swap_ins if self.swap_ins else 0.0


def bytes_per_s(nbytes: int, ms: float) -> float | None:
    """``nbytes`` moved in ``ms`` as bytes per second; None when nothing was timed."""
    return nbytes / (ms / 1e3) if nbytes and ms > 0 else None


@dataclass
class StepResult:
    loss: torch.Tensor
    op_ms: list[float] | None = None   # measured per-op times (when asked for)
    iter_ms: float | None = None       # a recent measured iteration time, if available
    stall_ms: float | None = None      # compute waiting for copy-ins (timed steps only)


@dataclass
class _Meta:
    """How a saved tensor views its storage."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Entry:
    """One managed activation during one step.

    ``data`` is a uint8 tensor over the whole device storage while it is on the device
    (``None`` once released); ``ready`` an event the compute stream waits for before
    using ``data`` (after a swap-in or a rebuild ahead); ``out_done`` marks the end of the
    copy-out. ``held``: a rebuild ahead's recipe, kept (with the sources it references)
    until the compute stream has waited for it, so that no source's block is handed out
    again while the side stream may still read it.
    """

    def __init__(self, sid: int, nbytes: int, swap: Swap | None, rec: Recompute | None):
        self.sid, self.nbytes, self.swap, self.recompute = sid, nbytes, swap, rec
        self.data: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.out_done = None
        self.ready = None
        self.recipe = None        # (func, args, kwargs, output position) of the producer
        self.then: list = []      # (func, args, kwargs) of the in-place updates after it
        self.orig: StorageWeakRef | None = None
        self.live_handles = 0
        self.in_backward = False
        self.held = None

    def handle_dropped(self) -> None:
        self.live_handles -= 1
        if self.live_handles == 0 and self.in_backward:
            self.data = None  # autograd is done with it: free the device copy


class _Own:
    """In a recipe: the recomputed tensor itself (an in-place update's ``self``)."""

    __slots__ = ("meta",)

    def __init__(self, meta: _Meta):
        self.meta = meta


class _Scratch:
    """In a recipe: a tensor the op also writes (running statistics): replayed on a copy."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Ref:
    """In a recipe: another managed activation, brought back when the recipe runs."""

    __slots__ = ("entry", "meta")

    def __init__(self, entry: "_Entry", meta: _Meta):
        self.entry, self.meta = entry, meta


class _Packed:
    """What autograd stores instead of a managed activation."""

    __slots__ = ("entry", "meta")

    def __init__(self, entry: _Entry, meta: _Meta):
        self.entry, self.meta = entry, meta
        entry.live_handles += 1

    def __del__(self):
        self.entry.handle_dropped()


class _Persistent:
    """A parameter or optimizer-state tensor swapped across the iteration boundary."""

    def __init__(self, swap: Swap, host: torch.Tensor):
        self.swap = swap
        self.host = host          # uint8 host region
        self.meta: _Meta | None = None  # how the tensor views its storage (at copy-out)
        self.out_done = None
        self.copied_out = False  # copy issued, device copy dropped when the next step starts
        self.on_host = False     # obj.data currently points at the host region
        self.pending: torch.Tensor | None = None  # device uint8 buffer being filled
        self.ready = None


class _Mode(TorchDispatchMode):
    """Counts and checks the ops of a step; hands ops with planned work to the runner."""

    def __init__(self, runner: "PlanRunner"):
        super().__init__()
        self.runner = runner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Hot path: op k is the recorded one and nothing is planned at it (``_fast[k]``
        # holds its OpOverload; ``None`` where the runner must act, and past the end).
        r = self.runner
        k = r.k
        if func is r._fast[k]:
            r.k = k + 1
            return func(*args, **(kwargs or {}))
        return r._run_op(func, args, kwargs or {})


_WINDOW_PHASES = ("forward", "loss")  # module hooks can switch the mode on and off there
_END = float("inf")                   # a window that lasts to the end of its phase


@dataclass
class _Work:
    """What the runtime does at one anchor (see :class:`tensile.record.Anchor`)."""

    ops: int                                    # ops done there (checked under the mode)
    acts: list = field(default_factory=list)    # the plan's actions "before op ``ops``"
    binds: list[tuple[int, int]] = field(default_factory=list)  # (sid, module output position)
    toggle: bool | None = None                  # a mode window opens (True) or closes here


@dataclass
class _Schedule:
    """Where a plan's work happens during a step (worked out once per plan).

    The actions "before op c" (the plan's "after op c - 1") run where a dispatch mode
    that sees op ``c`` start would run them: at the phase change if op ``c - 1`` ends a
    phase, else at the last anchor before op ``c`` (nothing the step does lies between
    the two), else at op ``c`` itself, under the mode. Swapped activations are bound at
    the post-hook of the module that returns them where that hook runs right after the
    producing op and before autograd saves them; others in their op, under the mode.
    """

    at: dict[tuple, _Work] = field(default_factory=dict)      # anchor key -> work
    at_boundary: dict[int, list] = field(default_factory=dict)  # phase change -> actions
    at_op: dict[int, list] = field(default_factory=dict)      # op -> actions run as it starts
    grab_at_op: dict[int, list[int]] = field(default_factory=dict)  # op -> storages bound there
    slow_ops: set[int] = field(default_factory=set)           # ops the mode hands to the runner
    full_phases: set[str] = field(default_factory=set)        # run entirely under the mode
    window_at_boundary: set[int] = field(default_factory=set)  # windows that open with a phase


def _schedule(rec: Recording, before: dict[int, list], grabs: dict[int, list[int]],
              bindable: set[int], noted: set[int] = frozenset()) -> _Schedule:
    """Anchor the actions and bindings; put a mode window around every op that needs one.

    ``before``: op -> actions to run as it starts; ``grabs``: op -> managed storages it
    produces; ``bindable``: the storages a module hook may bind (they need no recipe);
    ``noted``: ops whose arguments the runner keeps (in-place updates a recompute replays).
    """
    s = _Schedule()
    anchors = rec.anchors

    def work(j: int) -> _Work:
        return s.at.setdefault(anchors[j].key, _Work(anchors[j].ops))

    first_boundary: dict[int, int] = {}
    for i, (_, ops, _, _) in enumerate(rec.boundaries):
        first_boundary.setdefault(ops, i)
    last_anchor = {a.ops: j for j, a in enumerate(anchors)}  # the last one of each count wins
    for c, acts in before.items():
        if c in first_boundary:
            s.at_boundary[first_boundary[c]] = acts
        elif c in last_anchor:
            work(last_anchor[c]).acts = acts
        else:
            s.at_op[c] = acts
    first_pack: dict[int, int] = {}
    posts: dict[int, list[int]] = {}  # ops done -> module post-hooks there
    for j, a in enumerate(anchors):
        if a.key[0] == "pack" and a.sids[0] is not None:
            first_pack.setdefault(a.sids[0], j)
        elif a.key[0] == "post":
            posts.setdefault(a.ops, []).append(j)
    for k, sids in grabs.items():
        for sid in sids:
            j = next((j for j in posts.get(k + 1, []) if sid in anchors[j].sids), None)
            if sid in bindable and j is not None and j < first_pack.get(sid, len(anchors)):
                work(j).binds.append((sid, anchors[j].sids.index(sid)))
            else:
                s.grab_at_op.setdefault(k, []).append(sid)
    s.slow_ops = set(s.at_op) | set(s.grab_at_op) | set(noted)
    # Windows open and close at module calls (forward pre-/post-hooks): plain Python
    # between two ops. Switching the mode inside an op's dispatch (in a pack hook, say)
    # would show that op's inner ops to the mode, or hide the op from it.
    calls: dict[str, list[int]] = {}  # phase -> its module hook anchors, in order
    for j, a in enumerate(anchors):
        if a.key[0] in ("pre", "post"):
            calls.setdefault(a.phase, []).append(j)
    b_ops = [b[1] for b in rec.boundaries]
    windows: dict[int, list[list]] = {}
    for x in sorted(s.slow_ops):
        i = bisect.bisect_right(b_ops, x) - 1  # the phase op x runs in
        phase = rec.boundaries[i][0]
        if phase not in _WINDOW_PHASES:
            s.full_phases.add(phase)
            continue
        js = calls.get(phase, [])
        ops = [anchors[j].ops for j in js]
        j_open = bisect.bisect_right(ops, x) - 1  # the last module call before op x
        j_close = bisect.bisect_left(ops, x + 1)  # the first one after it
        windows.setdefault(i, []).append([js[j_open] if j_open >= 0 else -1,
                                          js[j_close] if j_close < len(js) else _END])
    for i, ws in windows.items():
        merged: list[list] = []
        for w in sorted(ws):
            if merged and w[0] <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], w[1])
            else:
                merged.append(w)
        for start, end in merged:
            if start < 0:
                s.window_at_boundary.add(i)
            else:
                work(start).toggle = True
            if end != _END:
                work(end).toggle = False
    return s


class PlanRunner:
    """Runs training steps of one recorded model under a plan (see the module docstring)."""

    def __init__(self, recording: Recording, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable | None, plan: Plan, *, simulate: bool,
                 batch_norm_from_stats: bool = False) -> None:
        self.rec = recording
        # rebuild training-mode batch norms from their batch statistics (_batch_norm_apply)
        self.batch_norm_from_stats = batch_norm_from_stats
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.simulate = simulate
        self.device = next(model.parameters()).device
        if simulate and self.device.type != "cpu":
            raise ValueError(f"simulation mode runs on CPU tensors; the model is on {self.device}")
        if not simulate and self.device.type != "cuda":
            raise ValueError(f"the runtime needs a CUDA model (got {self.device}); "
                             "use simulate=True to check the bookkeeping on CPU")
        self.nodes = recording.graph.nodes
        self.stats = RuntimeStats()
        if simulate:
            self.d2h = self.h2d = None
        else:
            # not torch.cuda.Stream: its pool holds 70 MB outside the allocator (streams.py)
            self.d2h = side_stream(self.device, "d2h")
            self.h2d = side_stream(self.device, "h2d")
        self.rebuild = None   # rebuilds ahead of need: created by the first one
        self._ahead: list | None = None   # entries rebuilt in the current rebuild ahead
        self._pool: torch.Tensor | None = None
        self._regions: dict[int, torch.Tensor] = {}
        self._persistent: dict[int, _Persistent] = {}
        self._hooks: list = []
        self.check_every_step = False  # True: every step runs fully under the mode (debugging)
        self._mode = _Mode(self)
        self._mode_on = False
        self._in_step = False
        self._prev_iter = None
        self.capturing = False   # this step is being captured into a CUDA graph
        self.captured_copies: list = []   # the capture's copies: (direction, bytes, start, end)
        self.time_captured_copies = False  # timing events around a capture's copies (see _timed_copy)
        if not recording.boundaries or len(recording.funcs) != len(self.nodes):
            raise ValueError("the recording has no anchors (op objects, phase changes): "
                             "record it with tensile.record.record_step")
        self._first_producer: dict[int, int] = {}  # storage -> the first op that outputs it
        for k, outs in enumerate(recording.out_sids):
            for sid in outs:
                self._first_producer.setdefault(sid, k)
        named = dict(model.named_parameters())
        self._params_by_sid = {sid: named[name] for sid, name in recording.param_names.items()}
        self.plan: Plan | None = None
        self.set_plan(plan)

    # ================================================================== plan setup
    def set_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` between steps (swapped-out parameters come back first).

        On a re-plan the blocks the caching allocator kept for the old plan go back to the
        driver, so the GPU's memory (NVML: what other jobs on the GPU can get) falls to what
        the new plan needs; otherwise it would stay at the largest plan's peak, vanilla's
        from the cold start on."""
        if plan.num_ops != len(self.nodes):
            raise ValueError(f"the plan is for {plan.num_ops} ops, the recording has {len(self.nodes)}")
        self.restore_all()
        if self.plan is not None and not self.simulate:
            torch.cuda.synchronize(self.device)   # copies of the old plan still read their blocks
            torch.cuda.empty_cache()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.plan = plan
        self.swaps = {s.sid: s for s in plan.swaps if not s.cross_iteration}
        self.recomputes = {r.sid: r for r in plan.recomputes}
        self.updates: dict[int, list[int]] = {}  # op -> recomputed storages it updates in place
        for r in plan.recomputes:
            for k in r.then_ops:
                self.updates.setdefault(k, []).append(r.sid)
        cross = [s for s in plan.swaps if s.cross_iteration]
        known = {sid for n in self.nodes for sid in n.storage_bytes}
        for sid in list(self.swaps) + list(self.recomputes) + [s.sid for s in cross]:
            if sid not in known:
                raise ValueError(f"the plan names storage {sid}, unknown to the recording")
        for r in plan.recomputes:
            if r.issue_op is not None and not r.release_after_op < r.issue_op < r.before_op:
                raise ValueError(f"storage {r.sid}: a rebuild ahead must be issued after its "
                                 f"release (op {r.release_after_op}) and before its use (op "
                                 f"{r.before_op}), got issue_op={r.issue_op}")
        # After-op actions: copy-outs (planned start order), releases, copy-ins.
        self.after: dict[int, list[tuple]] = {}
        for s in plan.swaps:
            self.after.setdefault(s.out_issue_op, []).append((1, s.out_start_ms, "out", s))
            if not s.cross_iteration:
                self.after.setdefault(s.release_after_op, []).append((2, 0.0, "release", s))
            self.after.setdefault(s.in_issue_op, []).append((3, s.in_start_ms, "in", s))
        for r in plan.recomputes:
            self.after.setdefault(r.release_after_op, []).append((2, 0.0, "release", r))
            if r.issue_op is not None:
                self.after.setdefault(r.issue_op, []).append((4, 0.0, "rebuild", r))
        self.after = {k: [(kind, a) for _, _, kind, a in sorted(v, key=lambda x: x[:2])]
                      for k, v in self.after.items()}
        # Where each managed activation is first produced: grab it there.
        self.grab: dict[int, list[int]] = {}
        self._producer_of: dict[int, int] = {}
        for sid in list(self.swaps) + list(self.recomputes):
            k = self._producer_of[sid] = self._producer(sid)
            self.grab.setdefault(k, []).append(sid)
        self._setup_anchors()
        self._opt_params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._setup_pool(plan)
        self._persistent = {}
        for s in cross:
            if s.sid not in self.rec.param_names and s.sid not in self.rec.opt_state_keys:
                raise ValueError(f"storage {s.sid} is planned across iterations but is neither "
                                 "a recorded parameter nor optimizer state")
            self._persistent[s.sid] = _Persistent(s, self._regions[s.sid])
        self._install_param_hooks()
        self._install_anchor_hooks()

    def _setup_anchors(self) -> None:
        """Where the plan's work happens (:class:`_Schedule`) and what the hooks look up."""
        before = {k + 1: acts for k, acts in self.after.items() if k >= 0}
        self.sched = sched = _schedule(self.rec, before, self.grab, set(self.swaps),
                                       set(self.updates))
        managed = set(self.swaps) | set(self.recomputes)
        self._managed_packs = {a.key[1] for a in self.rec.anchors
                               if a.key[0] == "pack" and a.sids[0] in managed}
        self._node_hooks = [key[1] for key in sched.at if key[0] == "node"]
        # Autograd's pack/unpack hooks cost ~1 us per saved tensor: fast steps install
        # them only if the plan manages activations or anchors work on them.
        self._saved_hooks = bool(self._managed_packs) or any(
            key[0] in ("pack", "unpack") for key in sched.at)
        fast = list(self.rec.funcs) + [None]  # None: the runner acts (and past the last op)
        for k in sched.slow_ops:
            fast[k] = None
        self._fast_plan = fast
        self._fast_none = [None] * len(fast)  # timed steps: every op goes to the runner
        self._grad_types: list | None = None  # backward node types, cached once checked
        self._verified = False                # the next step checks every op

    def _producer(self, sid: int) -> int:
        if sid not in self._first_producer:
            raise ValueError(f"storage {sid} is managed by the plan but no recorded op produces it")
        return self._first_producer[sid]

    def _setup_pool(self, plan: Plan) -> None:
        """One host pool for all swapped tensors, grown (re-allocated) only when needed."""
        offsets, total = {}, 0
        for sw in plan.swaps:
            offsets[sw.sid] = (total, sw.nbytes)
            total += -(-sw.nbytes // _ALIGN) * _ALIGN
        if self._pool is None or self._pool.numel() < total:
            # Pinned memory is allocated once, never per tensor: cudaHostAlloc is slow and
            # synchronises the device (torchtune#2076). A re-plan that needs more grows it
            # by at least 1.5x, so a job re-planning around the same size allocates rarely.
            grown = total if self._pool is None else max(total, int(1.5 * self._pool.numel()))
            self._pool = torch.empty(max(grown, 1), dtype=torch.uint8,
                                     pin_memory=not self.simulate)
            self.stats.host_pool_bytes = self._pool.numel()
        self._regions = {sid: self._pool[o:o + n] for sid, (o, n) in offsets.items()}

    def _install_anchor_hooks(self) -> None:
        """Forward hooks on the modules whose calls anchor work (after the parameter hooks:
        a parameter is back before the actions "before the module's first op" run, as
        when the mode ran them as that op started)."""
        modules = list(self.model.modules())
        for kind, m in sorted({key[:2] for key in self.sched.at if key[0] in ("pre", "post")}):
            if kind == "post":
                h = modules[m].register_forward_hook(
                    lambda _mod, _args, out, m=m: self._module_call("post", m, out))
            else:
                h = modules[m].register_forward_pre_hook(
                    lambda _mod, _args, m=m: self._module_call("pre", m, None))
            self._hooks.append(h)

    def _install_param_hooks(self) -> None:
        """Forward pre-hooks that put swapped parameters back before their module runs."""
        named = dict(self.model.named_parameters())
        wanted: dict[int, int] = {}  # id(param) -> sid
        for sid in self._persistent:
            name = self.rec.param_names.get(sid)
            if name is not None:
                wanted[id(named[name])] = sid
        if not wanted:
            return
        for m in self.model.modules():
            sids = [wanted[id(p)] for p in m._parameters.values() if p is not None and id(p) in wanted]
            if sids:
                self._hooks.append(m.register_forward_pre_hook(
                    lambda _m, _i, sids=sids: self._restore(sids)))

    # ================================================================== one step
    def step(self, batch: Sequence, *, measure_ops: bool = False, init_step: bool = False,
             capturing: bool = False) -> StepResult:
        """One training step under the plan.

        ``init_step``: the optimizer creates its state in this step, so its ops differ
        from the recording: the optimizer phase runs unplanned and unchecked.
        ``measure_ops``: time every op (CUDA events; host timers in simulation).
        ``capturing``: the step runs inside ``torch.cuda.graph`` (see the module notes).
        """
        if capturing:
            self.check_capturable(measure_ops, init_step)
            self.captured_copies = []
        self.capturing = capturing
        self._begin(measure_ops, init_step)
        try:
            hooks = (torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                     if self._full or self._saved_hooks else contextlib.nullcontext())
            with hooks:
                loss = training_step(self.model, self.optimizer, batch, self.loss_fn,
                                     on_phase=self._on_phase, on_backward=self._on_backward)
            self._set_mode(False)
            self._in_step = False
            return self._end(loss)
        except BaseException:
            self._set_mode(False)
            self._in_step = False
            self._entries, self._by_ptr = {}, {}
            if not self.capturing:   # a failed capture must not touch the device again
                self.restore_all()
            raise
        finally:
            self.capturing = False

    def check_capturable(self, measure_ops: bool = False, init_step: bool = False) -> None:
        """Refuse what a captured step cannot do, before anything runs."""
        if self.simulate:
            raise ValueError("a captured step needs CUDA; this runner simulates on the CPU")
        if measure_ops or init_step:
            raise ValueError("a captured step can be neither timed op by op nor the step that "
                             "creates the optimizer state: run those steps uncaptured first")
        if self._persistent:
            raise ValueError("the plan moves parameters or optimizer state across iterations, "
                             "but a CUDA graph keeps their addresses: plan with "
                             "allow_cross_iteration=False to capture the step")

    def _begin(self, measure_ops: bool, init_step: bool) -> None:
        self.k = 0
        self.phase = None
        self.init_step = init_step
        self.measure = measure_ops
        # A full step runs entirely under the mode and checks every op and anchor.
        self._full = measure_ops or init_step or not self._verified or self.check_every_step
        self._fast = self._fast_none if measure_ops else self._fast_plan
        self._packs = 0           # pack calls so far
        self._boundary = 0        # phase changes so far
        self._unpacks = 0         # unpack calls so far
        self._module_calls: dict[tuple[str, int], int] = {}  # hooked module calls so far
        self._in_step = True
        self._nodes_started = 0   # hooked backward nodes that ran
        self._entries: dict[int, _Entry] = {}
        self._by_ptr: dict[int, tuple[StorageWeakRef, _Entry]] = {}
        self._op_events: list = []
        self._stalls: list = []
        self._copies: list = []   # timed steps: (direction, bytes, start, end) of every copy
        self._forked: list = []   # copy streams this step forked from the compute stream
        self._op_t: list[float] = []
        if self.simulate:
            self._t0 = time.perf_counter()
        elif not self.capturing:   # timing events cannot be recorded into a graph
            self._iter_ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._iter_ev[0].record()
        # Parameters / state copied out last step now leave the device (no sync: the
        # copy-in waits for the copy-out on the GPU, and record_stream guards the block).
        for sid, pe in self._persistent.items():
            if pe.copied_out:
                self._persistent_obj(sid).data = _view(pe.host, pe.meta)
                pe.copied_out, pe.on_host = False, True
        for kind, a in self.after.get(-1, []):  # copy-ins issued at the iteration start
            self._act(kind, a)
        self._set_mode(self._full)

    def _set_mode(self, on: bool) -> None:
        """Switch op interception on or off (never from inside the mode's own handler)."""
        if on and not self._mode_on:
            self._mode.__enter__()
        elif not on and self._mode_on:
            self._mode.__exit__(None, None, None)
        self._mode_on = on

    def _on_phase(self, phase: str | None) -> None:
        i = self._boundary
        self._boundary = i + 1
        bounds = self.rec.boundaries
        if i >= len(bounds) or bounds[i][0] != phase:
            want = bounds[i][0] if i < len(bounds) else "no more phases"
            raise self._mismatch(f"phase change {i}: recorded {want}, now {phase}")
        _, ops, packs, unpacks = bounds[i]
        if not (self.init_step and phase is None):  # the init step's optimizer has other ops
            if self._mode_on and self.k != ops:
                raise self._mismatch(f"{self.k} ops before {phase or 'the end'}, recorded {ops}")
            counted = self._full or self._saved_hooks  # pack/unpack hooks installed
            if counted and (self._packs, self._unpacks) != (packs, unpacks):
                raise self._mismatch(f"{self._packs} tensors saved for backward and "
                                     f"{self._unpacks} unpacked before {phase or 'the end'}, "
                                     f"recorded {packs} and {unpacks}")
        if phase == "optimizer" and self._nodes_started != len(self._node_hooks):
            raise self._mismatch(f"{self._nodes_started} of the {len(self._node_hooks)} hooked "
                                 "backward nodes ran")
        self.k = ops
        self.phase = phase
        acts = self.sched.at_boundary.get(i)
        if acts and not (self.init_step and phase is None):
            self._run(acts)
        if phase == "optimizer" and not self.init_step:
            self._restore([sid for sid in self._persistent if sid in self.rec.opt_state_keys])
        if self.init_step and phase == "optimizer":
            on = False  # the optimizer is creating its state: other ops, unplanned
        else:
            on = (self._full or phase in self.sched.full_phases
                  or i in self.sched.window_at_boundary)
        self._set_mode(on and phase is not None)

    def _on_backward(self, loss: torch.Tensor) -> None:
        """Check the backward graph against the recording; hook the nodes that anchor actions."""
        nodes = autograd_nodes(loss)
        types = [type(n) for n in nodes]
        if types != self._grad_types:
            names, recorded = [n.name() for n in nodes], self.rec.grad_nodes
            if names != recorded:
                i = next((i for i, (a, b) in enumerate(zip(names, recorded)) if a != b),
                         min(len(names), len(recorded)))
                got = names[i] if i < len(names) else "no more nodes"
                want = recorded[i] if i < len(recorded) else "no more nodes"
                raise self._mismatch(f"backward node {i} (breadth-first from the loss): "
                                     f"recorded {want}, now {got}")
            self._grad_types = types
        for b in self._node_hooks:
            nodes[b].register_prehook(functools.partial(self._node_start, b))

    def _node_start(self, b: int, _grads) -> None:
        """Backward is about to run hooked node ``b``."""
        self._nodes_started += 1
        self._at(self.sched.at[("node", b)])

    def _module_call(self, kind: str, m: int, output) -> None:
        """Hooked module ``m`` starts (``kind`` "pre") or has returned ``output`` ("post")."""
        if not self._in_step:
            return  # the model runs outside a step (evaluation, say)
        n = self._module_calls.get((kind, m), 0)
        self._module_calls[(kind, m)] = n + 1
        work = self.sched.at.get((kind, m, n))
        if work is not None:
            self._at(work, output)

    def _at(self, work: _Work, output=None) -> None:
        """Do the work anchored at an event: bind module outputs, run actions, switch the mode."""
        if self._mode_on and self.k != work.ops:
            raise self._mismatch(f"{self.k} ops before a hook event, recorded {work.ops}")
        if work.binds or work.acts:
            with _disable_current_modes():  # the runtime's own ops are not the step's
                outs = device_tensors(output, self.device.type) if work.binds else []
                for sid, pos in work.binds:
                    if pos >= len(outs):
                        raise self._mismatch(f"a module returned {len(outs)} tensors, recorded "
                                             f"storage {sid} as output {pos}")
                    self._bind(sid, outs[pos], None)
                for kind, a in work.acts:
                    self._act(kind, a)
        if work.toggle is not None and not self._full:  # a full step keeps the mode on
            self.k = work.ops
            self._set_mode(work.toggle)

    def _mismatch(self, what: str) -> PlanMismatchError:
        return PlanMismatchError(
            f"{what}. The model's op sequence changed (data-dependent control flow or new "
            "shapes?): build a new Scheduler for it")

    def _end(self, loss: torch.Tensor) -> StepResult:
        if self._boundary != len(self.rec.boundaries):
            raise PlanMismatchError(f"the step went through {self._boundary} phase changes, "
                                    f"the recording {len(self.rec.boundaries)}")
        if self._full and not self.init_step:
            self._verified = True
        # Between steps every parameter is on the device (one its module did not use
        # this step would still be on the host: bring it back).
        self._restore([sid for sid, pe in self._persistent.items() if pe.on_host], forced=True)
        self._entries, self._by_ptr = {}, {}
        self.stats.steps += 1
        result = StepResult(loss=loss)
        if self.simulate:
            result.iter_ms = (time.perf_counter() - self._t0) * 1e3
            if self.measure and not self.init_step:
                result.op_ms = self._op_t
        elif self.capturing:
            # A capture must end with every stream it forked joined back to the capture
            # stream (and only those: waiting on a stream the capture never reached would
            # wait on work outside the graph).
            compute = torch.cuda.current_stream(self.device)
            for stream in self._forked:
                compute.wait_stream(stream)
        else:
            self._iter_ev[1].record()
            prev = self._prev_iter
            # A step that timed every op ran slower: never report it as an iteration time.
            self._prev_iter = None if self.measure else self._iter_ev
            if self.measure and not self.init_step:
                self._iter_ev[1].synchronize()
                result.op_ms = [a.elapsed_time(b) for a, b in self._op_events]
                result.iter_ms = self._iter_ev[0].elapsed_time(self._iter_ev[1])
                result.stall_ms = sum(a.elapsed_time(b) for a, b in self._stalls)
                self.stats.stall_ms += result.stall_ms
            elif prev is not None and prev[1].query():  # no sync: last step's time if done
                result.iter_ms = prev[0].elapsed_time(prev[1])
        if self.measure and not self.init_step:
            self._count_copies()
        self._copies = []
        return result

    # ================================================================== per op
    def _run_op(self, func, args, kwargs):
        """An op the mode's hot path did not take: a view, a planned op, or a mismatch."""
        if not is_counted(func):
            return func(*args, **kwargs)
        k = self.k
        if k >= len(self.nodes) or func is not self.rec.funcs[k]:
            want = (f"{self.nodes[k].name} in {self.nodes[k].phase}" if k < len(self.nodes)
                    else "no more ops")
            raise self._mismatch(f"op {k}: recorded {want}, now {op_name(func)} in {self.phase}")
        acts = self.sched.at_op.get(k)
        if acts:
            self._run(acts)
        if self.measure:
            if self.simulate:
                t0 = time.perf_counter()
            else:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
        out = func(*args, **kwargs)
        if self.measure:
            if self.simulate:
                self._op_t.append((time.perf_counter() - t0) * 1e3)
            else:
                ev[1].record()
                self._op_events.append(ev)
        if k in self.sched.grab_at_op:
            self._grab(k, func, args, kwargs, out)
        if k in self.updates:
            self._note_updates(k, func, args, kwargs)
        self.k = k + 1
        return out

    def _run(self, acts: list) -> None:
        """Run actions (their copies are not ops of the step: no mode sees them)."""
        with _disable_current_modes():
            for kind, a in acts:
                self._act(kind, a)

    def _grab(self, k: int, func, args, kwargs, out) -> None:
        """Take hold of the managed activations op ``k`` produces (by output position)."""
        outs = device_tensors(out, self.device.type)
        if len(outs) != len(self.rec.out_sids[k]):
            raise PlanMismatchError(f"op {k} ({op_name(func)}): recorded {len(self.rec.out_sids[k])} "
                                    f"device outputs, now {len(outs)}")
        for sid in self.sched.grab_at_op[k]:
            pos = self.rec.out_sids[k].index(sid)
            rec = self.recomputes.get(sid)
            recipe = None
            if rec is not None:
                recipe = self._batch_norm_recipe(k, func, args, kwargs, out, outs) if pos == 0 else None
                if recipe is None:
                    recipe = (func, *self._recipe_args(k, args, kwargs, None, set(rec.scratch)), pos)
            self._bind(sid, outs[pos], recipe)

    def _batch_norm_recipe(self, k: int, func, args, kwargs, out, outs: list[torch.Tensor]):
        """The recipe of a training-mode batch norm's output from the batch statistics the op
        returned (:func:`_batch_norm_apply`), or None where the op is not one, runs in eval
        mode, lays its output out unlike its input, or its statistics are themselves planned
        (the recipe holds them by reference)."""
        spec = _BN_TRAINING.get(func.overloadpacket.__name__)
        if not self.batch_norm_from_stats or spec is None or kwargs \
                or not isinstance(out, (tuple, list)) or len(out) < 3:
            return None
        flag, eps_at = spec
        if (flag is not None and not args[flag]) or len(args) <= eps_at:
            return None
        x, y, mean, invstd = args[0], out[0], out[1], out[2]
        dense = x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)
        if not dense or y.shape != x.shape or y.stride() != x.stride() or mean.dim() != 1:
            return None
        for stat in (mean, invstd):
            at = [i for i, t in enumerate(outs) if t is stat]
            if not at or self.rec.out_sids[k][at[0]] in self.swaps or \
                    self.rec.out_sids[k][at[0]] in self.recomputes:
                return None
        kept, _ = self._recipe_args(k, args, kwargs, None, set())   # input, weight, bias as kept
        return (_batch_norm_apply, (kept[0], kept[1], kept[2], mean, invstd, float(args[eps_at])), {}, 0)

    def _note_updates(self, k: int, func, args, kwargs) -> None:
        """Op ``k`` updated recomputed tensors in place: keep it to replay after their producer
        (a residual add and a ReLU right after a batch norm rebuilt from its statistics join
        that rebuild, :func:`_joined`)."""
        for sid in self.updates[k]:
            e = self._entries.get(sid)
            if e is None or e.recipe is None:
                continue
            kept = self._recipe_args(k, args, kwargs, e, set())
            joined = None if e.then else _joined(e.recipe, func, args, kwargs, kept)
            if joined is not None:
                e.recipe = joined
            else:
                e.then.append((func, *kept))

    def _recipe_args(self, k: int, args, kwargs, own: _Entry | None, scratch: set[int]):
        """``(args, kwargs)`` of op ``k`` as a recompute keeps them. Tensors stay referenced
        (the plan keeps them resident) except: ``own``'s storage (an in-place update's
        target), storages in ``scratch`` and other managed activations, which would stay
        alive through the reference: placeholders (:class:`_Own`, :class:`_Scratch`,
        :class:`_Ref`) that :meth:`_replay_args` resolves."""
        sids = iter(self.rec.arg_sids[k])
        own_ptr = own.data.untyped_storage().data_ptr() if own is not None else None

        def keep(x):
            if not (isinstance(x, torch.Tensor) and device_tensors(x, self.device.type)):
                return x
            sid, ptr = next(sids), x.untyped_storage().data_ptr()
            if ptr == own_ptr:
                return _Own(_meta_of(x))
            if sid in scratch:
                return _Scratch(x)
            hit = self._by_ptr.get(ptr)
            if hit is not None and not hit[0].expired():
                return _Ref(hit[1], _meta_of(x))
            return x
        return tree_map(keep, (args, kwargs))

    def _replay_args(self, tree, transient: set[int], own: torch.Tensor | None = None):
        """Resolve a recipe's placeholders: ``own`` is the rebuilt tensor's bytes; a
        released managed input in ``transient`` is rebuilt for this call only."""
        def real(x):
            if isinstance(x, _Own):
                return _view(own, x.meta)
            if isinstance(x, _Scratch):
                return x.tensor.clone()
            if isinstance(x, _Ref):
                e = x.entry
                if e.data is None and e.sid in transient and e.recipe is not None:
                    return _view(self._rerun(e, transient), x.meta)
                return _view(self._bring_back(e), x.meta)
            return x
        return tree_map(real, tree, is_leaf=lambda x: isinstance(x, (_Own, _Scratch, _Ref)))

    def _bind(self, sid: int, t: torch.Tensor, recipe) -> None:
        """Manage ``t`` as storage ``sid`` from now on (``recipe``: how to recompute it)."""
        want = self.rec.graph.nodes[self._producer_of[sid]].storage_bytes[sid]
        if t.untyped_storage().nbytes() != want:
            raise PlanMismatchError(f"storage {sid}: recorded {want} bytes, now "
                                    f"{t.untyped_storage().nbytes()}")
        e = _Entry(sid, want, self.swaps.get(sid), self.recomputes.get(sid))
        e.data = _bytes_of(t)
        e.orig = StorageWeakRef(t.untyped_storage())
        if e.recompute is not None:
            e.recipe = recipe
        self._entries[sid] = e
        self._by_ptr[t.untyped_storage().data_ptr()] = (e.orig, e)

    def _act(self, kind: str, a) -> None:
        if a.sid in self._persistent:
            if self.init_step and self.phase == "optimizer":
                return
            {"out": self._persistent_out, "in": self._persistent_in}[kind](self._persistent[a.sid])
            return
        e = self._entries.get(a.sid)
        if e is None:
            return  # not produced in this step (cannot happen when the ops match)
        if kind == "out":
            self._swap_out(e)
        elif kind == "release":
            if self.capturing and e.out_done is not None:
                # no record_stream in a capture: the block may be reused by the next
                # allocation on the compute stream, which must come after the copy read it
                torch.cuda.current_stream(self.device).wait_event(e.out_done)
            e.data = None  # the copy-out (if any) was issued before: its stream holds the block
        elif kind == "in":
            if e.data is None and e.host is not None and not e.in_backward:
                self._swap_in(e, passive=False)
        elif kind == "rebuild":
            if e.data is None and e.recipe is not None:
                self._rebuild_ahead(e)

    # ================================================================== copies
    def _swap_out(self, e: _Entry) -> None:
        if e.data is None:
            return
        e.host = self._regions[e.sid]
        e.out_done = self._copy_out(e.host, e.data)
        self.stats.swap_outs += 1
        self.stats.bytes_d2h += e.nbytes

    def _swap_in(self, e: _Entry, passive: bool) -> None:
        if e.orig is not None and not e.orig.expired():
            self.stats.ineffective_releases += 1
        e.orig = None
        e.data, e.ready = self._copy_in(e.host, e.out_done, passive)
        self.stats.swap_ins += 1
        self.stats.passive_swap_ins += passive
        self.stats.bytes_h2d += e.nbytes

    def _persistent_out(self, pe: _Persistent) -> None:
        obj = self._persistent_obj(pe.swap.sid)
        if obj is None or obj.device.type != self.device.type or pe.on_host:
            return
        pe.meta = _meta_of(obj)
        pe.out_done = self._copy_out(pe.host, _bytes_of(obj))
        pe.copied_out = True
        self.stats.swap_outs += 1
        self.stats.bytes_d2h += pe.swap.nbytes

    def _persistent_in(self, pe: _Persistent) -> None:
        if pe.on_host and pe.pending is None:
            pe.pending, pe.ready = self._copy_in(pe.host, pe.out_done, passive=False)
            self.stats.swap_ins += 1
            self.stats.bytes_h2d += pe.swap.nbytes

    def _restore(self, sids: list[int], forced: bool = False) -> None:
        """Point swapped parameters / optimizer state at device memory again.

        A copy-in not issued by now is done on the spot: a passive swap-in, unless the
        restore is ``forced`` (between steps, outside the plan).
        """
        with _disable_current_modes():
            for sid in sids:
                pe = self._persistent.get(sid)
                if pe is None or not pe.on_host:
                    continue
                if pe.pending is None:  # its copy-in was not issued in time: do it now
                    pe.pending, pe.ready = self._copy_in(pe.host, pe.out_done, passive=True)
                    self.stats.swap_ins += not forced
                    self.stats.passive_swap_ins += not forced
                    self.stats.bytes_h2d += pe.swap.nbytes
                if pe.ready is not None:
                    self._wait(pe.ready)
                self._persistent_obj(sid).data = _view(pe.pending, pe.meta)
                pe.pending, pe.ready, pe.on_host = None, None, False

    def restore_all(self) -> None:
        """Keep every parameter / optimizer state on the device (before a new plan, after
        an error): cancel pending releases and bring back what is on the host."""
        for pe in self._persistent.values():
            pe.copied_out = False
        self._restore(list(self._persistent), forced=True)

    def _wait(self, ready) -> None:
        """Make the compute stream wait for a copy-in; on timed steps, time the wait."""
        compute = torch.cuda.current_stream(self.device)
        if not self.measure:
            compute.wait_event(ready)
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(ready)
        after.record(compute)
        self._stalls.append((before, after))

    def _copy_out(self, host: torch.Tensor, data: torch.Tensor):
        """Device→host copy of ``data`` after the compute stream's work so far."""
        if self.simulate:
            with self._timed_copy("d2h", data.nbytes, None):
                host.copy_(data)
            return None
        compute = torch.cuda.current_stream(self.device)  # before entering the side stream
        self.d2h.wait_stream(compute)
        self._fork(self.d2h)
        with torch.cuda.stream(self.d2h), self._timed_copy("d2h", data.nbytes, self.d2h):
            host.copy_(data, non_blocking=True)
        # Hazard: the compute stream may free ``data`` right after this; the allocator
        # must not hand its block out again before the copy has read it. (Captured: the
        # release waits for the copy instead, see the module notes.)
        if not self.capturing:
            data.record_stream(self.d2h)
        done = torch.cuda.Event()
        done.record(self.d2h)
        return done

    def _copy_in(self, host: torch.Tensor, out_done, passive: bool):
        """Host→device copy into a new device buffer; returns ``(buffer, ready event)``."""
        if self.simulate:
            with self._timed_copy("h2d", host.nbytes, None):
                return host.clone(), None
        compute = torch.cuda.current_stream(self.device)
        buf = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)  # on compute
        if passive:  # on the compute stream itself: the next op waits for it
            if out_done is not None:
                compute.wait_event(out_done)
            with self._timed_copy("h2d", host.nbytes, compute):
                buf.copy_(host, non_blocking=True)
            return buf, None
        # The new block may have been used by compute work enqueued before: wait for it.
        self.h2d.wait_stream(compute)
        self._fork(self.h2d)
        if out_done is not None:
            self.h2d.wait_event(out_done)  # the host region must be fully written
        with torch.cuda.stream(self.h2d), self._timed_copy("h2d", host.nbytes, self.h2d):
            buf.copy_(host, non_blocking=True)
        if not self.capturing:  # captured: compute waits for the copy before any use
            buf.record_stream(self.h2d)
        ready = torch.cuda.Event()
        ready.record(self.h2d)
        return buf, ready

    def _fork(self, stream) -> None:
        if not any(stream is s for s in self._forked):
            self._forked.append(stream)

    @contextlib.contextmanager
    def _timed_copy(self, direction: str, nbytes: int, stream):
        """On timed steps, time the copy made inside (events on ``stream``; host clock in
        simulation) for :meth:`_count_copies`. In a capture, only if ``time_captured_copies``
        (``Scheduler.capture(time_copies=True)``): external timing events go into the graph
        with the copy, and :meth:`captured_copy_rates` reads them after a replay. Off by
        default: on the H200 a wait for a copy between such events cost about 10 µs against
        1-3 µs without (``experiments.join_cost --timed``, results/h200/README.md, thirtieth
        session), and a captured step waits twice per swap."""
        if self.capturing and not self.time_captured_copies:
            yield
            return
        if self.capturing:
            start, end = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
            start.record(stream)
            yield
            end.record(stream)
            self.captured_copies.append((direction, nbytes, start, end))
            return
        if not self.measure:
            yield
            return
        if stream is None:
            t0 = time.perf_counter()
            yield
            self._copies.append((direction, nbytes, (time.perf_counter() - t0) * 1e3))
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        self._copies.append((direction, nbytes, (start, end)))

    def captured_copy_rates(self) -> dict[str, float | None]:
        """What the captured step's copies took in the graph's latest replay: bytes per second
        each way (``d2h_bytes_per_s``, ``h2d_bytes_per_s``; None without copies) and the
        summed copy time (``copy_ms``). Call after a replay; it waits for the device."""
        if self.simulate or not self.captured_copies:
            return {"d2h_bytes_per_s": None, "h2d_bytes_per_s": None, "copy_ms": None}
        torch.cuda.synchronize(self.device)
        moved = {"d2h": [0, 0.0], "h2d": [0, 0.0]}
        for direction, nbytes, start, end in self.captured_copies:
            moved[direction][0] += nbytes
            moved[direction][1] += start.elapsed_time(end)
        return {"d2h_bytes_per_s": bytes_per_s(*moved["d2h"]),
                "h2d_bytes_per_s": bytes_per_s(*moved["h2d"]),
                "copy_ms": moved["d2h"][1] + moved["h2d"][1]}

    def _count_copies(self) -> None:
        """Add a timed step's copies to the stats (a copy-out issued late in the step may
        still run: wait for it, as a timed step waits for its compute)."""
        s = self.stats
        s.timed_steps += 1
        for direction, nbytes, t in self._copies:
            if isinstance(t, tuple):
                t[1].synchronize()
                t = t[0].elapsed_time(t[1])
            if direction == "d2h":
                s.timed_d2h_bytes += nbytes
                s.timed_d2h_ms += t
            else:
                s.timed_h2d_bytes += nbytes
                s.timed_h2d_ms += t

    # ================================================================== autograd hooks
    def _pack(self, t: torch.Tensor):
        """Autograd saves ``t`` (pack call ``p``, an anchor)."""
        p = self._packs
        self._packs = p + 1
        out = self._handle(t) if p in self._managed_packs else t
        work = self.sched.at.get(("pack", p))
        if work is not None:
            self._at(work)
        return out

    def _handle(self, t: torch.Tensor):
        """A handle instead of ``t`` if ``t`` views a managed activation."""
        if not self._by_ptr or t.device.type != self.device.type or t.layout != torch.strided:
            return t
        hit = self._by_ptr.get(t.untyped_storage().data_ptr())
        if hit is None or hit[0].expired():
            return t
        # Autograd packs op k's tensors after the plan's actions for op k ran, so the
        # entry may already be released: the handle still works (the copy-out or the
        # recipe was taken), and the tensor's memory goes with the caller's reference.
        return _Packed(hit[1], _meta_of(t))

    def _unpack(self, h):
        """Backward needs a saved tensor: the anchor of unpack call ``u``."""
        u = self._unpacks
        self._unpacks = u + 1
        t = self._unpack_handle(h) if isinstance(h, _Packed) else h
        work = self.sched.at.get(("unpack", u))
        if work is not None:
            self._at(work)
        return t

    def _unpack_handle(self, h: "_Packed") -> torch.Tensor:
        """The managed activation behind ``h``, brought back if it is not on the device."""
        e = h.entry
        with _disable_current_modes():
            e.in_backward = True
            return _view(self._bring_back(e), h.meta)

    def _bring_back(self, e: _Entry) -> torch.Tensor:
        """``e``'s bytes on the device, recomputed or copied in if released; the compute
        stream waits for a copy-in before it uses them."""
        if e.data is None:
            if e.recipe is not None:
                self._recompute(e)
            elif e.host is not None:
                self._swap_in(e, passive=True)
            else:
                raise RuntimeError(f"TENSILE runtime bug: storage {e.sid} was released "
                                   "without a copy or a recompute recipe")
        if e.ready is not None:
            self._wait(e.ready)          # on the current stream: the rebuild stream's own
            if self._ahead is None:      # waits leave it for the compute stream's
                e.ready, e.held = None, None
        return e.data

    def _recompute(self, e: _Entry) -> None:
        """Rebuild ``e`` for good (:meth:`_rerun`) and drop its recipe with the sources."""
        data = self._rerun(e, set(e.recompute.transient))
        if e.orig is not None and not e.orig.expired():
            self.stats.ineffective_releases += 1
        if self._ahead is not None:      # on the rebuild stream: see _rebuild_ahead
            e.held = (e.recipe, e.then)
            self._ahead.append(e)
        e.data, e.recipe, e.then, e.orig = data, None, [], None  # drop the sources
        self.stats.recomputes += 1

    def _rebuild_ahead(self, e: _Entry) -> None:
        """Rebuild ``e`` now, before backward needs it (``Recompute.issue_op``), on the
        rebuild stream, so that the rerun overlaps the compute stream's work.

        Ordering: the rebuild stream first waits for all compute work issued so far, so it
        reads its sources after they were written, and a block the compute stream freed
        before now (the rebuilt tensors go back to the rebuild stream's free list when
        backward is done with them) is written only after its last reader. Dropped sources
        of the same group (``before_op`` alike) are rebuilt inside, on the same stream.
        Every entry rebuilt here gets ``ready``: the compute stream waits for it before its
        first use (:meth:`_bring_back`), and keeps the recipes (``held``) until then: a
        source freed by its last reader would otherwise return to the compute stream's free
        list while this stream may still read it. In a capture the stream is joined back
        at the end of the step, as the copy streams are."""
        if self.simulate:
            self._recompute(e)
            return
        compute = torch.cuda.current_stream(self.device)
        if self.rebuild is None:
            self.rebuild = side_stream(self.device, "rebuild")
        self.rebuild.wait_stream(compute)
        self._fork(self.rebuild)
        self._ahead = []
        try:
            with torch.cuda.stream(self.rebuild):
                self._recompute(e)
            done = torch.cuda.Event()
            done.record(self.rebuild)
            for x in self._ahead:
                x.ready = done
        finally:
            self._ahead = None

    def _rerun(self, e: _Entry, transient: set[int]) -> torch.Tensor:
        """``e``'s bytes, rebuilt: its producer, then the in-place updates that followed it
        in forward. A managed input released meanwhile is brought back first (a chain of
        recomputes), for this rebuild alone if it is in ``transient``."""
        func, args, kwargs, pos = e.recipe
        with torch.no_grad():
            out = func(*self._replay_args(args, transient), **self._replay_args(kwargs, transient))
            t = device_tensors(out, self.device.type)[pos]
            if t.untyped_storage().nbytes() != e.nbytes:
                raise PlanMismatchError(f"recomputing storage {e.sid}: got "
                                        f"{t.untyped_storage().nbytes()} bytes, recorded {e.nbytes}")
            data = _bytes_of(t)
            for f, a, kw in e.then:
                f(*self._replay_args(a, transient, data), **self._replay_args(kw, transient, data))
        return data

    # ================================================================== objects
    def _persistent_obj(self, sid: int) -> torch.Tensor | None:
        """The live parameter or optimizer-state tensor behind a recorded storage id."""
        param = self._params_by_sid.get(sid)
        if param is not None:
            return param
        key = self.rec.opt_state_keys.get(sid)
        if key is not None:
            v = self.optimizer.state.get(self._opt_params[key[0]], {}).get(key[1])
            return v if isinstance(v, torch.Tensor) else None
        return None


_RELU_ = torch.ops.aten.relu_.default
_ADD_ = torch.ops.aten.add_.Tensor


def _joined(recipe: tuple, func, args, kwargs, kept: tuple) -> tuple | None:
    """The rebuild ``recipe`` of a batch norm from its statistics with the in-place op that
    came next joined into it (:func:`tensile.fused.batch_norm_act`, one pass where the
    tensors are laid out alike, else the same ops in turn), or None where it cannot join:
    ``relu_``, and a residual ``add_`` of another tensor before any ReLU. ``kept`` is that
    op's ``(args, kwargs)`` as a recompute keeps them."""
    rebuild, bn_args, options, pos = recipe
    if rebuild is _batch_norm_apply:
        options = {"residual": None, "relu": False}
    elif rebuild is not batch_norm_act:
        return None
    if func is _RELU_ and not options["relu"]:
        return (batch_norm_act, bn_args, {**options, "relu": True}, pos)
    if (func is _ADD_ and options["residual"] is None and not options["relu"] and not kwargs
            and len(args) == 2 and isinstance(args[1], torch.Tensor)
            and not isinstance(kept[0][1], _Own)):        # out += out: nothing to read yet
        return (batch_norm_act, bn_args, {**options, "residual": kept[0][1]}, pos)
    return None


# Training-mode batch norms: op name -> (position of the ``training`` argument, None where
# the op always trains; position of ``eps``). Outputs 0-2 of each: the normalised input, the
# batch mean and its inverse standard deviation (cudnn's "save_var" is that too).
_BN_TRAINING = {"native_batch_norm": (5, 7), "cudnn_batch_norm": (5, 7),
                "_native_batch_norm_legit": (5, 7), "_batch_norm_with_update": (None, 6)}


def _batch_norm_apply(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      mean: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """A training-mode batch norm's output rebuilt from the batch statistics its forward
    returned (which its backward keeps anyway): ``(x - mean) * invstd * weight + bias``.

    Why: rerunning the op itself makes a statistics pass over ``x`` again, and updates the
    running statistics (so on scratch copies); this is the op's second half alone, one
    elementwise kernel on CUDA (``batch_norm_elemt``, what SyncBatchNorm applies with). The
    result matches the op's output to rounding, not bit for bit (cuDNN's kernel may order
    the arithmetic differently), and a ReLU after it can then pass or stop a gradient
    where the op's own rerun would not: training matches vanilla within tolerance, no longer
    bit for bit. Hence opt-in (``Scheduler(..., batch_norm_from_stats=True)``).
    """
    out = torch.empty_like(x)
    if x.is_cuda:
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps, out=out)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    scale = invstd if weight is None else invstd * weight
    torch.mul(x - mean.view(shape), scale.view(shape), out=out)
    return out if bias is None else out.add_(bias.view(shape))


def _meta_of(t: torch.Tensor) -> _Meta:
    return _Meta(t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of ``t`` (copies move storages, not views)."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))


def _view(data: torch.Tensor, meta: _Meta) -> torch.Tensor:
    """``meta``'s view of the bytes ``data`` (a uint8 slice, possibly of the host pool)."""
    item = meta.dtype.itemsize
    base = data.storage_offset()  # bytes into the pool; regions are _ALIGN-aligned
    if base % item:
        raise RuntimeError(f"TENSILE runtime bug: region at byte {base} is not {item}-aligned")
    return torch.empty(0, dtype=meta.dtype, device=data.device).set_(
        data.untyped_storage(), base // item + meta.offset, meta.size, meta.stride)
