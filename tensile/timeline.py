"""The access timeline of one training iteration: who holds how much memory, when.

TENSILE plans on a simulated timeline (reference §3.2, §6 "Build"): operators run one
after another in trace order, op ``k`` occupies ``[start[k], end[k])`` in milliseconds,
and every tensor (here: every *storage*, so views and in-place ops are one tensor) has
a size, the ops that access it and a role.

Residency rules used by the planner and the simulator (both count whole ops, not ms):

* a *transient* tensor (role ``activation``: made inside the iteration) is resident from
  the op that first writes it to the op that last accesses it, inclusive, or to the op
  where the step lets it go, if later (``held_to``, ``held_to_end``);
* a *persistent* tensor (parameter, optimizer state, input, buffer, anything that
  existed before the iteration) is resident during every op. The timeline is periodic:
  op 0 of the next iteration follows op ``n - 1``.

A timeline is built from a :class:`nimble.graph.TaskGraph` (:meth:`AccessTimeline.from_graph`)
or by hand (:meth:`AccessTimeline.from_ops`), which is what the tests do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "ROLES",
    "PERSISTENT_ROLES",
    "CROSS_ITERATION_ROLES",
    "PHASES",
    "FORWARD_PHASES",
    "TensorInfo",
    "AccessTimeline",
]

ROLES = ("activation", "param", "opt_state", "input", "buffer", "other")
PERSISTENT_ROLES = frozenset(ROLES) - {"activation"}
# Only these may leave the device across the iteration boundary (issue: "parameters and
# optimizer state may be swapped out after their update and back in before first use").
CROSS_ITERATION_ROLES = frozenset({"param", "opt_state"})
PHASES = ("forward", "loss", "backward", "optimizer")
FORWARD_PHASES = frozenset({"forward", "loss"})

# Substrings of ATen op names that draw random numbers: recomputing them would give a
# different result, so they are never recomputed (used when a graph carries no tags).
_RANDOM_OP_WORDS = ("bernoulli", "dropout", "rand", "normal", "uniform", "multinomial",
                    "exponential", "geometric", "cauchy", "log_normal", "random_")


@dataclass
class TensorInfo:
    """One storage of the iteration.

    ``accesses`` and ``writes`` are sorted, de-duplicated op indices (every write is
    also an access). ``swappable`` says whether the runtime can move it at all (an
    activation saved for backward, a parameter restorable before its module runs, an
    optimizer state tensor); the planner still checks the timing. ``needed_by`` is, for
    persistent tensors, the op before which the runtime puts it back (default: the
    first access).
    """

    sid: int
    nbytes: int
    role: str
    accesses: list[int]
    writes: list[int]
    swappable: bool = False
    needed_by: int | None = None
    held_to_end: bool = False   # alive to the iteration's end after its last op (gradients)
    # the last op during which the step still holds a transient tensor after its last
    # access (a reference Python code keeps: a streamed optimizer's ring slot, given back
    # some updates after its last copy-out); None: freed after its last access
    held_to: int | None = None
    # the last op of a forward module call that took it as an input: its caller references
    # it until the call returns, so it cannot leave the device before (a residual block's
    # input, read by its last conv long before the block's add); None: no such call
    forward_hold: int | None = None

    @property
    def persistent(self) -> bool:
        return self.role in PERSISTENT_ROLES

    @property
    def first(self) -> int:
        return self.accesses[0]

    @property
    def last(self) -> int:
        return self.accesses[-1]


@dataclass
class AccessTimeline:
    """Ops on a serial timeline plus the tensors they touch.

    Per op ``k``: ``names[k]``, ``phases[k]``, ``op_ms[k]`` (estimated or measured
    duration), ``random[k]`` (draws random numbers), ``reads[k]`` / ``writes[k]``
    (storage ids). ``start``/``end`` are derived: ``end[k] = start[k] + op_ms[k]``.
    """

    names: list[str]
    phases: list[str]
    op_ms: np.ndarray
    random: list[bool]
    reads: list[list[int]]
    writes: list[list[int]]
    tensors: dict[int, TensorInfo]
    # copies between host and device that the step makes itself (op index, "h2d" or "d2h",
    # bytes): a streamed optimizer's state (:mod:`tensile.streamed`); the planner keeps its
    # copy channels free for them
    transfers: tuple[tuple[int, str, int], ...] = ()
    # what rerunning op k for a recompute costs, as a share of op_ms[k], where it is not
    # all of it: a training-mode batch norm rebuilt from the batch statistics it returned
    # reruns only its elementwise half, and the residual add and ReLU(inplace=True) after it
    # join that pass (share 0) (``tensile.Scheduler(..., batch_norm_from_stats=True)``). A
    # share, not ms, so that it holds when op times are measured again or stretched.
    rerun_share: Mapping[int, float] = field(default_factory=dict)
    # bytes op k holds only while it runs, beyond its inputs and outputs: a library's
    # workspace (cuDNN's for a convolution's backward: 16-32 MiB on ResNet-50 at b=8-16 on
    # the H200), measured on the captured step (:func:`tensile.optimes.step_op_profile`).
    # Counted in every memory curve at op k, so a plan's peak is the one the allocator sees.
    # A recompute's rerun of the op is not charged it.
    scratch: Mapping[int, int] = field(default_factory=dict)
    start: np.ndarray = field(init=False, repr=False)
    end: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.op_ms = np.asarray(self.op_ms, dtype=np.float64)
        self.transfers = _checked_transfers(self.transfers, len(self.names))
        self.rerun_share = _checked_rerun_share(self.rerun_share, len(self.names))
        self.scratch = _checked_scratch(self.scratch, len(self.names))
        self.end = np.cumsum(self.op_ms)
        self.start = self.end - self.op_ms

    # ------------------------------------------------------------------ basic facts
    @property
    def num_ops(self) -> int:
        return len(self.names)

    @property
    def iteration_ms(self) -> float:
        return float(self.end[-1]) if self.num_ops else 0.0

    def vanilla_range(self, sid: int) -> tuple[int, int]:
        """Ops ``(lo, hi)`` (inclusive) during which the tensor is resident without a plan."""
        t = self.tensors[sid]
        if t.persistent or t.held_to_end:
            return (0 if t.persistent else t.first), self.num_ops - 1
        return t.first, t.last if t.held_to is None else max(t.last, t.held_to)

    def vanilla_curve(self) -> np.ndarray:
        """Resident bytes during each op, without any plan (int64 array of length n), each
        op's ``scratch`` included. A new array each call (the planner edits its copy)."""
        return self._vanilla.copy()

    @cached_property
    def _vanilla(self) -> np.ndarray:
        # worked out once: a planner replays plans against it hundreds of times, and a
        # timeline's tensors do not change once it is built (with_* make new ones)
        diff = np.zeros(self.num_ops + 1, dtype=np.int64)
        for sid, t in self.tensors.items():
            lo, hi = self.vanilla_range(sid)
            diff[lo] += t.nbytes
            diff[hi + 1] -= t.nbytes
        return np.cumsum(diff[:-1]) + self.scratch_curve()

    def scratch_curve(self) -> np.ndarray:
        """``scratch`` as an int64 array of length n (0 where an op has none)."""
        out = np.zeros(self.num_ops, dtype=np.int64)
        for k, nbytes in self.scratch.items():
            out[k] = nbytes
        return out

    def backward_gap(self, sid: int) -> tuple[int, int] | None:
        """``(i, j)``: the last forward/loss access and the first backward access.

        Between them a transient tensor is only referenced by autograd's saved-tensor
        slot, so the runtime can swap or drop it there. Inside the forward pass Python
        code may still hold the tensor (a residual branch, say): moving it there would
        free nothing, so this is the only gap a transient tensor is moved in, and it
        starts no earlier than the end of the module calls it is an input of
        (``forward_hold``). Returns ``None`` when the tensor has no such gap.
        """
        t = self.tensors[sid]
        if t.persistent:
            return None
        fwd = [a for a in t.accesses if self.phases[a] in FORWARD_PHASES]
        bwd = [a for a in t.accesses if self.phases[a] == "backward"]
        if not fwd or not bwd:
            return None
        i, j = fwd[-1], bwd[0]
        if t.forward_hold is not None:
            i = max(i, t.forward_hold)   # the forward code still references it
        if j <= i + 1:
            return None
        return i, j

    def last_write_at_or_before(self, sid: int, op: int) -> int:
        """The last op ``<= op`` that writes ``sid`` (its data is final after that op)."""
        ws = [w for w in self.tensors[sid].writes if w <= op]
        if not ws:
            raise ValueError(f"tensor {sid} is not written at or before op {op}")
        return ws[-1]

    def last_op_ending_by(self, t_ms: float) -> int:
        """The last op whose end is ``<= t_ms`` (``-1``: none, i.e. the iteration start).

        A copy planned to start at ``t_ms`` is issued after this op.
        """
        return int(np.searchsorted(self.end, t_ms + 1e-9, side="right")) - 1

    def first_op_starting_at_or_after(self, t_ms: float) -> int:
        """The first op whose start is ``>= t_ms`` (``num_ops`` if none)."""
        return int(np.searchsorted(self.start, t_ms - 1e-9, side="left"))

    def with_op_times(self, op_ms: Sequence[float]) -> "AccessTimeline":
        """The same accesses with new op durations (after a measurement); ``rerun_share``
        and ``scratch`` are kept."""
        _check_op_ms(op_ms, self.num_ops)
        return replace(self, op_ms=np.asarray(op_ms, dtype=np.float64))

    def with_scratch(self, scratch: Mapping[int, int]) -> "AccessTimeline":
        """The same timeline with ``scratch`` (op -> bytes it holds only while it runs)
        in place of its own."""
        return replace(self, scratch=scratch)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_ops(
        cls,
        ops: Sequence[tuple[str, str, float, Iterable[int], Iterable[int]]],
        sizes: Mapping[int, int],
        roles: Mapping[int, str] | None = None,
        *,
        swappable: Mapping[int, bool] | None = None,
        needed_by: Mapping[int, int] | None = None,
        random_ops: Iterable[int] | None = None,
        held_to_end: Iterable[int] | None = None,
        transfers: Iterable[tuple[int, str, int]] = (),
        rerun_share: Mapping[int, float] | None = None,
        scratch: Mapping[int, int] | None = None,
        held_to: Mapping[int, int] | None = None,
        forward_hold: Mapping[int, int] | None = None,
    ) -> "AccessTimeline":
        """Build a timeline by hand.

        ``ops`` are ``(name, phase, ms, reads, writes)`` in execution order; ``sizes``
        maps every storage id to its bytes; ``roles`` defaults to ``activation`` for
        storages first written inside the iteration and ``other`` for those first read.
        ``swappable`` overrides the default eligibility (activations with a
        forward→backward gap, parameters, optimizer state). ``random_ops`` lists op
        indices that draw random numbers (default: guessed from the op name).
        ``held_to_end`` lists transient storages that stay allocated to the iteration's end
        after their last op: the gradients, which ``optimizer.zero_grad`` frees only after
        ``optimizer.step()`` (a model that freed them at their last read would promise
        memory the step never gives back). ``transfers`` lists the step's own host↔device
        copies as ``(op, "h2d" | "d2h", bytes)``. ``rerun_share`` maps an op to the share of
        its time that rerunning it for a recompute costs, where that is not all of it.
        ``scratch`` maps an op to the bytes it holds only while it runs (a workspace).
        ``held_to`` maps a transient storage to the last op during which the step still
        holds it after its last access (:attr:`TensorInfo.held_to`; persistent ones are
        resident throughout anyway and ignored). ``forward_hold`` maps a transient storage
        to the last op of a forward module call it is an input of
        (:attr:`TensorInfo.forward_hold`: its backward gap starts after it).
        """
        roles = dict(roles or {})
        n = len(ops)
        names, phases, op_ms, reads, writes = [], [], [], [], []
        accesses: dict[int, list[int]] = {}
        wr: dict[int, list[int]] = {}
        first_is_read: dict[int, bool] = {}
        for k, op in enumerate(ops):
            if len(op) != 5:
                raise ValueError(f"op {k}: expected (name, phase, ms, reads, writes), got {op!r}")
            name, phase, ms, r, w = op
            if phase not in PHASES:
                raise ValueError(f"op {k} ({name}): phase must be one of {PHASES}, got {phase!r}")
            r, w = _unique(r), _unique(w)
            for sid in r + w:
                if sid not in sizes:
                    raise ValueError(f"op {k} ({name}) touches storage {sid}, which has no size")
                if sid not in accesses:
                    accesses[sid] = []
                    first_is_read[sid] = sid in r and sid not in w
                if not accesses[sid] or accesses[sid][-1] != k:
                    accesses[sid].append(k)
            for sid in w:
                wr.setdefault(sid, []).append(k)
            names.append(str(name))
            phases.append(phase)
            op_ms.append(ms)
            reads.append(r)
            writes.append(w)
        _check_op_ms(op_ms, n)
        rnd = set(random_ops) if random_ops is not None else {
            k for k, nm in enumerate(names) if _looks_random(nm)}

        tensors: dict[int, TensorInfo] = {}
        for sid, acc in accesses.items():
            nbytes = sizes[sid]
            if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
                raise ValueError(f"storage {sid}: size must be a non-negative int, got {nbytes!r}")
            role = roles.get(sid, "other" if first_is_read[sid] else "activation")
            if role not in ROLES:
                raise ValueError(f"storage {sid}: role must be one of {ROLES}, got {role!r}")
            if role == "activation" and first_is_read[sid]:
                raise ValueError(
                    f"storage {sid} is read at op {acc[0]} before any op writes it, so it "
                    "existed before the iteration; give it a persistent role "
                    f"({sorted(PERSISTENT_ROLES)}), not 'activation'")
            tensors[sid] = TensorInfo(sid=sid, nbytes=int(nbytes), role=role, accesses=acc,
                                      writes=wr.get(sid, []))
        tl = cls(names, phases, np.asarray(op_ms, dtype=np.float64),
                 [k in rnd for k in range(n)], reads, writes, tensors, tuple(transfers),
                 {} if rerun_share is None else rerun_share, {} if scratch is None else scratch)

        for sid, op in (forward_hold or {}).items():
            t = tensors.get(sid)
            if t is None:
                raise ValueError(f"forward_hold names storage {sid!r}, which no op accesses")
            if not _is_op_index(op, n) or op < t.first or phases[op] not in FORWARD_PHASES:
                raise ValueError(f"forward_hold[{sid}]: expected the index of a forward op from "
                                 f"its first access ({t.first}) on, got {op!r}")
            if not t.persistent:
                t.forward_hold = int(op)
        nb = dict(needed_by or {})
        for sid, t in tensors.items():
            if t.persistent:
                t.needed_by = nb.get(sid, t.first)
                if t.needed_by > t.first:
                    raise ValueError(f"storage {sid}: needed_by={t.needed_by} is after its "
                                     f"first access (op {t.first})")
                t.swappable = t.role in CROSS_ITERATION_ROLES and t.needed_by > 0
            else:
                t.swappable = tl.backward_gap(sid) is not None
        for sid, ok in (swappable or {}).items():
            if sid in tensors:
                tensors[sid].swappable = bool(ok) and tensors[sid].swappable
        for sid in held_to_end or ():
            if sid in tensors and not tensors[sid].persistent:
                tensors[sid].held_to_end = True
        for sid, op in (held_to or {}).items():
            t = tensors.get(sid)
            if t is None:
                raise ValueError(f"held_to names storage {sid!r}, which no op accesses")
            if not _is_op_index(op, n) or op < t.last:
                raise ValueError(f"held_to[{sid}]: expected an op index from its last access "
                                 f"({t.last}) to {n - 1}, got {op!r}")
            if not t.persistent and op > t.last:
                t.held_to = int(op)
        return tl

    @classmethod
    def from_graph(
        cls,
        graph,
        op_times_ms: Sequence[float],
        *,
        roles: Mapping[int, str] | None = None,
        swappable: Mapping[int, bool] | None = None,
        needed_by: Mapping[int, int] | None = None,
        random_ops: Iterable[int] | None = None,
        held_to_end: Iterable[int] | None = None,
        transfers: Iterable[tuple[int, str, int]] = (),
        rerun_share: Mapping[int, float] | None = None,
        scratch: Mapping[int, int] | None = None,
        held_to: Mapping[int, int] | None = None,
        forward_hold: Mapping[int, int] | None = None,
    ) -> "AccessTimeline":
        """Build the timeline of a training trace (a :class:`nimble.graph.TaskGraph`).

        Roles default to: ``graph.params`` → ``param`` (buffers included),
        ``graph.inputs`` → ``input``; a storage that existed before the iteration (first
        touched by a pure read or by an in-place update, but not by a whole overwrite
        such as ``copy_``/``fill_``) → ``opt_state`` when the optimizer phase writes it,
        else ``other``; everything else → ``activation``. Without ``swappable`` every
        activation with a forward→backward gap counts as movable: right for analysis;
        the runtime uses :meth:`tensile.record.Recording.timeline`, which knows which
        tensors autograd really saved.
        ``op_times_ms`` gives one duration per node (see :mod:`tensile.estimate`);
        ``scratch``: the bytes an op holds only while it runs, ``held_to`` and
        ``forward_hold``: how long the step holds a storage after its last access and in
        forward (:meth:`from_ops`).
        """
        nodes = graph.nodes
        if len(op_times_ms) != len(nodes):
            raise ValueError(f"op_times_ms has {len(op_times_ms)} entries, the graph "
                             f"has {len(nodes)} nodes")
        sizes: dict[int, int] = {}
        ops = []
        for n in nodes:
            for sid, b in n.storage_bytes.items():
                sizes[sid] = max(sizes.get(sid, 0), int(b))
            for sid in list(n.reads) + list(n.writes):
                if sid not in n.storage_bytes:
                    raise ValueError(f"node {n.index} ({n.name}) touches storage {sid} "
                                     "but has no storage_bytes entry for it")
            ops.append((n.name, n.phase, op_times_ms[n.index], n.reads, n.writes))
        auto = _graph_roles(graph)
        auto.update(roles or {})
        return cls.from_ops(ops, sizes, auto, swappable=swappable, needed_by=needed_by,
                            random_ops=random_ops, held_to_end=held_to_end, transfers=transfers,
                            rerun_share=rerun_share, scratch=scratch, held_to=held_to,
                            forward_hold=forward_hold)


