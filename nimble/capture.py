"""Nimble: ahead-of-time scheduling and multi-stream capture into one CUDA graph.

    fast = Nimble(model)                      # model on CUDA, eval mode
    fast.prepare(example_input, training=False, use_multi_stream=True)
    out = fast(x)                             # copies x in, replays one graph

What :meth:`Nimble.prepare` does, in order, and why that order:

1. **Trace** the module twice eagerly (:func:`nimble.trace.trace_graph`). The eager runs
   also do everything run-time scheduling does once: cuDNN algorithm selection, lazy
   initialisation, allocator warm-up. Two runs must issue the same ops (static model).
2. **Plan** streams with :func:`nimble.streams.assign_streams` (one stream when
   ``use_multi_stream=False``, from the same code path).
3. **Pre-run** the module uncaptured under :class:`ScheduledMode`, which runs op ``k`` on
   the stream the plan chose and records/waits events for the plan's syncs. This creates
   each stream's library handles and workspaces (cuBLAS keeps one per stream) outside
   capture, and checks the op sequence once more against the trace.
4. **Capture** the same scheduled run into one ``torch.cuda.CUDAGraph``: every side
   stream forks from the capture stream when capture begins and is joined back before it
   ends (or capture fails); event record/wait pairs become graph edges. The graph keeps
   the DAG, not the stream identities: concurrency is what survives.

Memory safety across streams: the caching allocator ties a block to the stream that
allocated it. A tensor made on stream A and read on stream B could be freed and handed to
a new allocation on A while B still reads it. :class:`ScheduledMode` keeps such tensors
alive until stream A is ordered after every foreign use (vector clocks over the plan's
events), then lets them go, so memory is reused inside the graph as in eager mode and
never while another stream may still touch it. (The original Nimble reused nothing;
``record_stream`` would defer every cross-stream block to the end of capture.)

That still keeps one working set per stream: a freed block goes back to its own stream's
free list. Under the ``cudaMallocAsync`` allocator backend (the process started with
``PYTORCH_ALLOC_CONF=backend:cudaMallocAsync``) allocations made during capture become graph
memory nodes instead, and the driver reuses memory across streams wherever the graph orders
one tensor's free before another's allocation: on the H200 a 13-stream NASNet-A mobile
graph at batch 32 holds 303 MiB there against 490-548 MiB under the caching allocator.
``memory_limit`` gives up concurrency where memory is high (:func:`serialize_hot`) or
everywhere (:func:`cap_streams`) until the graph fits beside eager's peak.

Outputs are static: the tensors returned by a call are overwritten by the next call.
Pass ``return_copies=True`` to :meth:`Nimble.prepare` to get fresh tensors instead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .allocator import GraphMemoryMeter, allocator_backend, measure_eager_peak
from .graph import TaskGraph
from .memplan import lifetimes, live_bytes
from .convsel import select_conv_kernels
from .convsel import summarize as summarize_conv_choices
from .cudagraph import capture_graph
from .fusion import (ConvReluFusion, FusedRun, FusionMismatchError, find_conv_relu,
                     with_fusion_edges)
from .fusion import summarize as summarize_fusions
from .passes import channels_last_inputs, fold_conv_bn, to_channels_last
from .priority import NodePriorityGraph
from .streams import (StreamPlan, assign_streams, critical_path, critical_streams,
                      single_stream_plan)
from .trace import OpRecorder, TraceMismatchError, _tensors, as_tuple, trace_graph

__all__ = ["Nimble", "NimbleError", "ScheduledMode", "PrepareStats", "check_whole_step_allocator",
           "check_call_inputs", "check_one_device", "fold_tiny_isolated_ops"]


class NimbleError(RuntimeError):
    """The module or the call cannot be handled by Nimble; the message says why."""


@dataclass
class PrepareStats:
    """What ``prepare`` found and built; all sizes in bytes, times in seconds."""

    num_ops: int = 0
    num_view_ops: int = 0
    num_edges: int = 0
    num_streams: int = 1
    num_syncs: int = 0
    folded_conv_bn: int = 0
    native_convs: int = 0            # Conv2d moved off cuDNN by select_convs
    fused_conv_relu: int = 0         # convs run fused with their ReLU (and residual add)
    prepare_s: float = 0.0
    plan_s: float = 0.0
    capture_s: float = 0.0
    eager_peak_bytes: int = 0        # weights + eager's peak of allocated activations
    eager_reserved_bytes: int = 0    # weights + what eager's caching allocator reserved
    graph_pool_bytes: int = 0        # the graph's own memory (pool or graph memory nodes)
    weights_bytes: int = 0
    allocator: str = "native"        # PyTorch's CUDA allocator backend during capture
    notes: list[str] = field(default_factory=list)

    @property
    def graph_total_bytes(self) -> int:
        """Weights plus the graph's private pool: the footprint to compare with eager peak."""
        return self.weights_bytes + self.graph_pool_bytes


