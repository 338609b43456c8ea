"""Conv+ReLU fusion at the op level: cuDNN's one kernel for conv, bias, (residual,) ReLU.

Why: after conv+BN folding, a ResNet or Inception conv layer is three kernels (cuDNN's
convolution, the bias add PyTorch issues after it, the ReLU), and the last conv of a
residual block four (plus the residual add). cuDNN computes ``relu(conv(x, w) + b [+ z])``
in one kernel (``torch.cudnn_convolution_relu`` / ``torch.cudnn_convolution_add_relu``).
On the H200 at batch 1, whole-model CUDA graphs of ResNet-50, ResNet-101 and Inception-v3
ran 1.35-1.48x faster fused in channels-last layout and 1.08-1.09x in NCHW.

How the pairs are found: from one real run, not a symbolic trace, so models that
``torch.fx`` cannot trace work too. A dispatch mode follows tensor *objects* from op to op
(views make new objects, so a view never matches), and the task graph's storage reads and
writes say who else touches the data. A convolution is fused when

* **relu**: its output goes to exactly one op, ``relu``/``relu_`` on that very tensor, and
  nothing reads the pre-ReLU values (in place: nothing between the two; out of place: the
  conv's output is read by the ReLU alone and is not a module output). Not a ReLU6: fusing
  MobileNetV2's as cuDNN's conv+ReLU plus a clamp made its batch-1 graph 0.90x as fast on the
  H200 (0.97x with its depthwise convs left out), so those stay apart;
* **add+relu**: its output goes to exactly one op, an ``add``/``add_`` with ``alpha`` 1 of a
  tensor ``z`` of the same shape, strides and dtype, the sum goes to exactly one ReLU, and
  ``z``'s value is final before the conv runs (made by an earlier op, written by nothing
  until the add). torchvision's ResNets compute a block's downsample branch after its last
  conv, so those four blocks of ResNet-50 keep their separate add.

In the scheduled run (:class:`FusedRun`) the conv op launches the fused kernel; the absorbed
add and ReLU are still called by the module's Python code, and return the fused conv's
output and launch nothing. The fused conv now reads ``z``, so :func:`with_fusion_edges`
adds an edge from ``z``'s maker to it before streams are planned. Inference only.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .graph import OpNode, TaskGraph
from .trace import OpRecorder, _tensors, as_tuple, check_same_ops

__all__ = ["ConvReluFusion", "FusedRun", "FusionMismatchError", "find_conv_relu",
           "summarize", "with_fusion_edges"]

CONV = "aten.convolution.default"
RELU = {"aten.relu.default", "aten.relu_.default"}
ADD = {"aten.add.Tensor", "aten.add_.Tensor"}
IN_PLACE = {"aten.relu_.default", "aten.add_.Tensor"}
FUSABLE_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


class FusionMismatchError(RuntimeError):
    """The scheduled run did not call the absorbed ops on the tensors the search saw."""


@dataclass(frozen=True)
class ConvReluFusion:
    """One fused conv: node ``conv`` runs the fused kernel, the nodes in ``absorbed`` (the
    add, if any, then the ReLU) launch nothing; ``z_from`` = (node, output position) of the
    op that made the residual ``z``, or None for conv+ReLU."""

    conv: int
    absorbed: tuple[int, ...]
    z_from: tuple[int, int] | None = None


@dataclass
class _Arg:
    """A tensor argument as the search saw it: its maker (node, position) and layout."""

    source: tuple[int, int] | None
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _Call:
    name: str
    args: list[Any]                  # _Arg for tensors, the value otherwise
    kwargs: dict[str, Any]
    out: list[_Arg]
    cudnn: bool                      # torch.backends.cudnn.enabled during the call


class _ObjectRecorder(OpRecorder):
    """:class:`OpRecorder` that also notes which earlier op made each tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[weakref.ref, int, int]] = {}   # id -> (ref, node, pos)
        self.calls: list[_Call] = []

    def _arg(self, t: torch.Tensor) -> _Arg:
        entry = self.made.get(id(t))
        source = entry[1:] if entry is not None and entry[0]() is t else None
        return _Arg(source, tuple(t.shape), tuple(t.stride()), t.dtype)

    def record(self, index, func, args, kwargs, ins, read_ids, out) -> None:
        super().record(index, func, args, kwargs, ins, read_ids, out)
        wrap = (lambda v: self._arg(v) if isinstance(v, torch.Tensor) else v)
        outs = _tensors(out)
        self.calls.append(_Call(str(func), [wrap(a) for a in args],
                                {k: wrap(v) for k, v in kwargs.items()},
                                [self._arg(t) for t in outs], torch.backends.cudnn.enabled))
        for pos, t in enumerate(outs):      # an in-place op's output is its input object
            self.made[id(t)] = (weakref.ref(t), index, pos)


