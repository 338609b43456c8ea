"""CUDA graph capture that Python's garbage collector cannot break.

Every capture in this project (Nimble's graphs, TENSILE's captured steps, the timing graphs)
goes through :func:`capture_graph`, which is ``torch.cuda.graph`` with the cyclic garbage
collector paused for the duration of the capture.

Why: ``torch.cuda.graph`` no longer runs ``gc.collect()`` before a capture in the
PyTorch versions we support (2.11-2.14; pytorch/pytorch#158193 removed it, for speed). A ``CUDAGraph`` that died inside a reference
cycle (a released Nimble, a capture the memory search threw away) then lingers until the
collector's next automatic pass, and that pass can fall inside another capture: the dead
graph's destructor calls ``cudaGraphExecDestroy``, which CUDA refuses while a stream is
capturing ("operation not permitted when stream is capturing"), and the capture in
progress fails (pytorch/pytorch#161037 has a reproducer). Pausing the collector moves the
pass to after the capture, where the destructor is legal. Nothing is leaked: the garbage
is collected on the collector's next pass.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator

import torch

__all__ = ["capture_graph", "gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic garbage collection off for the block, then restored to what it was (also
    when the block raises). For captures made by library code, such as
    ``torch.cuda.make_graphed_callables``."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, **kwargs: Any) -> Iterator[torch.cuda.CUDAGraph]:
    """``with torch.cuda.graph(graph, **kwargs)`` under :func:`gc_paused`."""
    with gc_paused(), torch.cuda.graph(graph, **kwargs):
        yield graph
