"""Nimble for training: captured forward and backward graphs, or one whole-step graph.

Two modes, both built on the inference capture of :mod:`nimble.capture`:

**fwd-bwd** (the paper's way; ``Nimble.prepare(x, training=True)``). The forward is
captured multi-stream under :class:`~nimble.capture.ScheduledMode`; the backward is captured
by running autograd on the captured outputs, into a second graph that shares the forward
graph's memory pool (the backward frees the forward's saved activations). Autograd runs
every backward op on the stream of its forward op, so the backward inherits the forward's
streams. Calling the Nimble object goes through :class:`_ReplayFunction`: its forward
replays the forward graph, its backward copies the incoming gradients in and replays the
backward graph, which accumulates into every parameter's ``.grad``. Loss and optimizer
stay eager, as in the paper.

**whole step** (``Nimble.prepare_step(...)``): forward, loss, backward and
``optimizer.step()`` captured into one graph; a call is one training iteration. With
``use_multi_stream="auto"`` the step is captured on the plan's streams and on one stream,
both are timed on the example batch, and the faster is kept (:func:`faster_whole_step`).

Hazards, and how each is handled:

* Gradients must stay at fixed addresses. ``optimizer.zero_grad()`` defaults to
  ``set_to_none=True`` in PyTorch 2.x, which drops ``.grad``. In fwd-bwd mode the backward
  replay re-attaches the static gradient buffers first: a ``None`` gradient becomes the
  zeroed static buffer, a replaced gradient is copied into it, so the ordinary loop works.
  In whole-step mode gradients live inside the graph; don't zero or step yourself.
* BatchNorm running statistics are in-place updates inside the forward graph: every
  replay updates them, as eager does.
* Random ops (dropout): the default CUDA generator is registered with every capture, so
  each replay draws fresh numbers, and the backward uses the masks its forward drew.
* ``prepare`` leaves parameters, buffers, gradients (and in whole-step mode the optimizer
  state) as they were: the eager trace runs and the pre-run change them, and are undone
  in place (addresses the graphs use must not change). A fresh optimizer's state is left
  as zeros, which is what a first SGD-with-momentum (dampening 0) or Adam step starts from.
* ``split_conv_backward=True`` (opt-in): each convolution's weight gradient runs on a side
  stream beside its input gradient (:class:`ConvBackwardSplitter`): concurrency that
  autograd's one-call ``convolution_backward`` leaves on the table.
* Memory across streams in backward: autograd picks the streams there, so the vector
  clocks of :class:`ScheduledMode` cannot see the syncs. With several streams, every
  tensor the backward touches is kept alive until capture ends (no reuse inside the
  backward graph, as in the original Nimble); with one stream memory is reused as usual.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .allocator import GraphMemoryMeter, allocator_backend, measure_eager_peak
from .graph import TaskGraph
from .cudagraph import capture_graph
from .capture import AUTO_ONE_STREAM_NOTE, check_call_inputs, compare_streams
from .trace import OpRecorder, _snapshot, _tensors, check_same_ops

__all__ = ["TrainingCapture", "WholeStep", "ConvBackwardSplitter", "trace_training_forward",
           "faster_whole_step", "save_step_state", "put_back_step_state", "step_state_kept",
           "check_capturable", "is_capturable"]


def trace_training_forward(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> TaskGraph:
    """Task graph of one forward in training mode with autograd recording (twice, compared)."""
    graphs = []
    for _ in range(2):
        params = [*module.parameters(), *module.buffers()]
        rec = OpRecorder()
        rec.storage_ids(list(inputs) + params)
        with torch.enable_grad(), rec:
            out = module(*inputs)
        graphs.append(rec.to_graph(inputs, params, _tensors(out), str(inputs[0].device)))
        del out
    check_same_ops(graphs[0], graphs[1])
    return graphs[0]


class _KeepAlive(TorchDispatchMode):
    """Holds every tensor an op touches until the mode is dropped (no reuse meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.kept.extend(_tensors((args, kwargs, out)))
        return out


class ConvBackwardSplitter(TorchDispatchMode):
    """Computes each convolution's weight gradient on a side stream, beside its input gradient.

    Autograd computes both in one ``convolution_backward`` call, i.e. one after the other
    on one stream, although neither needs the other. Here the call is split in two: the
    weight (and bias) gradient runs on a side stream of the op's stream, forked after
    everything the op needs; the input gradient runs on the op's stream and the backward
    goes on. A later op that reads a weight gradient waits for the side stream's event
    first (the optimizer, after backward, is ordered by the final join). Side streams are
    created in the uncaptured pre-run and reused by the capture; every tensor involved is
    kept alive until the join (:class:`_KeepAlive`, the outer mode), so no block is reused
    while a side stream may still read it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.side: dict[int, torch.cuda.Stream] = {}     # op stream handle -> its side stream
        self.ready: dict[int, torch.cuda.Event] = {}     # storage address -> "computed" event
        self.waited: set[tuple[int, int]] = set()
        self.splits = 0

    def reset(self) -> None:
        """Forget the last backward's gradients (call before each backward)."""
        self.ready, self.waited, self.splits = {}, set(), 0

    def side_streams(self) -> list[torch.cuda.Stream]:
        return list(self.side.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._wait_for(args, kwargs)
        if func is torch.ops.aten.convolution_backward.default and args[10][0] and args[10][1]:
            return self._split(func, args, kwargs)
        return func(*args, **kwargs)

    def _split(self, func, args, kwargs):
        current = torch.cuda.current_stream()
        side = self.side.get(current.cuda_stream)
        if side is None:
            side = self.side[current.cuda_stream] = torch.cuda.Stream(device=current.device)
        side.wait_stream(current)                     # grad_output, input, weight are ready
        with torch.cuda.stream(side):
            _, grad_weight, grad_bias = func(*args[:10], [False, True, args[10][2]], **kwargs)
        done = torch.cuda.Event()
        done.record(side)
        grad_input, _, _ = func(*args[:10], [True, False, False], **kwargs)
        for t in (grad_weight, grad_bias):
            if t is not None:
                self.ready[t.untyped_storage().data_ptr()] = done
        self.splits += 1
        return grad_input, grad_weight, grad_bias

    def _wait_for(self, args, kwargs) -> None:
        """The current stream waits for any weight gradient this op reads."""
        if not self.ready:
            return
        current = torch.cuda.current_stream()
        for t in _tensors((args, kwargs)):
            ptr = t.untyped_storage().data_ptr()
            event = self.ready.get(ptr)
            if event is not None and (ptr, current.cuda_stream) not in self.waited:
                current.wait_event(event)
                self.waited.add((ptr, current.cuda_stream))


def _backward_on_streams(outputs, grad_outputs, streams: list[torch.cuda.Stream],
                         splitter: ConvBackwardSplitter | None = None) -> None:
    """Run autograd's backward from the origin stream (the current one) and join it back.

    With several streams, tensors the backward touches stay alive until every side stream
    has been joined into the origin stream: only then may their blocks be reused. Under the
    ``cudaMallocAsync`` backend a free is itself stream-ordered work (a graph node on the
    stream that allocated the tensor), so there the side streams are forked once more after
    the join, the kept tensors are freed (each free after every use), and the side streams
    are joined again: a free after the last join is work the capture never joined, and
    ending the capture fails ("capturing stream has unjoined work").
    """
    origin = streams[0]
    several = len(streams) > 1 or splitter is not None
    keep = _KeepAlive() if several else contextlib.nullcontext()
    split = splitter if splitter is not None else contextlib.nullcontext()
    if splitter is not None:
        splitter.reset()
    with keep:                  # outer mode: it also sees the calls the splitter makes
        with split:
            torch.autograd.backward(outputs, grad_outputs)
        sides = [*streams[1:], *(splitter.side_streams() if splitter else [])]
        for s in sides:
            origin.wait_stream(s)
    if several and allocator_backend() == "cudaMallocAsync":
        for s in sides:
            s.wait_stream(origin)
        keep.kept.clear()
        for s in sides:
            origin.wait_stream(s)


def _restore_in_place(module: nn.Module, saved: dict, grads: list[torch.Tensor],
                      params: list[nn.Parameter]) -> None:
    """Put parameters, buffers and gradient values back without moving any tensor."""
    with torch.no_grad():
        for k, v in module.state_dict().items():
            v.copy_(saved["model"][k])
        names = {id(p): n for n, p in module.named_parameters()}
        for p, g in zip(params, grads):
            old = saved["grads"][names[id(p)]]
            g.copy_(old) if old is not None else g.zero_()


def _wait_for_host_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state kept in host memory beside a CUDA model (``tensile.stream_optimizer``)
    is written by asynchronous copies: let them finish before the host reads or writes it."""
    device = next(module.parameters()).device
    if device.type == "cuda" and any(isinstance(v, torch.Tensor) and v.device.type == "cpu"
                                     for st in optimizer.state.values() for v in st.values()):
        torch.cuda.synchronize(device)


def _state_beside(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Optimizer state that lives outside ``optimizer.state`` during training: the rows a
    streamed optimizer keeps on the device (``tensile.stream_optimizer(slice_resident=k)``),
    newer than their host copies between steps. Saved and put back with the rest."""
    streamed = getattr(optimizer, "_tensile_streamed", None)
    return streamed.device_rows() if streamed is not None else []


def save_step_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, list]:
    """Clones of the module's state and of the optimizer's state tensors (those a streamed
    optimizer keeps beside ``optimizer.state`` too), for :func:`put_back_step_state` after
    warm-up steps or timing replays that train."""
    _wait_for_host_state(module, optimizer)
    return ({k: v.detach().clone() for k, v in module.state_dict().items()},
            {p: {k: v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
             for p, st in optimizer.state.items()},
            [t.detach().clone() for t in _state_beside(optimizer)])


def put_back_step_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                        saved: tuple[dict, dict, list], grads: Sequence[torch.Tensor | None]) -> None:
    """Module and optimizer state back *in place* (a captured graph keeps using those
    addresses), ``grads`` zeroed; optimizer state created since the save becomes zeros."""
    model_state, opt_state, beside = saved
    _wait_for_host_state(module, optimizer)
    with torch.no_grad():
        for k, v in module.state_dict().items():
            v.copy_(model_state[k])
        for g in grads:
            if g is not None:
                g.zero_()
        now = _state_beside(optimizer)
        if beside and [t.shape for t in now] != [t.shape for t in beside]:
            raise RuntimeError(f"the streamed optimizer's device rows changed since the save "
                               f"(shapes {[tuple(t.shape) for t in beside]} then, "
                               f"{[tuple(t.shape) for t in now]} now): its state was re-homed "
                               f"between save_step_state and put_back_step_state")
        for i, v in enumerate(now):   # made since the save (no state then): zeros, as below
            v.copy_(beside[i]) if beside else v.zero_()
    _zero_or_restore_optimizer(optimizer, opt_state)


@contextlib.contextmanager
def step_state_kept(module: nn.Module, optimizer: torch.optim.Optimizer,
                    grads: Callable[[], Sequence[torch.Tensor | None]] | None = None):
    """Around timing replays or profiling steps that train: module and optimizer state and
    (for a CUDA module) the CUDA generator are saved on entry and put back (in place) when
    the block ends; ``grads()`` (default: the parameters' ``.grad`` then) names the gradients
    to zero. A block that raises leaves them as they are."""
    device = next(module.parameters()).device
    saved = save_step_state(module, optimizer)
    rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    yield
    put_back_step_state(module, optimizer, saved,
                        grads() if grads is not None else [p.grad for p in module.parameters()])
    if rng is not None:
        torch.cuda.set_rng_state(rng, device)


def _zero_or_restore_optimizer(optimizer: torch.optim.Optimizer, saved_state: dict) -> None:
    """Optimizer state back in place: old values, or zeros where the state was new."""
    with torch.no_grad():
        for p, state in optimizer.state.items():
            before = saved_state.get(p, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    v.copy_(before[k]) if k in before else v.zero_()


def _note_splits(stats, splitter: ConvBackwardSplitter | None) -> None:
    if splitter is not None:
        stats.notes.append(f"split_conv_backward: {splitter.splits} convolution backwards split "
                           f"over {len(splitter.side)} side stream(s)")


def _record_graph_memory(stats, meter: GraphMemoryMeter, *graphs: torch.cuda.CUDAGraph) -> None:
    """Store the captured ``graphs``' memory in ``stats``.

    Under the cudaMallocAsync backend graph memory is mapped at the first launch, and
    launching a training graph here would update the weights. The fwd-bwd graphs are then
    captured with ``keep_graph=True`` and their memory is read off their allocation nodes,
    whose addresses the driver fixes at capture (:meth:`GraphMemoryMeter.read`); they are
    instantiated here. (Whole-step captures are refused there:
    :func:`nimble.capture.check_whole_step_allocator`.)
    """
    stats.graph_pool_bytes = meter.read(*graphs)
    stats.allocator = meter.backend
    if meter.needs_launch:
        for graph in graphs:
            graph.instantiate()


class TrainingCapture:
    """The fwd-bwd capture of a module in training mode (see the module docstring)."""

    def __init__(self, nimble, inputs: tuple[torch.Tensor, ...]) -> None:
        self.nimble = nimble
        self.splitter = ConvBackwardSplitter() if nimble._split_conv_backward else None
        module = nimble.module
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("training capture: the module has no parameter that requires grad")
        saved = _snapshot(module, None)
        # Static gradient buffers: the backward graph accumulates into these addresses.
        self.grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        try:
            self._capture(inputs)
        finally:
            _restore_in_place(module, saved, self.grads, self.params)

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> None:
        nb = self.nimble
        start = time.perf_counter()
        with measure_eager_peak(nb.stats):
            graph = trace_training_forward(nb.module, inputs)
            nb._adopt_graph(graph, training=True)
            nb._static_inputs = tuple(x.detach().clone() for x in inputs)
            # Pre-run: forward on the real streams, then a backward with zero gradients, to
            # create handles, pick cuDNN's backward algorithms and warm the allocator.
            out = nb._run_scheduled(capture=None, grad=True)
            flat = [t for t in tree_flatten(out)[0]]
            self.static_grad_outputs = [torch.zeros_like(t) for t in flat]
            _backward_on_streams(flat, self.static_grad_outputs, nb._streams, self.splitter)
            del out, flat

        meter = GraphMemoryMeter()
        self.forward_graph = torch.cuda.CUDAGraph(keep_graph=meter.needs_launch)
        out = nb._run_scheduled(capture=self.forward_graph, grad=True)
        flat, nb._out_spec = tree_flatten(out)
        if not all(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            raise ValueError("training capture: every output must be a tensor that requires grad")
        self.static_outputs = flat
        self.backward_graph = torch.cuda.CUDAGraph(keep_graph=meter.needs_launch)
        origin = nb._streams[0]
        origin.wait_stream(torch.cuda.current_stream())
        with capture_graph(self.backward_graph, pool=self.forward_graph.pool(), stream=origin):
            for s in nb._streams[1:]:
                s.wait_stream(origin)
            _backward_on_streams(flat, self.static_grad_outputs, nb._streams, self.splitter)
        _record_graph_memory(nb.stats, meter, self.forward_graph, self.backward_graph)
        _note_splits(nb.stats, self.splitter)
        nb.stats.capture_s = time.perf_counter() - start
        # The captured outputs keep their autograd history (saved activations live in the
        # pool and are rewritten by every replay); callers get detached aliases of them.

    def attach_grads(self) -> None:
        """Make every parameter's ``.grad`` the static buffer the backward graph adds into."""
        with torch.no_grad():
            for p, g in zip(self.params, self.grads):
                current = p.grad
                if current is None:               # zero_grad(set_to_none=True)
                    g.zero_()
                elif current.data_ptr() != g.data_ptr():
                    g.copy_(current)              # the user replaced .grad
                else:
                    continue
                p.grad = g

    def __call__(self, inputs: Sequence[torch.Tensor]) -> Any:
        for x in inputs:
            if x.requires_grad:
                raise ValueError("Nimble training capture does not compute input gradients; "
                                 "pass inputs without requires_grad")
        outs = _ReplayFunction.apply(self, _REQUIRES_GRAD_TOKEN(), *inputs)
        return tree_unflatten(list(outs), self.nimble._out_spec)

    def replay_forward(self, inputs: Sequence[torch.Tensor]) -> None:
        for static, x in zip(self.nimble._static_inputs, inputs):
            static.copy_(x)
        self.forward_graph.replay()

    def replay_backward(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        for static, g in zip(self.static_grad_outputs, grad_outputs):
            if g is None:
                static.zero_()
            else:
                static.copy_(g)
        self.attach_grads()
        self.backward_graph.replay()


def _REQUIRES_GRAD_TOKEN() -> torch.Tensor:
    """A tiny input that requires grad, so the replayed outputs join the autograd graph."""
    return torch.empty(0, requires_grad=True)


class _ReplayFunction(torch.autograd.Function):
    """forward: replay the forward graph; backward: copy gradients in, replay backward."""

    @staticmethod
    def forward(ctx, capture: TrainingCapture, token: torch.Tensor, *inputs: torch.Tensor):
        ctx.capture = capture
        ctx.num_inputs = len(inputs)
        capture.replay_forward(inputs)
        return tuple(t.detach() for t in capture.static_outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        ctx.capture.replay_backward(grad_outputs)
        return (None, None) + (None,) * ctx.num_inputs


class WholeStep:
    """Forward, loss, backward and ``optimizer.step()`` captured into one graph.

    Calling it with ``(inputs, target)`` runs one training iteration and returns the
    static loss tensor (overwritten by the next call; ``.item()`` it or clone it).
    """

    def __init__(self, nimble, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 optimizer: torch.optim.Optimizer, warmup: int = 2) -> None:
        check_capturable(optimizer)
        self.nimble, self.loss_fn, self.optimizer = nimble, loss_fn, optimizer
        self.splitter = ConvBackwardSplitter() if nimble._split_conv_backward else None
        module = nimble.module
        saved = save_step_state(module, optimizer)
        self.static_target = target.detach().clone()
        try:
            self._capture(inputs, warmup)
        finally:
            grads = [p.grad for p in module.parameters() if p.requires_grad]
            put_back_step_state(module, optimizer, saved, grads)

    def _step_body(self) -> torch.Tensor:
        nb = self.nimble
        out = nb._run_module_scheduled_current()
        loss = self.loss_fn(out, self.static_target)
        _backward_on_streams([loss], None, nb._streams, self.splitter)
        self.optimizer.step()
        return loss

    def _capture(self, inputs: tuple[torch.Tensor, ...], warmup: int) -> None:
        nb = self.nimble
        start = time.perf_counter()
        with measure_eager_peak(nb.stats):
            nb._adopt_graph(trace_training_forward(nb.module, inputs), training=True)
            nb._static_inputs = tuple(x.detach().clone() for x in inputs)
            self.static_inputs = nb._static_inputs    # this graph's own (a second capture makes others)
            for _ in range(warmup):                   # creates optimizer state, warms kernels
                self.optimizer.zero_grad(set_to_none=True)
                nb._run_step_uncaptured(self._step_body)
        # Gradients are created inside the graph (AccumulateGrad takes the new buffer).
        self.optimizer.zero_grad(set_to_none=True)
        meter = GraphMemoryMeter()
        self.graph = torch.cuda.CUDAGraph()     # not under cudaMallocAsync: check_whole_step_allocator
        self.static_loss = nb._run_step_captured(self.graph, self._step_body)
        _record_graph_memory(nb.stats, meter)
        _note_splits(nb.stats, self.splitter)
        nb.stats.capture_s = time.perf_counter() - start

    def __call__(self, inputs: Sequence[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        check_call_inputs(self.static_inputs, tuple(inputs))
        if target.shape != self.static_target.shape or target.dtype != self.static_target.dtype \
                or target.device != self.static_target.device:
            raise ValueError(
                f"target: prepared for shape {tuple(self.static_target.shape)}, "
                f"{self.static_target.dtype} on {self.static_target.device}; called with shape "
                f"{tuple(target.shape)}, {target.dtype} on {target.device}")
        for static, x in zip(self.static_inputs, inputs):
            static.copy_(x)
        self.static_target.copy_(target)
        self.graph.replay()
        return self.static_loss


def faster_whole_step(nimble, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                      loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                      optimizer: torch.optim.Optimizer, replays: int = 20,
                      rounds: int = 3) -> WholeStep:
    """``use_multi_stream="auto"``: the whole step on the plan's streams or on one stream,
    whichever replays faster on the example batch.

    Why: streams pay only where a step's independent work outweighs the events that order
    it. On CIFAR-sized MobileNetV2 and ResNet-50 a multi-stream whole step ran 1-6 % slower
    than one stream on an H200, because the heaviest dependency path holds 88-96 % of the
    kernel time there.

    Ordering: both graphs are captured first (each capture restores the module and the
    optimizer), then replayed in turns, ``rounds`` x ``replays`` each, median per graph.
    The replays train, so parameters, buffers, optimizer state, gradients and the CUDA
    generator's state are put back in place afterwards. The loser's graph is released; the
    parameters' ``.grad`` point at the winner's gradient buffers.
    """
    params = [p for p in nimble.module.parameters() if p.requires_grad]
    notes_before = list(nimble.stats.notes)     # prepare_step's own (channels_last)
    nimble._use_multi_stream = True
    multi = WholeStep(nimble, inputs, target, loss_fn, optimizer)
    streams = nimble.plan.num_streams
    if streams == 1:
        nimble.stats.notes.append(AUTO_ONE_STREAM_NOTE)
        return multi
    kept = {"stats": nimble.stats, "graph": nimble.graph, "plan": nimble.plan,
            "streams": nimble._streams, "grads": [p.grad for p in params]}
    nimble.stats = type(kept["stats"])()
    nimble.stats.notes = list(notes_before)
    nimble._count_weights()
    nimble._use_multi_stream = False
    single = WholeStep(nimble, inputs, target, loss_fn, optimizer)

    with step_state_kept(nimble.module, optimizer,
                         lambda: [*kept["grads"], *(p.grad for p in params)]):
        keep, note = compare_streams(multi.graph, single.graph, streams, rounds, replays, " per step")
        torch.cuda.synchronize()

    if keep:
        nimble.stats, nimble.graph, nimble.plan = kept["stats"], kept["graph"], kept["plan"]
        nimble._streams = kept["streams"]
        for p, g in zip(params, kept["grads"]):   # the multi-stream graph's gradient buffers
            p.grad = g
        winner, loser = multi, single
    else:
        winner, loser = single, multi
    loser.graph.reset()   # its memory pool goes back to the allocator
    nimble.stats.notes.append(note)
    return winner


def is_capturable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` runs on the device alone, so a CUDA graph can hold it:
    optimizers without a step count on the host (SGD), and Adam-family ones created with
    ``capturable=True`` or ``fused=True`` (both keep the step count on the device)."""
    if "capturable" not in optimizer.defaults:
        return True
    return all(g.get("capturable") or g.get("fused") for g in optimizer.param_groups)


def check_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Adam-family optimizers step on the host unless ``capturable=True`` (or ``fused=True``):
    refuse them."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not is_capturable(optimizer):
        raise ValueError(f"{type(optimizer).__name__}.step() reads its step count on the host; "
                         f"create it with capturable=True (or fused=True) to capture it in a "
                         f"CUDA graph")
