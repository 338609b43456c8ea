"""Record one training step as a task graph, with what the runtime needs to act on it.

``nimble.trace.trace_graph`` gives the same kind of graph; TENSILE's runtime needs
more facts, so it records its own step with the same conventions:

* **positions**: for every op, the storage id of each device tensor among its
  arguments and outputs, in flattening order. The runtime binds the tensors of a later
  step to storage ids by position, so ids agree between recording and execution
  without relying on memory addresses (which the caching allocator reuses);
* **saved**: the storages autograd saved for backward (seen by a pack hook). Only those
  can be moved by the runtime between forward and backward;
* **needed_by**: for each parameter, the op before which its module's forward
  pre-hook runs; that is where the runtime puts a swapped parameter back;
* **holds**: how long Python code keeps a storage beyond its last access, and a forward
  module call's inputs until the call returns (:attr:`Recording.held_to`,
  :attr:`Recording.forward_hold`): the memory curves count them;
* **anchors**: events the runtime sees without intercepting ops, in order, each with
  the number of ops done before it (:class:`Anchor`): every tensor autograd saves (pack
  hook) or unpacks (unpack hook), every module call (forward pre- and post-hook), every
  backward node about to run (node pre-hook; nodes are numbered breadth-first from the
  loss), and every phase change. The runtime acts there and intercepts ops only where
  an action needs the op itself.

Storage ids are handed out in order of first sight; a storage is identified by a weak
reference to its ``StorageImpl`` (views and in-place ops share their base's id).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nimble.graph import OpNode, TaskGraph
from nimble.trace import StorageDependencies, estimate_flops, mutated_args

from .step import split_batch, training_step
from .streamed import streamed_of
from .timeline import FORWARD_PHASES, AccessTimeline

__all__ = ["Anchor", "Recording", "record_step", "autograd_nodes", "device_tensors", "is_counted",
           "op_name"]


_COUNTED: dict = {}


def is_counted(func) -> bool:
    """Ops that become graph nodes: not views/aliases, not profiler markers (no GPU work).

    Cached per op: the runtime asks for every op it intercepts.
    """
    counted = _COUNTED.get(func)
    if counted is None:
        counted = _COUNTED[func] = not func.is_view and func.namespace != "profiler"
    return counted


_NAMES: dict = {}


def op_name(func) -> str:
    """``aten.convolution.default`` (cached: called once per op at run time)."""
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


def device_tensors(tree, device_type: str) -> list[torch.Tensor]:
    """Dense tensors on ``device_type`` with a non-empty storage, in flattening order."""
    out = []
    for x in tree_flatten(tree)[0]:
        if isinstance(x, torch.Tensor) and x.device.type == device_type and x.layout == torch.strided:
            try:
                if x.untyped_storage().nbytes() > 0:
                    out.append(x)
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                pass
    return out


def autograd_nodes(loss: torch.Tensor) -> list:
    """The backward graph's nodes, breadth-first from ``loss.grad_fn`` (a stable numbering:
    the same forward builds the same graph)."""
    root = loss.grad_fn
    if root is None:
        return []
    order, seen = [root], {root}
    for node in order:  # the list grows while we walk it
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                order.append(nxt)
    return order


class StorageIds:
    """Live storage → small integer id, weakly held (a dead storage never matches)."""

    def __init__(self) -> None:
        self._ids: dict[int, tuple[StorageWeakRef, int]] = {}
        self.next_id = 0

    def lookup(self, t: torch.Tensor) -> int | None:
        ref = StorageWeakRef(t.untyped_storage())
        hit = self._ids.get(ref.cdata)
        return hit[1] if hit is not None and not hit[0].expired() else None

    def get_or_new(self, t: torch.Tensor) -> tuple[int, bool]:
        """``(id, is_new)``."""
        sid = self.lookup(t)
        if sid is not None:
            return sid, False
        ref = StorageWeakRef(t.untyped_storage())
        sid = self.next_id
        self.next_id += 1
        self._ids[ref.cdata] = (ref, sid)
        return sid, True


@dataclass(frozen=True)
class Anchor:
    """One event of the recorded step that hooks see (no op interception needed).

    ``key`` says how the runtime recognises it in a later step: ``("pack", i)`` and
    ``("unpack", i)`` for the i-th pack / unpack hook call of the step, ``("pre", m, i)``
    and ``("post", m, i)`` for the i-th call of module ``m`` (index into
    ``model.modules()``), ``("node", b)`` for backward node ``b`` about to run.
    """

    key: tuple
    ops: int          # ops done before the event
    phase: str
    sids: tuple = ()  # pack: the saved tensor's storage id; pre / post: the module's inputs' / outputs'


@dataclass
class Recording:
    """One recorded training step (see the module docstring)."""

    graph: TaskGraph
    arg_sids: list[list[int]]
    out_sids: list[list[int]]
    roles: dict[int, str]
    saved: set[int]
    needed_by: dict[int, int]
    random_ops: set[int]
    param_names: dict[int, str] = field(default_factory=dict)     # sid -> parameter name
    opt_state_keys: dict[int, tuple[int, str]] = field(default_factory=dict)  # sid -> (param index, key)
    device_type: str = "cpu"
    funcs: list = field(default_factory=list)            # the OpOverload of every op
    anchors: list[Anchor] = field(default_factory=list)  # in the order they happened
    boundaries: list[tuple[str | None, int, int, int]] = field(default_factory=list)
    # ^ per phase change: (new phase, ops done, pack calls done, unpack calls done)
    grad_nodes: list[str] = field(default_factory=list)  # backward nodes' names, breadth-first
    # the gradients' storages: alive until zero_grad after optimizer.step() (training_step)
    held_to_end: set[int] = field(default_factory=set)
    # the step's own host<->device copies: (op, "h2d" | "d2h", bytes) (a streamed optimizer)
    transfers: list[tuple[int, str, int]] = field(default_factory=list)
    # storage -> the last op it was still allocated at, where that is after its last access
    # (Python kept a reference: a streamed optimizer's ring slot, a gradient until its
    # group's update is done); AccessTimeline.held_to
    held_to: dict[int, int] = field(default_factory=dict)
    # storage -> the last op of a forward module call it is an input of, where that is after
    # its last access in that call (its caller holds it until the call returns);
    # AccessTimeline.forward_hold
    forward_hold: dict[int, int] = field(default_factory=dict)

    def timeline(self, op_ms: Sequence[float], rerun_share: Mapping[int, float] | None = None,
                 scratch: Mapping[int, int] | None = None) -> AccessTimeline:
        """The access timeline of this step with the given op durations (and shares of them
        that recomputes' reruns cost, :attr:`AccessTimeline.rerun_share`; the bytes ops hold
        only while they run, :attr:`AccessTimeline.scratch`)."""
        swappable = {sid: (sid in self.saved) for sid, r in self.roles.items() if r == "activation"}
        swappable.update({sid: sid in self.needed_by for sid, r in self.roles.items()
                          if r in ("param", "opt_state")})
        return AccessTimeline.from_graph(self.graph, op_ms, roles=self.roles,
                                         swappable=swappable, needed_by=self.needed_by,
                                         random_ops=self.random_ops, held_to_end=self.held_to_end,
                                         transfers=self.transfers, rerun_share=rerun_share,
                                         scratch=scratch, held_to=self.held_to,
                                         forward_hold=self.forward_hold)


class _Recorder(TorchDispatchMode):
    """Dispatch mode that turns every counted ATen op into an :class:`OpNode`."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.ids = StorageIds()
        self.phase = "forward"
        self.nodes: list[OpNode] = []
        self.arg_sids: list[list[int]] = []
        self.out_sids: list[list[int]] = []
        self.funcs: list = []
        self.first_read: set[int] = set()  # storages whose first access is a read
        self.random_ops: set[int] = set()  # ops that draw random numbers
        self.transfers: list[tuple[int, str, int]] = []  # copies between host and device
        self.deps = StorageDependencies()
        self.alive: dict[int, StorageWeakRef] = {}  # storages an op made, not yet seen freed
        self.freed_before: dict[int, int] = {}       # storage -> the first op it was gone at

    def _note_frees(self, k: int) -> None:
        """Storages made by the step that are gone before op ``k`` runs."""
        gone = [sid for sid, ref in self.alive.items() if ref.expired()]
        for sid in gone:
            del self.alive[sid]
            self.freed_before[sid] = k

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counted = is_counted(func)
        if counted:
            self._note_frees(len(self.nodes))
        out = func(*args, **kwargs)
        if not counted:
            return out
        k = len(self.nodes)
        ins = device_tensors((args, kwargs), self.device_type)
        outs = device_tensors(out, self.device_type)
        arg_ids = []
        for t in ins:
            sid, new = self.ids.get_or_new(t)
            if new:
                self.first_read.add(sid)
            arg_ids.append(sid)
        out_ids = []
        for t in outs:
            sid, new = self.ids.get_or_new(t)
            if new:
                self.alive[sid] = StorageWeakRef(t.untyped_storage())
            out_ids.append(sid)
        mutated_ts = _mutated_args(func, args, kwargs, self.device_type)
        mutated = [self.ids.get_or_new(t)[0] for t in mutated_ts]
        reads = list(dict.fromkeys(arg_ids))
        writes = list(dict.fromkeys(out_ids + mutated))
        sbytes = {sid: t.untyped_storage().nbytes() for sid, t in zip(arg_ids + out_ids, ins + outs)}
        self.deps.add(k, reads, writes)
        self.nodes.append(OpNode(
            index=k, name=op_name(func),
            input_shapes=[tuple(t.shape) for t in ins], input_dtypes=[str(t.dtype) for t in ins],
            output_shapes=[tuple(t.shape) for t in outs], output_dtypes=[str(t.dtype) for t in outs],
            bytes_read=sum(t.nbytes for t in ins), bytes_written=_written_bytes(outs, mutated_ts),
            flops=estimate_flops(func, args, kwargs, out), reads=reads, writes=writes,
            storage_bytes=sbytes, phase=self.phase))
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random_ops.add(k)
        if func is torch.ops.aten.copy_.default and args[0].device.type != args[1].device.type:
            self.transfers.append((k, "h2d" if args[0].device.type == self.device_type else "d2h",
                                   args[1].nbytes))
        self.arg_sids.append(arg_ids)
        self.out_sids.append(out_ids)
        self.funcs.append(func)
        return out


