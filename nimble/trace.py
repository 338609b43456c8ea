"""Record the GPU-task DAG of a module from one real run.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every ATen op the run
issues: the forward, and for a training trace the loss, the backward ops autograd runs
(dispatch modes follow autograd onto its worker thread) and the optimizer step. Each op
that can launch GPU work becomes a :class:`~nimble.graph.OpNode`; metadata-only ops
(views, ``detach``, ``_unsafe_view`` ...) are counted but get no node, because they read
no data and launch nothing.

Edges come from *storages*, not tensors: a view or an in-place op reads or writes its
base's storage, so read-after-write, write-after-read and write-after-write are tracked
per storage. Node ``k`` is the k-th non-view op, which is what the capture relies on when
it replays the same module op by op (:func:`check_same_ops`).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from .graph import OpNode, TaskGraph

__all__ = ["trace_graph", "TraceMismatchError", "OpRecorder", "StorageDependencies",
           "check_same_ops", "as_tuple", "mutated_args", "estimate_flops"]

# Ops whose result the host has to wait for: they cannot be captured or replayed.
HOST_SYNC_OPS = {
    "aten._local_scalar_dense.default",
    "aten.item.default",
    "aten.is_nonzero.default",
    "aten.equal.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.unique_consecutive.default",
    "aten._unique2.default",
}
# Ops that launch no GPU task: views without a view schema, size queries, and bare
# allocations (the first op that writes the allocation is the task).
METADATA_OPS = {
    "aten._unsafe_view.default", "aten.detach.default", "aten.alias.default",
    "aten.lift_fresh.default", "aten.sym_size.int", "aten.sym_stride.int",
    "aten.sym_numel.default", "aten.sym_storage_offset.default", "aten.size.default",
    "aten.stride.default", "aten.dim.default", "aten.is_contiguous.default",
    "aten._reshape_alias.default", "aten.empty.memory_format", "aten.empty_strided.default",
    "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty_like.default",
}
# Ops that only move bytes: they cost bandwidth, not arithmetic.
COPY_OPS = {"aten.copy_.default", "aten._to_copy.default", "aten.clone.default",
            "aten.zeros.default", "aten.zero_.default", "aten.fill_.Scalar"}


class TraceMismatchError(RuntimeError):
    """Two runs of the module issued different op sequences (data-dependent model)."""

    def __init__(self, index: int, expected: str, got: str):
        self.index, self.expected, self.got = index, expected, got
        super().__init__(
            f"the module's op sequence changed between runs at op #{index}: expected "
            f"{expected}, got {got}. Nimble needs a static model (same ops and shapes on "
            f"every call); data-dependent control flow or shapes cannot be captured.")


def as_tuple(inputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Normalise ``example_inputs`` to a tuple of tensors, with a clear error otherwise."""
    items = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"example inputs must be a tensor or a tuple of tensors; "
                            f"item {i} is {type(t).__name__}")
    return items


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Ops whose schemas do not annotate what they write: in training mode they update the
# running statistics in place (``_native_batch_norm_legit`` and ``_batch_norm_with_update``
# annotate theirs with ``(a!)``).
UNANNOTATED_RUNNING_STATS = frozenset({"aten::native_batch_norm", "aten::cudnn_batch_norm",
                                       "aten::miopen_batch_norm"})


