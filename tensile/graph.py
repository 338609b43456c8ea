"""A training step captured into one CUDA graph and replayed: no host work per step.

    graph = sched.capture(x, y)      # tensile.Scheduler: its plan's copies and recomputes too
    for x, y in loader:
        loss = graph(x, y)           # one replay: forward, backward, optimizer.step()

Why: a host-bound job (small batches, many small kernels) pays for every Python hook the
runtime adds, so its measured extra time says more about the host than about the plan's
copies. Captured, the step's kernels, copies and event waits replay from the GPU's own
queue; what a plan costs is then what it costs the GPU.

How (``torch.cuda.graphs``' recipe): one uncaptured warm-up step on a side stream (lazy
initialisation and the optimizer's state happen outside the graph; model, optimizer and
RNG are put back afterwards, so the warm-up trains nothing), then one step inside
``torch.cuda.graph``. Its allocations come from the graph's private pool, and a block
freed during the capture serves later allocations of the same capture, so the pool is
the captured step's peak. Inputs are copied into static tensors before every replay.

``GraphStep.replay_ms()`` times the captured step (``Scheduler.capture`` plans for that time).

Limits: the graph keeps the plan it was captured with (no re-plan, no drift test); the
optimizer must be capturable (``Adam(..., capturable=True)`` or ``fused=True``); the loss it
returns is overwritten by the next replay. A graph captured before :func:`tensile.trim_stack`,
:func:`tensile.compact` or :func:`tensile.trim_blas_workspace` is ``stale`` and refuses to
replay (its kernels keep the stack size of their capture and fault after a trim,
:mod:`tensile.stack`; it keeps the addresses of tensors a compaction moved,
:mod:`tensile.compact`, and of the cuBLAS workspaces a trim dropped, :mod:`tensile.workspace`);
capture the step again.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import nn

from nimble.allocator import GraphMemoryMeter
from nimble.cudagraph import capture_graph
from nimble.capture import check_call_inputs, check_whole_step_allocator, replay_ms
from nimble.training import check_capturable, put_back_step_state, save_step_state, step_state_kept

from .compact import compact_count
from .stack import trim_count
from .workspace import blas_trim_count
from .streams import side_stream

__all__ = ["GraphStep", "memory_changes", "warmup_stream"]

# step(batch, capturing) runs one training step and returns the (detached) loss.
StepFn = Callable[[tuple, bool], torch.Tensor]


def memory_changes() -> tuple[int, int, int]:
    """What changed under this process's graphs so far: thread-stack trims, compactions and
    cuBLAS workspace trims. A graph captured at another value must not be replayed."""
    return trim_count(), compact_count(), blas_trim_count()


def warmup_stream(device: torch.device | str | int | None = None) -> torch.cuda.Stream:
    """The one side stream per device that every warm-up before a capture, and the
    capture itself, run on.

    cuBLAS keeps a workspace (65 MiB on an H200, torch 2.11) for every stream it ran on,
    for the life of the process. A fresh stream per warm-up left one more workspace
    behind each time: 260 MB per captured TENSILE step (three warm-ups and the timing
    graph), counted in its peak and held by every later job of the process. It is not a
    ``torch.cuda.Stream`` either, nor is ``torch.cuda.graph``'s default capture stream
    used: the first of those creates PyTorch's stream pool (:mod:`tensile.streams`).
    """
    return side_stream(device, "warmup")


class GraphStep:
    """``step`` captured into a CUDA graph; calling it copies the batch in and replays.

    ``peak_bytes``: the device's allocated peak during the capture (weights, optimizer
    state and the captured step's own peak); ``pool_bytes``: what the graph's pool
    reserved; ``reserved_bytes``: all the allocator reserved right after the capture.
    A replay allocates nothing: these are what every replay needs. ``setup_s``: seconds
    the set-up took, ``warmup`` (the uncaptured steps, state saved and put back) and
    ``capture`` (the captured step and the graph's instantiation).
    """

    def __init__(self, step: StepFn, batch: Sequence[torch.Tensor], model: nn.Module,
                 optimizer: torch.optim.Optimizer, *, warmup: int = 1) -> None:
        check_capturable(optimizer)
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"a CUDA graph needs a CUDA model; the model is on {device}")
        if warmup < 1:
            raise ValueError(f"warmup: expected at least 1 uncaptured step; got {warmup}")
        for i, t in enumerate(batch):
            if not isinstance(t, torch.Tensor) or t.device != device:
                got = t.device if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"batch element {i}: expected a tensor on {device}, got {got}")
        check_whole_step_allocator()
        self.model, self.optimizer = model, optimizer
        self.static_batch = tuple(t.detach().clone() for t in batch)
        t0 = time.perf_counter()
        saved = save_step_state(model, optimizer)
        with torch.random.fork_rng(devices=[device]):
            current, side = torch.cuda.current_stream(device), warmup_stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    step(self.static_batch, False)
            current.wait_stream(side)
            torch.cuda.synchronize(device)
        put_back_step_state(model, optimizer, saved, [p.grad for p in model.parameters()])
        # The saved copies (module and optimizer state) are not needed any more: freed
        # before the capture, so the captured peak below is the step's own.
        del saved
        t1 = time.perf_counter()
        torch.cuda.reset_peak_memory_stats(device)
        meter = GraphMemoryMeter()    # synchronises and empties the cache first
        self.graph = torch.cuda.CUDAGraph()
        with capture_graph(self.graph, stream=warmup_stream(device)):
            self.static_loss = step(self.static_batch, True)
        torch.cuda.synchronize(device)
        self.setup_s = {"warmup": t1 - t0, "capture": time.perf_counter() - t1}
        self.peak_bytes = torch.cuda.max_memory_allocated(device)
        self.pool_bytes = meter.read()
        self.reserved_bytes = torch.cuda.memory_reserved(device)
        self.changes_at_capture = memory_changes()

    @property
    def stale(self) -> bool:
        """Whether :func:`tensile.trim_stack`, :func:`tensile.compact` or
        :func:`tensile.trim_blas_workspace` ran since the capture: the graph must not be
        replayed (:mod:`tensile.stack`, :mod:`tensile.compact`, :mod:`tensile.workspace`)."""
        return memory_changes() != self.changes_at_capture

    def _check_not_stale(self) -> None:
        if self.stale:
            raise RuntimeError("this CUDA graph was captured before tensile.trim_stack(), "
                               "tensile.compact() or tensile.trim_blas_workspace(): its kernels "
                               "keep the thread-stack size and the tensor and workspace "
                               "addresses of their capture, and a replay after any of them "
                               "would fault the GPU or use freed memory; capture the "
                               "step again (a new GraphStep, or Scheduler.replay, which does "
                               "so itself)")

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        """One training step on ``batch`` (same shapes, dtypes and device as captured)."""
        check_call_inputs(self.static_batch, batch)
        self._check_not_stale()
        for static, x in zip(self.static_batch, batch):
            static.copy_(x)
        self.graph.replay()
        return self.static_loss

    def replay_ms(self, replays: int = 20, rounds: int = 1, gap_s: float = 0.0) -> float:
        """Mean time in ms of one replay on the captured batch, over ``replays`` back-to-back
        replays after one untimed one (:func:`nimble.capture.replay_ms`). The replays train,
        so model, optimizer state and the CUDA RNG are put back afterwards.

        ``rounds`` > 1: the least such mean of that many rounds, ``gap_s`` apart. On a GPU
        that other processes share, a single round times whatever they run meanwhile: another
        job's first step or capture made a ResNet-50 step (6.6-9.6 ms beside one co-runner at
        steady state) time at 6.2-11.4 ms, and a plan made for that time was off by as much.
        The quietest of rounds spread over a while is the step's own time."""
        if replays < 1 or rounds < 1:
            raise ValueError(f"replays and rounds: expected at least 1, got {replays} and {rounds}")
        if gap_s < 0:
            raise ValueError(f"gap_s: expected seconds >= 0, got {gap_s}")
        self._check_not_stale()
        times = []
        with step_state_kept(self.model, self.optimizer):
            for i in range(rounds):
                if i and gap_s:
                    time.sleep(gap_s)
                times.append(replay_ms(self.graph, replays))
        return min(times)
