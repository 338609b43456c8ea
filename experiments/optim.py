"""The experiments' optimizers by name (``experiment.optimizer``, ``tensile_multi --optimizer``)."""
from __future__ import annotations

import torch

__all__ = ["OPTIMIZERS", "make_optimizer"]

# sgd: with momentum; adam: PyTorch's default (foreach) Adam, as the TENSILE authors trained;
# adam_fused: the same update in one fused kernel per call
OPTIMIZERS = ("sgd", "adam", "adam_fused")


def make_optimizer(model: torch.nn.Module, name: str, lr: float, momentum: float = 0.9,
                   capturable: bool = False) -> torch.optim.Optimizer:
    """Optimizer ``name`` (:data:`OPTIMIZERS`) over ``model``'s trainable parameters.

    ``adam`` runs a dozen multi-tensor kernels per ``step()`` call. With ``capturable`` its
    step count stays on the device (a CUDA graph needs that) and it runs two more kernels
    per parameter: its bias corrections are then per-parameter tensors, which the
    multi-tensor kernels cannot take. ``adam_fused`` (``fused=True``) runs the same update
    in one kernel per call, equal to ``adam`` up to rounding, its step count always on the
    device. The difference grows with the calls: a streamed optimizer
    (:func:`tensile.stream_optimizer`) calls ``step()`` once per group of parameters.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, capturable=capturable)
    if name == "adam_fused":
        return torch.optim.Adam(params, lr=lr, capturable=capturable, fused=True)
    raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {name!r}")