def _checked_transfers(transfers, num_ops: int) -> tuple[tuple[int, str, int], ...]:
    """``transfers`` as a tuple of ``(op, direction, bytes)``; ValueError names a bad entry."""
    out = []
    for k, t in enumerate(transfers):
        ok = (isinstance(t, (tuple, list)) and len(t) == 3 and isinstance(t[0], (int, np.integer))
              and 0 <= t[0] < num_ops and t[1] in ("h2d", "d2h")
              and isinstance(t[2], (int, np.integer)) and t[2] >= 0)
        if not ok:
            raise ValueError(f"transfers[{k}]: expected (op index in [0, {num_ops}), 'h2d' or "
                             f"'d2h', bytes >= 0), got {t!r}")
        out.append((int(t[0]), str(t[1]), int(t[2])))
    return tuple(out)


def _is_op_index(k, num_ops: int) -> bool:
    """Whether ``k`` is an op index of a timeline of ``num_ops`` ops (an int, not a bool)."""
    return isinstance(k, (int, np.integer)) and not isinstance(k, bool) and 0 <= k < num_ops


def _checked_rerun_share(rerun_share, num_ops: int) -> dict[int, float]:
    """``rerun_share`` as ``{op: share}``; ValueError names a bad entry."""
    if not isinstance(rerun_share, Mapping):
        raise ValueError(f"rerun_share: expected a mapping of op index to a share of its time, "
                         f"got {rerun_share!r}")
    out = {}
    for k, share in rerun_share.items():
        ok_share = (isinstance(share, (int, float, np.floating, np.integer))
                    and not isinstance(share, bool) and math.isfinite(share) and share >= 0)
        if not (_is_op_index(k, num_ops) and ok_share):
            raise ValueError(f"rerun_share: expected op index in [0, {num_ops}) -> a finite "
                             f"share of its time >= 0, got {k!r}: {share!r}")
        out[int(k)] = float(share)
    return out


