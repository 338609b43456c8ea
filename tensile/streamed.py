"""The optimizer's update inside backward, its state in host memory and streamed.

    opt = torch.optim.Adam(model.parameters(), capturable=True)
    streamed = tensile.stream_optimizer(opt)     # before the Scheduler is built
    sched = tensile.Scheduler(model, opt, example_batch, loss_fn, allow_cross_iteration=False)

Why: a captured step's peak sits at the end of backward, where weights, all gradients and
all of Adam's state are on the device at once (ResNet-50 at b=16: 97 + 97 + 195 MB of the
planned 668). PyTorch's optimizers read all their state in one go after backward, so moving
that state to the host costs a copy back in before the update and a copy out after it, both
in the step's critical path (about 2 x 2P / 55 GB/s: 7 ms on ResNet-50's 11 ms step).

How: the parameters are cut into ``groups`` groups of about equal state bytes, in the reverse
of their order (the order backward makes their gradients); from eight groups on the first and
the last are a quarter of that (:data:`END_SHARE`), whose copies nothing hides. When backward
has accumulated every gradient of a group (``register_post_accumulate_grad_hook``), the
optimizer's own ``step`` runs on that group alone and its gradients are dropped. The group's
state (every state tensor shaped like its parameter: Adam's two moments) lives in one pinned
host region between steps. During backward up to ``prefetch + 1`` device slots form a ring: a
host→device stream copies the next groups' regions into free slots, the compute stream waits
for a group's copy before its update, and a device→host stream copies the updated state back. A
slot is free again once its copy-out is issued: the next copy-in into it waits, on the
host→device stream, for that copy-out's event alone. So the compute stream does not wait for
copies out and the copy streams never wait for backward's kernels, only for the update whose
state they carry (no ``record_stream``, which a CUDA graph capture would defer to the capture's
end). A slot is as large as the groups of about its size that come next. One too small for the
group that comes (groups are only about equal) leaves the ring for a larger one, and one far
larger than every group still to come (VGG-16's first fully connected layer) is dropped too;
either is given back ``prefetch + 1`` updates after its copy-out was issued, the compute stream
waiting for that copy then, long done by then (given back at once, the compute stream waited
for it: three such waits a step cost Inception-v4 at b=16 0.95 ms of its 25, profiled on the
H200). Only a slot more than twice too small (VGG-16's fully connected layers come after a
small group) is given back at once: memory first. Once no group is left to bring in (fewer
than ``prefetch + 1`` updates remain), every free slot is given back one update after its
copy-out, not kept over backward's last layers. The last go when backward ends, after the
compute stream waited for their copies out. So about ``prefetch + 1`` groups' state (one
more while a slot leaves) and one group's gradients are on the device at a time, and the copies
run beside backward's kernels.

A PyTorch optimizer's update makes temporaries as large as the parameters it updates (Adam's
``sqrt(v)``: one for every parameter of the group), and on VGG-16 those of its first fully
connected layer (392 MiB) sit on top of the step's peak. ``update_chunk_mb`` bounds them: each
group's update runs as several calls of the optimizer's own ``step`` on at most that many MiB of
parameters, a larger parameter cut into flat slices whose state is the matching slices of its
state (bit for bit the same for an elementwise optimizer: tests; not fused Adam on the CPU,
which can round the elements past a slice's last whole vector differently,
``tests/test_slice_cost.py``).

A parameter whose state alone is most of the step's (VGG-16's first fully connected layer:
784 MiB of Adam's 1056) cannot be one group: its copies (16 ms each way at 55 GB/s) would
come and go with its one update. ``slice_mb`` cuts every parameter larger than that into
slices of whole rows of about that size, each its own group, whose state is the matching
rows of the parameter's state in one host region. The slices queue when the parameter's
gradient is there and go one at a time, due evenly over the gradients backward has still to
accumulate (as many as in the step before), so their copies run beside the rest of backward
and at most ``prefetch + 1`` slices' state is on the device. A weight whose gradient
:func:`tensile.defer_weight_grads` defers gives each slice its rows of the deferred product
(``grad_out[:, rows].T @ input``: the product's rows, bit for bit), so the whole gradient is
never made. ``resident`` counts the other groups. Measured on VGG-16 at b=16 (H100, 67th
session, ``results/h100-80gb-hbm3/README.md``), fc6's state off the device took the step under
the TENSILE authors' memory saving with no plan (MSR 0.33-0.38), but the step took 26-28 ms
instead of 19: 784 MiB each way a step, over a link that carried 46.7 GB/s each way with both
directions busy, from backward's first gradient on.

``slice_resident=k`` keeps the state of the last ``k`` slices backward updates on the device,
so fewer bytes cross the link. Those slices update as soon as their gradient is there, and the
streamed ones spread over the rest of backward. A parameter with
some slices kept keeps its whole state in the host region, which stays the state
``optimizer.state`` and ``state_dict()`` show. The kept slices' rows also live in device
buffers, which their updates read and write. :meth:`StreamedOptimizer.synchronize` (which
``state_dict()`` calls) copies those rows into the region. A parameter whose slices are all
kept keeps its state on the device, like a resident group. With its large weights in slices,
the rest of a model may be small (VGG-16: 72 MiB), and every group is one optimizer call in
backward, tens of microseconds each for a captured foreach Adam: on VGG-16 3 groups instead
of 16 took 0.4-0.6 ms off the captured step (H100, seventieth session).

The first groups backward updates come in during backward's short start (ResNet-50's layer 4
holds most of its weights), faster than two copy engines can carry them: ``resident=k``
keeps the state of the first ``k`` groups on the device, trading memory for that wait;
:func:`tensile.tune_resident` (:mod:`tensile.resident`) chooses ``k`` from one timed step.

The update of each group is the optimizer's own, so an elementwise optimizer (Adam, AdamW,
SGD, ...) trains exactly as with one ``step()`` after backward: bit for bit (tests). The host
regions are written by asynchronous copies: ``optimizer.state_dict()`` waits for them (so do
``nimble.training.save_step_state`` and the Scheduler's snapshots); read ``optimizer.state``
directly only after ``StreamedOptimizer.synchronize()``. Not for an update that needs all
gradients at once: gradient clipping by the global norm, gradient accumulation over several
backward passes, LBFGS. The first ``step()`` (the optimizer's state does not exist yet) runs
as usual after backward and then moves the state to the host.

Measured (H200, b=16, against the captured vanilla step; ``results/h200/README.md``, twelfth
session): the streaming alone costs ResNet-50 0.13 of its step (``prefetch=2, resident=4``;
0.39 with one group ahead and none resident), Inception-v3 0.09, Inception-v4 0.05,
DenseNet-121 0.04; since the ring stopped waiting for copies out and the end groups shrank
(forty-fourth session) ResNet-50 0.09 and Inception-v4 0.02 (``resident=4``), 0.16 and 0.03
with none resident. Planned and captured with TENSILE: MSR 0.672 / 0.621 on ResNet-50 /
Inception-v3 at EOR 0.43 / 0.20, where the captured step without it stopped at 0.56 / 0.45.

With a :class:`~tensile.Scheduler`, install it first: the step TENSILE records then has the
updates and copies inside backward and no optimizer state on the device, and its plan and
captured graph (``Scheduler.capture``/``replay``) include them. On the CPU (simulation) the
copies are plain copies.
"""
from __future__ import annotations

