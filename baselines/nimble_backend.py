"""Nimble itself behind the baselines interface: "nimble" (multi-stream), "nimble-single", and
"nimble-mem" (multi-stream within 1.2x of eager's peak memory, fewer streams where needed),
"nimble-split" (training: convolution weight gradients on side streams), "nimble-cl" (multi-stream,
module in channels-last memory format), "nimble-prio" (the critical path's streams at high
priority), "nimble-inductor" (Inductor-compiled segments on Nimble's streams), "nimble-select"
(each convolution on the faster of cuDNN and PyTorch's native kernels), "nimble-fuse" and
"nimble-cl-fuse" (each conv+ReLU, and conv+residual add+ReLU, as one cuDNN kernel; NCHW and
channels-last), "nimble-inductor-freeze" (nimble-inductor with the weights frozen into the
compiled segments).

The callable returned by :meth:`NimbleBackend.prepare` carries ``fn.extra``, a dict of
what the capture found (streams, syncs, folded conv+BN pairs, graph and eager memory),
which the experiment runner stores in the row's ``extra`` column, and ``fn.nimble``, the
:class:`nimble.Nimble` object (for critical-path analysis).
"""
from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from .base import Backend, BackendUnavailable, register_backend

MB = 2 ** 20


class NimbleBackend(Backend):
    """Nimble's AoT capture; ``multi_stream`` picks the stream assignment or one stream."""

    name = "nimble"
    needs_cuda = True
    supports_training = True
    multi_stream = True
    max_streams: int | None = None
    memory_limit: float | None = None
    split_conv_backward = False
    channels_last = False
    prioritize_critical = False
    select_convs = False
    fuse_relu = False

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        """Inference capture, or (``training=True``) forward+backward capture whose
        outputs' ``.backward()`` replays the backward graph into ``.grad``."""
        from nimble import Nimble     # imported here: nimble is not needed to list backends

        if training and self.channels_last:
            raise BackendUnavailable(f"{self.name} trains in whole-step mode only "
                                     "(experiment.mode=whole-step)")
        limit = None if training else self.memory_limit
        fast = Nimble(model).prepare(example_inputs, training=training,
                                     use_multi_stream=self.multi_stream,
                                     max_streams=self.max_streams, memory_limit=limit,
                                     split_conv_backward=self.split_conv_backward,
                                     channels_last=self.channels_last,
                                     prioritize_critical=self.prioritize_critical,
                                     select_convs=self.select_convs,
                                     fuse_relu=self.fuse_relu)

        def fn(*inputs: Tensor) -> Any:
            return fast(*inputs)

        if not training:
            fn.analyze = lambda median_ms: distance_to_limit(fast, median_ms)
        return _with_stats(fn, fast)

    def prepare_step(self, model: nn.Module, example_inputs: tuple[Tensor, Tensor],
                     loss_fn: Callable[[Any, Tensor], Tensor],
                     optimizer) -> Callable[[Tensor, Tensor], Tensor]:
        """Whole-step capture (forward, loss, backward, optimizer) on Nimble's streams."""
        from nimble import Nimble

        x, y = example_inputs
        fast = Nimble(model)
        step = fast.prepare_step(x, y, loss_fn, optimizer, use_multi_stream=self.multi_stream,
                                 max_streams=self.max_streams,
                                 split_conv_backward=self.split_conv_backward,
                                 channels_last=self.channels_last)

        def fn(inputs: Tensor, target: Tensor) -> Tensor:
            return step((inputs,), target)

        return _with_stats(fn, fast)


def distance_to_limit(fast, median_ms: float) -> dict:
    """The latency limit of this graph: the single-stream GPU time of the ops along the
    heaviest dependency path, and how far the measured latency is above it."""
    times = fast.op_times_ms()
    critical = fast.critical_path_ms(times)
    return {"critical_path_ms": round(critical, 4), "kernel_sum_ms": round(sum(times), 4),
            "over_critical_path": round(median_ms / critical, 3) if critical > 0 else None}


def _with_stats(fn: Callable[..., Any], fast) -> Callable[..., Any]:
    """Attach the Nimble object and what its capture found to ``fn``."""
    st = fast.stats
    fn.nimble = fast
    fn.extra = {
        "ops": st.num_ops, "streams": st.num_streams, "syncs": st.num_syncs,
        "folded_conv_bn": st.folded_conv_bn, "native_convs": st.native_convs,
        "fused_conv_relu": st.fused_conv_relu,
        "graph_mem_mb": round(st.graph_total_bytes / MB, 1),
        "graph_pool_mb": round(st.graph_pool_bytes / MB, 1),
        "eager_peak_mb": round(st.eager_peak_bytes / MB, 1),
        "eager_reserved_mb": round(st.eager_reserved_bytes / MB, 1),
        "weights_mb": round(st.weights_bytes / MB, 1),
        "allocator": st.allocator,
    }
    if st.notes:
        fn.extra["notes"] = list(st.notes)
    return fn