def _checked_scratch(scratch, num_ops: int) -> dict[int, int]:
    """``scratch`` as ``{op: bytes}`` without zeros; ValueError names a bad entry."""
    if not isinstance(scratch, Mapping):
        raise ValueError(f"scratch: expected a mapping of op index to bytes, got {scratch!r}")
    out = {}
    for k, nbytes in scratch.items():
        ok_bytes = isinstance(nbytes, (int, np.integer)) and not isinstance(nbytes, bool) \
            and nbytes >= 0
        if not (_is_op_index(k, num_ops) and ok_bytes):
            raise ValueError(f"scratch: expected op index in [0, {num_ops}) -> a whole number of "
                             f"bytes >= 0, got {k!r}: {nbytes!r}")
        if nbytes:
            out[int(k)] = int(nbytes)
    return out


def _graph_roles(graph) -> dict[int, str]:
    """Default roles for the storages of a TaskGraph (see :meth:`AccessTimeline.from_graph`)."""
    roles: dict[int, str] = {sid: "param" for sid in graph.params}
    roles.update({sid: "input" for sid in graph.inputs})
    seen: set[int] = set()
    pre_existing: set[int] = set()
    opt_written: set[int] = set()
    for n in graph.nodes:
        for sid in list(n.reads) + list(n.writes):
            if sid not in seen:
                seen.add(sid)
                if _existed_before(n, sid):
                    pre_existing.add(sid)
        if n.phase == "optimizer":
            opt_written.update(n.writes)
    for sid in pre_existing:
        if sid not in roles:
            roles[sid] = "opt_state" if sid in opt_written else "other"
    return roles