def mutated_args(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors the op writes in place: its schema's alias annotations ``(a!)``, plus the
    running statistics of the batch-norm ops in training mode whose schemas omit them."""
    schema = func._schema

    def value(i: int, name: str) -> Any:
        return args[i] if i < len(args) else kwargs.get(name)

    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        out.extend(_tensors(value(i, arg.name)))
    if schema.name in UNANNOTATED_RUNNING_STATS:
        named = {a.name: value(i, a.name) for i, a in enumerate(schema.arguments)}
        if named.get("training"):
            out.extend(_tensors([named.get("running_mean"), named.get("running_var")]))
    return out


def estimate_flops(func, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs from PyTorch's flop counter where it knows the op, else one per output element."""
    counter = flop_registry.get(func.overloadpacket)
    if counter is not None:
        try:
            return int(counter(*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 - a counter that cannot handle these args
            pass
    if str(func) in COPY_OPS:
        return 0
    outs = _tensors(out)
    return max((t.numel() for t in outs), default=0)


class StorageDependencies:
    """Dependency edges between ops, from the storages each reads and writes, in order.

    ``add(v, reads, writes)`` for op ``v`` adds read-after-write (last writer -> v),
    write-after-write (last writer -> v) and write-after-read (every reader since the
    last write -> v) edges to :attr:`edges`.
    """

    def __init__(self) -> None:
        self.edges: set[tuple[int, int]] = set()
        self._last_writer: dict[int, int] = {}
        self._readers: dict[int, list[int]] = {}

    def add(self, v: int, reads: Sequence[int], writes: Sequence[int]) -> None:
        for s in reads:                                   # read-after-write
            u = self._last_writer.get(s)
            if u is not None:
                self.edges.add((u, v))
        for s in writes:
            u = self._last_writer.get(s)                  # write-after-write
            if u is not None and u != v:
                self.edges.add((u, v))
            for r in self._readers.get(s, ()):            # write-after-read
                if r != v:
                    self.edges.add((r, v))
        for s in reads:
            self._readers.setdefault(s, []).append(v)
        for s in writes:
            self._last_writer[s] = v
            self._readers[s] = []


class OpRecorder(TorchDispatchMode):
    """Dispatch mode that turns every op into an :class:`OpNode` with storage edges.

    Subclasses (the capture) override :meth:`run_op` to run op ``k`` somewhere else,
    e.g. on the stream a plan chose; the bookkeeping stays the same.
    """

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[OpNode] = []
        self.raw_ops: list[int] = []          # per op seen: node index, or -1 for metadata-only
        self.num_ops = 0                      # non-view ops seen so far (next node index)
        self.num_view_ops = 0
        self.phase = "forward"
        self._ids: dict[int, tuple[StorageWeakRef, int]] = {}
        self._sizes: dict[int, int] = {}
        self.deps = StorageDependencies()

    # -- storage identity -------------------------------------------------------------
    def storage_id(self, t: torch.Tensor) -> int:
        """A small integer naming ``t``'s storage for the whole trace.

        The weak reference keeps the StorageImpl object (not its data) alive, so its
        address cannot be reused by another storage while we hold it.
        """
        st = t.untyped_storage()
        ref = StorageWeakRef(st)
        entry = self._ids.get(ref.cdata)
        if entry is None or entry[0].expired():
            sid = len(self._sizes)
            self._ids[ref.cdata] = (ref, sid)
            self._sizes[sid] = st.nbytes()
            return sid
        return entry[1]

    def storage_ids(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        return sorted({self.storage_id(t) for t in tensors if t.layout == torch.strided})

    # -- dispatch ---------------------------------------------------------------------
    def run_op(self, index: int | None, func, args: tuple, kwargs: dict) -> Any:
        """Run one op. ``index`` is the node index it will get (None if metadata-only)."""
        return func(*args, **kwargs)

    def is_metadata_only(self, func, args: tuple, kwargs: dict) -> bool:
        """True for ops that only make a new view of existing data (no kernel, no write)."""
        return func.is_view or str(func) in METADATA_OPS

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.is_metadata_only(func, args, kwargs):
            self.raw_ops.append(-1)
            self.num_view_ops += 1
            return self.run_op(None, func, args, kwargs)
        index = self.num_ops
        self.num_ops += 1
        self.raw_ops.append(index)
        ins = _tensors((args, kwargs))
        read_ids = self.storage_ids(ins)
        out = self.run_op(index, func, args, kwargs)
        self.record(index, func, args, kwargs, ins, read_ids, out)
        return out

    def record(self, index: int, func, args, kwargs, ins, read_ids, out) -> None:
        name = str(func)
        outs = _tensors(out)
        mutated = mutated_args(func, args, kwargs)
        write_ids = self.storage_ids(outs + mutated)
        node = OpNode(
            index=index, name=name,
            input_shapes=[tuple(t.shape) for t in ins],
            input_dtypes=[str(t.dtype).removeprefix("torch.") for t in ins],
            output_shapes=[tuple(t.shape) for t in outs],
            output_dtypes=[str(t.dtype).removeprefix("torch.") for t in outs],
            bytes_read=sum(_nbytes(t) for t in ins),
            bytes_written=sum(_nbytes(t) for t in outs + mutated),
            flops=estimate_flops(func, args, kwargs, out),
            reads=read_ids, writes=write_ids,
            storage_bytes={s: self._sizes[s] for s in set(read_ids) | set(write_ids)},
            phase=self.phase,
            host_sync=name in HOST_SYNC_OPS or _crosses_to_host(ins, outs),
        )
        self.nodes.append(node)
        self.deps.add(index, read_ids, write_ids)

    def to_graph(self, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor], device: str) -> TaskGraph:
        return TaskGraph(
            nodes=self.nodes, edges=sorted(self.deps.edges),
            inputs=self.storage_ids(list(inputs)), params=self.storage_ids(list(params)),
            outputs=self.storage_ids(list(outputs)), num_view_ops=self.num_view_ops,
            device=device, raw_ops=list(self.raw_ops))


def _crosses_to_host(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> bool:
    """A device tensor copied into a CPU tensor makes the host wait for the GPU."""
    return (any(t.device.type != "cpu" for t in ins)
            and any(t.device.type == "cpu" for t in outs))


def _default_loss(out: Any) -> torch.Tensor:
    tensors = [t for t in _tensors(out) if t.is_floating_point()]
    if not tensors:
        raise ValueError("training trace: the module returned no floating-point tensor; "
                         "pass loss_fn=callable(output) -> scalar loss")
    return sum(t.float().mean() for t in tensors)


def trace_graph(model: nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor], *,
                training: bool = False, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                optimizer: torch.optim.Optimizer | None = None,
                check_static: bool = False) -> TaskGraph:
    """Run ``model`` once under an :class:`OpRecorder` and return its task graph.

    Args:
        model: the module, on the device it will run on (CPU or CUDA).
        example_inputs: a tensor or a tuple of tensors.
        training: also record the loss (``loss_fn(output)``, default: mean of the
            outputs), the backward pass and, if given, ``optimizer.step()``. The module's
            parameters, buffers, gradients and optimizer state are restored afterwards,
            so tracing a training step does not train the model.
        check_static: run twice and raise :class:`TraceMismatchError` naming the first
            differing op if the two op sequences differ (data-dependent control flow).
    """
    inputs = as_tuple(example_inputs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    graph = _trace_once(model, inputs, training, loss_fn, optimizer)
    if check_static:
        check_same_ops(graph, _trace_once(model, inputs, training, loss_fn, optimizer))
    return graph


def _trace_once(model, inputs, training, loss_fn, optimizer) -> TaskGraph:
    params = [*model.parameters(), *model.buffers()]
    device = str(params[0].device) if params else str(inputs[0].device) if inputs else "cpu"
    rec = OpRecorder()
    # Name inputs and parameters first so their storage ids are the small ones.
    rec.storage_ids(list(inputs) + params)
    if not training:
        with torch.no_grad(), rec:
            out = model(*inputs)
        return rec.to_graph(inputs, params, _tensors(out), device)
    saved = _snapshot(model, optimizer)
    try:
        with rec:
            out = model(*inputs)
            rec.phase = "loss"
            loss = (loss_fn or _default_loss)(out)
            rec.phase = "backward"
            loss.backward()
            if optimizer is not None:
                rec.phase = "optimizer"
                optimizer.step()
        opt_state = _optimizer_tensors(optimizer)
        return rec.to_graph(inputs, params + opt_state, _tensors(out), device)
    finally:
        _restore(model, optimizer, saved)


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [t for state in optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor)]


def _snapshot(model: nn.Module, optimizer) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {n: (None if p.grad is None else p.grad.detach().clone())
                  for n, p in model.named_parameters()},
        "opt": copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
    }


def _restore(model: nn.Module, optimizer, saved: dict) -> None:
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(saved["model"][k])
        for n, p in model.named_parameters():
            g = saved["grads"][n]
            if g is None:
                p.grad = None
            elif p.grad is not None:
                p.grad.copy_(g)
            else:
                p.grad = g
    if optimizer is not None:
        optimizer.load_state_dict(saved["opt"])


def check_same_ops(expected: TaskGraph, got: TaskGraph) -> None:
    """Raise :class:`TraceMismatchError` at the first op whose name or input shapes differ."""
    for a, b in zip(expected.nodes, got.nodes):
        if a.signature() != b.signature():
            raise TraceMismatchError(a.index, _describe(a), _describe(b))
    if len(expected.nodes) != len(got.nodes):
        n = min(len(expected.nodes), len(got.nodes))
        left = _describe(expected.nodes[n]) if n < len(expected.nodes) else "end of run"
        right = _describe(got.nodes[n]) if n < len(got.nodes) else "end of run"
        raise TraceMismatchError(n, left, right)


def _describe(node: OpNode) -> str:
    shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in node.input_shapes)
    return f"{node.name}({shapes})"
