"""Execute a :class:`~tensile.plan.Plan` during real training steps.

Mechanism (reference §9, §11):

* a ``TorchDispatchMode`` counts the ops of the step (op ``k`` must be node ``k`` of the
  recording: same name, same phase, else :class:`PlanMismatchError`), grabs the tensors
  the plan manages when they are produced (by output position, size checked), and runs
  the plan's "after op k" actions when op ``k + 1`` starts (autograd has packed op
  ``k``'s saved tensors by then). Cost: a Python dispatch mode adds ~15-25 us of host
  time per ATen op, which dominates the overhead of host-bound models;
* ``saved_tensors_hooks`` hand autograd a small handle instead of a managed activation,
  so the device copy can be dropped; unpacking in backward brings it back;
* swap-outs are copied on a dedicated device→host stream into one pinned host pool
  (allocated once, sized from the plan), swap-ins on a host→device stream; CUDA events
  order the copies against the compute stream, never host timers;
* a tensor that is not back when backward unpacks it is swapped in synchronously on the
  compute stream: a *passive* swap-in, counted (TENSILE's plan-quality measure); on
  timed steps the compute stream's waits for copy-ins are timed with events (stalls);
* recomputation reruns the producing op from the inputs it read, kept by reference
  (the planner checked they stay resident and unmodified);
* parameters swapped across the iteration boundary are copied out after their update
  and become pinned host tensors (``p.data``) when the *next* step starts, so between
  steps every parameter is the valid device tensor and no host synchronisation is
  needed (the copy-in waits for the copy-out with an event; ``record_stream`` keeps the
  old block from reuse until the copy has read it). They return in their module's
  forward pre-hook; optimizer state returns just before ``optimizer.step()``.

Simulation mode (``simulate=True``, CPU tensors) does the same bookkeeping with plain
copies and no streams: it tests handles, positions, recomputation and counting on a
machine without a GPU. Memory and time are only meaningful on CUDA.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .plan import Plan, Recompute, Swap
from .record import Recording, device_tensors, is_counted, op_name
from .step import training_step

__all__ = ["PlanMismatchError", "RuntimeStats", "StepResult", "PlanRunner"]

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

    @property
    def passive_share(self) -> float:
        return self.passive_swap_ins / self.swap_ins if self.swap_ins else 0.0


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
    using ``data`` (after a swap-in); ``out_done`` marks the end of the copy-out.
    """

    def __init__(self, sid: int, nbytes: int, swap: Swap | None, rec: Recompute | None):
        self.sid, self.nbytes, self.swap, self.recompute = sid, nbytes, swap, rec
        self.data: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.out_done = None
        self.ready = None
        self.recipe = None
        self.orig: StorageWeakRef | None = None
        self.live_handles = 0
        self.in_backward = False

    def handle_dropped(self) -> None:
        self.live_handles -= 1
        if self.live_handles == 0 and self.in_backward:
            self.data = None  # autograd is done with it: free the device copy


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
    def __init__(self, runner: "PlanRunner"):
        super().__init__()
        self.runner = runner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_counted(func):
            return func(*args, **kwargs)
        return self.runner._run_op(func, args, kwargs)