class ScheduledMode(OpRecorder):
    """Runs op ``k`` on ``streams[plan.stream_of[k]]`` with the plan's event waits.

    Also checks, op by op, that the run issues the same ops as the traced graph.
    ``timing_events`` (optional): record one external timing event after every op on the
    stream, for per-op GPU times in a single-stream profile capture.

    Memory across streams (the hazard, and how it is avoided): the caching allocator
    hands a freed block only to later allocations *on the stream that allocated it*, in
    that stream's order. A tensor allocated on stream A and used by op v on stream B must
    therefore not be freed until A is ordered after v, or A's next allocation could
    overwrite it while B still reads it. This mode keeps a reference to every such
    cross-stream tensor and drops it only once A has waited (through the plan's events)
    on an event recorded at or after v. "Ordered after" is tracked with vector clocks:
    ``clock[a][b]`` is the last op of stream b that stream a is known to follow. Tensors
    used on one stream only are freed and reused as in eager mode.

    ``fused`` (optional, :class:`nimble.fusion.FusedRun`): make fused convs' calls instead
    of the module's own, and let their absorbed add and ReLU launch nothing.
    """

    def __init__(self, graph: TaskGraph, plan: StreamPlan, streams: Sequence[torch.cuda.Stream],
                 timing_events: list[torch.cuda.Event] | None = None,
                 fused: FusedRun | None = None) -> None:
        super().__init__()
        self.graph, self.plan, self.streams = graph, plan, list(streams)
        self.fused = fused
        self.waits: dict[int, list[int]] = {}
        for u, v in plan.syncs:
            self.waits.setdefault(v, []).append(u)
        self.signals = {u for u, _ in plan.syncs}
        self.events = {u: torch.cuda.Event() for u in self.signals}
        self.timing_events = timing_events
        k = len(self.streams)
        self.clock = [[-1] * k for _ in range(k)]
        self.event_clock: dict[int, list[int]] = {}
        self.alloc_stream: dict[int, int] = {}          # storage id -> stream (-1: outside)
        self.pending: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in range(k)]

    def fork(self) -> None:
        """Every side stream starts after everything queued on the origin stream."""
        for i, s in enumerate(self.streams[1:], start=1):
            s.wait_stream(self.streams[0])
            self._merge_clock(i, self.clock[0])

    def join(self) -> None:
        """Free what is still held on its own stream, then join every side stream.

        Order matters under the ``cudaMallocAsync`` allocator backend, where a free is a
        graph node on the stream that allocated the tensor: a side stream's tensors are
        freed while that stream is still a branch of the capture, after it has waited
        for the streams that last read them, so the free is ordered after every use and
        joined back with the rest. Then the origin stream waits for every side stream
        (capture fails otherwise).
        """
        for a, refs in enumerate(self.pending):
            for b in sorted({b for _, b, v in refs if self.clock[a][b] < v}):
                self.streams[a].wait_stream(self.streams[b])
                self._merge_clock(a, self.clock[b])
            refs.clear()
        for i, s in enumerate(self.streams[1:], start=1):
            self.streams[0].wait_stream(s)
            self._merge_clock(0, self.clock[i])

    def _merge_clock(self, stream: int, other: list[int]) -> None:
        mine = self.clock[stream]
        for b, v in enumerate(other):
            if v > mine[b]:
                mine[b] = v

    def _release(self, a: int) -> None:
        """Drop the references to tensors of stream ``a`` whose foreign uses ``a`` follows."""
        known = self.clock[a]
        self.pending[a] = [(t, b, v) for t, b, v in self.pending[a] if known[b] < v]

    def _current_index(self) -> int:
        current = torch.cuda.current_stream()
        return next((i for i, s in enumerate(self.streams) if s == current), -1)

    def run_op(self, index, func, args, kwargs):
        ins = [t for t in _tensors((args, kwargs)) if t.is_cuda]
        for t in ins:                                    # first seen as an input: not ours
            self.alloc_stream.setdefault(self.storage_id(t), -1)
        if index is None:                                # metadata only (views, allocs)
            out = func(*args, **kwargs)
            here = self._current_index()
            for t in _tensors(out):
                if t.is_cuda:
                    self.alloc_stream.setdefault(self.storage_id(t), here)
            return out
        if index >= self.graph.num_nodes:
            raise TraceMismatchError(index, "end of run", str(func))
        if self.fused is not None:
            func, args, kwargs = self.fused.swap(index, func, args, kwargs)
            ins = [t for t in _tensors((args, kwargs)) if t.is_cuda]
        s = self.plan.stream_of[index]
        stream = self.streams[s]
        for u in self.waits.get(index, ()):
            stream.wait_event(self.events[u])
            self._merge_clock(s, self.event_clock[u])
        self._release(s)                                 # before this op allocates on s
        with torch.cuda.stream(stream):
            out = func(*args, **kwargs)
        if self.fused is not None:
            self.fused.done(index, out)
        outs = [t for t in _tensors(out) if t.is_cuda]
        for t in outs:
            self.alloc_stream.setdefault(self.storage_id(t), s)
        for t in ins + outs:
            a = self.alloc_stream[self.storage_id(t)]
            if a >= 0 and a != s:
                self.pending[a].append((t, s, index))
        self.clock[s][s] = index
        if index in self.signals:
            self.events[index].record(stream)
            self.event_clock[index] = list(self.clock[s])
        if self.timing_events is not None:
            self.timing_events[index].record(stream)
        return out

    def record(self, index, func, args, kwargs, ins, read_ids, out) -> None:
        expected = self.graph.nodes[index]
        got = (str(func), tuple(tuple(t.shape) for t in ins))
        if (expected.name, tuple(expected.input_shapes)) != got:
            raise TraceMismatchError(index, f"{expected.name}{list(expected.input_shapes)}",
                                     f"{got[0]}{list(got[1])}")
        # The graph is known: no need to rebuild nodes and edges during capture.


