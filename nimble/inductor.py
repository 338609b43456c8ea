"""Inductor's kernels under Nimble's multi-stream schedule (experimental).

    fast = InductorNimble(model).prepare(x)          # model on CUDA, eval mode
    out = fast(x)                                    # one CUDA graph: fused kernels, many streams

torch.compile fuses kernels but launches them on one stream; Nimble runs ATen's kernels on
many streams. This module does both:

1. **Trace** the module to a functional ATen FX graph (``make_fx`` + ``functionalize``).
2. **Plan** streams over the graph's ops with :func:`nimble.streams.assign_streams` (a
   ``getitem`` goes with the op whose tuple it takes apart; an op with no tensor input,
   such as ``empty``, is copied into every segment that uses it).
3. **Partition** each stream's ops into *segments*: a segment ends after an op another
   stream waits for and a new one begins at an op that waits for another stream, so every
   sync falls between segments.
4. **Compile** every segment of at least ``min_segment_ops`` ops with ``torch.compile``
   (Inductor by default) on its own: the kernels fuse within a segment, never across
   streams. A smaller segment has nothing to fuse and runs its ATen ops as traced: on
   NASNet-A mobile 132 of the 236 segments hold one op, so this halves the compiles.
5. **Run** the segments in the order of their first op, each on its stream after waiting
   for the events of the segments it reads from; on CUDA the whole run is captured into
   one CUDA graph, like :class:`nimble.Nimble`.

Memory: every value that crosses segments is kept until the end of the run (the graph's
join), so no block is reused while another stream may read it; values inside a segment
are Inductor's to manage. With ``freeze=True`` Inductor keeps its own folded copies of the
weights beside the module's (on ResNet-50, 125 MB more at peak for 98 MB of weights). On a
CPU the segments run one after the other (no streams, no graph): that is how the
partitioning is tested without a GPU.
"""
from __future__ import annotations

import operator
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch._inductor import config as inductor_config
from torch.fx.experimental.proxy_tensor import make_fx
from tqdm import tqdm

from .capture import check_call_inputs, check_one_device
from .cudagraph import capture_graph
from .streams import assign_streams
from .trace import as_tuple

__all__ = ["Segment", "trace_aten", "partition", "InductorNimble"]


@dataclass
class Segment:
    """Consecutive ops of one stream with no sync inside."""

    stream: int
    nodes: list[fx.Node]                                    # ops (and getitems), in graph order
    inputs: list[fx.Node] = field(default_factory=list)     # values made elsewhere
    sources: list[fx.Node] = field(default_factory=list)    # input-free ops copied in
    outputs: list[fx.Node] = field(default_factory=list)    # values read elsewhere
    waits: list[int] = field(default_factory=list)          # segments on other streams
    feeds: list[fx.Node] = field(default_factory=list)      # inputs passed at each call
    fn: Callable[..., Any] | None = None


