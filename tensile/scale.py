"""A training step recorded at small batches, scaled to the batch it will train at.

TENSILE records one real training step before it plans (:mod:`tensile.record`). A job that
does not fit the GPU unplanned cannot run that step. For a static model, what the recording
holds does not depend on the batch size (the op sequence, the storages each op touches,
what autograd saves, the hooks' order), except its sizes: every shape, byte count and FLOP
count is linear in the batch. So the step is recorded at a few small batches, at least
three: two fit each number's line, the others check it. The recording for the real batch is
the first one with every such number read off its line.

Anything else that differs between the small batches, or a number off its line, is
refused with :class:`ScaleError`: the model's step is not batch-linear there, and a scaled
recording would be wrong. The runtime still checks the real steps against the scaled
recording (op sequence, every storage's size) and stops with a ``PlanMismatchError``
rather than run a plan that does not fit them.

    recs = [(b, record_step(model, opt, slice_batch(batch, b), loss_fn)) for b in (2, 4, 8)]
    rec = scale_recording(recs, batch=256)
"""
from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch

from .record import Recording

__all__ = ["ScaleError", "scale_recording", "slice_batch", "batch_size_of", "valid_record_batches"]


class ScaleError(ValueError):
    """The small-batch recordings do not scale to another batch size."""


def batch_size_of(batch: Sequence) -> int:
    """The batch size: dimension 0, which every tensor of ``batch`` must share."""
    sizes = {x.shape[0] for x in batch if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise ScaleError(f"every tensor of the batch needs the batch size as dimension 0; "
                         f"found sizes {sorted(sizes)} there")
    return sizes.pop()


def valid_record_batches(sizes: Sequence, full: int) -> bool:
    """Whether ``sizes`` can record a step of batch ``full``: three or more different ints,
    each between 1 and ``full - 1``."""
    return len(set(sizes)) >= 3 and all(
        not isinstance(b, bool) and isinstance(b, int) and 0 < b < full for b in sizes)


def slice_batch(batch: Sequence, size: int) -> tuple:
    """The first ``size`` samples of ``batch`` (copies: their storages are that size)."""
    return tuple(x[:size].clone() if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                 for x in batch)


# One number of a recording that may depend on the batch size: read it, write it.
Slot = tuple[Callable[[], int], Callable[[int], None]]


def _shape_slots(shapes: list) -> list[Slot]:
    slots = []
    for i, shape in enumerate(shapes):
        for d in range(len(shape)):
            def get(i=i, d=d) -> int:
                return shapes[i][d]

            def put(v: int, i=i, d=d) -> None:
                shapes[i] = tuple(shapes[i][:d]) + (v,) + tuple(shapes[i][d + 1:])
            slots.append((get, put))
    return slots


def _attr_slot(obj, name: str) -> Slot:
    return (lambda: getattr(obj, name), lambda v: setattr(obj, name, v))


def _key_slot(mapping: dict, key) -> Slot:
    return (lambda: mapping[key], lambda v: mapping.__setitem__(key, v))


def _slots(rec: Recording) -> list[Slot]:
    """Every batch-dependent number of ``rec``, in a fixed order."""
    slots: list[Slot] = []
    for n in rec.graph.nodes:
        slots += _shape_slots(n.input_shapes) + _shape_slots(n.output_shapes)
        slots += [_attr_slot(n, "bytes_read"), _attr_slot(n, "bytes_written"), _attr_slot(n, "flops")]
        slots += [_key_slot(n.storage_bytes, sid) for sid in sorted(n.storage_bytes)]
    for i in range(len(rec.transfers)):
        def get(i=i) -> int:
            return rec.transfers[i][2]

        def put(v: int, i=i) -> None:
            op, kind, _ = rec.transfers[i]
            rec.transfers[i] = (op, kind, v)
        slots.append((get, put))
    return slots


def _structure(rec: Recording) -> dict[str, object]:
    """Everything in ``rec`` that must not depend on the batch size, by what it is."""
    g = rec.graph
    return {
        "op sequence": [(n.name, n.phase, n.host_sync) for n in g.nodes],
        "storages each op reads and writes": [(n.reads, n.writes, sorted(n.storage_bytes))
                                              for n in g.nodes],
        "tensor ranks and dtypes": [([len(s) for s in n.input_shapes], n.input_dtypes,
                                     [len(s) for s in n.output_shapes], n.output_dtypes)
                                    for n in g.nodes],
        "dependencies": (g.edges, g.inputs, g.params, g.outputs, g.num_view_ops, g.raw_ops),
        "op arguments' storages": (rec.arg_sids, rec.out_sids),
        "storage roles": (rec.roles, rec.saved, rec.needed_by, rec.held_to_end,
                          rec.held_to, rec.forward_hold),
        "random ops": rec.random_ops,
        "parameters and optimizer state": (rec.param_names, rec.opt_state_keys),
        "hooks": (rec.anchors, rec.boundaries, rec.grad_nodes),
        "device": (rec.device_type, g.device, [str(f) for f in rec.funcs]),
        "host-device copies": [(op, kind) for op, kind, _ in rec.transfers],
    }


def scale_recording(recordings: Sequence[tuple[int, Recording]], batch: int) -> Recording:
    """The recording of the step at ``batch``, from ``(batch size, recording)`` pairs of
    the same step at (at least three different) smaller batch sizes. Raises
    :class:`ScaleError` when they do not describe one batch-linear step."""
    recordings = sorted(recordings, key=lambda br: br[0])
    sizes = [b for b, _ in recordings]
    if len(set(sizes)) < 3 or len(set(sizes)) != len(sizes):
        raise ScaleError(f"need recordings at three or more different batch sizes (two fit the "
                         f"line, the rest check it); got batch sizes {sizes}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ScaleError(f"batch: expected a positive int, got {batch!r}")
    (b0, first), (b1, _) = recordings[0], recordings[1]
    shape = _structure(first)
    for b, rec in recordings[1:]:
        other = _structure(rec)
        for what in shape:
            if other[what] != shape[what]:
                raise ScaleError(f"the step at batch {b} differs from the step at batch {b0} "
                                 f"in its {what}: it does not scale with the batch size "
                                 "(record the real batch instead)")
    columns = [[get() for get, _ in _slots(rec)] for _, rec in recordings]
    out = copy.deepcopy(first)
    for k, (_, put) in enumerate(_slots(out)):
        y0, y1 = columns[0][k], columns[1][k]
        for (b, _), ys in zip(recordings[2:], columns[2:]):
            # on the line through (b0, y0) and (b1, y1): (y - y0)(b1 - b0) == (y1 - y0)(b - b0)
            if (ys[k] - y0) * (b1 - b0) != (y1 - y0) * (b - b0):
                raise ScaleError(f"a size of the step is not linear in the batch size: "
                                 f"{y0} at batch {b0}, {y1} at {b1}, {ys[k]} at {b} "
                                 "(record the real batch instead)")
        value, rest = divmod(y0 * (b1 - b0) + (y1 - y0) * (batch - b0), b1 - b0)
        if rest or value < 0:
            raise ScaleError(f"a size of the step does not scale to batch {batch}: {y0} at "
                             f"batch {b0}, {y1} at {b1}")
        put(value)
    return out
