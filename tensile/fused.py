"""One kernel for a batch norm's output rebuilt from its statistics and then ReLU'd in place.

Conv → BatchNorm → ReLU(inplace=True) is the commonest block of the paper's models. Its saved
output is the batch norm's, overwritten by the ReLU; a recompute rebuilds it from the batch
statistics (:func:`tensile.runtime._batch_norm_apply`, one elementwise pass) and then reruns
the ReLU (a second pass over the same bytes). :func:`batch_norm_relu` does both in one pass:
``max((x - mean) * invstd * weight + bias, 0)``, a Triton kernel on CUDA. Where Triton is
missing (CPU builds of PyTorch) or the tensor is neither contiguous nor channels-last, it is
the two passes. The result equals the two passes' to rounding (the same arithmetic, maybe
fused differently), which ``batch_norm_from_stats`` accepts already.
"""
from __future__ import annotations

import torch

__all__ = ["batch_norm_relu", "fused_available"]

try:  # Triton comes with CUDA builds of PyTorch; not with CPU ones
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the build
    triton = None

_BLOCK = 1024

if triton is not None:
    @triton.jit
    def _bn_relu_kernel(x_ptr, y_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, n, channels, plane,
                        CHANNELS_LAST: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                        BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if CHANNELS_LAST:
            c = offs % channels
        else:
            c = (offs // plane) % channels
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        y = (x - tl.load(mean_ptr + c, mask=mask)) * tl.load(invstd_ptr + c, mask=mask)
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=mask).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + c, mask=mask).to(tl.float32)
        tl.store(y_ptr + offs, tl.maximum(y, 0.0).to(y_ptr.dtype.element_ty), mask=mask)


def fused_available(x: torch.Tensor) -> bool:
    """Whether :func:`batch_norm_relu` runs as one kernel for ``x``."""
    return (triton is not None and x.is_cuda and x.dim() >= 2 and 0 < x.numel() < 2**31
            and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)))


def batch_norm_relu(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    mean: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """``relu((x - mean) * invstd * weight + bias)`` per channel (dim 1), in a new tensor laid
    out like ``x``; ``mean``/``invstd`` are the float32 batch statistics a training-mode batch
    norm returned. ``eps`` is unused (``invstd`` has it), kept for the rebuild's signature."""
    if not fused_available(x):
        from .runtime import _batch_norm_apply   # the two passes
        return _batch_norm_apply(x, weight, bias, mean, invstd, eps).relu_()
    out = torch.empty_like(x)
    channels_last = not x.is_contiguous()
    plane = x.numel() // (x.shape[0] * x.shape[1])
    grid = (triton.cdiv(x.numel(), _BLOCK),)
    _bn_relu_kernel[grid](x, out, mean, invstd, weight if weight is not None else mean,
                          bias if bias is not None else mean, x.numel(), x.shape[1], plane,
                          CHANNELS_LAST=channels_last, HAS_W=weight is not None,
                          HAS_B=bias is not None, BLOCK=_BLOCK)
    return out
