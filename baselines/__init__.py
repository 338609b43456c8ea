"""Adapters for the systems Nimble is compared with, behind one interface.

    from baselines import get_backend, try_prepare
    result = try_prepare(get_backend("inductor"), model, (x,), device="cuda")
    if result.status == "ok":
        out = result.fn(x)
    else:
        print(result.status, result.reason)   # a row with a reason, never a crash

Registered names: eager, torchscript, cudagraph, inductor, inductor-cudagraphs,
inductor-max-autotune, tensorrt, tvm, tvm-tuned, onnxruntime (and whatever other packages
add with :func:`register_backend`, e.g. nimble). Importing this package imports no optional
dependency: TensorRT, TVM and ONNX Runtime are imported when a backend is prepared.
"""
from .base import (BACKENDS, Availability, Backend, BackendUnavailable, PrepareResult, get_backend,
                   register_backend, try_prepare)
from . import torch_backends, onnx_backends, tensorrt_backend, tvm_backend  # noqa: F401  (register)
from . import nimble_backend  # noqa: F401  ("nimble", "nimble-single"; imports nimble lazily)

__all__ = ["BACKENDS", "Availability", "Backend", "BackendUnavailable", "PrepareResult", "get_backend",
           "register_backend", "try_prepare"]
