"""CUDA graph capture that the garbage collector and other threads cannot break.

Every capture in this project (Nimble's graphs, TENSILE's captured steps, the timing graphs)
goes through :func:`capture_graph`: ``torch.cuda.graph`` with two changes.

1. The cyclic garbage collector is paused until the capture ends. ``torch.cuda.graph`` no
   longer runs ``gc.collect()`` before a capture in the PyTorch versions we support
   (2.11-2.14; pytorch/pytorch#158193 removed it, for speed). A ``CUDAGraph`` that died
   inside a reference cycle (a released Nimble, a capture the memory search threw away)
   then lingers until the collector's next automatic pass, and that pass can fall inside
   another capture: the dead graph's destructor makes a CUDA call that is refused while a
   stream is capturing ("operation not permitted when stream is capturing"), and the
   capture in progress fails (pytorch/pytorch#161037 has a reproducer). Paused, the pass
   comes after the capture, where the destructor is legal; nothing is leaked.
2. ``capture_error_mode`` defaults to ``"thread_local"`` instead of ``"global"``. Under
   ``"global"`` a CUDA call that is unsafe during capture made by *any* thread breaks the
   capture, and fails in that thread: a ``DataLoader(pin_memory=True)`` keeps such a thread
   (``cudaHostAlloc``, ``cudaEventQuery`` for its pinned blocks), so a capture taken in the
   middle of a training loop, as ``prepare_step`` and TENSILE's capture are, could kill the
   run. ``"thread_local"`` restricts only the capturing thread, which is the one that runs the
   model: host syncs inside the captured code are still refused. Pass
   ``capture_error_mode="global"`` to get PyTorch's default back.
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
    """``with torch.cuda.graph(graph, **kwargs)`` under :func:`gc_paused`, with
    ``capture_error_mode="thread_local"`` unless ``kwargs`` says otherwise (module docstring)."""
    kwargs.setdefault("capture_error_mode", "thread_local")
    with gc_paused(), torch.cuda.graph(graph, **kwargs):
        yield graph
