"""Optional graph passes Nimble applies before capture (the paper used conv+BN folding;
``to_channels_last`` is ours: NHWC lets cuDNN pick tensor-core convolution kernels).

Folding is decided from one real run, not from a symbolic trace, so it works on models
that ``torch.fx`` cannot trace (timm, NAS cells): forward hooks name the storage each
Conv2d writes and each BatchNorm reads, and the task graph says how many ops read it.
A conv whose output is read by exactly one op, the BatchNorm right after it, is folded.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from .trace import OpRecorder, as_tuple

__all__ = ["fold_conv_bn", "to_channels_last", "channels_last_inputs"]


def _replacement_for(bn: nn.Module) -> nn.Module:
    """What stands in for a folded BatchNorm: nothing, or timm's fused activation."""
    if type(bn) is nn.BatchNorm2d:
        return nn.Identity()
    # timm's BatchNormAct2d = BatchNorm2d + drop + act in one module.
    if isinstance(bn, nn.BatchNorm2d) and hasattr(bn, "act") and hasattr(bn, "drop"):
        return nn.Sequential(bn.drop, bn.act)
    raise TypeError(type(bn).__name__)


def fold_conv_bn(model: nn.Module, example_inputs) -> tuple[nn.Module, int]:
    """Return a copy of ``model`` (eval mode) with Conv2d+BatchNorm2d pairs folded.

    Returns the new module and the number of pairs folded. The input module is untouched.
    """
    if model.training:
        raise ValueError("conv+BN folding needs eval mode (BatchNorm must use running stats)")
    model = copy.deepcopy(model)
    inputs = as_tuple(example_inputs)
    rec = OpRecorder()
    calls: dict[nn.Module, list] = {}
    parents: dict[nn.Module, tuple[nn.Module, str]] = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            parents[child] = (parent, name)

    def conv_hook(mod, args, out):
        calls.setdefault(mod, []).append(("conv", rec.storage_id(out)))

    def bn_hook(mod, args):
        calls.setdefault(mod, []).append(("bn", rec.storage_id(args[0]), len(rec.nodes)))

    hooks = []
    for m in model.modules():
        if type(m) is nn.Conv2d:
            hooks.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, nn.BatchNorm2d) and m.track_running_stats:
            hooks.append(m.register_forward_pre_hook(bn_hook))
    try:
        with torch.no_grad(), rec:
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()

    readers: dict[int, int] = {}
    for node in rec.nodes:
        for s in node.reads:
            readers[s] = readers.get(s, 0) + 1
    conv_of_storage = {c[0][1]: m for m, c in calls.items()
                       if len(c) == 1 and c[0][0] == "conv"}
    folded = 0
    for bn, c in calls.items():
        if len(c) != 1 or c[0][0] != "bn":
            continue                                   # reused BatchNorm: leave it
        conv = conv_of_storage.get(c[0][1])
        if conv is None or readers.get(c[0][1]) != 1 or bn not in parents:
            continue                                   # conv output also used elsewhere
        try:
            replacement = _replacement_for(bn)
        except TypeError:
            continue
        fused = fuse_conv_bn_eval(conv, bn)
        conv.weight, conv.bias = fused.weight, fused.bias
        parent, name = parents[bn]
        setattr(parent, name, replacement)
        folded += 1
    return model, folded


def to_channels_last(model: nn.Module, example_inputs) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Return a copy of ``model`` with 4-D parameters and buffers in channels-last (NHWC) memory
    format, and the 4-D example inputs converted the same way (others unchanged).

    Values are untouched, only strides change, so outputs equal NCHW's up to the kernels'
    round-off. On GPUs with tensor cores cuDNN's NHWC convolutions are the fast ones
    (torch.compile converts layouts for the same reason). The input module is untouched.
    """
    model = copy.deepcopy(model).to(memory_format=torch.channels_last)
    return model, channels_last_inputs(example_inputs)


def channels_last_inputs(inputs) -> tuple[torch.Tensor, ...]:
    """The 4-D tensors of ``inputs`` in channels-last (NHWC) memory format, others unchanged."""
    return tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x
                 for x in as_tuple(inputs))