import itertools
import types
from dataclasses import dataclass, field
from typing import Callable

import torch

from .streams import side_stream

__all__ = ["StreamedOptimizer", "stream_optimizer", "streamed_of", "row_slices", "spread_dues",
           "DEFAULT_PREFETCH"]

# Groups whose state is copied in ahead of the one updating, by default. On the H200,
# ResNet-50's streaming cost 0.24 of its step with 2 and 0.39 with 1 (twelfth session).
DEFAULT_PREFETCH = 2
# The first and the last group backward updates, as a share of the others' bytes: backward's
# first update waits for the first group's copy in, the step's end for the last group's copy
# out, and neither hides behind other work (Inception-v4 at b=16 on the H200: 0.2 and 0.28 ms
# a step with groups of equal size, profiled).
END_SHARE = 0.25
END_GROUPS = 8
# At backward's tail (no group left to bring in), a free slot is given back this many updates
# after its copy-out was issued; None: kept to backward's end.
TAIL_WAIT: int | None = 1


@dataclass
class _Group:
    """Parameters updated together, and the host region of their state."""

    params: list[torch.nn.Parameter]
    keys: list[tuple[torch.nn.Parameter, str, int, int]] = field(default_factory=list)  # p, key, offset, bytes
    host: torch.Tensor | None = None      # uint8, pinned on CUDA (None: resident or stateless)
    slot: "_Slot | None" = None           # the device slot holding its state during the update
    in_done: object = None                # CUDA event: the copy into the slot has landed
    rows: tuple[int, int] | None = None   # a slice: flat elements [a, b) of its one parameter
    dev: list[torch.Tensor] | None = None  # a kept slice: its rows of each state entry, on the device

    @property
    def streams(self) -> bool:
        """Whether its state is copied in and out each step (in a host region, not kept)."""
        return self.host is not None and self.dev is None


@dataclass(eq=False)   # slots compare by identity (list.remove, ``in``)
class _Slot:
    """A device buffer of the ring; ``free_after``: the event of its last copy-out;
    ``freed_at``: the update count when it last became free."""

    device: torch.Tensor
    free_after: object = None
    freed_at: int = 0


def streamed_of(optimizer: torch.optim.Optimizer) -> "StreamedOptimizer | None":
    """The :class:`StreamedOptimizer` installed on ``optimizer``, or None."""
    return getattr(optimizer, "_tensile_streamed", None)


def stream_optimizer(optimizer: torch.optim.Optimizer, groups: int = 16,
                     prefetch: int = DEFAULT_PREFETCH, resident: int = 0,
                     update_chunk_mb: float | None = None,
                     slice_mb: float | None = None,
                     slice_resident: int = 0) -> "StreamedOptimizer":
    """Run ``optimizer``'s update inside backward, a group of parameters at a time, with its
    state in host memory (see the module notes); ``prefetch`` groups' state is copied in ahead
    of the group updating (:data:`DEFAULT_PREFETCH`); the first ``resident`` groups backward
    updates keep their state on the device (all ``groups``: only the update moves into
    backward, which drops the gradients early; :func:`tensile.tune_resident` chooses it);
    ``update_chunk_mb``: each update on at most that many MiB of parameters at a time, which
    bounds the optimizer's temporaries (None: a group at once); ``slice_mb``: a parameter larger
    than that many MiB streams its state in row slices of about that size, each its own group,
    updated across the rest of backward (module notes; ``resident`` then counts the other
    groups); ``slice_resident``: the last that many slices backward updates keep their state on
    the device (module notes). Returns the handle; ``.remove()`` undoes it."""
    return StreamedOptimizer(optimizer, groups, prefetch, resident, update_chunk_mb, slice_mb,
                             slice_resident)