class NimbleSingleBackend(NimbleBackend):
    """The paper's ablation: the same capture with every op on one stream."""

    name = "nimble-single"
    multi_stream = False


class NimbleMemoryBackend(NimbleBackend):
    """Multi-stream within 1.2x of eager's peak (the issue's memory target; weights counted
    in both): the most streams whose graph fits (``Nimble.prepare(memory_limit=1.2)``)."""

    name = "nimble-mem"
    memory_limit = 1.2
    supports_training = False


class NimbleSplitBackend(NimbleBackend):
    """Training: multi-stream, and each convolution's weight gradient on a side stream beside
    its input gradient (``split_conv_backward=True``). Inference: the same as "nimble"."""

    name = "nimble-split"
    split_conv_backward = True


class NimblePriorityBackend(NimbleBackend):
    """Multi-stream, with the streams that run the FLOP-heaviest path at high CUDA priority
    (``Nimble.prepare(prioritize_critical=True)``): concurrent kernels compete for SMs at
    batch 32, and the critical path should win. Inference only."""

    name = "nimble-prio"
    prioritize_critical = True
    supports_training = False


class NimbleChannelsLastBackend(NimbleBackend):
    """Multi-stream, with the model in channels-last (NHWC) memory format: a copy for inference
    (``Nimble.prepare(channels_last=True)``), the model itself for whole-step training
    (``prepare_step(channels_last=True)``). cuDNN's tensor-core convolutions want NHWC."""

    name = "nimble-cl"
    channels_last = True


class NimbleSelectBackend(NimbleBackend):
    """Multi-stream, each convolution on the faster of cuDNN and PyTorch's native kernels for
    its real input (``Nimble.prepare(select_convs=True)``, the paper's conv selection).
    Inference only: the backward kernels are not timed."""

    name = "nimble-select"
    select_convs = True
    supports_training = False


class NimbleFuseBackend(NimbleBackend):
    """Multi-stream, each convolution that feeds a ReLU (after an optional residual add) run as
    one cuDNN kernel for conv, bias, add and ReLU (``Nimble.prepare(fuse_relu=True)``,
    :mod:`nimble.fusion`). Inference only: the fused kernel has no backward."""

    name = "nimble-fuse"
    fuse_relu = True
    supports_training = False


class NimbleChannelsLastFuseBackend(NimbleFuseBackend):
    """``nimble-fuse`` on a channels-last (NHWC) copy of the model: cuDNN's fused NHWC kernels
    are the fast ones (``prepare(fuse_relu=True, channels_last=True)``)."""

    name = "nimble-cl-fuse"
    channels_last = True


class NimbleAutoBackend(NimbleBackend):
    """The plan's streams or one stream, whichever replays faster on the example input:
    inference (``prepare(use_multi_stream="auto")``) and whole-step training
    (``prepare_step(use_multi_stream="auto")``). Not the fwd-bwd training mode."""

    name = "nimble-auto"
    multi_stream = "auto"

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        if training:
            raise BackendUnavailable(f"{self.name} compares whole graphs: for training it "
                                     "needs experiment.mode=whole-step")
        return super().prepare(model, example_inputs, training)


class NimbleInductorBackend(Backend):
    """Inductor-compiled segments on Nimble's streams, one CUDA graph (:mod:`nimble.inductor`).
    Compiles every segment separately: minutes for the NAS nets (hundreds of segments)."""

    name = "nimble-inductor"
    needs_cuda = True
    freeze = False

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        from nimble.inductor import InductorNimble

        fast = InductorNimble(model).prepare(example_inputs, freeze=self.freeze)

        def fn(*inputs: Tensor) -> Any:
            return fast(*inputs)

        fn.extra = dict(fast.stats)
        return fn


class NimbleInductorFreezeBackend(NimbleInductorBackend):
    """nimble-inductor with Inductor's freezing: weights are compile-time constants, so their
    channels-last copies and the conv+BN folding are made once, not on every replay."""

    name = "nimble-inductor-freeze"
    freeze = True


register_backend("nimble", NimbleBackend)
register_backend("nimble-single", NimbleSingleBackend)
register_backend("nimble-mem", NimbleMemoryBackend)
register_backend("nimble-split", NimbleSplitBackend)
register_backend("nimble-cl", NimbleChannelsLastBackend)
register_backend("nimble-prio", NimblePriorityBackend)
register_backend("nimble-inductor", NimbleInductorBackend)
register_backend("nimble-inductor-freeze", NimbleInductorFreezeBackend)
register_backend("nimble-auto", NimbleAutoBackend)
register_backend("nimble-select", NimbleSelectBackend)
register_backend("nimble-fuse", NimbleFuseBackend)
register_backend("nimble-cl-fuse", NimbleChannelsLastFuseBackend)