def _written_bytes(outs: list[torch.Tensor], mutated: list[torch.Tensor]) -> int:
    """Bytes an op writes: its outputs, and the arguments it writes in place that it does not
    also return (``_foreach_*_`` and ``_fused_adam_`` return nothing), as :mod:`nimble.trace`
    counts them."""
    returned = {id(t) for t in outs}
    return sum(t.nbytes for t in outs) + sum(t.nbytes for t in mutated if id(t) not in returned)


def _mutated_args(func, args, kwargs, device_type: str) -> list[torch.Tensor]:
    """Arguments the op writes in place (schema alias info ``(a!)``), on ``device_type``."""
    return [t for t in mutated_args(func, args, kwargs) if t.device.type == device_type]


def record_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence,
                loss_fn: Callable | None) -> Recording:
    """Run one real training step (it updates the model) and record it.

    Run it on a step whose op sequence repeats (the optimizer's state already exists),
    see :class:`tensile.api.Scheduler`, which restores the model afterwards.
    """
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters")
    device_type = params[0].device.type
    rec = _Recorder(device_type)
    saved: set[int] = set()
    prehook_at: dict[int, int] = {}  # id(param) -> op index when its module's pre-hook ran
    anchors: list[Anchor] = []
    calls: dict[tuple, int] = {}  # ("pack",), ("unpack",), ("pre", m), ("post", m) -> calls
    boundaries: list[tuple[str | None, int, int, int]] = []
    grad_nodes: list[str] = []

    def anchor(kind: tuple, sids: tuple = ()) -> None:
        n = calls.get(kind, 0)
        calls[kind] = n + 1
        anchors.append(Anchor(kind + (n,), len(rec.nodes), rec.phase, sids))

    def pack(t: torch.Tensor):
        sid = None
        if t.device.type == device_type and t.layout == torch.strided:
            sid = rec.ids.lookup(t)
            if sid is not None:
                saved.add(sid)
        anchor(("pack",), (sid,))
        return t

    def unpack(t: torch.Tensor):
        anchor(("unpack",))
        return t

    def pre_hook(module: nn.Module, m: int, args) -> None:
        anchor(("pre", m), tuple(rec.ids.lookup(t) for t in device_tensors(args, device_type)))
        for p in module._parameters.values():
            if p is not None and id(p) not in prehook_at:
                prehook_at[id(p)] = len(rec.nodes)

    def post_hook(output, m: int) -> None:
        anchor(("post", m), tuple(rec.ids.lookup(t) for t in device_tensors(output, device_type)))

    grads: set[int] = set()

    def on_phase(phase: str | None) -> None:
        packs, unpacks = calls.get(("pack",), 0), calls.get(("unpack",), 0)
        boundaries.append((phase, len(rec.nodes), packs, unpacks))
        if phase is not None:
            rec.phase = phase
        else:   # after optimizer.step(), before zero_grad: the gradients are still there
            grads.update(s for s in (rec.ids.lookup(p.grad) for p in params if p.grad is not None)
                         if s is not None)

    def on_backward(loss: torch.Tensor) -> None:
        for b, node in enumerate(autograd_nodes(loss)):
            grad_nodes.append(node.name())
            node.register_prehook(lambda _grads, b=b: anchors.append(
                Anchor(("node", b), len(rec.nodes), rec.phase)))

    handles = []
    for m, module in enumerate(model.modules()):
        handles.append(module.register_forward_pre_hook(
            lambda mod, args, m=m: pre_hook(mod, m, args)))
        handles.append(module.register_forward_hook(
            lambda _mod, _args, out, m=m: post_hook(out, m)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), rec:
            training_step(model, optimizer, batch, loss_fn, on_phase=on_phase,
                          on_backward=on_backward)
    finally:
        for h in handles:
            h.remove()

    streamed = streamed_of(optimizer)
    if streamed is not None:
        # Its host regions are host memory: a CUDA recording never sees them, a CPU one
        # (simulation) takes them for device tensors. They weigh nothing on the device.
        host = {rec.ids.lookup(g.host) for g in streamed.groups if g.host is not None} - {None}
        for n in rec.nodes:
            for sid in host & n.storage_bytes.keys():
                n.storage_bytes[sid] = 0
            if host and n.name == "aten.copy_.default" and host & set(n.reads + n.writes):
                # a CPU recording's copies to and from them (a CUDA one saw the devices differ)
                rec.transfers.append((n.index, "d2h" if host & set(n.writes) else "h2d",
                                      n.bytes_read // 2))
    graph = TaskGraph(nodes=rec.nodes, edges=sorted(rec.deps.edges), device=device_type)
    roles, param_names, opt_keys = _roles(rec, model, optimizer, batch, loss_fn)
    graph.params = sorted(s for s, r in roles.items() if r in ("param", "buffer"))
    graph.inputs = sorted(s for s, r in roles.items() if r == "input")
    for sid in rec.first_read:  # existed before the step but is none of the known objects
        roles.setdefault(sid, "other")
    first_access: dict[int, int] = {}
    for n in rec.nodes:
        for sid in n.reads + n.writes:
            first_access.setdefault(sid, n.index)
    held_to, forward_hold = _holds(rec, anchors, roles)
    needed_by: dict[int, int] = {}
    named = dict(model.named_parameters())
    for sid, name in param_names.items():
        at = prehook_at.get(id(named[name]))
        if at is not None and sid in first_access and at <= first_access[sid]:
            needed_by[sid] = at
    opt_start = next((n.index for n in rec.nodes if n.phase == "optimizer"), None)
    if opt_start is not None:
        for sid in opt_keys:
            if sid in first_access and first_access[sid] >= opt_start:
                needed_by[sid] = opt_start
    return Recording(graph=graph, arg_sids=rec.arg_sids, out_sids=rec.out_sids, roles=roles,
                     saved=saved, needed_by=needed_by, random_ops=rec.random_ops,
                     param_names=param_names, opt_state_keys=opt_keys, device_type=device_type,
                     held_to_end=grads, transfers=sorted(rec.transfers), held_to=held_to,
                     forward_hold=forward_hold,
                     funcs=rec.funcs, anchors=anchors, boundaries=boundaries,
                     grad_nodes=grad_nodes)


def _holds(rec: _Recorder, anchors: list[Anchor], roles: dict[int, str]
           ) -> tuple[dict[int, int], dict[int, int]]:
    """How long Python code held the step's transient storages beyond what their accesses
    say: ``(held_to, forward_hold)`` (:attr:`Recording.held_to`, :attr:`Recording.forward_hold`).

    ``held_to``: to the op before the one a storage was first seen gone at (the step's
    last op if never), where that is after its last access. ``forward_hold``: a forward
    module call's inputs stay referenced by its caller until the call returns, kept where
    that is after their last forward access (a residual stage's input)."""
    n_ops = len(rec.nodes)
    last_access: dict[int, int] = {}
    forward_last: dict[int, int] = {}
    for n in rec.nodes:
        for sid in n.reads + n.writes:
            last_access[sid] = n.index
            if n.phase in FORWARD_PHASES:
                forward_last[sid] = n.index
    transient = set(last_access) - set(roles)   # roles name all that existed before the step
    held_to = {}
    for sid in sorted(transient):
        end = rec.freed_before.get(sid, n_ops) - 1
        if end > last_access[sid]:
            held_to[sid] = end
    call_end = {a.key[1:]: a.ops - 1 for a in anchors if a.key[0] == "post"}
    forward_hold: dict[int, int] = {}
    for a in anchors:
        end = call_end.get(a.key[1:]) if a.key[0] == "pre" else None
        if end is None or a.phase not in FORWARD_PHASES:
            continue
        for sid in a.sids:
            if sid in transient and sid in forward_last and end > max(
                    forward_last[sid], forward_hold.get(sid, -1)):
                forward_hold[sid] = end
    return held_to, forward_hold


def _roles(rec: _Recorder, model, optimizer, batch, loss_fn):
    """Roles of the storages of known objects: parameters, optimizer state, buffers, inputs."""
    roles: dict[int, str] = {}
    param_names: dict[int, str] = {}
    opt_keys: dict[int, tuple[int, str]] = {}
    shared: set[int] = set()
    for name, p in model.named_parameters():
        sid = rec.ids.lookup(p)
        if sid is not None and sid in param_names:
            shared.add(sid)  # several parameters in one storage: never moved (see below)
        elif sid is not None and sid not in roles:
            roles[sid] = "param"
            param_names[sid] = name
    for sid in shared:
        # Re-pointing one parameter's .data would split it from its siblings' storage.
        del param_names[sid]
    all_params = [p for g in optimizer.param_groups for p in g["params"]]
    streamed = streamed_of(optimizer)
    for i, p in enumerate(all_params):
        for key, v in optimizer.state.get(p, {}).items():
            if streamed is not None and streamed.homes(p, key):
                continue   # host memory streamed in by the step itself, never moved by a plan
            if isinstance(v, torch.Tensor) and v.device.type == rec.device_type:
                sid = rec.ids.lookup(v)
                if sid is not None and sid not in roles:
                    roles[sid] = "opt_state"
                    opt_keys[sid] = (i, key)
    for b in model.buffers():
        sid = rec.ids.lookup(b)
        if sid is not None:
            roles.setdefault(sid, "buffer")
    inputs, target = split_batch(batch, loss_fn)
    for t in device_tensors((inputs, target), rec.device_type):
        sid = rec.ids.lookup(t)
        if sid is not None:
            roles.setdefault(sid, "input")
    return roles, param_names, opt_keys