class StreamedOptimizer:
    """Installed on one optimizer by :func:`stream_optimizer`.

    ``updates_in_backward`` counts the group updates run by backward's hooks, ``late_updates``
    those left to ``step()`` (a parameter without a gradient in that step, say).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, groups: int = 16,
                 prefetch: int = DEFAULT_PREFETCH,
                 resident: int = 0, update_chunk_mb: float | None = None,
                 slice_mb: float | None = None, slice_resident: int = 0) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("LBFGS updates from all gradients at once: it cannot update in backward")
        if streamed_of(optimizer) is not None:
            raise ValueError("this optimizer is streamed already")
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups: expected an int >= 1, got {groups!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch: expected an int >= 1 (groups copied in ahead), got {prefetch!r}")
        if not isinstance(resident, int) or not 0 <= resident <= groups:
            raise ValueError(f"resident: expected an int from 0 to groups = {groups} (groups whose "
                             f"state stays on the device; all: only the update moves into "
                             f"backward), got {resident!r}")
        for name, mb, what in (("update_chunk_mb", update_chunk_mb, "the most parameter bytes "
                                "one update call takes"),
                               ("slice_mb", slice_mb, "larger parameters stream their state in "
                                "row slices of about that size")):
            if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float))
                                   or not mb > 0):
                raise ValueError(f"{name}: expected MiB > 0 ({what}) or None, got {mb!r}")
        if isinstance(slice_resident, bool) or not isinstance(slice_resident, int) \
                or slice_resident < 0:
            raise ValueError(f"slice_resident: expected an int >= 0 (the last slices whose state "
                             f"stays on the device), got {slice_resident!r}")
        if slice_resident and slice_mb is None:
            raise ValueError(f"slice_resident={slice_resident} keeps slices' state on the device: "
                             f"it needs slice_mb, which makes the slices")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            raise ValueError("the optimizer has no parameters that require gradients")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device; got {sorted(map(str, devices))}")
        self.optimizer = optimizer
        self.device = params[0].device
        self.cuda = self.device.type == "cuda"
        self.prefetch = prefetch
        self.groups = _split(params[::-1], groups,
                             None if slice_mb is None else max(1, int(slice_mb * 2**20)))
        # the groups resident counts: every group but a large parameter's slices
        self._whole = [i for i, g in enumerate(self.groups) if g.rows is None]
        self.resident = min(resident, len(self._whole))
        self.update_chunk = None if update_chunk_mb is None else max(1, int(update_chunk_mb * 2**20))
        sliced = [i for i, g in enumerate(self.groups) if g.rows is not None]
        self._slices_of: dict[int, list[int]] = {}   # id(parameter) -> its slices' groups
        for i in sliced:
            self._slices_of.setdefault(id(self.groups[i].params[0]), []).append(i)
        # the last slices backward updates, whose state stays on the device
        self._kept = set(sliced[len(sliced) - min(slice_resident, len(sliced)):])
        self.slice_resident = len(self._kept)
        # a parameter's group; a sliced one's first slice (whose keys and region all share)
        self._group_of = {id(p): i for i, g in reversed(list(enumerate(self.groups))) for p in g.params}
        self._row_grads: dict[int, Callable] = {}    # id(parameter) -> rows' gradient (deferred)
        self._queue: list[int] = []           # slices whose gradient is there, not updated yet
        self._due: list[int] = []             # the hook count at which each queued slice goes
        self._hooks_seen = 0                  # gradients that reached a hook this step
        self._hooks_total = len(params)       # ... in the last step (a first guess: all)
        self.updates_in_backward = 0
        self.late_updates = 0
        self._ready: dict[int, int] = {}      # group -> gradients accumulated this step
        self._done: set[int] = set()          # groups updated this step
        self._slots: list[_Slot] = []          # the ring, during backward
        self._free: list[_Slot] = []           # slots no group holds now
        self._leaving: list[_Slot] = []        # out of the ring, given back once their copy-out is done
        self._next_in = 0                     # the lowest group not brought in nor done
        self._updates = 0                     # group updates this step
        self._needs: list[int] = []           # each group's state bytes (0: not streamed)
        self._still: list[int] = []           # the largest need from group i on
        self._in_step = False
        self._new_state = False               # an update this step created state on the device
        self._marks = None                    # tensile.resident's timing: called at "begin", each update
        # tensile.pace: the hook at which each slice goes and its rank among those due then
        # (None: spread over the hooks, see _enqueue); the hook each sliced parameter's
        # gradient came at in the last step
        self._pace: dict[int, tuple[int, int]] | None = None
        self.paced: dict | None = None        # what tensile.tune_pace measured and chose
        self._arrived: dict[int, int] = {}
        self.tuned: dict | None = None        # what tensile.tune_resident chose, if it ran
        self._original = {name: getattr(optimizer, name)
                          for name in ("step", "load_state_dict", "state_dict")}
        optimizer.step = types.MethodType(_streamed_step, optimizer)
        optimizer.load_state_dict = types.MethodType(_streamed_load, optimizer)
        optimizer.state_dict = types.MethodType(_streamed_state_dict, optimizer)
        optimizer._tensile_streamed = self
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        for p in self._sliced_params():   # a deferred weight's rows come here
            p._tensile_rows = self._on_rows
        self.home_state()

    # ------------------------------------------------------------------ public
    def remove(self) -> None:
        """Undo :func:`stream_optimizer`: hooks off, state back on the device."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._sliced_params():
            vars(p).pop("_tensile_rows", None)
        for name, fn in self._original.items():
            setattr(self.optimizer, name, fn)
        del self.optimizer._tensile_streamed
        self._state_to_device(self.groups)

    def synchronize(self) -> None:
        """Wait for the state's copies to the host: the host regions are final afterwards.
        ``optimizer.state_dict()`` does it; read ``optimizer.state`` directly only after it."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for g in self._kept:   # the kept slices' rows: their device buffers are the newer
            grp = self.groups[g]
            for host, dev in zip(self._host_rows(grp), grp.dev or []):
                host.copy_(dev)

    def device_rows(self) -> list[torch.Tensor]:
        """The state rows the kept slices (``slice_resident``) hold on the device: between
        steps the newer copy of those rows (:meth:`synchronize` writes them to the host).
        ``nimble.training.save_step_state`` saves them with ``optimizer.state``."""
        return [t for g in sorted(self._kept) for t in (self.groups[g].dev or [])]

    def set_resident(self, resident: int) -> None:
        """Keep the state of backward's first ``resident`` groups on the device from now on
        (0 to ``len(groups)``), the others' in host memory. Not during a step or a capture:
        a captured graph keeps the addresses it was captured with, so capture again after."""
        if not isinstance(resident, int) or isinstance(resident, bool) \
                or not 0 <= resident <= len(self._whole):
            raise ValueError(f"resident: expected an int from 0 to {len(self._whole)} (the groups "
                             f"that are not a parameter's slices), got {resident!r}")
        if self._in_step or (self.cuda and torch.cuda.is_current_stream_capturing()):
            raise RuntimeError("set_resident between steps only, not during a step or a capture")
        self._state_to_device([self.groups[i] for i in self._whole[:resident]])
        self.resident = resident
        self.home_state()

    def set_pace(self, pace: "dict[int, tuple[int, int]] | None") -> None:
        """Give every slice the hook at which it goes and its rank among the slices due at
        the same hook: ``{group: (hook, rank)}``, hooks counted from 0 at backward's first
        gradient (:func:`tensile.tune_pace` makes it); None: back to spreading them over the
        hooks. Between steps only, like :meth:`set_resident`: a captured graph and TENSILE's
        recorded step keep the order of the step they saw."""
        if self._in_step or (self.cuda and torch.cuda.is_current_stream_capturing()):
            raise RuntimeError("set_pace between steps only, not during a step or a capture")
        if pace is not None:
            slices = {g for gs in self._slices_of.values() for g in gs}
            if set(pace) != slices:
                raise ValueError(f"pace: expected an entry for each of the {len(slices)} slices "
                                 f"(groups {sorted(slices)}), got groups {sorted(pace)}")
            bad = {g: v for g, v in pace.items()
                   if not (isinstance(v, tuple) and len(v) == 2
                           and all(isinstance(x, int) and x >= 0 for x in v))}
            if bad:
                raise ValueError(f"pace: expected (hook, rank) pairs of ints >= 0, got {bad}")
        self._pace = None if pace is None else dict(pace)

    def _state_to_device(self, groups: list[_Group]) -> None:
        """The state of ``groups`` back on the device, their host regions dropped (once the
        last step's copies to the host are done)."""
        self.synchronize()
        moved = set()    # a parameter's slices share its region: each entry moves once
        for g in groups:
            for p, key, off, n in g.keys:
                if (id(p), key) not in moved:
                    state = self.optimizer.state[p]
                    state[key] = state[key].to(self.device, copy=True)
                    moved.add((id(p), key))
            g.keys, g.host, g.dev = [], None, None

    def _sliced_params(self) -> list[torch.Tensor]:
        """The parameters cut into slices, each once."""
        return [self.groups[slices[0]].params[0] for slices in self._slices_of.values()]

    def _streamed_groups(self) -> list[int]:
        """The groups whose state lives on the host: every slice, and the other groups from
        the ``resident``-th on."""
        resident = set(self._whole[:self.resident])
        resident |= {i for slices in self._slices_of.values() if self._kept.issuperset(slices)
                     for i in slices}
        return [i for i in range(len(self.groups)) if i not in resident]

    def homes(self, p: torch.Tensor, key: str) -> bool:
        """Whether state entry ``key`` of parameter ``p`` lives in a host region."""
        g = self._group_of.get(id(p))
        return g is not None and any(q is p and k == key for q, k, _, _ in self.groups[g].keys)

    def home_state(self) -> None:
        """Move every state tensor shaped like its parameter into its group's host region
        (done after the step that creates the state and after ``load_state_dict``)."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the optimizer's state must be in host memory before a capture: "
                               "run one step first")
        homed: dict[int, _Group] = {}   # id(parameter) -> its first slice, once homed
        fresh: set[int] = set()         # id(parameter): a sliced one's region made just now
        for i in self._streamed_groups():
            g = self.groups[i]
            wanted = [(p, key) for p in g.params for key, v in self.optimizer.state.get(p, {}).items()
                      if _streamed_key(p, key, v)]
            if g.rows is not None and id(g.params[0]) in homed:   # the region of its first slice
                first = homed[id(g.params[0])]
                g.keys, g.host = first.keys, first.host
                continue
            if g.host is not None and wanted == [(p, k) for p, k, _, _ in g.keys] and \
                    all(_in_region(self.optimizer.state[p][k], g.host) for p, k in wanted):
                if g.rows is not None:
                    homed[id(g.params[0])] = g
                continue    # homed already
            keys, total = [], 0
            for p, key in wanted:
                v = self.optimizer.state[p][key]
                n = v.numel() * v.element_size()
                keys.append((p, key, total, n))
                total += -(-n // 512) * 512
            if not keys:
                g.keys, g.host = [], None
                continue
            host = torch.empty(total, dtype=torch.uint8, pin_memory=self.cuda)
            for p, key, off, n in keys:
                v = self.optimizer.state[p][key]
                view = _view(host, off, v)
                view.copy_(v)
                self.optimizer.state[p][key] = view
            g.keys, g.host = keys, host
            if g.rows is not None:
                homed[id(g.params[0])] = g
                fresh.add(id(g.params[0]))
        for i in sorted(self._kept):   # a kept slice's rows on the device, from a new region
            g = self.groups[i]
            if g.host is None:           # every slice of its parameter kept, or no state yet
                g.dev = None
            elif g.dev is None or id(g.params[0]) in fresh:
                g.dev = [host.to(self.device, copy=True) for host in self._host_rows(g)]

    # ------------------------------------------------------------------ backward
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.optimizer.state.get(p):
            return   # no state yet (the optimizer's first step): step() does it after backward
        if not self._in_step:   # backward's first gradient: a new step
            self._begin()
        if self._marks is not None:   # tensile.pace: backward's own work ends here ...
            self._marks(("hook", self._hooks_seen))
        self._hooks_seen += 1
        if id(p) in self._slices_of:
            self._enqueue(p)
        else:
            g = self._group_of[id(p)]
            self._ready[g] = self._ready.get(g, 0) + 1
            if self._ready[g] == len(self.groups[g].params):
                self._backward_update(g)
        self._pace_queue()
        if self._marks is not None:   # ... and starts again here
            self._marks(("hooked", self._hooks_seen - 1))

    def _on_rows(self, p: torch.Tensor, rows_grad: Callable[[int, int], torch.Tensor]) -> bool:
        """A deferred weight's gradient (:mod:`tensile.defer`): ``rows_grad(r0, r1)`` makes
        its rows ``r0:r1``. Its slices queue as if the gradient were there. False (the
        optimizer's first step, no state yet): the caller makes the gradient as usual."""
        if not self.optimizer.state.get(p):
            return False
        self._row_grads[id(p)] = rows_grad
        self._on_grad(p)
        return True

    def _enqueue(self, p: torch.Tensor) -> None:
        """``p``'s gradient is there: its slices join the queue, and every queued slice goes
        one at a time, due evenly over the hooks still to come this step (as many as came in
        the last step), in the queue's order (the ring's), so their copies run beside the
        rest of backward instead of the compute stream waiting for them all at once. Kept
        slices (``slice_resident``) have no copies to spread: they go at once, and the
        streamed ones spread over the whole rest of backward. With a pace
        (:func:`tensile.tune_pace`), every slice, kept or not, goes at the hook the pace
        gives it, in the pace's order."""
        slices = self._slices_of[id(p)]
        self._arrived[id(p)] = self._hooks_seen - 1
        if self._pace is not None:
            self._queue += slices
            self._queue.sort(key=lambda g: self._pace[g])
            self._due = [self._pace[g][0] + 1 for g in self._queue]   # hooks seen by then
            return
        for g in slices:
            if g in self._kept:
                self._backward_update(g)
        self._queue += [g for g in slices if g not in self._kept]
        self._due = spread_dues(self._hooks_seen, self._hooks_total, len(self._queue))

    def _pace_queue(self) -> None:
        """Update the queued slices that are due by now."""
        while self._queue and self._due[0] <= self._hooks_seen:
            self._due.pop(0)
            self._backward_update(self._queue.pop(0))

    def _backward_update(self, g: int) -> None:
        """Group ``g``'s update run from backward's hooks (counted)."""
        self._update(g)
        self.updates_in_backward += 1

    def _begin(self) -> None:
        """Backward's first gradient: the first groups' state into the ring's slots."""
        self._in_step = True
        if self._marks is not None:
            self._marks("begin")
        self._ready, self._done, self._next_in, self._updates = {}, set(), 0, 0
        self._queue, self._due, self._hooks_seen = [], [], 0
        self._needs = [_slot_bytes(g) for g in self.groups]
        self._still = [max(self._needs[i:], default=0) for i in range(len(self._needs) + 1)]
        self._fill()

    def _fill(self) -> None:
        """Bring the next groups, in backward's order, into slots while there are some."""
        while self._next_in < len(self.groups):
            g = self._next_in
            if not self._wants_slot(g):
                self._next_in += 1
                continue
            slot = self._slot_for(g)
            if slot is None:
                return
            self._next_in += 1
            self._bring_in(g, slot)

    def _oversized(self, slot: _Slot) -> bool:
        """Far larger than any group still to come in (VGG-16's first fully connected layer)."""
        return slot.device.numel() > 2 * max(self._still[self._next_in], 1)

    def _slot_for(self, g: int) -> "_Slot | None":
        """A free slot for group ``g``, a new one while the ring has fewer than ``prefetch + 1``
        of fitting size, or None (wait for an update to free one)."""
        need = self._needs[g]
        fitting = [s for s in self._free if need <= s.device.numel() and not self._oversized(s)]
        if fitting:
            slot = min(fitting, key=lambda s: s.device.numel())
            self._free.remove(slot)
            return slot
        active = [s for s in self._slots if not self._oversized(s) and s not in self._leaving]
        if len(active) >= self.prefetch + 1:
            small = [s for s in self._free if s in active]
            if not small:
                return None
            # Too small for this group: a larger one instead. For a group of about its size
            # the small one leaves the ring but is given back only once its copy-out has had
            # time to finish (see _update): given back now, the compute stream would wait
            # for that copy (Inception-v4 at b=16: three such waits a step, 0.95 ms of its
            # 25). For a far larger group (VGG-16's fully connected layers) memory comes
            # first: it is given back now.
            if need > 2 * small[0].device.numel():
                self._retire(small[0])
            else:
                self._free.remove(small[0])
                self._leaving.append(small[0])
        # as large as the coming groups of about this size (not a far larger one's)
        window = [n for n in self._needs[g:g + self.prefetch + 1] if n <= 2 * need]
        return self._new_slot(max(window))

    def _new_slot(self, nbytes: int) -> _Slot:
        slot = _Slot(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        if self.cuda:   # its memory may have been freed by compute-stream work still queued
            side_stream(self.device, "h2d").wait_stream(torch.cuda.current_stream(self.device))
        self._slots.append(slot)
        return slot

    def _retire(self, slot: _Slot) -> None:
        """Give a free slot's memory back once its last copy-out is done."""
        if self.cuda and slot.free_after is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.free_after)
        self._slots.remove(slot)
        for pool in (self._free, self._leaving):
            if slot in pool:
                pool.remove(slot)

    def _bring_in(self, g: int, slot: _Slot) -> None:
        """Issue the copy of group ``g``'s state into ``slot``."""
        grp = self.groups[g]
        grp.slot = slot
        pairs = self._host_and_slot(grp, slot)
        if not self.cuda:
            for host, dev in pairs:
                dev.copy_(host)
            return
        h2d = side_stream(self.device, "h2d")
        if slot.free_after is not None:
            h2d.wait_event(slot.free_after)   # the slot's last group has gone out
        with torch.cuda.stream(h2d):
            self._copy_mark("in", g)
            for host, dev in pairs:
                dev.copy_(host, non_blocking=True)
            self._copy_mark("in", g, end=True)
            grp.in_done = torch.cuda.Event()
            grp.in_done.record(h2d)

    def _copy_mark(self, way: str, g: int, end: bool = False) -> None:
        """tensile.pace: a copy of group ``g``'s state starts or ends, on the copy's stream
        (the current one): after its waits, so the two marks time the copy alone."""
        if self._marks is not None:
            self._marks((way + ("_end" if end else ""), g))

    def _host_and_slot(self, grp: _Group, slot: _Slot) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (host, device) pieces a group's state copies between: its whole region, or a
        slice's rows of each state entry, one after the other in the slot."""
        if grp.rows is None:
            n = grp.host.numel()
            return [(grp.host, slot.device[:n])]
        pairs, off = [], 0
        for host in self._host_rows(grp):
            nbytes = host.numel() * host.element_size()
            pairs.append((host, slot.device[off:off + nbytes].view(host.dtype)))
            off += -(-nbytes // 512) * 512
        return pairs

    def _host_rows(self, grp: _Group) -> list[torch.Tensor]:
        """A slice's rows of each state entry in its parameter's host region (flat)."""
        a, b = grp.rows
        return [self.optimizer.state[p][key].view(-1)[a:b]   # between steps: the host's
                for p, key, _, _ in grp.keys]

    def _update(self, g: int) -> None:
        """Group ``g``'s update on its streamed-in state; the state goes back to the host."""
        grp = self.groups[g]
        if self._marks is not None:
            self._marks(g)
        if grp.streams and grp.slot is None:   # out of backward's order, or no free slot
            self._bring_in(g, self._new_slot(_slot_bytes(grp)))
        state = self.optimizer.state
        slot = grp.slot
        if slot is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(grp.in_done)
        if self._marks is not None:   # tensile.pace: the update itself, from here ...
            self._marks(("run", g))
        if grp.rows is not None:
            self._step_slice(g)
        else:
            if slot is not None:
                for p, key, off, n in grp.keys:
                    state[p][key] = _view(slot.device, off, state[p][key])
            # a parameter updated for the first time gets its state now, on the device
            self._new_state |= any(p.grad is not None and not state.get(p) for p in grp.params)
            for piece in self._pieces(grp.params):
                self._step_on(piece)
            for p in grp.params:
                p.grad = None
        self._done.add(g)
        if self._marks is not None:   # ... to here
            self._marks(("ran", g))
        if slot is None:
            return
        pairs = self._host_and_slot(grp, slot)
        if grp.rows is None:
            for p, key, off, n in grp.keys:
                state[p][key] = _view(grp.host, off, state[p][key])
        if self.cuda:
            compute, d2h = torch.cuda.current_stream(self.device), side_stream(self.device, "d2h")
            d2h.wait_stream(compute)
            with torch.cuda.stream(d2h):
                self._copy_mark("out", g)
                for host, dev in pairs:
                    host.copy_(dev, non_blocking=True)
                self._copy_mark("out", g, end=True)
                slot.free_after = torch.cuda.Event()
                slot.free_after.record(d2h)
        else:
            for host, dev in pairs:
                host.copy_(dev)
        grp.slot = None
        self._updates += 1
        slot.freed_at = self._updates
        self._free.append(slot)
        # A slot out of the ring goes once its copy-out had prefetch + 1 updates' time to
        # finish; at backward's tail, where no group is left to bring in, every free slot
        # is out and goes one update after its copy-out: fewer updates than prefetch + 1
        # remain, and it would otherwise stay to backward's end, over the step's last
        # layers, which hold its peak (ResNet-50 at b=16: 41 MiB of slots held there).
        tail = TAIL_WAIT is not None and not self._to_bring_in()
        unwanted = self._leaving + [s for s in self._free if tail or self._oversized(s)]
        wait = TAIL_WAIT if tail else self.prefetch + 1
        for s in [s for s in unwanted if self._updates - s.freed_at >= wait]:
            self._retire(s)
        self._fill()

    def _wants_slot(self, g: int) -> bool:
        """Whether group ``g`` is streamed and not yet in a slot or updated this step."""
        grp = self.groups[g]
        return grp.streams and g not in self._done and grp.slot is None

    def _to_bring_in(self) -> bool:
        """Whether a group still has to come into a slot this step."""
        return any(self._wants_slot(g) for g in range(self._next_in, len(self.groups)))

    def _pieces(self, params: list) -> list[list]:
        """``params`` in runs of at most ``update_chunk`` bytes (one run without a bound); a
        larger parameter alone, as ``(parameter, slice length)``: :meth:`_step_sliced`."""
        if self.update_chunk is None:
            return [params]
        out, run, acc = [], [], 0
        for p in params:
            n = p.numel() * p.element_size()
            if n > self.update_chunk and self._sliceable(p):
                out += [run] if run else []
                out.append([(p, max(1, self.update_chunk // p.element_size()))])
                run, acc = [], 0
                continue
            if run and acc + n > self.update_chunk:
                out.append(run)
                run, acc = [], 0
            run.append(p)
            acc += n
        return out + ([run] if run else [])

    def _sliceable(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s update can run on flat slices: it has state already (a first update
        creates it whole) and it, its gradient and its parameter-shaped state are contiguous."""
        st = self.optimizer.state.get(p)
        return bool(st) and p.grad is not None and p.is_contiguous() and p.grad.is_contiguous() \
            and all(v.is_contiguous() for k, v in st.items() if _streamed_key(p, k, v))

    def _step_on(self, piece: list) -> None:
        """The optimizer's own ``step`` on ``piece``: parameters, or one sliced parameter."""
        if piece and isinstance(piece[0], tuple):
            self._step_sliced(*piece[0])
            return
        opt = self.optimizer
        saved = opt.param_groups
        opt.param_groups = _subgroups(saved, piece)
        try:
            self._original["step"]()
        finally:
            opt.param_groups = saved

    def _step_sliced(self, p: torch.Tensor, length: int) -> None:
        """``p``'s update as one ``step`` per flat slice of ``length`` elements
        (:meth:`_step_piece`), the step count written back once the last slice is done."""
        grad, last = p.grad.view(-1), None
        for a in range(0, p.numel(), length):
            last = self._step_piece(p, a, a + length, grad[a:a + length])
        _write_back(p, self.optimizer.state[p], last)   # every slice advanced its copy alike

    def _step_slice(self, g: int) -> None:
        """Slice group ``g``'s update (:meth:`_step_piece`): its rows of the parameter, their
        gradient (the deferred product's rows, or the gradient's) and their state in its slot
        (or its kept rows on the device, or the state itself where nothing streams). The
        parameter's last slice this step
        writes the step count back and drops the gradient."""
        grp = self.groups[g]
        p, (a, b) = grp.params[0], grp.rows
        rows_grad = self._row_grads.get(id(p))
        if rows_grad is None and p.grad is None:
            return   # no gradient this step: the optimizer would skip it too
        st = self.optimizer.state.get(p)
        if not st:   # its first gradient: the whole update makes its state, on the device
            self._step_on([p])
            p.grad = None
            self._new_state = True   # to the host once backward ends
            self._done.update(self._slices_of[id(p)])
            return
        row = p.numel() // p.shape[0]
        grad = rows_grad(a // row, b // row).view(-1) if rows_grad is not None \
            else p.grad.view(-1)[a:b]
        moments = grp.dev if grp.dev is not None else None if grp.slot is None else \
            [dev for _, dev in self._host_and_slot(grp, grp.slot)]
        last = self._step_piece(p, a, b, grad, moments)
        if all(j in self._done for j in self._slices_of[id(p)] if j != g):   # the last slice
            _write_back(p, st, last)
            p.grad = None
            self._row_grads.pop(id(p), None)

    def _step_piece(self, p: torch.Tensor, a: int, b: int, grad: torch.Tensor,
                    moments: list[torch.Tensor] | None = None) -> dict:
        """The optimizer's own ``step`` on ``p``'s flat elements ``a:b``: a view of ``p`` (the
        update writes ``p``'s memory) with ``grad``, its parameter-shaped state ``moments`` (in
        the order of ``p``'s state; None: the matching slices of that state) and its own copy
        of the rest (Adam's step count). Returns the piece's state after the step."""
        opt, state, st = self.optimizer, self.optimizer.state, self.optimizer.state[p]
        piece = p.detach().view(-1)[a:b]
        piece.grad = grad
        moment = iter(moments) if moments is not None else None
        state[piece] = {k: (next(moment) if moment is not None else v.view(-1)[a:b])
                        if _streamed_key(p, k, v)
                        else (v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in st.items()}
        saved = opt.param_groups
        opt.param_groups = [{**_subgroups(saved, [p])[0], "params": [piece]}]
        try:
            self._original["step"]()
        finally:
            opt.param_groups = saved
            piece.grad = None
            last = state.pop(piece)
        return last

    def _finish(self) -> None:
        """After backward: update the groups backward did not complete (a parameter without
        a gradient this step, or without state yet), then drop the slots once the compute
        stream waited for their last copies out."""
        if self._marks is not None and self._in_step:   # tensile.pace: backward's end
            self._marks("finish")
        for g in range(len(self.groups)):
            if g not in self._done:
                self._update(g)
                self.late_updates += 1
        self._queue, self._due, self._row_grads = [], [], {}
        if self._hooks_seen:
            self._hooks_total = self._hooks_seen
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            for slot in self._slots:
                if slot.free_after is not None:
                    compute.wait_event(slot.free_after)
        self._slots, self._free, self._leaving, self._in_step = [], [], [], False
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        if capturing:   # events recorded in a capture mean nothing outside it
            for grp in self.groups:
                grp.in_done = None
        elif self._new_state:
            self.home_state()   # a parameter's first update created its state on the device
            self._new_state = False


def _streamed_step(optimizer, closure=None):
    """``optimizer.step()`` of a streamed optimizer: what backward's hooks left, or (the
    first step) the optimizer's own full step, whose new state then moves to the host."""
    s: StreamedOptimizer = optimizer._tensile_streamed
    if closure is not None:
        raise ValueError("a streamed optimizer updates in backward: step() takes no closure")
    if not optimizer.state:     # the first step creates the state: as usual, then to the host
        s._original["step"]()
        s.home_state()
        return None
    if not s._in_step:          # no gradient reached a hook (no backward?): update them all now
        s._begin()
    s._finish()
    return None


def _streamed_load(optimizer, state_dict):
    s: StreamedOptimizer = optimizer._tensile_streamed
    s.synchronize()     # no copy may still read or write the regions being replaced
    s._original["load_state_dict"](state_dict)
    s.home_state()


def _streamed_state_dict(optimizer):
    s: StreamedOptimizer = optimizer._tensile_streamed
    s.synchronize()     # the last step's copies to the host are done
    return s._original["state_dict"]()


def _split(params: list, groups: int, slice_bytes: int | None = None) -> list[_Group]:
    """``params`` (in backward's order) cut into at most ``groups`` runs of about equal bytes,
    the first and the last :data:`END_SHARE` of the others' from :data:`END_GROUPS` groups on
    (with fewer, the others would grow by more than a fifth, and the ring's slots with them).
    A parameter larger than ``slice_bytes`` is not in a run: it becomes groups of its own, one
    per slice of whole rows of about that many bytes, where it comes in backward's order."""
    big = [] if slice_bytes is None else \
        [p for p in params if p.dim() >= 1 and p.is_contiguous()
         and p.numel() * p.element_size() > slice_bytes]
    if not big:
        return _runs(params, groups)
    out = _runs([p for p in params if all(p is not q for q in big)], groups)
    where = {id(p): i for i, p in enumerate(params)}
    for p in big:   # before the first run that backward updates after it
        at = next((i for i, g in enumerate(out) if where[id(g.params[0])] > where[id(p)]), len(out))
        out[at:at] = _slices(p, slice_bytes)
    return out


def spread_dues(seen: int, hooks: int, queued: int) -> list[int]:
    """The hook counts at which ``queued`` slices go with no pace, ``seen`` of a step's
    ``hooks`` hooks come: evenly over the hooks still to come, the first at once.
    :func:`tensile.pace.spread_pace` replays it."""
    later = max(hooks - seen, 0)
    return [seen + (k * later) // queued for k in range(queued)]


def row_slices(rows: int, row_bytes: int, nbytes: int) -> list[tuple[int, int]]:
    """The row ranges ``[r0, r1)`` that ``slice_mb`` cuts a parameter of ``rows`` rows of
    ``row_bytes`` each into: whole rows, about ``nbytes`` a slice (at least one row), the last
    slice what is left."""
    if rows < 1 or row_bytes < 1 or nbytes < 1:
        raise ValueError(f"row_slices: expected rows, row_bytes and nbytes >= 1, got "
                         f"{rows}, {row_bytes} and {nbytes}")
    step = max(1, nbytes // row_bytes)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _slices(p: torch.Tensor, nbytes: int) -> list[_Group]:
    """``p`` in slices of whole rows (its first dimension) of about ``nbytes`` each."""
    row = p.numel() // p.shape[0]
    return [_Group([p], rows=(r0 * row, r1 * row))
            for r0, r1 in row_slices(p.shape[0], row * p.element_size(), nbytes)]


def _runs(params: list, groups: int) -> list[_Group]:
    """:func:`_split` without slices."""
    if not params:
        return []
    total = sum(p.numel() * p.element_size() for p in params)
    shares = [1.0] * groups
    if groups >= END_GROUPS:
        shares[0] = shares[-1] = END_SHARE
    unit = total / sum(shares)
    bounds = list(itertools.accumulate(s * unit for s in shares))
    out, run, acc = [], [], 0.0
    for p in params:
        run.append(p)
        acc += p.numel() * p.element_size()
        if len(out) < groups - 1 and acc >= bounds[len(out)]:
            out.append(_Group(run))
            run = []
    if run:
        out.append(_Group(run))
    return out


def _write_back(p: torch.Tensor, st: dict, last: dict) -> None:
    """A sliced update's last slice's copy of ``p``'s other state (the step count) into
    ``p``'s state ``st``: every slice advanced its own copy of it alike."""
    for k, v in st.items():
        if _streamed_key(p, k, v):
            continue
        if isinstance(v, torch.Tensor):
            v.copy_(last[k])   # in place: a captured graph keeps its address
        else:
            st[k] = last[k]


def _slot_bytes(g: _Group) -> int:
    """The device bytes group ``g``'s state takes in a slot (0: not streamed)."""
    if not g.streams:
        return 0
    if g.rows is None:
        return g.host.numel()
    a, b = g.rows
    return sum(-(-((b - a) * (n // p.numel())) // 512) * 512 for p, _, _, n in g.keys)


def _streamed_key(p: torch.Tensor, key: str, v) -> bool:
    """Whether state entry ``key`` of ``p`` lives on the host: a floating tensor shaped like
    the parameter (Adam's moments, SGD's momentum), not the step count."""
    return (key != "step" and isinstance(v, torch.Tensor) and v.shape == p.shape
            and v.dtype.is_floating_point)


def _subgroups(param_groups: list[dict], params: list) -> list[dict]:
    """The optimizer's param groups restricted to ``params`` (same hyperparameters)."""
    wanted = {id(p) for p in params}
    out = []
    for pg in param_groups:
        mine = [p for p in pg["params"] if id(p) in wanted]
        if mine:
            out.append({**pg, "params": mine})
    return out


def _in_region(v: torch.Tensor, region: torch.Tensor) -> bool:
    """Whether ``v`` is a view of ``region``'s memory (not, say, a tensor ``load_state_dict``
    made, which on a CPU run is on the region's device too)."""
    return v.untyped_storage().data_ptr() == region.untyped_storage().data_ptr()


def _view(region: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """``like``'s shape and dtype over ``region[offset:]`` (a uint8 buffer)."""
    n = like.numel() * like.element_size()
    return region[offset:offset + n].view(like.dtype).view(like.shape)