def find_conv_relu(module: nn.Module, example_inputs, graph: TaskGraph) -> list[ConvReluFusion]:
    """The convs of ``module`` that can run fused with their ReLU (and residual add).

    Runs ``module`` once more (no grad) to follow tensor objects; ``graph`` is its task
    graph from :func:`nimble.trace.trace_graph`, and the run must issue the same ops.
    """
    rec = _ObjectRecorder()
    inputs = as_tuple(example_inputs)
    with torch.no_grad(), rec:
        module(*inputs)
    check_same_ops(graph, rec.to_graph(inputs, [], [], graph.device))
    return _match(rec.calls, graph)


def _match(calls: Sequence[_Call], graph: TaskGraph) -> list[ConvReluFusion]:
    """The fusion patterns among ``calls`` (one per node of ``graph``)."""
    users: dict[tuple[int, int], list[int]] = defaultdict(list)
    for index, call in enumerate(calls):
        for a in [*call.args, *call.kwargs.values()]:
            if isinstance(a, _Arg) and a.source is not None:
                users[a.source].append(index)
    readers: dict[int, list[int]] = defaultdict(list)
    writers: dict[int, list[int]] = defaultdict(list)
    for n in graph.nodes:
        for s in n.reads:
            readers[s].append(n.index)
        for s in n.writes:
            writers[s].append(n.index)
    outputs = set(graph.outputs)

    def only_user(made: tuple[int, int], names: set[str]) -> int | None:
        """The one op that takes the tensor ``made`` as an argument, if its name fits."""
        use = users.get(made, [])
        return use[0] if len(use) == 1 and calls[use[0]].name in names else None

    def untouched(storage: int, after: int, upto: int, allowed: set[int]) -> bool:
        """Nothing but ``allowed`` reads or writes ``storage`` in nodes (after, upto]."""
        return all(v in allowed for v in readers[storage] + writers[storage] if after < v <= upto)

    def unread_after(storage: int, op: int) -> bool:
        """An out-of-place op's input: nothing reads it after ``op`` and no output is it."""
        return storage not in outputs and not any(v > op for v in readers[storage])

    def relu_ok(relu: int, tensor: tuple[int, int], storage: int, since: int) -> bool:
        if not (calls[relu].args and isinstance(calls[relu].args[0], _Arg)
                and calls[relu].args[0].source == tensor):
            return False
        if not untouched(storage, since, relu, {relu}):
            return False
        return calls[relu].name in IN_PLACE or unread_after(storage, relu)

    fusions = []
    for i, call in enumerate(calls):
        if not _fusable_conv(call, graph.nodes[i]):
            continue
        y = (i, 0)
        (sy,) = graph.nodes[i].writes
        j = only_user(y, RELU | ADD)
        if j is None:
            continue
        if calls[j].name in RELU:
            if relu_ok(j, y, sy, i):
                fusions.append(ConvReluFusion(i, (j,)))
            continue
        z = _residual(calls[j], y, call.out[0])
        if z is None or not z.source[0] < i or not untouched(sy, i, j, {j}):
            continue
        others = [s for s in graph.nodes[j].reads if s != sy]
        if len(others) != 1 or any(z.source[0] < v < j for v in writers[others[0]]):
            continue
        if calls[j].name in IN_PLACE:
            summed, ss = (j, 0), sy
        else:
            if not unread_after(sy, j):
                continue
            summed, (ss,) = (j, 0), graph.nodes[j].writes
        k = only_user(summed, RELU)
        if k is not None and relu_ok(k, summed, ss, j):
            fusions.append(ConvReluFusion(i, (j, k), z.source))
    return fusions


def _fusable_conv(call: _Call, node: OpNode) -> bool:
    """A 2-D, non-transposed convolution on cuDNN in a dtype the fused kernel takes."""
    if call.name != CONV or not call.cudnn or len(call.args) != 9 or call.kwargs:
        return False
    x, w, _bias, _stride, _padding, _dilation, transposed, output_padding, _groups = call.args
    return (isinstance(x, _Arg) and isinstance(w, _Arg) and len(x.shape) == 4
            and not transposed and not any(output_padding) and x.dtype in FUSABLE_DTYPES
            and len(node.writes) == 1 and len(call.out) == 1)


