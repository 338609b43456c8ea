"""Large linear layers' weight gradients made at the end of backward, not where autograd makes them.

    handle = tensile.defer_weight_grads(model, min_mb=64)   # VGG-16: fc6 (392 MiB), fc7 (64 MiB)
    ...                                                     # train as usual
    handle.remove()

Why: backward starts at the classifier, where every activation saved by forward is still on
the device. A fully connected layer's weight gradient is as large as its weight (VGG-16's
first one: 392 MiB at any batch), and autograd makes it right there, on top of that peak; an
optimizer streamed into backward (:func:`tensile.stream_optimizer`) then adds the update's
temporaries as large again. Yet nothing else reads that gradient: the layer's input gradient,
which backward needs next, comes from the weight and the output gradient alone. Kept until
backward's end, the two small tensors the weight gradient is made of (the layer's input and
output gradient: 1.5 MiB and 0.25 MiB for VGG-16's fc6 at batch 16) stand in for it, and the
gradient (and, with a streamed optimizer, its update) then lands where the activations are
gone. On VGG-16 at batch 16 on an H100, with fc6 and fc7 deferred, the unplanned peak TENSILE
must shave fell from 3409 to 2684 MiB and the plan at the TENSILE authors' memory saving was
priced 0.29 ms instead of 2.41, its step 0.148 over the captured vanilla step instead of 0.261.
The plan's peak stayed at 2488 MiB, set by a convolution's backward near the step's end, which
this does not touch (66th session, ``results/h100-80gb-hbm3/README.md``).

How: each chosen layer's forward runs :class:`_DeferredLinear`, whose backward returns the
input and bias gradients at once, keeps ``(input, output gradient)`` and queues one callback
at the end of the backward pass (``queue_callback`` of autograd's engine: it runs after the
last node, on the stream ``backward()`` was called on, so in a CUDA graph capture too). The
callback makes each weight gradient with the product autograd uses (``grad_out.T @ input``:
bit for bit the same gradient; tests), accumulates it into ``weight.grad`` as autograd would
and then runs the weight's post-accumulate-grad hooks, which is how a streamed optimizer learns
that the gradient is there. So an optimizer stepped after ``backward()`` sees every gradient,
and a streamed one updates the layer's group last. Only two-dimensional inputs are deferred
(a classifier head); a layer called on other inputs, on an input that needs no gradient,
without gradients, or with its weight frozen runs as usual. Not for code that reads a
deferred weight's gradient during backward, or that hooks it with ``Tensor.register_hook``
(refused when the handle is made: such a hook would not run), nor for ``torch.autograd.grad``
through such a layer: a backward with ``create_graph=True`` is refused, and without it the
weight's ``.grad`` still gets its gradient, which ``torch.autograd.grad`` would not give it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["DeferredWeightGrads", "defer_weight_grads"]


@dataclass
class DeferredWeightGrads:
    """What :func:`defer_weight_grads` changed: ``layers`` names the deferred layers;
    ``deferred`` counts weight gradients made at a backward's end so far."""

    layers: list[str]
    deferred: int = 0
    _modules: list[nn.Module] = field(default_factory=list, repr=False)
    _pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = \
        field(default_factory=list, repr=False)
    _task: int | None = field(default=None, repr=False)   # the backward _pending belongs to

    def remove(self) -> None:
        """The layers' own forward back. Call it between steps: what is pending then was left
        by a backward that failed before its end, and is dropped."""
        self._pending, self._task = [], None
        for m in self._modules:
            del m.forward   # the instance attribute: the class's forward again
        self._modules = []

    def flush(self) -> None:
        """Make the pending weight gradients now (the end-of-backward callback calls it)."""
        pending, self._pending, self._task = self._pending, [], None
        for weight, grad_out, inp in pending:
            with torch.no_grad():   # the engine runs callbacks in backward()'s caller's grad mode
                grad = grad_out.t().mm(inp)   # autograd's product for linear's weight gradient
                if weight.grad is None:
                    weight.grad = grad
                else:
                    weight.grad.add_(grad)
            for hook in (getattr(weight, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(weight)
            self.deferred += 1

    def _defer(self, weight: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
        # A streamed optimizer that slices this weight (``slice_mb``) takes the gradient row
        # slice by row slice, updating each over the rest of backward; the rows of the
        # product are the product's rows, bit for bit (tests).
        take = getattr(weight, "_tensile_rows", None)
        if take is not None and take(weight, lambda r0, r1: grad_out[:, r0:r1].t().mm(inp)):
            self.deferred += 1
            return
        task = torch._C._current_graph_task_id()
        if task != self._task:   # the first this backward: one callback makes them all
            # what a backward that failed before its end left is not this one's
            self._pending, self._task = [], task
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        self._pending.append((weight, grad_out, inp))


def defer_weight_grads(model: nn.Module, min_mb: float = 64.0) -> DeferredWeightGrads:
    """Make the weight gradients of ``model``'s ``nn.Linear`` layers whose weight takes at
    least ``min_mb`` MiB at the end of each backward pass (module notes). Returns the handle
    that undoes it; ValueError if no layer qualifies or a weight carries a ``register_hook``
    hook, which would not run."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(min_mb, bool) or not isinstance(min_mb, (int, float)) or not min_mb >= 0:
        raise ValueError(f"min_mb: expected MiB >= 0 (the smallest weight deferred), got {min_mb!r}")
    chosen = [(name, m) for name, m in model.named_modules()
              if type(m) is nn.Linear and m.weight.requires_grad
              and m.weight.numel() * m.weight.element_size() >= min_mb * 2**20]
    if not chosen:
        sizes = [f"{n} {m.weight.numel() * m.weight.element_size() / 2**20:.1f}"
                 for n, m in model.named_modules() if type(m) is nn.Linear]
        raise ValueError(f"no nn.Linear layer with a trainable weight of at least {min_mb} MiB "
                         f"(the model's, MiB: {', '.join(sizes) or 'none'})")
    for name, m in chosen:
        if "forward" in vars(m):
            raise ValueError(f"layer {name!r} has its forward replaced already (deferred twice?)")
        if m.weight._backward_hooks:
            raise ValueError(f"layer {name!r}: its weight has a Tensor.register_hook hook, which a "
                             f"deferred gradient would not run")
    handle = DeferredWeightGrads(layers=[n for n, _ in chosen], _modules=[m for _, m in chosen])
    for m in handle._modules:
        m.forward = _deferred_forward(m, handle)
    return handle


def _deferred_forward(layer: nn.Linear, handle: DeferredWeightGrads):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not torch.is_grad_enabled() or not layer.weight.requires_grad \
                or not x.requires_grad:
            return F.linear(x, layer.weight, layer.bias)
        # the weight goes in detached, the layer (not a tensor) names it: as an input,
        # autograd would run its AccumulateGrad node (and its post-accumulate hooks) with
        # no gradient right there
        return _DeferredLinear.apply(x, layer.weight.detach(), layer.bias, handle, layer)
    return forward


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward leaves the weight's gradient to the handle."""

    @staticmethod
    def forward(ctx, x, weight, bias, handle, layer):
        ctx.save_for_backward(x, weight)
        ctx.handle, ctx.param = handle, layer.weight
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():   # create_graph=True: the deferred product has no graph
            raise RuntimeError("tensile.defer_weight_grads: a backward with create_graph=True (a "
                               "double backward, a gradient penalty) through a deferred layer is "
                               "not supported; remove() the handle for such steps")
        x, weight = ctx.saved_tensors
        grad_x = grad_out.mm(weight) if ctx.needs_input_grad[0] else None
        grad_b = grad_out.sum(0) if ctx.needs_input_grad[2] else None
        ctx.handle._defer(ctx.param, grad_out, x)
        return grad_x, None, grad_b, None, None