# In-place ops that overwrite a whole fresh allocation. Traces that skip bare allocations
# (``aten.empty``) show such a storage first touched by one of these: it is new, not old.
_OVERWRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_",
               "exponential_", "geometric_", "cauchy_", "log_normal_"}


def _existed_before(node, sid: int) -> bool:
    """Did ``sid`` hold data before ``node``, the first op that touches it?"""
    base = base_name(node.name)
    if base in _OVERWRITES:
        return False
    if sid in node.reads and sid not in node.writes:
        return True  # read before anything in the iteration wrote it
    return base.endswith("_") and not base.endswith("__")  # updated in place


def base_name(name: str) -> str:
    """``aten.add_.Tensor`` → ``add_``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]


def _looks_random(name: str) -> bool:
    low = name.lower()
    return any(w in low for w in _RANDOM_OP_WORDS)


def _unique(xs: Iterable[int]) -> list[int]:
    out: list[int] = []
    for x in xs:
        x = int(x)
        if x not in out:
            out.append(x)
    return out


def _check_op_ms(op_ms: Sequence[float], n: int) -> None:
    if len(op_ms) != n:
        raise ValueError(f"expected {n} op times, got {len(op_ms)}")
    for k, ms in enumerate(op_ms):
        if not (isinstance(ms, (int, float, np.floating, np.integer)) and math.isfinite(ms)
                and ms > 0):
            raise ValueError(f"op {k}: time must be a positive finite number of ms, got {ms!r}")