def _residual(add: _Call, y: tuple[int, int], y_arg: _Arg) -> _Arg | None:
    """The other operand of ``add`` (alpha 1, same layout as the conv output ``y``)."""
    args = add.args
    alpha = add.kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    if alpha != 1 or len(args) < 2 or not all(isinstance(a, _Arg) for a in args[:2]):
        return None
    first, second = args[0], args[1]
    if first.source == y:
        z = second
    elif second.source == y and add.name not in IN_PLACE:
        z = first
    else:
        return None
    same_layout = (z.shape, z.stride, z.dtype) == (y_arg.shape, y_arg.stride, y_arg.dtype)
    return z if same_layout and z.source is not None and z.source != y else None


def with_fusion_edges(graph: TaskGraph, fusions: Sequence[ConvReluFusion]) -> TaskGraph:
    """``graph`` with an edge from each residual's maker to the conv that now reads it."""
    extra = {(f.z_from[0], f.conv) for f in fusions if f.z_from is not None}
    return dataclasses.replace(graph, edges=sorted(set(graph.edges) | extra))


def summarize(fusions: Sequence[ConvReluFusion], graph: TaskGraph) -> str:
    """One line for ``PrepareStats.notes``: how many convs run fused, how many with an add."""
    convs = sum(n.name == CONV for n in graph.nodes)
    added = sum(f.z_from is not None for f in fusions)
    return (f"fuse_relu: {len(fusions)} of {convs} convs run fused with their ReLU "
            f"({added} with the residual add)")


def _passthrough(t: torch.Tensor) -> torch.Tensor:
    return t


class FusedRun:
    """Carries out ``fusions`` in one scheduled run of the module (see the module doc).

    :meth:`swap` gives the call to make for node ``index`` instead of the module's own;
    :meth:`done` sees each node's output, to hold the residuals until their conv runs.
    ``kernels`` = (conv+relu, conv+add+relu) with the signatures of
    ``torch.ops.aten.cudnn_convolution_relu`` and ``cudnn_convolution_add_relu`` (the
    defaults); tests pass CPU stand-ins.
    """

    def __init__(self, fusions: Sequence[ConvReluFusion],
                 kernels: tuple[Callable, Callable] | None = None) -> None:
        self.by_conv = {f.conv: f for f in fusions}
        self.absorbed = {j: f for f in fusions for j in f.absorbed}
        self.wanted: dict[int, list[tuple[int, int]]] = defaultdict(list)   # maker -> (pos, conv)
        for f in fusions:
            if f.z_from is not None:
                self.wanted[f.z_from[0]].append((f.z_from[1], f.conv))
        self.kernels = kernels or (torch.ops.aten.cudnn_convolution_relu.default,
                                   torch.ops.aten.cudnn_convolution_add_relu.default)
        self.residual: dict[int, torch.Tensor] = {}   # conv -> its z, until the add is seen
        self.fused_out: dict[int, torch.Tensor] = {}  # conv -> its output, until the ReLU

    def swap(self, index: int, func, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
        f = self.by_conv.get(index)
        if f is not None:
            x, w, b, stride, padding, dilation, _, _, groups = args
            if f.z_from is None:
                return self.kernels[0], (x, w, b, stride, padding, dilation, groups), {}
            z = self.residual.get(index)
            if z is None:
                raise FusionMismatchError(f"op #{index}: the residual of this fused conv was "
                                          f"not made by op #{f.z_from[0]} in this run")
            return self.kernels[1], (x, w, z, 1.0, b, stride, padding, dilation, groups), {}
        f = self.absorbed.get(index)
        if f is None:
            return func, args, kwargs
        is_add = f.z_from is not None and index == f.absorbed[0]
        y = self.fused_out.get(f.conv)
        z = self.residual.pop(f.conv, None) if is_add else y
        if (str(func) not in (ADD if is_add else RELU) or y is None
                or not any(a is y for a in args[:2]) or not any(a is z for a in args[:2])):
            raise FusionMismatchError(f"op #{index} ({func}) was expected to be the "
                                      f"{'add' if is_add else 'ReLU'} of fused conv #{f.conv}'s "
                                      "output; the run took another path")
        if index == f.absorbed[-1]:
            del self.fused_out[f.conv]
        return _passthrough, (y,), {}

    def done(self, index: int, out: Any) -> None:
        if index in self.by_conv:
            self.fused_out[index] = out
        for pos, conv in self.wanted.get(index, ()):
            self.residual[conv] = _tensors(out)[pos]

    def finish(self) -> None:
        """Every fused conv met its absorbed ops (else the run took another path)."""
        if self.fused_out or self.residual:
            left = sorted(set(self.fused_out) | set(self.residual))
            raise FusionMismatchError(f"fused convs {left[:5]} never reached their ReLU")
