"""Launching a captured CUDA graph with its kernels' own stream priorities.

Stream capture copies each kernel's stream priority into its graph node, but a graph runs
at the priority of the stream it is launched into unless it was instantiated with
``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY``, and ``torch.cuda.CUDAGraph`` does not
pass that flag. :class:`NodePriorityGraph` instantiates the captured graph itself (the
graph must be captured with ``keep_graph=True``) through the driver API and launches that
executable graph; the ``torch.cuda.CUDAGraph`` object stays alive beside it, since it owns
the memory pool the kernels' addresses point into.

Only for graphs without random ops: ``torch.cuda.CUDAGraph.replay`` also advances the
random generators' offsets, which this launch does not.
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from .allocator import _check, _libcuda

__all__ = ["NodePriorityGraph", "USE_NODE_PRIORITY"]

USE_NODE_PRIORITY = 8   # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY, cuda.h


class NodePriorityGraph:
    """An executable graph of ``graph`` (captured with ``keep_graph=True``) that runs each
    kernel at the priority of the stream it was captured on. ``replay()`` launches it on the
    current stream, like ``torch.cuda.CUDAGraph.replay``."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        lib = _libcuda()
        handle = ctypes.c_void_p()
        _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(handle),
                                               ctypes.c_void_p(graph.raw_cuda_graph()),
                                               ctypes.c_ulonglong(USE_NODE_PRIORITY)),
               "cuGraphInstantiateWithFlags(USE_NODE_PRIORITY)")
        self.graph = graph            # owns the memory pool the kernels use
        self._exec = handle
        self._launch = lib.cuGraphLaunch
        weakref.finalize(self, lib.cuGraphExecDestroy, handle)

    def replay(self) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        _check(self._launch(self._exec, ctypes.c_void_p(stream)), "cuGraphLaunch")
