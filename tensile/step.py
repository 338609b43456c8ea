"""The one training step that is recorded, planned and replayed.

Recording, the scheduled runtime and the vanilla baseline all run this function, so
their op sequences match op for op (the runtime checks that they do).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

__all__ = ["split_batch", "training_step"]


def split_batch(batch: Sequence, loss_fn) -> tuple[tuple, object]:
    """``(model inputs, target)``: with a ``loss_fn`` the last element is the target.

    Without a ``loss_fn`` the model returns the loss itself and every element is an
    input (target ``None``).
    """
    if isinstance(batch, torch.Tensor) or not isinstance(batch, (tuple, list)):
        raise TypeError(f"a batch is a tuple of tensors, e.g. (x, y); got {type(batch).__name__}")
    batch = tuple(batch)
    if loss_fn is None:
        if not batch:
            raise ValueError("the batch is empty: expected at least one model input")
        return batch, None
    if len(batch) < 2:
        raise ValueError(f"with a loss_fn the batch is (inputs..., target); got {len(batch)} element(s)")
    return batch[:-1], batch[-1]


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence,
                  loss_fn: Callable | None,
                  on_phase: Callable[[str | None], None] | None = None,
                  on_backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Forward, loss, backward and ``optimizer.step()``; returns the detached loss.

    Gradients are set to ``None`` before and after (``zero_grad(set_to_none=True)``), so
    they live only from backward to the update, as the access timeline assumes.
    ``on_phase`` is told ``"forward"``, ``"loss"``, ``"backward"``, ``"optimizer"`` and
    finally ``None`` as the step moves on. ``on_backward`` gets the loss right before
    ``loss.backward()``, when the autograd graph is complete (to hook its nodes).
    """
    phase = on_phase or (lambda _p: None)
    inputs, target = split_batch(batch, loss_fn)
    optimizer.zero_grad(set_to_none=True)
    phase("forward")
    out = model(*inputs)
    phase("loss")
    loss = loss_fn(out, target) if loss_fn is not None else out
    del out  # only autograd keeps what backward needs
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("the loss must be a one-element tensor; got "
                         f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
    phase("backward")
    if on_backward is not None:
        on_backward(loss)
    loss.backward()
    phase("optimizer")
    optimizer.step()
    phase(None)
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