class PlanRunner:
    """Runs training steps of one recorded model under a plan (see the module docstring)."""

    def __init__(self, recording: Recording, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable | None, plan: Plan, *, simulate: bool) -> None:
        self.rec = recording
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
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
        self._pool: torch.Tensor | None = None
        self._regions: dict[int, torch.Tensor] = {}
        self._persistent: dict[int, _Persistent] = {}
        self._hooks: list = []
        self._mode = _Mode(self)
        self._prev_iter = None
        self.plan: Plan | None = None
        self.set_plan(plan)

    # ================================================================== plan setup
    def set_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` between steps (swapped-out parameters come back first)."""
        if plan.num_ops != len(self.nodes):
            raise ValueError(f"the plan is for {plan.num_ops} ops, the recording has {len(self.nodes)}")
        self.restore_all()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.plan = plan
        self.swaps = {s.sid: s for s in plan.swaps if not s.cross_iteration}
        self.recomputes = {r.sid: r for r in plan.recomputes}
        cross = [s for s in plan.swaps if s.cross_iteration]
        known = {sid for n in self.nodes for sid in n.storage_bytes}
        for sid in list(self.swaps) + list(self.recomputes) + [s.sid for s in cross]:
            if sid not in known:
                raise ValueError(f"the plan names storage {sid}, unknown to the recording")
        # After-op actions: copy-outs (planned start order), releases, copy-ins.
        self.after: dict[int, list[tuple]] = {}
        for s in plan.swaps:
            self.after.setdefault(s.out_issue_op, []).append((1, s.out_start_ms, "out", s))
            if not s.cross_iteration:
                self.after.setdefault(s.release_after_op, []).append((2, 0.0, "release", s))
            self.after.setdefault(s.in_issue_op, []).append((3, s.in_start_ms, "in", s))
        for r in plan.recomputes:
            self.after.setdefault(r.release_after_op, []).append((2, 0.0, "release", r))
        self.after = {k: [(kind, a) for _, _, kind, a in sorted(v, key=lambda x: x[:2])]
                      for k, v in self.after.items()}
        # Where each managed activation is first produced: grab it there.
        self.grab: dict[int, list[int]] = {}
        for sid in list(self.swaps) + list(self.recomputes):
            k = self._producer(sid)
            self.grab.setdefault(k, []).append(sid)
        self._setup_pool(plan)
        self._persistent = {}
        for s in cross:
            if s.sid not in self.rec.param_names and s.sid not in self.rec.opt_state_keys:
                raise ValueError(f"storage {s.sid} is planned across iterations but is neither "
                                 "a recorded parameter nor optimizer state")
            self._persistent[s.sid] = _Persistent(s, self._regions[s.sid])
        self._install_param_hooks()

    def _producer(self, sid: int) -> int:
        for k, outs in enumerate(self.rec.out_sids):
            if sid in outs:
                return k
        raise ValueError(f"storage {sid} is managed by the plan but no recorded op produces it")

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
    def step(self, batch: Sequence, *, measure_ops: bool = False, init_step: bool = False) -> StepResult:
        """One training step under the plan.

        ``init_step``: the optimizer creates its state in this step, so its ops differ
        from the recording: the optimizer phase runs unplanned and unchecked.
        ``measure_ops``: time every op (CUDA events; host timers in simulation).
        """
        self._begin(measure_ops, init_step)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), self._mode:
                loss = training_step(self.model, self.optimizer, batch, self.loss_fn,
                                     on_phase=self._on_phase)
            return self._end(loss)
        except BaseException:
            self._entries, self._by_ptr, self._pending = {}, {}, ()
            self.restore_all()
            raise

    def _begin(self, measure_ops: bool, init_step: bool) -> None:
        self.k = 0
        self.phase = None
        self.checking = True
        self.init_step = init_step
        self.measure = measure_ops
        self._entries: dict[int, _Entry] = {}
        self._by_ptr: dict[int, tuple[StorageWeakRef, _Entry]] = {}
        self._op_events: list = []
        self._stalls: list = []
        self._pending: Sequence = ()
        self._op_t: list[float] = []
        if self.simulate:
            self._t0 = time.perf_counter()
        else:
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

    def _on_phase(self, phase: str | None) -> None:
        self.phase = phase
        if self.checking:
            self._flush()
        if phase == "optimizer":
            if self.init_step:
                self.checking = False  # the optimizer is creating its state: other ops
            else:
                self._restore([sid for sid in self._persistent
                               if sid in self.rec.opt_state_keys])

    def _end(self, loss: torch.Tensor) -> StepResult:
        if not self.init_step and self.k != len(self.nodes):
            raise PlanMismatchError(f"the step ran {self.k} ops, the recording has {len(self.nodes)}")
        self._flush()
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
        return result

    # ================================================================== per op
    def _run_op(self, func, args, kwargs):
        k = self.k
        if self.checking:
            if k >= len(self.nodes) or self.nodes[k].name != op_name(func) or \
                    self.nodes[k].phase != self.phase:
                want = (f"{self.nodes[k].name} in {self.nodes[k].phase}" if k < len(self.nodes)
                        else "no more ops")
                raise PlanMismatchError(
                    f"op {k}: recorded {want}, now {op_name(func)} in {self.phase}. The model's "
                    "op sequence changed (data-dependent control flow or new shapes?): build a "
                    "new Scheduler for it")
        if not self.checking:
            return func(*args, **kwargs)
        self._flush()
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
        if k in self.grab:
            self._grab(k, func, args, kwargs, out)
        # "After op k" runs when the next op starts: by then autograd has packed op k's
        # saved tensors and Python has dropped the tensors op k used last, which is the
        # state the planner's per-op memory count assumes.
        self._pending = self.after.get(k, ())
        self.k = k + 1
        return out

    def _flush(self) -> None:
        """Run the pending "after op k" actions (their copies must not count as ops)."""
        pending, self._pending = self._pending, ()
        if pending:
            with _disable_current_modes():
                for kind, a in pending:
                    self._act(kind, a)

    def _grab(self, k: int, func, args, kwargs, out) -> None:
        """Take hold of the managed activations op ``k`` produces (by output position)."""
        outs = device_tensors(out, self.device.type)
        if len(outs) != len(self.rec.out_sids[k]):
            raise PlanMismatchError(f"op {k} ({op_name(func)}): recorded {len(self.rec.out_sids[k])} "
                                    f"device outputs, now {len(outs)}")
        for sid in self.grab[k]:
            pos = self.rec.out_sids[k].index(sid)
            t = outs[pos]
            want = self.nodes[k].storage_bytes[sid]
            if t.untyped_storage().nbytes() != want:
                raise PlanMismatchError(f"op {k} ({op_name(func)}) output {pos}: recorded a "
                                        f"{want}-byte storage, now {t.untyped_storage().nbytes()}")
            e = _Entry(sid, want, self.swaps.get(sid), self.recomputes.get(sid))
            e.data = _bytes_of(t)
            e.orig = StorageWeakRef(t.untyped_storage())
            if e.recompute is not None:
                e.recipe = (func, args, kwargs, pos)
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
            e.data = None  # the copy-out (if any) was issued before: its stream holds the block
        elif kind == "in":
            if e.data is None and e.host is not None and not e.in_backward:
                self._swap_in(e, passive=False)

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
            host.copy_(data)
            return None
        compute = torch.cuda.current_stream(self.device)  # before entering the side stream
        self.d2h.wait_stream(compute)
        with torch.cuda.stream(self.d2h):
            host.copy_(data, non_blocking=True)
        # Hazard: the compute stream may free ``data`` right after this; the allocator
        # must not hand its block out again before the copy has read it.
        data.record_stream(self.d2h)
        done = torch.cuda.Event()
        done.record(self.d2h)
        return done

    def _copy_in(self, host: torch.Tensor, out_done, passive: bool):
        """Host→device copy into a new device buffer; returns ``(buffer, ready event)``."""
        if self.simulate:
            return host.clone(), None
        compute = torch.cuda.current_stream(self.device)
        buf = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)  # on compute
        if passive:  # on the compute stream itself: the next op waits for it
            if out_done is not None:
                compute.wait_event(out_done)
            buf.copy_(host, non_blocking=True)
            return buf, None
        # The new block may have been used by compute work enqueued before: wait for it.
        self.h2d.wait_stream(compute)
        if out_done is not None:
            self.h2d.wait_event(out_done)  # the host region must be fully written
        with torch.cuda.stream(self.h2d):
            buf.copy_(host, non_blocking=True)
        buf.record_stream(self.h2d)
        ready = torch.cuda.Event()
        ready.record(self.h2d)
        return buf, ready

    # ================================================================== autograd hooks
    def _pack(self, t: torch.Tensor):
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
        if not isinstance(h, _Packed):
            return h
        e = h.entry
        with _disable_current_modes():
            e.in_backward = True
            if e.data is None:
                if e.recipe is not None:
                    self._recompute(e)
                elif e.host is not None:
                    self._swap_in(e, passive=True)
                else:
                    raise RuntimeError(f"TENSILE runtime bug: storage {e.sid} was released "
                                       "without a copy or a recompute recipe")
            if e.ready is not None:
                self._wait(e.ready)
                e.ready = None
            return _view(e.data, h.meta)

    def _recompute(self, e: _Entry) -> None:
        func, args, kwargs, pos = e.recipe
        with torch.no_grad():
            out = func(*args, **kwargs)
        t = device_tensors(out, self.device.type)[pos]
        if t.untyped_storage().nbytes() != e.nbytes:
            raise PlanMismatchError(f"recomputing storage {e.sid}: got {t.untyped_storage().nbytes()} "
                                    f"bytes, recorded {e.nbytes}")
        if e.orig is not None and not e.orig.expired():
            self.stats.ineffective_releases += 1
        e.data, e.recipe, e.orig = _bytes_of(t), None, None  # drop the sources
        self.stats.recomputes += 1

    # ================================================================== objects
    def _persistent_obj(self, sid: int) -> torch.Tensor | None:
        """The live parameter or optimizer-state tensor behind a recorded storage id."""
        name = self.rec.param_names.get(sid)
        if name is not None:
            return dict(self.model.named_parameters())[name]
        key = self.rec.opt_state_keys.get(sid)
        if key is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            v = self.optimizer.state.get(params[key[0]], {}).get(key[1])
            return v if isinstance(v, torch.Tensor) else None
        return None


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