def trace_aten(module: nn.Module, inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """A functional ATen graph of one inference run (parameters become ``get_attr``)."""
    with torch.no_grad():
        return make_fx(torch.func.functionalize(module), tracing_mode="real")(*inputs)


def _sources(gm: fx.GraphModule) -> set[fx.Node]:
    """Ops that read no activation: ``empty``, a transposed weight. They are copied into
    every segment that uses them instead of getting a place (and a stream) of their own."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem and \
                all(a.op == "get_attr" or a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def partition(gm: fx.GraphModule, multi_stream: bool = True) -> tuple[list[Segment], int]:
    """Segments of ``gm``'s ops over the streams of Nimble's assignment, and the stream count."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    sources = _sources(gm)
    unit: dict[fx.Node, int] = {}
    heads: list[fx.Node] = []
    for n in ops:
        if n.target is operator.getitem:
            if n.args[0] in unit:
                unit[n] = unit[n.args[0]]
        elif n not in sources:
            unit[n] = len(heads)
            heads.append(n)
    edges = sorted({(unit[a], unit[n]) for n in heads for a in n.all_input_nodes
                    if a in unit and unit[a] != unit[n]})
    if multi_stream:
        plan = assign_streams(len(heads), edges)
        stream_of, num_streams = plan.stream_of, plan.num_streams
    else:
        stream_of, num_streams = [0] * len(heads), 1
    waits_in = {v for u, v in edges if stream_of[u] != stream_of[v]}
    signals_out = {u for u, v in edges if stream_of[u] != stream_of[v]}

    # split every stream's units at syncs, then order segments by their first unit
    by_stream: dict[int, list[list[int]]] = {}
    for u in range(len(heads)):
        runs = by_stream.setdefault(stream_of[u], [])
        if not runs or u in waits_in or runs[-1][-1] in signals_out:
            runs.append([])
        runs[-1].append(u)
    runs = sorted((r for rs in by_stream.values() for r in rs), key=lambda r: r[0])
    segment_of_unit = {u: i for i, r in enumerate(runs) for u in r}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    segments = []
    for r in runs:
        members = set(r)
        nodes = sorted((n for n in ops if unit.get(n) in members), key=position.__getitem__)
        segments.append(Segment(stream=stream_of[r[0]], nodes=nodes))
    producer = {n: segment_of_unit[unit[n]] for n in ops if n in unit}
    for seg in segments:
        inside = set(seg.nodes)

        def need(a: fx.Node) -> None:
            if a in inside or a in seg.inputs or a in seg.sources:
                return
            if a in sources:                   # copied in, after what it reads
                for b in a.all_input_nodes:
                    need(b)
                seg.sources.append(a)
                return
            seg.inputs.append(a)
            j = producer.get(a)
            if j is not None and segments[j].stream != seg.stream and j not in seg.waits:
                seg.waits.append(j)

        for n in seg.nodes:
            for a in n.all_input_nodes:
                need(a)
        seg.outputs = [n for n in seg.nodes if any(user not in inside for user in n.users)]
    return segments, num_streams


def _op_count(seg: Segment) -> int:
    """The segment's ops (tuple unpacking not counted)."""
    return sum(1 for n in seg.nodes if n.target is not operator.getitem)


def _segment_module(seg: Segment, constants: dict[fx.Node, torch.Tensor] | None = None
                    ) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The segment as a module, and the values its placeholders take, in order.

    ``constants`` (weights) are kept inside the module as buffers, so that Inductor's
    freezing can fold them (convert their layout once, fold BatchNorm into the conv);
    otherwise every value made outside the segment, weights included, is an input.
    """
    g = fx.Graph()
    root = nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    placeholders: list[fx.Node] = []
    for a in seg.inputs:
        if constants is not None and a in constants:
            root.register_buffer(a.name, constants[a])
            env[a] = g.get_attr(a.name)
        else:
            env[a] = g.placeholder(f"in_{len(placeholders)}")
            placeholders.append(a)
    for n in [*seg.sources, *seg.nodes]:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[o] for o in seg.outputs))
    return fx.GraphModule(root, g), placeholders


class InductorNimble:
    """Inductor-compiled segments on Nimble's streams, captured into one CUDA graph.

    ``prepare(x)`` traces, plans, compiles every segment and (on CUDA) captures; calling
    the object copies inputs into static buffers and replays. Outputs are static, as with
    :class:`nimble.Nimble`. On a CPU the segments run in order without a graph.
    """

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"InductorNimble wraps a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.segments: list[Segment] = []
        self.num_streams = 0
        self.stats: dict[str, Any] = {}
        self._graph: torch.cuda.CUDAGraph | None = None

    def prepare(self, dummy_input: torch.Tensor | Sequence[torch.Tensor],
                use_multi_stream: bool = True, backend: str = "inductor",
                min_segment_ops: int = 2, freeze: bool = False) -> "InductorNimble":
        """Trace, partition, compile each segment of at least ``min_segment_ops`` ops with
        ``backend`` (smaller ones run as traced ATen ops), capture (CUDA).

        ``freeze=True`` keeps the weights inside each segment and turns on Inductor's
        freezing: weights are constants, so their layout is converted and BatchNorm folded
        once at compile time instead of on every call (without it, Inductor copies every
        conv weight to channels-last on every call when it picks that layout).
        """
        if self.module.training:
            raise ValueError("InductorNimble captures inference: call model.eval() first")
        if isinstance(min_segment_ops, bool) or not isinstance(min_segment_ops, int) \
                or min_segment_ops < 1:
            raise ValueError(f"min_segment_ops: expected a positive int, got {min_segment_ops!r}")
        if not isinstance(freeze, bool):
            raise ValueError(f"freeze: expected True or False, got {freeze!r}")
        start = time.perf_counter()
        inputs = tuple(as_tuple(dummy_input))
        gm = trace_aten(self.module, inputs)
        self.segments, self.num_streams = partition(gm, use_multi_stream)
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._constants = {n: operator.attrgetter(n.target)(gm)
                           for n in gm.graph.nodes if n.op == "get_attr"}
        self._output = gm.graph.output_node().args[0]
        compiled = 0
        self._freeze = freeze
        for seg in self.segments:      # compiled at their first call, in the pre-run below
            seg.fn, seg.feeds = _segment_module(seg, self._constants if freeze else None)
            if _op_count(seg) >= min_segment_ops:
                seg.fn = torch.compile(seg.fn, backend=backend, fullgraph=True, dynamic=False)
                compiled += 1
        self._cuda = inputs[0].is_cuda
        if self._cuda:
            check_one_device({t.device for t in (*inputs, *self.module.parameters(),
                                                 *self.module.buffers())},
                             torch.cuda.current_device())
        self._static_inputs = tuple(x.detach().clone() for x in inputs)
        t0 = time.perf_counter()
        if self._cuda:
            # the same streams for the pre-run and the capture: cuBLAS and cuDNN keep
            # per-stream workspaces, which must exist before capture begins
            origin = torch.cuda.Stream()
            self._streams = [origin] + [torch.cuda.Stream() for _ in range(self.num_streams - 1)]
            origin.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(origin):
                self._run(progress=backend)
            torch.cuda.synchronize()
        else:
            self._run(progress=backend)
        compile_s = time.perf_counter() - t0
        if self._cuda:
            self._graph = torch.cuda.CUDAGraph()
            origin.wait_stream(torch.cuda.current_stream())
            with capture_graph(self._graph, stream=origin):
                self._static_outputs = self._run()
        self.stats = {"segments": len(self.segments), "compiled_segments": compiled,
                      "streams": self.num_streams, "freeze": freeze,
                      "compile_s": round(compile_s, 2),
                      "prepare_s": round(time.perf_counter() - start, 2)}
        return self

    def _run(self, progress: str | None = None) -> Any:
        """All segments in order, each on its stream after the events it waits for.

        ``progress`` (the backend's name) shows a bar: the first run compiles every segment.
        """
        values: dict[fx.Node, Any] = dict(zip(self._placeholders, self._static_inputs))
        values.update(self._constants)
        events: dict[int, Any] = {}
        streams = getattr(self, "_streams", None) if self._cuda else None
        if streams:
            for s in streams[1:]:
                s.wait_stream(streams[0])
        order = tqdm(self.segments, desc=f"compiling segments ({progress})", unit="seg",
                     disable=progress is None or len(self.segments) < 20, leave=False)
        # Dynamo decides at trace time, from the global flag, whether weights are constants
        freezing = inductor_config.patch(freezing=True) if self._freeze else nullcontext()
        with torch.no_grad(), freezing:
            for i, seg in enumerate(order):
                args = [values[a] for a in seg.feeds]
                if streams:
                    stream = streams[seg.stream]
                    for j in seg.waits:
                        stream.wait_event(events[j])
                    with torch.cuda.stream(stream):
                        outs = seg.fn(*args)
                    events[i] = torch.cuda.Event()
                    events[i].record(stream)
                else:
                    outs = seg.fn(*args)
                values.update(zip(seg.outputs, outs))
        if streams:
            for s in streams[1:]:
                streams[0].wait_stream(s)
        return fx.node.map_arg(self._output, values.__getitem__)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if not self.segments:
            raise RuntimeError("call prepare(example_input) first")
        check_call_inputs(self._static_inputs, inputs)
        for static, x in zip(self._static_inputs, inputs):
            static.copy_(x)
        if self._graph is None:
            return self._run()
        self._graph.replay()
        return self._static_outputs
