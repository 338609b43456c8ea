"""How small one static arena could hold a graph's tensors on a stream plan (an analysis).

PyTorch's caching allocator reuses a freed block only on the stream that allocated it, so
a multi-stream capture keeps one working set per stream (see :mod:`nimble.allocator`):
NASNet-A mobile at batch 32 needs 548 MiB on 13 streams against 114 MiB on one. Would a
memory plan of our own, one arena for all streams, meet "within 1.2x of eager's peak"?
This module bounds the answer on the task graph alone, before anyone builds such an
allocator. It counts the graph's own tensors: library workspaces (cuDNN's) are not in the
trace, and eager's measured peak includes them.

A plan may give two tensors the same bytes only if every use of one finishes before the
other is first written, in the plan's *happens-before* order: earlier on the same stream,
or through the plan's event syncs (transitively). Every later use of a tensor depends on
its first write (the graph's read- and write-after-write edges), so "before the first
write" is before all of it. :func:`arena_bytes` places every transient tensor greedily, largest first, at the lowest offset that no tensor it may be
live with occupies (the "greedy by size" heuristic of TFLite's and XLA's planners).
With one stream it is the classic interval packing, close to :func:`live_peak`, the most
bytes alive at any op in program order (what eager reaches at best).

The greedy arena is an upper bound on what a plan needs. :func:`interleaved_peak` is a
lower bound that holds for *any* allocator: the GPU may run the streams' ops in round-robin
order (:func:`round_robin_order`), and then everything alive at once in that order must
occupy distinct bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .graph import TaskGraph
from .streams import StreamPlan

__all__ = ["Lifetime", "lifetimes", "HappensBefore", "arena_bytes", "live_bytes", "live_peak",
           "round_robin_order", "interleaved_peak"]


@dataclass(frozen=True)
class Lifetime:
    """A transient storage: ``nbytes``, written first by op ``first``, last touched by op
    ``last`` (in index order), touched by ``uses`` (``first`` included)."""

    sid: int
    nbytes: int
    first: int
    last: int
    uses: tuple[int, ...]


def lifetimes(graph: TaskGraph) -> list[Lifetime]:
    """Every storage the graph creates (first touched by a write), with its op range.

    Inputs, parameters and buffers, and storages first read (they existed before), are
    not the arena's. A graph output is live to the last op.
    """
    uses: dict[int, list[int]] = {}
    size: dict[int, int] = {}
    created: set[int] = set()
    for node in graph.nodes:
        for sid in node.reads:
            uses.setdefault(sid, []).append(node.index)
        for sid in node.writes:
            if sid not in uses:
                created.add(sid)
            if not uses.get(sid) or uses[sid][-1] != node.index:
                uses.setdefault(sid, []).append(node.index)
        size.update(node.storage_bytes)
    outside = set(graph.inputs) | set(graph.params)
    end = graph.num_nodes - 1
    out = []
    for sid in sorted(created - outside):
        ops = tuple(uses[sid]) + ((end,) if sid in graph.outputs and uses[sid][-1] != end else ())
        out.append(Lifetime(sid, size.get(sid, 0), ops[0], ops[-1], ops))
    return out


class HappensBefore:
    """``ordered(u, v)``: op ``u`` finishes before op ``v`` starts under ``plan``.

    Vector clocks: ``before[v][s]`` is the position (on stream ``s``) of the last op of
    ``s`` that ``v`` waits for, directly or transitively (-1: none); ops of one stream run
    in index order, and a sync ``(u, v)`` makes ``v`` wait for ``u``.
    """

    def __init__(self, num_nodes: int, plan: StreamPlan) -> None:
        self.stream = np.asarray(plan.stream_of, dtype=np.int64)
        self.pos = np.zeros(num_nodes, dtype=np.int64)
        for order in plan.streams():
            self.pos[order] = np.arange(len(order))
        waits: list[list[int]] = [[] for _ in range(num_nodes)]
        for u, v in plan.syncs:
            waits[v].append(u)
        self.before = np.full((num_nodes, plan.num_streams), -1, dtype=np.int64)
        after = np.full((num_nodes, plan.num_streams), -1, dtype=np.int64)  # clock incl. v
        previous = [-1] * plan.num_streams
        for v in range(num_nodes):          # node order is a topological order
            s = self.stream[v]
            clock = self.before[v]
            if previous[s] >= 0:
                np.maximum(clock, after[previous[s]], out=clock)
            for u in waits[v]:
                np.maximum(clock, after[u], out=clock)
            after[v] = clock
            after[v, s] = self.pos[v]
            previous[s] = v

    def ordered(self, u: int, v: int) -> bool:
        """Does op ``u`` finish before op ``v`` starts?"""
        return u != v and bool(self.before[v, self.stream[u]] >= self.pos[u])

    def frontier(self, ops: tuple[int, ...]) -> np.ndarray:
        """Per stream, the position of the last of ``ops`` on it (-1: none): all of ``ops``
        finish before ``v`` starts iff ``frontier <= before[v]`` on every stream."""
        out = np.full(self.before.shape[1], -1, dtype=np.int64)
        np.maximum.at(out, self.stream[list(ops)], self.pos[list(ops)])
        return out


def arena_bytes(tensors: list[Lifetime], order: HappensBefore) -> int:
    """Size of one arena holding ``tensors`` (greedy by size, see the module docstring)."""
    if not tensors:
        return 0
    todo = sorted(tensors, key=lambda t: (-t.nbytes, t.first))
    firsts = np.array([t.first for t in todo], dtype=np.int64)
    done = np.array([order.frontier(t.uses) for t in todo]).reshape(len(todo), -1)
    offsets = np.zeros(len(todo), dtype=np.int64)
    sizes = np.array([t.nbytes for t in todo], dtype=np.int64)
    top = 0
    for i, t in enumerate(todo):
        if i:   # placed tensors that may be live with this one: neither is over before the other
            placed_over = np.all(done[:i] <= order.before[t.first], axis=1)
            this_over = np.all(done[i] <= order.before[firsts[:i]], axis=1)
            busy = np.flatnonzero(~(placed_over | this_over))
            spans = sorted(zip(offsets[busy], offsets[busy] + sizes[busy]))
        else:
            spans = []
        offset = 0
        for lo, hi in spans:
            if lo - offset >= t.nbytes:
                break
            offset = max(offset, hi)
        offsets[i] = offset
        top = max(top, offset + t.nbytes)
    return int(top)


def live_bytes(tensors: list[Lifetime], num_nodes: int) -> np.ndarray:
    """Bytes of ``tensors`` alive at each op (int64, one entry an op), ops in index order."""
    delta = np.zeros(num_nodes + 1, dtype=np.int64)
    for t in tensors:
        delta[t.first] += t.nbytes
        delta[t.last + 1] -= t.nbytes
    return np.cumsum(delta)[:-1]


def live_peak(tensors: list[Lifetime], num_nodes: int) -> int:
    """Most bytes of ``tensors`` alive at any one op, running the ops in index order."""
    return int(live_bytes(tensors, num_nodes).max()) if num_nodes else 0


def round_robin_order(plan: StreamPlan) -> list[int]:
    """The ops in an order the plan allows: one op per stream in turn, each once the ops
    it syncs on have run (streams run their ops in index order)."""
    streams = plan.streams()
    waits: dict[int, list[int]] = {}
    for u, v in plan.syncs:
        waits.setdefault(v, []).append(u)
    done: set[int] = set()
    heads = [0] * len(streams)
    order: list[int] = []
    total = sum(len(ops) for ops in streams)
    while len(order) < total:
        progressed = False
        for s, ops in enumerate(streams):
            if heads[s] < len(ops) and all(u in done for u in waits.get(ops[heads[s]], ())):
                v = ops[heads[s]]
                heads[s] += 1
                order.append(v)
                done.add(v)
                progressed = True
        if not progressed:
            raise ValueError("the plan's syncs and stream orders form a cycle")
    return order


def interleaved_peak(tensors: list[Lifetime], plan: StreamPlan) -> int:
    """Most bytes alive at once when the plan's ops run in :func:`round_robin_order`: a
    lower bound on any arena for the plan."""
    order = round_robin_order(plan)
    step = np.empty(len(order), dtype=np.int64)
    step[order] = np.arange(len(order))
    delta = np.zeros(len(order) + 1, dtype=np.int64)
    for t in tensors:
        at = step[list(t.uses)]
        delta[at.min()] += t.nbytes
        delta[at.max() + 1] -= t.nbytes
    return int(np.cumsum(delta)[:-1].max()) if len(order) else 0
