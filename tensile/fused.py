"""One kernel for a batch norm's output rebuilt from its statistics, with the in-place ops
that followed it: a residual ``add_`` and a ``relu_``.

Conv → BatchNorm → ReLU(inplace=True) is the commonest block of the paper's models, and
ResNet's block ends in BatchNorm → ``out += identity`` → ReLU(inplace=True). The saved tensor
is the batch norm's output, overwritten in place by what follows. A recompute rebuilds it
from the batch statistics (:func:`tensile.runtime._batch_norm_apply`, one elementwise pass)
and then reruns each in-place op (a pass each over the same bytes). :func:`batch_norm_act`
does it all in one pass, ``relu((x - mean) * invstd * weight + bias + residual)``: a Triton
kernel on CUDA. Where Triton is missing (CPU builds of PyTorch) or the tensors are not laid
out alike (contiguous or channels-last), it is the separate passes. The result equals theirs
to rounding (the same arithmetic, maybe contracted differently), which
``batch_norm_from_stats`` accepts already.
"""
from __future__ import annotations

import torch

__all__ = ["batch_norm_act", "fused_available"]

try:  # Triton comes with CUDA builds of PyTorch; not with CPU ones
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the build
    triton = None

_BLOCK = 1024

if triton is not None:
    @triton.jit
    def _bn_act_kernel(x_ptr, res_ptr, y_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, n, channels,
                       plane, CHANNELS_LAST: tl.constexpr, HAS_W: tl.constexpr,
                       HAS_B: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr,
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
        if HAS_RES:
            y = y + tl.load(res_ptr + offs, mask=mask).to(tl.float32)
        if RELU:
            y = tl.maximum(y, 0.0)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def fused_available(x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether :func:`batch_norm_act` runs as one kernel for ``x`` (and ``residual``)."""
    dense = x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)
    alike = residual is None or (residual.shape == x.shape and residual.stride() == x.stride()
                                 and residual.dtype == x.dtype and residual.device == x.device)
    return (triton is not None and x.is_cuda and x.dim() >= 2 and 0 < x.numel() < 2**31
            and dense and alike)


def batch_norm_act(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   mean: torch.Tensor, invstd: torch.Tensor, eps: float, *,
                   residual: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """``(x - mean) * invstd * weight + bias`` per channel (dim 1), plus ``residual``, then
    ReLU if ``relu``, in a new tensor laid out like ``x``. ``mean``/``invstd`` are the
    float32 batch statistics a training-mode batch norm returned; ``eps`` is unused
    (``invstd`` has it), kept for the rebuild's signature."""
    if not fused_available(x, residual):
        from .runtime import _batch_norm_apply   # the separate passes, as the step ran them
        out = _batch_norm_apply(x, weight, bias, mean, invstd, eps)
        if residual is not None:
            out.add_(residual)
        return out.relu_() if relu else out
    out = torch.empty_like(x)
    plane = x.numel() // (x.shape[0] * x.shape[1])
    grid = (triton.cdiv(x.numel(), _BLOCK),)
    _bn_act_kernel[grid](x, residual if residual is not None else x, out, mean, invstd,
                         weight if weight is not None else mean,
                         bias if bias is not None else mean, x.numel(), x.shape[1], plane,
                         CHANNELS_LAST=not x.is_contiguous(), HAS_W=weight is not None,
                         HAS_B=bias is not None, HAS_RES=residual is not None, RELU=relu,
                         BLOCK=_BLOCK)
    return out
