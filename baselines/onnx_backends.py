"""ONNX Runtime as a baseline, and the ONNX export it shares with TensorRT's ONNX-parser
route (:mod:`baselines.tensorrt_backend`).

ONNX Runtime on CUDA uses the CUDA execution provider with ``enable_cuda_graph`` and
IOBinding (inputs and outputs at fixed device addresses, as the provider requires); on CPU
it uses the CPU provider. ``onnxruntime`` (CPU-only) and ``onnxruntime-gpu`` install the same
module: a CUDA request without the CUDA provider is "unavailable", never a silent CPU run.
"""
from __future__ import annotations

import importlib.util
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .base import Availability, Backend, BackendUnavailable, register_backend
from .torch_backends import WARMUP_ITERS

__all__ = ["export_onnx", "flatten_outputs", "OnnxRuntimeBackend"]

ONNX_OPSET = 17


def flatten_outputs(out: Any) -> list[Tensor]:
    """The tensors of a model output (tensor, tuple/list, dict values), in order."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)) and all(isinstance(t, Tensor) for t in out):
        return list(out)
    raise TypeError(f"model outputs must be tensors, a tuple/list or dict of tensors, got {type(out).__name__}")


def export_onnx(model: nn.Module, example_inputs: tuple[Tensor, ...]) -> tuple[bytes, str]:
    """Serialised ONNX model of ``model`` in eval mode, and which exporter made it.

    The TorchScript-based exporter (``dynamo=False``) is tried first: it is fast and robust
    for CNNs. It is deprecated in PyTorch 2.x; where it fails, the torch.export-based one
    (needs ``onnxscript``) is used. Inputs are named ``input0..``, outputs ``output0..``.
    """
    model.eval()
    in_names = [f"input{i}" for i in range(len(example_inputs))]
    with torch.no_grad():
        n_out = len(flatten_outputs(model(*example_inputs)))
    out_names = [f"output{i}" for i in range(n_out)]
    errors = []
    for dynamo in (False, True):
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = Path(tmp) / "model.onnx"
            try:
                torch.onnx.export(model, example_inputs, str(path), dynamo=dynamo, input_names=in_names,
                                  output_names=out_names, opset_version=ONNX_OPSET if not dynamo else 18)
                return path.read_bytes(), ("torch.onnx dynamo exporter" if dynamo
                                           else "torch.onnx TorchScript exporter")
            except Exception as e:  # try the other exporter; report both if both fail
                errors.append(f"dynamo={dynamo}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    raise RuntimeError("ONNX export failed with both exporters: " + " | ".join(errors))


_NP_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.int64: "int64",
              torch.int32: "int32", torch.bool: "bool_"}


class OnnxRuntimeBackend(Backend):
    """ONNX Runtime: CUDA EP + CUDA graph + IOBinding on a GPU, CPU EP on the CPU."""

    name = "onnxruntime"

    def __init__(self) -> None:
        self._provider = ""
        self._exporter = ""

    def _check(self, device: torch.device) -> Availability:
        if importlib.util.find_spec("onnxruntime") is None:
            return Availability(False, "onnxruntime is not installed (pip install onnxruntime, or onnxruntime-gpu for CUDA)")
        if importlib.util.find_spec("onnx") is None:
            return Availability(False, "onnx is not installed (torch.onnx.export needs it)")
        if device.type == "cuda":
            import onnxruntime as ort
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                return Availability(False, "onnxruntime has no CUDAExecutionProvider here "
                                    f"(providers: {ort.get_available_providers()}); install onnxruntime-gpu")
        return Availability(True)

    def version(self) -> str:
        try:
            import onnxruntime as ort
        except ImportError:
            return "onnxruntime (not installed)"
        extra = ", ".join(x for x in (self._provider, self._exporter) if x)
        return f"onnxruntime {ort.__version__}" + (f" ({extra})" if extra else "")

    def prepare(self, model: nn.Module, example_inputs: tuple[Tensor, ...],
                training: bool = False) -> Callable[..., Any]:
        self._refuse_training(training)
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise BackendUnavailable(f"onnxruntime is not installed: {e}") from e
        onnx_bytes, self._exporter = export_onnx(model, example_inputs)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        device = example_inputs[0].device
        if device.type == "cpu":
            self._provider = "CPUExecutionProvider"
            sess = ort.InferenceSession(onnx_bytes, opts, providers=["CPUExecutionProvider"])
            return _cpu_fn(sess)
        self._provider = "CUDAExecutionProvider + CUDA graph"
        return _cuda_graph_fn(ort, onnx_bytes, opts, model, example_inputs)


def _cpu_fn(sess: Any) -> Callable[..., Any]:
    """fn(*inputs) through numpy on the CPU provider; outputs as torch tensors."""
    names = [i.name for i in sess.get_inputs()]

    def run(*inputs: Tensor) -> Any:
        feeds = {n: x.detach().contiguous().numpy() for n, x in zip(names, inputs)}
        outs = [torch.from_numpy(o) for o in sess.run(None, feeds)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return run


def _cuda_graph_fn(ort: Any, onnx_bytes: bytes, opts: Any, model: nn.Module,
                   example_inputs: tuple[Tensor, ...]) -> Callable[..., Any]:
    """fn(*inputs): copy into bound static buffers, run the captured graph, static outputs.

    ORT runs on a torch side stream handed to it as ``user_compute_stream`` (capture is
    illegal on the legacy default stream), joined to the caller's stream on each call, so
    CUDA events on the caller's stream time it correctly.
    """
    import numpy as np

    device = example_inputs[0].device
    idx = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.Stream(device)
    provider = ("CUDAExecutionProvider", {"device_id": str(idx), "enable_cuda_graph": "1",
                                          "user_compute_stream": str(stream.cuda_stream)})
    sess = ort.InferenceSession(onnx_bytes, opts, providers=[provider])
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        raise BackendUnavailable(f"onnxruntime did not enable the CUDA provider (got {sess.get_providers()})")
    with torch.no_grad():
        ref = flatten_outputs(model(*example_inputs))
    static_in = [x.detach().clone().contiguous() for x in example_inputs]
    static_out = [torch.empty_like(t).contiguous() for t in ref]
    binding = sess.io_binding()
    for meta, t in zip(sess.get_inputs(), static_in):
        binding.bind_input(meta.name, "cuda", idx, getattr(np, _NP_DTYPES[t.dtype]), tuple(t.shape), t.data_ptr())
    for meta, t in zip(sess.get_outputs(), static_out):
        binding.bind_output(meta.name, "cuda", idx, getattr(np, _NP_DTYPES[t.dtype]), tuple(t.shape), t.data_ptr())
    run_opts = ort.RunOptions()
    # Leave synchronisation to the caller's stream (as for every other backend).
    run_opts.add_run_config_entry("disable_synchronize_execution_providers", "1")
    torch.cuda.synchronize(device)  # static buffers are written before ORT reads them

    def run(*inputs: Tensor) -> Any:
        if len(inputs) != len(static_in):
            raise ValueError(f"expected {len(static_in)} inputs, got {len(inputs)}")
        caller = torch.cuda.current_stream(device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for i, (x, s) in enumerate(zip(inputs, static_in)):
                if x.shape != s.shape or x.dtype != s.dtype:
                    raise ValueError(f"input {i} must be {(tuple(s.shape), s.dtype)} as bound, got "
                                     f"{(tuple(x.shape), x.dtype)}")
                s.copy_(x)
            sess.run_with_iobinding(binding, run_opts)
        caller.wait_stream(stream)
        return static_out[0] if len(static_out) == 1 else tuple(static_out)

    for _ in range(WARMUP_ITERS):  # ORT captures the graph during its first runs
        run(*example_inputs)
    return run


register_backend("onnxruntime", OnnxRuntimeBackend)