class Nimble:
    """Wraps a CUDA module; :meth:`prepare` captures it, calling the object replays it.

    The official Nimble's usage works as written::

        nimble_model = Nimble(model)
        nimble_model.prepare(dummy_input, training=False, use_multi_stream=True)
        output = nimble_model(input)
    """

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Nimble wraps a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.graph: TaskGraph | None = None
        self.plan: StreamPlan | None = None
        self.stats = PrepareStats()
        self._cuda_graph: torch.cuda.CUDAGraph | None = None
        self._static_inputs: tuple[torch.Tensor, ...] = ()
        self._static_outputs: list[torch.Tensor] = []
        self._out_spec = None
        self._return_copies = False
        self._streams: list[torch.cuda.Stream] = []
        self._run_module: nn.Module = module
        self._training = None                 # nimble.training.TrainingCapture when training
        self._fusions: list[ConvReluFusion] = []   # prepare(fuse_relu=True), nimble.fusion
        self._use_multi_stream: bool = True
        self._max_streams: int | None = None
        self._split_conv_backward = False
        self._prioritize_critical = False

    # -- prepare ------------------------------------------------------------------------
    def prepare(self, dummy_input: torch.Tensor | Sequence[torch.Tensor], training: bool = False,
                use_multi_stream: bool | str = True, *, fold_bn: bool = True,
                return_copies: bool = False, max_streams: int | None = None,
                memory_limit: float | None = None,
                split_conv_backward: bool = False, channels_last: bool = False,
                prioritize_critical: bool = False, select_convs: bool = False,
                fuse_relu: bool = False) -> "Nimble":
        """Pre-run, plan and capture the module for inputs shaped like ``dummy_input``.

        Args:
            dummy_input: a CUDA tensor or tuple of CUDA tensors (values are irrelevant).
            training: ``False`` captures inference (module in eval mode). ``True``
                captures the forward and the backward graph: calling the object then
                returns outputs whose ``.backward()`` replays the backward graph into the
                parameters' ``.grad``; step an ordinary optimizer eagerly
                (:mod:`nimble.training`; :meth:`prepare_step` captures the whole step).
            use_multi_stream: run independent ops on separate streams (Nimble's stream
                assignment); ``False`` captures everything on one stream; ``"auto"``
                (inference) captures both, replays them in turns and keeps the faster,
                so a chain-like net is never slower than on one stream (a note in
                ``stats`` gives both times; the capture takes about twice as long).
            fold_bn: fold Conv2d+BatchNorm2d pairs first (inference only; on a copy).
            return_copies: return fresh output tensors on every call instead of the
                static ones the next call overwrites.
            max_streams: cap the number of streams (extra chains are merged round-robin,
                in chain order; syncs are recomputed so the schedule stays safe).
            memory_limit: keep the graph's footprint (weights plus its pool,
                ``stats.graph_total_bytes``) within this multiple of eager's peak (weights
                plus the peak of what eager allocated, ``stats.eager_peak_bytes``), since
                more concurrency keeps more alive at once. Two ladders of plans are
                bisected until the capture fits: the ops where most memory is alive run on
                stream 0 (:func:`serialize_hot`), or the chains fold onto fewer streams
                (:func:`cap_streams`); when both fit, the faster graph stays. One stream
                is the floor, and ``stats.notes`` says what was tried and whether it fits.
            split_conv_backward: (training) compute each convolution's weight gradient on
                a side stream, beside its input gradient (:mod:`nimble.training`).
            prioritize_critical: create the streams that run the FLOP-heaviest dependency
                path with a high CUDA priority (the others at the default), so that the
                critical path's kernels get SMs first when concurrent kernels compete. The
                graph is instantiated with CUDA's use-node-priority flag
                (:mod:`nimble.priority`); inference only.
            channels_last: (inference; for training see :meth:`prepare_step`) run a copy of
                the module in channels-last (NHWC)
                memory format; calls still take ordinary tensors (the copy into the static
                input converts them) and outputs keep the layout the module gives them.
            select_convs: (inference) time each ``Conv2d`` through cuDNN and through
                PyTorch's native kernels on its real input and keep the faster
                (:mod:`nimble.convsel`, the paper's conv selection; on a copy, after
                folding and layout). The whole graph is then captured with every conv on
                cuDNN too, and the faster of the two kept (a note gives both times);
                ``stats.native_convs`` counts the convs moved off cuDNN in the kept one.
            fuse_relu: (inference) run each convolution whose output goes straight into a
                ReLU (after an optional residual add) as one cuDNN kernel for conv, bias,
                add and ReLU (:mod:`nimble.fusion`); ``stats.fused_conv_relu`` counts them.
                Fastest with ``channels_last=True``.
        """
        start = time.perf_counter()
        if memory_limit is not None and not memory_limit > 0:
            raise NimbleError(f"memory_limit must be a positive multiple of eager's peak, "
                              f"got {memory_limit!r}")
        check_stream_choice(use_multi_stream)
        if select_convs and training:
            raise NimbleError("select_convs times inference convolutions only; a training "
                              "capture's backward kernels are not timed")
        if fuse_relu and training:
            raise NimbleError("fuse_relu fuses inference convolutions only (cuDNN's fused "
                              "kernel has no backward)")
        if use_multi_stream == "auto" and training:
            raise NimbleError("use_multi_stream='auto' times whole graphs: for training it is an "
                              "option of prepare_step (the whole step), not of prepare(training=True)")
        inputs = self._check_prepare_args(dummy_input, training)
        if prioritize_critical and training:
            raise NimbleError("prioritize_critical is for inference graphs: their replay "
                              "skips the random generators' bookkeeping that training needs")
        if channels_last and training:
            raise NimbleError("prepare(training=True) does not take channels_last; the whole-step "
                              "capture does (prepare_step(..., channels_last=True)), or convert "
                              "the model yourself before training")
        self.stats = PrepareStats()
        self._return_copies = return_copies
        self._use_multi_stream, self._max_streams = use_multi_stream is not False, max_streams
        self._split_conv_backward = split_conv_backward
        self._prioritize_critical = prioritize_critical
        self._training = None
        self._cuda_graph = None
        self._fusions = []
        if training:
            from .training import TrainingCapture   # the training half builds on this file
            self._run_module = self.module
            self._count_weights()
            self._training = TrainingCapture(self, inputs)
            self.stats.prepare_s = time.perf_counter() - start
            return self
        module = self.module
        if fold_bn:
            module, self.stats.folded_conv_bn = fold_conv_bn(module, inputs)
        if channels_last:   # after folding: the folded weights are converted too
            module, inputs = to_channels_last(module, inputs)
            self.stats.notes.append("channels_last: module and static inputs in NHWC")
        plain = module
        if select_convs:    # last: the timings are for the weights and layout that will run
            module, choices = select_conv_kernels(module, inputs)
            self.stats.native_convs = sum(c.count for c in choices if c.native)
            self.stats.notes.append(summarize_conv_choices(choices))
        self._run_module = module
        self._count_weights()

        # 1. trace twice (also the eager warm-up) and measure eager's peak memory
        with measure_eager_peak(self.stats):
            graph = trace_graph(module, inputs, check_static=True)
        if fuse_relu:
            self._fusions = find_conv_relu(module, inputs, graph)
            graph = with_fusion_edges(graph, self._fusions)
            self.stats.fused_conv_relu = len(self._fusions)
            self.stats.notes.append(summarize_fusions(self._fusions, graph))
        # 2. plan
        self._adopt_graph(graph)

        # 3. pre-run on the real streams, 4. capture
        self._static_inputs = tuple(x.detach().clone() for x in inputs)
        self._capture_forward()
        if use_multi_stream == "auto":
            self._keep_faster_forward()
        if self.stats.native_convs:
            self._keep_faster_convs(plain)
        if memory_limit is not None:
            self._fit_memory(memory_limit)
        self.stats.prepare_s = time.perf_counter() - start
        return self

    def _capture_forward(self) -> None:
        """Pre-run and capture the inference forward under ``self.plan``."""
        t0 = time.perf_counter()
        self._run_scheduled(capture=None)
        torch.cuda.synchronize()
        # Per-kernel priorities need an executable graph of our own (nimble.priority).
        # What the capture adds is the graph's memory: its private pool (native
        # allocator) or its graph memory nodes (cudaMallocAsync, mapped at first launch,
        # read off the kept graph's allocation nodes).
        meter = GraphMemoryMeter()
        cuda_graph = (torch.cuda.CUDAGraph(keep_graph=True)
                      if self._prioritize_critical or meter.needs_launch else torch.cuda.CUDAGraph())
        out = self._run_scheduled(capture=cuda_graph)
        if meter.needs_launch:
            cuda_graph.replay()        # same static inputs: rewrites the static outputs only
        self.stats.graph_pool_bytes = meter.read(cuda_graph)
        self.stats.allocator = meter.backend
        self.stats.capture_s = time.perf_counter() - t0
        flat, self._out_spec = tree_flatten(out)
        if not all(isinstance(t, torch.Tensor) for t in flat):
            raise NimbleError("the module must return tensors (or tuples/lists/dicts of them); "
                              f"got {[type(t).__name__ for t in flat]}")
        self._static_outputs = flat
        self._cuda_graph = NodePriorityGraph(cuda_graph) if self._prioritize_critical else cuda_graph

    # What a capture leaves on the object (and in its stats): swapped as one for "auto".
    _CAPTURE_STATE = ("plan", "_streams", "_cuda_graph", "_static_outputs", "_out_spec")
    _CAPTURE_STATS = ("num_streams", "num_syncs", "plan_s", "capture_s", "graph_pool_bytes")

    def _keep_faster_forward(self, rounds: int = 3, budget_s: float = 0.3) -> None:
        """``use_multi_stream="auto"``: capture on one stream too, keep the faster graph.

        Why: streams pay only where independent work outweighs the events that order it.
        On the H200 at batch 32, in the same process, ResNet-101 ran 0.2-0.6 % and
        ResNet-50 0.1 % slower on their two-stream plans than on one stream (three and two
        runs). Both graphs replay in turns,
        ``rounds`` times, as many replays each as fit ``budget_s`` in all (3 to 20); the
        median per graph decides. An inference replay changes nothing but the outputs, so
        nothing needs putting back; the loser's graph and its memory pool are released.
        """
        streams = self.plan.num_streams
        if streams == 1:
            self.stats.notes.append(AUTO_ONE_STREAM_NOTE)
            return

        def one_stream() -> None:
            self._use_multi_stream = False
            self._adopt_graph(self.graph)      # the one-stream plan of the same task graph

        keep, t_multi, t_single, replays = self._race_recapture(one_stream, rounds, budget_s)
        self._use_multi_stream = keep
        self.stats.notes.append(streams_note(streams, t_multi, t_single, rounds, replays))

    def _keep_faster_convs(self, plain: nn.Module, rounds: int = 3, budget_s: float = 0.3) -> None:
        """``select_convs``: capture ``plain`` (every conv on cuDNN) too, keep the faster graph.

        Why: the per-conv timings are of one conv alone on one stream. In the whole graph,
        beside concurrent streams, the native kernels (im2col + GEMM) can lose what they won
        alone: on the H200 at batch 1 NASNet-A mobile's 13-stream graph ran 7 % slower with
        58 convs moved (a few per cent of it the difference between any two of its captures),
        while ResNet-50's ran 4 % faster. Both captures share the task graph and the stream
        plan (the cuDNN flag only changes the kernels inside each conv op).
        """
        selected = self._run_module

        def every_conv_on_cudnn() -> None:
            self._run_module = plain

        keep, t_selected, t_plain, replays = self._race_recapture(every_conv_on_cudnn, rounds,
                                                                  budget_s)
        if keep:
            self._run_module = selected
        else:
            self.stats.native_convs = 0
        self.stats.notes.append(
            f"select_convs: {t_selected:.3f} ms with the selection, {t_plain:.3f} ms with every "
            f"conv on cuDNN (median of {rounds} x {replays} replays): "
            + ("kept the selection" if keep else "kept cuDNN"))

    def _capture_snapshot(self) -> "_CaptureSnapshot":
        """The current graph with what describes it (restored by :meth:`_restore_capture`)."""
        return _CaptureSnapshot({a: getattr(self, a) for a in self._CAPTURE_STATE},
                                {a: getattr(self.stats, a) for a in self._CAPTURE_STATS})

    def _restore_capture(self, snapshot: "_CaptureSnapshot") -> None:
        for a, v in snapshot.state.items():
            setattr(self, a, v)
        for a, v in snapshot.stats.items():
            setattr(self.stats, a, v)

    def _race_recapture(self, change: Callable[[], None], rounds: int,
                        budget_s: float) -> tuple[bool, float, float, int]:
        """Capture again after ``change()`` and race the new graph against the current one
        (:func:`race_graphs`, ``rounds`` times as many replays each as fit ``budget_s``);
        the faster keeps its capture state and stats, the other's memory pool is released.
        Returns whether the current (first) graph was kept, both times and the replays.
        The caller puts back what ``change`` changed beyond the capture state."""
        first = self._capture_snapshot()
        change()
        self._capture_forward()
        return self._race_captures(first, self._capture_snapshot(), rounds, budget_s)

    def _race_captures(self, first: "_CaptureSnapshot", second: "_CaptureSnapshot", rounds: int,
                       budget_s: float) -> tuple[bool, float, float, int]:
        """Race two captures (:func:`race_graphs`, ``rounds`` times as many replays each as
        fit ``budget_s``); the faster becomes this object's capture, the other's memory pool
        is released. Returns whether ``first`` was kept, both times and the replays."""
        replays = race_replays(replay_ms(first.graph, 1), budget_s, rounds)
        t_first, t_second = race_graphs(first.graph, second.graph, rounds, replays)
        keep_first = t_first < t_second
        winner, loser = (first, second) if keep_first else (second, first)
        self._restore_capture(winner)
        release_graph(loser.graph)
        return keep_first, t_first, t_second, replays

    def _fit_memory(self, limit: float) -> None:
        """Capture less concurrent plans until the graph's footprint fits ``limit``.

        Two ladders of plans run from the full plan down towards one stream, and each is
        bisected for its most concurrent plan that fits, assuming that along a ladder less
        concurrency never needs more memory (about log2 of its length in captures):

        - *serialized*: every stream kept, the ops where most memory is alive moved onto
          stream 0 (:func:`serialize_ladder`: :func:`serialize_hot` at each share of
          :data:`SERIALIZE_SHARES`, repeated plans left out);
        - *folded*: the chains folded onto fewer streams (:func:`cap_streams`).

        When both fit with more than one stream, the two graphs race and the faster stays
        (a note gives both times); when neither does, one stream is the floor. Each try that
        fails is released at once; what is kept is the capture that fitted, not a new one.
        """
        allowed = limit * self.stats.eager_peak_bytes - self.stats.weights_bytes   # for the pool
        if self.stats.graph_pool_bytes <= allowed:
            return
        full, streams = self.plan, self._streams
        tried = [f"{full.num_streams} stream{'s' if full.num_streams > 1 else ''} "
                 f"{self.stats.graph_pool_bytes >> 20} MiB"]
        fits = []
        if full.num_streams > 1:                   # else the capture is the floor already
            release_graph(self._cuda_graph)
            serialized = [(f"ops at >= {share:g} of the live peak on stream 0", plan)
                          for share, plan in serialize_ladder(full, self.graph)]
            folded = [(f"{k} streams", cap_streams(full, self.graph, k))
                      for k in range(full.num_streams - 1, 1, -1)]
            for ladder in (serialized, folded):
                best = self._bisect_fit(ladder, allowed, streams, tried)
                if best is not None:
                    fits.append(best)
        if len(fits) == 2:
            _, t_serialized, t_folded, _ = self._race_captures(*fits, rounds=3, budget_s=0.3)
            tried.append(f"serialized {t_serialized:.3f} ms, folded {t_folded:.3f} ms")
        elif fits:
            self._restore_capture(fits[0])
        elif full.num_streams > 1:
            self._capture_on(cap_streams(full, self.graph, 1), streams)
        kept = self.stats.num_streams
        self.stats.notes.append(f"memory_limit {limit:g}x eager ({allowed / 2**20:.0f} MiB for "
                                f"the pool): tried {', '.join(tried)}; kept {kept} stream"
                                f"{'s' if kept > 1 else ''} ({self.stats.graph_pool_bytes >> 20} MiB)")
        if self.stats.graph_pool_bytes > allowed:
            self.stats.notes.append(
                f"memory_limit {limit:g}x eager not met even on one stream "
                f"({self.stats.graph_pool_bytes >> 20} MiB > {allowed / 2**20:.0f} MiB)")

    def _bisect_fit(self, ladder: list[tuple[str, StreamPlan]], allowed: float,
                    streams: list[torch.cuda.Stream], tried: list[str]) -> "_CaptureSnapshot | None":
        """The capture of the first plan of ``ladder`` (most concurrent first) whose pool fits
        ``allowed``, found by bisection (the plan before the ladder is known not to fit and
        the one after it, one stream, is assumed to); ``None`` when none of them fits.
        Appends "label size" to ``tried``; releases every capture but the one returned."""
        fails, fits = -1, len(ladder)
        best = None
        while fits - fails > 1:
            mid = (fails + fits) // 2
            label, plan = ladder[mid]
            self._capture_on(plan, streams)
            tried.append(f"{label} {self.stats.graph_pool_bytes >> 20} MiB")
            if self.stats.graph_pool_bytes <= allowed:
                if best is not None:
                    release_graph(best.graph)
                fits, best = mid, self._capture_snapshot()
            else:
                fails = mid
                release_graph(self._cuda_graph)
        return best

    def _capture_on(self, plan: StreamPlan, streams: list[torch.cuda.Stream]) -> None:
        """Let go of this object's reference to the current graph (the caller has released
        it, or keeps it in a snapshot), then capture on ``plan`` with the first
        ``plan.num_streams`` of ``streams``."""
        self._cuda_graph, self._static_outputs = None, []
        self.plan = plan
        self._streams = streams[:plan.num_streams]
        self.stats.num_streams, self.stats.num_syncs = plan.num_streams, len(plan.syncs)
        self._capture_forward()

    def prepare_step(self, dummy_input: torch.Tensor | Sequence[torch.Tensor],
                     dummy_target: torch.Tensor, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                     optimizer: torch.optim.Optimizer, use_multi_stream: bool | str = True, *,
                     max_streams: int | None = None,
                     split_conv_backward: bool = False,
                     channels_last: bool = False) -> Callable[..., torch.Tensor]:
        """Capture one whole training iteration: forward, loss, backward, optimizer step.

        Returns ``step(inputs, target) -> loss``; ``loss`` is a static tensor that the
        next call overwrites. The optimizer must be graph-safe (SGD, or Adam/AdamW with
        ``capturable=True``); don't call ``zero_grad``/``step`` yourself, and note that
        a Python-float learning rate is baked into the graph. See :mod:`nimble.training`.

        ``channels_last=True`` converts the module's 4-D parameters and buffers to
        channels-last (NHWC) *in place* (the optimizer keeps the same parameter objects;
        values are unchanged, only strides) and captures with NHWC static inputs; calls
        still take ordinary tensors. cuDNN's tensor-core convolutions want NHWC.

        ``use_multi_stream="auto"`` captures the step on the plan's streams and on one
        stream, times both on the example batch and keeps the faster (a note in ``stats``
        gives both times); the capture then takes about twice as long.
        """
        from .training import WholeStep, faster_whole_step

        check_stream_choice(use_multi_stream)
        check_whole_step_allocator()
        start = time.perf_counter()
        inputs = self._check_prepare_args(dummy_input, training=True)
        if not isinstance(dummy_target, torch.Tensor) or not dummy_target.is_cuda:
            raise NimbleError("dummy_target must be a CUDA tensor (the labels of one batch)")
        self.stats = PrepareStats()
        self._use_multi_stream, self._max_streams = use_multi_stream, max_streams
        self._split_conv_backward = split_conv_backward
        self._prioritize_critical = False
        if channels_last:   # in place: the optimizer holds these very parameters
            self.module.to(memory_format=torch.channels_last)
            inputs = channels_last_inputs(inputs)
            self.stats.notes.append("channels_last: module (in place) and static inputs in NHWC")
        self._run_module = self.module
        self._count_weights()
        if use_multi_stream == "auto":
            step = faster_whole_step(self, inputs, dummy_target, loss_fn, optimizer)
        else:
            step = WholeStep(self, inputs, dummy_target, loss_fn, optimizer)
        self.stats.prepare_s = time.perf_counter() - start
        return step

    def _count_weights(self) -> None:
        self.stats.weights_bytes = sum(t.numel() * t.element_size() for t in
                                       [*self._run_module.parameters(), *self._run_module.buffers()])

    def _adopt_graph(self, graph: TaskGraph, training: bool = False) -> None:
        """Refuse host syncs, plan streams for ``graph`` and create the streams."""
        sync_ops = [n for n in graph.nodes if n.host_sync]
        if sync_ops:
            n = sync_ops[0]
            raise NimbleError(
                f"op #{n.index} ({n.name}) makes the host wait for the GPU (.item(), .cpu(), "
                f"printing a tensor, data-dependent shapes): it cannot be captured or "
                f"replayed. Remove host syncs from forward().")
        self.graph = graph
        t0 = time.perf_counter()
        self.plan = self._make_plan(graph, self._use_multi_stream, self._max_streams)
        self.stats.plan_s = time.perf_counter() - t0
        self.stats.num_ops, self.stats.num_view_ops = graph.num_nodes, graph.num_view_ops
        self.stats.num_edges = len(graph.edges)
        self.stats.num_streams, self.stats.num_syncs = self.plan.num_streams, len(self.plan.syncs)
        high: set[int] = set()
        if self._prioritize_critical and self.plan.num_streams > 1:
            high = critical_streams(self.plan, graph.edges, [float(n.flops) for n in graph.nodes])
            self.stats.notes.append(f"prioritize_critical: streams {sorted(high)} of "
                                    f"{self.plan.num_streams} at high priority")
        self._streams = [torch.cuda.Stream(priority=HIGH_PRIORITY if s in high else 0)
                         for s in range(self.plan.num_streams)]

    def _check_prepare_args(self, dummy_input, training: bool) -> tuple[torch.Tensor, ...]:
        if not torch.cuda.is_available():
            raise NimbleError("Nimble needs a CUDA device; torch.cuda.is_available() is False")
        inputs = as_tuple(dummy_input)
        if not inputs:
            raise NimbleError("prepare needs at least one example input tensor")
        for i, x in enumerate(inputs):
            if not x.is_cuda:
                raise NimbleError(f"example input {i} is on {x.device}; Nimble captures CUDA "
                                  f"work only: move inputs to the GPU (x.cuda())")
            if x.requires_grad:
                raise NimbleError(f"example input {i} requires grad; Nimble takes inputs "
                                  "without requires_grad (use x.detach())")
        devices = {p.device for p in [*self.module.parameters(), *self.module.buffers()]}
        if any(d.type != "cuda" for d in devices):
            raise NimbleError(f"the module has parameters or buffers on {sorted(map(str, devices))}; "
                              "move it to the GPU first (model.cuda())")
        check_one_device(devices | {x.device for x in inputs}, torch.cuda.current_device())
        if self.module.training and not training:
            raise NimbleError("the module is in training mode; inference capture needs "
                              "model.eval() (BatchNorm statistics, dropout), or use "
                              "prepare(..., training=True)")
        return inputs

    @staticmethod
    def _make_plan(graph: TaskGraph, multi: bool, max_streams: int | None) -> StreamPlan:
        if not multi:
            return single_stream_plan(graph.num_nodes)
        plan = fold_tiny_isolated_ops(assign_streams(graph.num_nodes, graph.edges), graph)
        if max_streams is not None and plan.num_streams > max_streams:
            plan = cap_streams(plan, graph, max_streams)
        return plan

    def _scheduled_forward(self, grad: bool,
                           timing_events: list[torch.cuda.Event] | None = None) -> Any:
        """Run the module under the plan; the current stream must be the origin stream."""
        fused = FusedRun(self._fusions) if self._fusions else None
        mode = ScheduledMode(self.graph, self.plan, self._streams, timing_events, fused)
        try:
            with torch.set_grad_enabled(grad):
                mode.fork()
                with mode:
                    out = self._run_module(*self._static_inputs)
                mode.join()
            if fused is not None:
                fused.finish()
        except FusionMismatchError as e:
            raise NimbleError(f"fuse_relu: {e}; prepare without fuse_relu") from e
        self._check_complete(mode)
        return out

    def _run_module_scheduled_current(self) -> Any:
        """The forward of a whole training step (called inside the step's own context)."""
        return self._scheduled_forward(grad=True)

    def _run_scheduled(self, capture: torch.cuda.CUDAGraph | None, grad: bool = False) -> Any:
        origin = self._streams[0]
        origin.wait_stream(torch.cuda.current_stream())
        if capture is not None:
            with capture_graph(capture, stream=origin):
                return self._scheduled_forward(grad)
        # Host syncs the trace cannot see (printing a tensor runs with dispatch modes
        # disabled) would break capture: make any synchronizing CUDA call an error here,
        # in the uncaptured pre-run, where failing leaves nothing half-captured.
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(origin):
                out = self._scheduled_forward(grad)
        except RuntimeError as e:
            if "synchronizing CUDA operation" not in str(e):
                raise
            raise NimbleError(
                "the module makes the host wait for the GPU during forward() (.item(), "
                ".cpu(), .tolist(), printing a tensor, data-dependent shapes): it cannot "
                f"be captured or replayed. Remove host syncs from forward(). ({e})") from e
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream().wait_stream(origin)
        return out

    def _run_step_uncaptured(self, body: Callable[[], Any]) -> Any:
        origin = self._streams[0]
        origin.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(origin):
            out = body()
            for s in self._streams[1:]:
                origin.wait_stream(s)
        torch.cuda.current_stream().wait_stream(origin)
        return out

    def _run_step_captured(self, graph: torch.cuda.CUDAGraph, body: Callable[[], Any]) -> Any:
        origin = self._streams[0]
        origin.wait_stream(torch.cuda.current_stream())
        with capture_graph(graph, stream=origin):
            for s in self._streams[1:]:
                s.wait_stream(origin)
            out = body()
            for s in self._streams[1:]:     # backward ran on side streams: join them all
                origin.wait_stream(s)
        return out

    def _check_complete(self, mode: ScheduledMode) -> None:
        seen = mode.num_ops
        if seen != self.graph.num_nodes:
            raise TraceMismatchError(seen, str(self.graph.nodes[seen].name)
                                     if seen < self.graph.num_nodes else "end of run",
                                     "end of run")

    # -- replay -------------------------------------------------------------------------
    def __call__(self, *inputs: torch.Tensor) -> Any:
        if self._cuda_graph is None and getattr(self, "_training", None) is None:
            raise NimbleError("call prepare(example_input) before calling the Nimble object")
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = tuple(inputs[0])
        check_call_inputs(self._static_inputs, inputs)
        if self._training is not None:
            return self._training(inputs)
        for static, x in zip(self._static_inputs, inputs):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x, non_blocking=True)
        self._cuda_graph.replay()
        outs = self._static_outputs
        if self._return_copies:
            outs = [t.clone() for t in outs]
        return tree_unflatten(outs, self._out_spec)

    def replay(self) -> None:
        """Launch the graph on the current stream without touching the inputs (benchmarks)."""
        if self._cuda_graph is None:
            raise NimbleError("call prepare(example_input) first")
        self._cuda_graph.replay()

    # -- analysis -----------------------------------------------------------------------
    def op_times_ms(self, repeats: int = 5) -> list[float]:
        """GPU time of every op: a single-stream profile capture with a timing event per op.

        The profile graph runs the ops back to back with no host gaps, so the time between
        consecutive events is the op's own kernel time (plus one event record). Median
        over ``repeats`` replays.
        """
        if self.graph is None:
            raise NimbleError("call prepare(example_input) first")
        n = self.graph.num_nodes
        plan, streams = self.plan, self._streams
        self.plan = StreamPlan([0] * n, [], 1, [list(range(n))], [])
        self._streams = [torch.cuda.Stream()]
        try:
            events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(n)]
            start = torch.cuda.Event(enable_timing=True, external=True)
            self._run_scheduled(capture=None)            # warm this stream's handles
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            origin = self._streams[0]
            with capture_graph(g, stream=origin):
                start.record(origin)
                self._scheduled_forward(grad=False, timing_events=events)
            samples = []
            for _ in range(repeats):
                g.replay()
                torch.cuda.synchronize()
                marks = [start] + events
                samples.append([marks[i].elapsed_time(marks[i + 1]) for i in range(n)])
            del g
            gap = _event_gap_ms(origin)
            return [max(0.0, sorted(col)[len(col) // 2] - gap) for col in zip(*samples)]
        finally:
            self.plan, self._streams = plan, streams

    def critical_path_ms(self, op_times: Sequence[float] | None = None) -> float:
        """Sum of single-stream op times along the heaviest dependency path: the limit."""
        times = list(op_times) if op_times is not None else self.op_times_ms()
        weight, _ = critical_path(self.graph.num_nodes, self.graph.edges, times)
        return weight


def replay_ms(graph, replays: int) -> float:
    """Mean ms per replay of a captured ``graph`` over ``replays`` back-to-back replays
    (after one untimed warm-up replay), timed with CUDA events."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


AUTO_ONE_STREAM_NOTE = "use_multi_stream='auto': the plan has one stream; nothing to compare"


def check_stream_choice(use_multi_stream: Any) -> None:
    """``prepare`` / ``prepare_step`` take ``use_multi_stream`` True, False or "auto"."""
    if use_multi_stream not in (True, False, "auto"):
        raise NimbleError(f"use_multi_stream must be True, False or 'auto', got {use_multi_stream!r}")


@dataclass
class _CaptureSnapshot:
    """A captured graph and the Nimble state and stats that go with it."""

    state: dict[str, Any]
    stats: dict[str, Any]

    @property
    def graph(self) -> torch.cuda.CUDAGraph:
        return self.state["_cuda_graph"]


def release_graph(graph) -> None:
    """Give a graph's memory pool back to the allocator now (the loser of a race)."""
    reset = getattr(graph, "reset", None)
    if reset is not None:
        reset()


def race_graphs(first, second, rounds: int, replays: int) -> tuple[float, float]:
    """Median ms per replay of two captured graphs, replayed in turns ``rounds`` times
    ``replays`` replays (taking turns spreads a slow spell of the GPU over both)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for graph, out in ((first, times[0]), (second, times[1])):
            out.append(replay_ms(graph, replays))
    t_first, t_second = (sorted(t)[len(t) // 2] for t in times)
    return t_first, t_second


def race_replays(first_ms: float, budget_s: float, rounds: int) -> int:
    """Replays per turn of :func:`race_graphs`: as many as fit ``budget_s`` in all, 3 to 20."""
    return int(min(20, max(3, budget_s / (2 * rounds * max(first_ms, 1e-3) / 1e3))))


def compare_streams(multi, single, streams: int, rounds: int, replays: int,
                    per: str = "") -> tuple[bool, str]:
    """``use_multi_stream="auto"``'s decision: the ``streams``-stream graph and the one-stream
    graph race (:func:`race_graphs`); the faster median decides.
    Returns whether the streams are faster, and the note for ``stats`` that gives both times
    (``per``: e.g. " per step")."""
    t_multi, t_single = race_graphs(multi, single, rounds, replays)
    return t_multi < t_single, streams_note(streams, t_multi, t_single, rounds, replays, per)


def streams_note(streams: int, t_multi: float, t_single: float, rounds: int, replays: int,
                 per: str = "") -> str:
    """The note ``use_multi_stream="auto"`` leaves in ``stats``: both times, which was kept."""
    return (f"use_multi_stream='auto': {streams} streams {t_multi:.3f} ms, one stream "
            f"{t_single:.3f} ms{per} (median of {rounds} x {replays} replays): "
            + ("kept the streams" if t_multi < t_single else "kept one stream"))


def check_one_device(devices: set[torch.device], current: int) -> None:
    """Refuse a module and inputs that are not all on one CUDA device, or on another device
    than the current one (``current``, an index): Nimble creates its streams and captures on
    the current device, so work on another would not be captured (multi-GPU hosts: select
    the device first)."""
    if len(devices) > 1:
        raise NimbleError(f"module and inputs must be on one CUDA device; found "
                          f"{sorted(map(str, devices))}")
    (device,) = devices
    index = current if device.index is None else device.index
    if index != current:
        raise NimbleError(
            f"module and inputs are on {device}, but the current CUDA device is cuda:{current}: "
            f"Nimble creates its streams and captures on the current device. Call "
            f"torch.cuda.set_device({index}) first, or prepare inside "
            f"`with torch.cuda.device({index}):`.")


def check_call_inputs(static_inputs: Sequence[torch.Tensor], inputs: Sequence[Any]) -> None:
    """Refuse a call whose inputs differ in number, shape, dtype or device from the prepared ones."""
    if len(inputs) != len(static_inputs):
        raise NimbleError(f"prepared for {len(static_inputs)} input(s), "
                          f"called with {len(inputs)}")
    for i, (want, x) in enumerate(zip(static_inputs, inputs)):
        if not isinstance(x, torch.Tensor):
            raise NimbleError(f"input {i}: expected a tensor, got {type(x).__name__}")
        if x.shape != want.shape or x.dtype != want.dtype or x.device != want.device:
            raise NimbleError(
                f"input {i}: prepared for shape {tuple(want.shape)}, {want.dtype} on "
                f"{want.device}; called with shape {tuple(x.shape)}, {x.dtype} on "
                f"{x.device}. A captured graph is specialised to its input shapes: "
                f"capture another one (a new Nimble object, or tensile's capture) for other shapes.")


def check_whole_step_allocator() -> None:
    """Refuse a whole-step training capture (Nimble's ``prepare_step``, TENSILE's
    :class:`tensile.graph.GraphStep`) under the ``cudaMallocAsync`` backend, the one kind
    of capture that fails there.

    Inference captures work there (measured on an H200, torch 2.11, seven multi-branch nets
    at batch 1 and 32): :meth:`ScheduledMode.join` frees what it still holds before the
    side streams are joined. Before it did, the frees came after the join and the capture
    aborted the process (``cudaFreeAsync`` of a captured allocation: invalid argument,
    which no ``except`` can catch). Fwd-bwd training captures work there too, on one
    stream and on several (MobileNetV2, EfficientNet-B0 and ResNet-50, SGD and Adam, with
    and without the convolution-backward split: updates equal eager's, and a garbage
    collection after them is clean), since the backward frees what it kept between two
    joins of the side streams (:func:`nimble.training._backward_on_streams`); before, the
    first multi-stream capture failed with "capturing stream has unjoined work".

    A whole-step capture fails there even on one stream (MobileNetV2, SGD, run alone): the
    process aborts with an illegal memory access when a tensor is freed after the capture.
    TENSILE's captured step is the same kind of capture (the optimizer inside the graph); it
    was not tried there and is refused for the same reason.
    """
    if allocator_backend() == "cudaMallocAsync":
        raise NimbleError(
            "a whole-step training capture (Nimble's prepare_step, TENSILE's captured step) "
            "is not supported under PYTORCH_ALLOC_CONF=backend:cudaMallocAsync (tried: the "
            "process aborts with an illegal memory access after the capture). Use the "
            "default (native) allocator, or Nimble's prepare(training=True).")


# CUDA stream priorities: lower is more urgent; the valid range is the device's (torch maps a
# value outside it to the nearest valid one). -1 is valid on every CUDA GPU.
HIGH_PRIORITY = -1


def _event_gap_ms(stream: torch.cuda.Stream, count: int = 101) -> float:
    """GPU time between two timing events recorded back to back inside a graph.

    Each op's profiled time includes one event record; this is subtracted from it.
    """
    events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(count)]
    g = torch.cuda.CUDAGraph()
    with capture_graph(g, stream=stream):
        for e in events:
            e.record(stream)
    gaps = []
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        gaps.append(events[0].elapsed_time(events[-1]) / (count - 1))
    return sorted(gaps)[1]


# Shares of the live peak for serialize_hot, tried by memory_limit: finer where the H200's
# b32 pools came close to 1.2x of eager (DARTS: 110 MiB at 0.3 against 108 allowed).
SERIALIZE_SHARES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05)

TINY_OP_BYTES = 4096   # an op moving less than this has nothing worth overlapping


def fold_tiny_isolated_ops(plan: StreamPlan, graph: TaskGraph,
                           max_bytes: int = TINY_OP_BYTES) -> StreamPlan:
    """Run tiny ops that nothing depends on, and that depend on nothing, on stream 0.

    In training mode every BatchNorm adds one to its ``num_batches_tracked`` (an 8-byte
    ``add_`` that no other op touches). Each such op is an antichain of its own, so the
    optimal assignment gives it a stream: ResNet-50's training forward gets 55 streams
    for 2 of real concurrency. Such an op has no edge, so moving it needs no sync and
    delays nobody; it only saves a stream, its fork and its join.
    """
    degree = [0] * graph.num_nodes
    for u, v in graph.edges:
        degree[u] += 1
        degree[v] += 1
    stream_of = [0 if degree[n.index] == 0 and n.bytes_read + n.bytes_written < max_bytes
                 else s for n, s in zip(graph.nodes, plan.stream_of)]
    renumber = {s: i for i, s in enumerate(sorted(set(stream_of) | {0}))}
    return StreamPlan(stream_of=[renumber[s] for s in stream_of], syncs=plan.syncs,
                      num_streams=len(renumber), chains=plan.chains, meg_edges=plan.meg_edges)


def cap_streams(plan: StreamPlan, graph: TaskGraph, max_streams: int) -> StreamPlan:
    """Fold chains onto at most ``max_streams`` streams; syncs = cross-stream edges.

    A stream runs its ops in index order, so putting two chains on one stream only adds
    ordering (never breaks a dependency); every edge that now crosses streams becomes a
    sync, which keeps the schedule safe. Concurrency is no longer maximal.
    """
    if max_streams < 1:
        raise ValueError(f"max_streams must be >= 1, got {max_streams}")
    return _replan(plan, graph, [s % max_streams for s in plan.stream_of], max_streams)


def _replan(plan: StreamPlan, graph: TaskGraph, stream_of: list[int],
            num_streams: int) -> StreamPlan:
    """``plan`` with its ops moved to ``stream_of``: every edge across streams is a sync
    (safe, not minimal: a stream runs its ops in index order, which only adds ordering)."""
    syncs = sorted({(u, v) for u, v in graph.edges if stream_of[u] != stream_of[v]})
    return StreamPlan(stream_of=stream_of, syncs=syncs, num_streams=num_streams,
                      chains=plan.chains, meg_edges=plan.meg_edges)


def serialize_hot(plan: StreamPlan, graph: TaskGraph, share: float) -> StreamPlan:
    """Run the ops where most memory is alive on stream 0, in program order; keep the
    others on ``plan``'s streams. Syncs = cross-stream edges, as in :func:`cap_streams`.

    An op is *hot* when the graph's tensors alive at it, in program order
    (:func:`nimble.memplan.live_bytes`), come to at least ``share`` of their peak.
    Concurrency costs memory where tensors are large: at batch 32 the NAS cells at full
    resolution hold most of the bytes, and running their branches at once keeps several
    branches' tensors alive together. Serialized there and concurrent elsewhere, the
    H200 measured (cudaMallocAsync, DARTS b32): 133 MiB of pool at 1.27x over one stream
    for ``share=0.5``, where two streams everywhere took 169 MiB for 1.13x. ``share=0``
    puts every op on stream 0; streams left without ops are dropped.
    """
    if not 0 <= share <= 1:
        raise ValueError(f"share must be within [0, 1], got {share}")
    return _serialize(plan, graph, live_bytes(lifetimes(graph), graph.num_nodes), share)


def serialize_ladder(plan: StreamPlan, graph: TaskGraph,
                     shares: Sequence[float] = SERIALIZE_SHARES) -> list[tuple[float, StreamPlan]]:
    """``(share, serialize_hot(plan, graph, share))`` for each of ``shares`` (highest
    first), the live profile computed once; a share whose plan repeats the one before
    it (no op crosses the threshold in between) is left out."""
    live = live_bytes(lifetimes(graph), graph.num_nodes)
    ladder: list[tuple[float, StreamPlan]] = []
    for share in shares:
        serialized = _serialize(plan, graph, live, share)
        if not ladder or serialized.stream_of != ladder[-1][1].stream_of:
            ladder.append((share, serialized))
    return ladder


def _serialize(plan: StreamPlan, graph: TaskGraph, live: np.ndarray, share: float) -> StreamPlan:
    peak = int(live.max()) if graph.num_nodes else 0
    stream_of = [0 if live[i] >= share * peak else s for i, s in enumerate(plan.stream_of)]
    renumber = {s: i for i, s in enumerate(sorted(set(stream_of) | {0}))}
    return _replan(plan, graph, [renumber[s] for s in stream_of], len(renumber))
