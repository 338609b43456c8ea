"""TensorRT: FP32 engines with auxiliary streams allowed, executed as a CUDA graph.

Two routes, the first that is installed wins:

1. Torch-TensorRT (``torch_tensorrt``; 2.11 pins ``tensorrt`` 10.15.x, cu13):
   ``torch_tensorrt.compile(ir="dynamo")`` then ``torch_tensorrt.runtime.enable_cudagraphs``.
2. TensorRT's own ONNX parser (``tensorrt`` only): ONNX export, engine build, and one
   ``execute_async_v3`` captured into a ``torch.cuda.CUDAGraph``.

TensorRT picks its own auxiliary streams for independent layers (``max_aux_streams``,
default: TensorRT's heuristic), which makes it the one stock system here that assigns
streams automatically. FP32 precision; TF32 is left at TensorRT's default (allowed), as
PyTorch's cuDNN convolutions do. Engine build time lands in ``prepare_s``.

The TensorRT libraries are several GB; on hosts without them this backend is
"unavailable" with the reason.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch
from torch import Tensor, nn

from nimble.cudagraph import capture_graph

from .base import Availability, Backend, BackendUnavailable, register_backend
from .onnx_backends import export_onnx
from .torch_backends import WARMUP_ITERS, static_graph_fn

__all__ = ["TensorRTBackend"]


class TensorRTBackend(Backend):
    """TensorRT FP32 + auxiliary streams + CUDA graph (see module docstring)."""

    name = "tensorrt"
    needs_cuda = True

    def __init__(self, max_aux_streams: int | None = None):
        if max_aux_streams is not None and max_aux_streams < 0:
            raise ValueError(f"max_aux_streams must be None (TensorRT's heuristic) or >= 0, got {max_aux_streams}")
        self.max_aux_streams = max_aux_streams
        self._route = ""

    def _check(self, device: torch.device) -> Availability:
        if importlib.util.find_spec("torch_tensorrt") is None and importlib.util.find_spec("tensorrt") is None:
            return Availability(False, "neither torch_tensorrt nor tensorrt is installed "
                                "(pip install torch-tensorrt==<torch version>, which pulls tensorrt 10.x)")
        return Availability(True)

    def version(self) -> str:
        for mod in ("torch_tensorrt", "tensorrt"):
            if importlib.util.find_spec(mod) is not None:
                try:
                    v = __import__(mod).__version__
                except Exception as e:  # a broken install still gets a row
                    v = f"(import failed: {type(e).__name__})"
                aux = "heuristic" if self.max_aux_streams is None else self.max_aux_streams
                return f"{mod} {v} ({self._route or 'not built'}; max_aux_streams={aux}; fp32; CUDA graph)"
        return "tensorrt (not installed)"

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        self._refuse_training(training)
        if example_inputs[0].device.type != "cuda":
            raise BackendUnavailable("tensorrt needs CUDA inputs")
        model.eval()
        if importlib.util.find_spec("torch_tensorrt") is not None:
            self._route = "Torch-TensorRT dynamo"
            return self._prepare_torch_tensorrt(model, example_inputs)
        if importlib.util.find_spec("tensorrt") is not None:
            self._route = "TensorRT ONNX parser"
            return self._prepare_onnx_parser(model, example_inputs)
        raise BackendUnavailable("neither torch_tensorrt nor tensorrt is installed")

    def _prepare_torch_tensorrt(self, model: nn.Module, example_inputs: tuple[Tensor, ...]) -> Callable[..., Any]:
        import torch_tensorrt

        kwargs: dict[str, Any] = dict(ir="dynamo", arg_inputs=list(example_inputs),
                                      enabled_precisions={torch.float32}, min_block_size=1)
        if self.max_aux_streams is not None:
            kwargs["max_aux_streams"] = self.max_aux_streams
        with torch.no_grad():
            trt_module = torch_tensorrt.compile(model, **kwargs)
            # enable_cudagraphs is a context manager; it stays entered for the lifetime of
            # the returned function (leaving it tears the recorded graph down).
            context = torch_tensorrt.runtime.enable_cudagraphs(trt_module)
            graphed = context.__enter__()

        def run(*inputs: Tensor) -> Any:
            with torch.no_grad():
                return graphed(*inputs)

        run._keepalive = (context, trt_module)  # type: ignore[attr-defined]
        for _ in range(WARMUP_ITERS):  # first call records the graph
            run(*example_inputs)
        return run

    def _prepare_onnx_parser(self, model: nn.Module, example_inputs: tuple[Tensor, ...]) -> Callable[..., Any]:
        import tensorrt as trt

        onnx_bytes, _ = export_onnx(model, example_inputs)
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
        parser = trt.OnnxParser(network, logger)
        if not parser.parse(onnx_bytes):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT could not parse the ONNX model: {errors}")
        config = builder.create_builder_config()
        if self.max_aux_streams is not None:
            config.max_aux_streams = self.max_aux_streams
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise RuntimeError("TensorRT engine build failed (see the TensorRT log above)")
        engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
        context = engine.create_execution_context()

        device = example_inputs[0].device
        static_in = [x.detach().clone().contiguous() for x in example_inputs]
        static_out: list[Tensor] = []
        in_iter = iter(static_in)
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                t = next(in_iter)
            else:
                shape = tuple(context.get_tensor_shape(name))
                dtype = {trt.float32: torch.float32, trt.float16: torch.float16,
                         trt.int32: torch.int32, trt.int64: torch.int64}[engine.get_tensor_dtype(name)]
                t = torch.empty(shape, dtype=dtype, device=device)
                static_out.append(t)
            context.set_tensor_address(name, t.data_ptr())

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_ITERS):  # the first enqueue flushes deferred setup
                context.execute_async_v3(stream.cuda_stream)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, stream=stream):
            context.execute_async_v3(stream.cuda_stream)
        outputs = static_out[0] if len(static_out) == 1 else tuple(static_out)
        run = static_graph_fn(graph, tuple(static_in), outputs)
        run._keepalive = (engine, context)  # type: ignore[attr-defined]
        return run


register_backend("tensorrt", TensorRTBackend)
