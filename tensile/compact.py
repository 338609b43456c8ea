"""A job's long-lived device tensors allocated again, side by side: the holes between them go back.

    training_step(model, opt, batch, loss_fn)        # the first step creates Adam's state
    moved = tensile.compact(model, opt)              # between steps, before any capture
    print(moved.reserved_before - moved.reserved_after, "bytes given back")

Why: the first training step allocates the optimizer's state in between that step's
activations, gradients and workspaces. When the activations are freed, the caching
allocator keeps every segment that still holds one long-lived tensor, and the holes in it
stay reserved for the rest of the process: PyTorch gives back only whole free segments.
:func:`tensile.stream_optimizer` makes more holes: it moves the state to the host after
that step. On the H200 (torch 2.11, batch 2) a captured DenseNet-121 job planned by TENSILE
held 86 MB in small-block segments for 34 MB of tensors, and 104 MB in large ones for 80
(``results/h200/README.md``, thirty-sixth session). On a GPU shared by several jobs that
is memory no other job can use.

How: every parameter, gradient, buffer and optimizer state tensor on the device that is
the only tensor over its storage and spans all of it is copied to the host and its device
storage dropped; then the allocator's free segments go back (``torch.cuda.empty_cache``)
and the tensors are copied back, in the model's order, into fresh segments. Each tensor
keeps its identity (its ``.data`` is re-pointed, as ``Module.to`` does), so the optimizer,
hooks and anything else holding the tensor object see the new memory. A tensor that shares
its storage (tied weights, a view, a gradient inside a bucket) stays where it is: moving it
would split it from the others. Values are bit-identical afterwards.

Hazard, CUDA graphs: a graph keeps the addresses it was captured with. Every compaction
counts (:func:`compact_count`): :class:`tensile.GraphStep` refuses to replay a graph
captured before the latest one, and :meth:`tensile.Scheduler.replay` captures the step
again. Compact between steps, after the step that creates the optimizer's state and
before capturing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

__all__ = ["CompactResult", "compact", "compact_count"]

_compactions = 0            # compact() calls that moved something, in this process


@dataclass(frozen=True)
class CompactResult:
    """What :func:`compact` did: ``moved`` tensors (``moved_bytes``) allocated again,
    ``kept`` left in place because their storage is shared; the allocator's reserved bytes
    on the device before and after (0 on the CPU)."""

    moved: int
    moved_bytes: int
    kept: int
    reserved_before: int
    reserved_after: int


def _long_lived(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """Parameters, their gradients, buffers and optimizer state tensors, in model order."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        yield value


def _use_count(t: torch.Tensor) -> int:
    """Tensors over ``t``'s storage (``t`` among them); the call's own reference is taken off."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def _movable(t: torch.Tensor) -> bool:
    """Alone over its storage, and all of it: re-pointing it splits nothing."""
    storage = t.untyped_storage()
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == storage.nbytes() > 0
            and _use_count(t) == 1)


def compact(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
            device: torch.device | str | None = None) -> CompactResult:
    """Allocate ``model``'s (and ``optimizer``'s) long-lived tensors on ``device`` again, side
    by side, and give the allocator's free segments back (module notes). ``device``: the
    parameters' device by default; tensors elsewhere are not touched. Between steps only,
    never during a CUDA graph capture; graphs captured before must be captured again."""
    global _compactions
    if device is None:
        first = next(model.parameters(), None)
        if first is None:
            raise ValueError("the model has no parameters: pass device= to say which to compact")
        device = first.device
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:   # "cuda": the current device, as tensors name it
        device = torch.device("cuda", torch.cuda.current_device())
    if cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("compact moves tensors the capture may use: call it between steps, "
                           "outside a CUDA graph capture")
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    for t in _long_lived(model, optimizer):
        if t.device == device and id(t) not in seen:
            seen.add(id(t))
            tensors.append(t)
    movable = [t for t in tensors if _movable(t)]
    if cuda:
        torch.cuda.synchronize(device)   # the step's last writes (and streamed copies) land first
    before = torch.cuda.memory_reserved(device) if cuda else 0
    # Off the device in one pass, so that no old block is still taken when the new ones come.
    hosted = [t.detach().to("cpu", copy=True) for t in movable]
    for t in movable:
        t.data = torch.empty(0, dtype=t.dtype, device=device)
    if cuda:
        torch.cuda.empty_cache()
    for t, h in zip(movable, hosted):
        t.data = h.to(device)
    if cuda:
        torch.cuda.synchronize(device)
    if movable:
        _compactions += 1
    return CompactResult(moved=len(movable),
                         moved_bytes=sum(h.numel() * h.element_size() for h in hosted),
                         kept=len(tensors) - len(movable), reserved_before=before,
                         reserved_after=torch.cuda.memory_reserved(device) if cuda else 0)


def compact_count() -> int:
    """How many :func:`compact` calls moved tensors in this process: a CUDA graph captured
    when the count was lower must not be replayed (module notes)."""
    return _compactions
