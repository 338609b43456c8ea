"""Nimble's stream assignment: which op runs on which CUDA stream, and which edges need an event.

The input is a DAG whose nodes ``0 .. n-1`` are already in a topological (execution) order, so
every edge ``(u, v)`` has ``u < v``. The algorithm is the one of the Nimble paper and its
official code:

1. **Minimum equivalent graph (MEG).** For a DAG this is the transitive reduction: drop every
   edge ``u -> v`` that another path ``u -> ... -> v`` already implies.
2. **Maximum bipartite matching** on the MEG (left copy = sources, right copy = targets).
   A matched pair ``(u, v)`` means "v runs right after u on the same stream".
3. **Chains.** Following matches splits the nodes into ``n - |M|`` vertex-disjoint MEG paths.
   One chain per stream gives *maximum logical concurrency* (two nodes with no path between
   them never share a stream) with the *minimum number of synchronizations*: each cross-stream
   MEG edge needs its own event, and a maximum matching keeps the most MEG edges inside streams.
4. **Merging** (official code, optional): a second maximum matching between chain ends and chain
   starts, with an edge ``A -> B`` when the end of ``A`` reaches the start of ``B``. Every node of
   ``A`` then precedes every node of ``B``, so concurrency is kept, and no MEG edge can join ``A``
   to ``B`` (it would be redundant, or would have enlarged the first matching): no sync is added.

Reachability is kept as Python-int bitsets (bit ``v`` of ``reach[u]`` set iff a path ``u -> v``
exists), which makes the closure and the reduction a few big-int ORs per edge. Matchings use
networkx's Hopcroft-Karp (:func:`networkx.bipartite.hopcroft_karp_matching`).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

__all__ = [
    "StreamPlan",
    "assign_streams",
    "transitive_reduction",
    "reachability",
    "max_antichain_width",
    "critical_path",
    "critical_streams",
    "single_stream_plan",
]

Edge = tuple[int, int]


@dataclass
class StreamPlan:
    """The result of :func:`assign_streams`.

    ``stream_of[k]`` is the stream id of node ``k`` (streams are numbered in order of their
    first node, so node 0 is on stream 0). ``syncs`` are the MEG edges whose endpoints are on
    different streams: record an event after ``u``, wait on it before ``v``. ``chains`` are the
    stage-1 chains (before merging), ``meg_edges`` the transitive reduction of the input.
    """

    stream_of: list[int]
    syncs: list[Edge]
    num_streams: int
    chains: list[list[int]]
    meg_edges: list[Edge]

    def streams(self) -> list[list[int]]:
        """Nodes of each stream, in execution order."""
        out: list[list[int]] = [[] for _ in range(self.num_streams)]
        for node, s in enumerate(self.stream_of):
            out[s].append(node)
        return out


# ----------------------------------------------------------------------------------------
# input checking
# ----------------------------------------------------------------------------------------

def _is_int(x: object) -> bool:
    # bool is an int subclass; True as a node id is almost surely a bug.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_num_nodes(num_nodes: object) -> int:
    if not _is_int(num_nodes) or num_nodes < 0:
        raise ValueError(f"num_nodes must be a non-negative int, got {num_nodes!r}")
    return int(num_nodes)


def _check_edges(num_nodes: int, edges: Iterable[Edge], what: str = "edge") -> list[Edge]:
    """Validate ``(u, v)`` pairs (ints, ``0 <= u < v < num_nodes``); return them sorted, deduped."""
    out = set()
    for e in edges:
        try:
            u, v = e
        except (TypeError, ValueError):
            raise ValueError(f"each {what} must be a pair (u, v), got {e!r}") from None
        if not (_is_int(u) and _is_int(v)):
            raise ValueError(f"{what} {e!r}: node ids must be ints, got {type(u).__name__}, "
                             f"{type(v).__name__}")
        u, v = int(u), int(v)
        if not 0 <= u < v < num_nodes:
            raise ValueError(f"{what} {e!r}: expected 0 <= u < v < num_nodes={num_nodes} "
                             "(nodes are numbered in execution order)")
        out.add((u, v))
    return sorted(out)


def _children(num_nodes: int, edges: list[Edge]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(num_nodes)]
    for u, v in edges:
        kids[u].append(v)
    return kids


def _bits_to_array(bits: int, num_nodes: int) -> np.ndarray:
    """Indices of the set bits of ``bits`` (bit k = node k), as an int64 array."""
    if bits == 0:
        return np.empty(0, dtype=np.int64)
    raw = np.frombuffer(bits.to_bytes((num_nodes + 7) // 8, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little"))


def _matching(rows: list[np.ndarray], num_cols: int) -> np.ndarray:
    """Maximum bipartite matching; ``rows[i]`` = columns adjacent to row ``i``.

    Returns, for each row, the matched column or -1. networkx's Hopcroft-Karp, not SciPy's
    ``maximum_bipartite_matching``: SciPy's takes exponential time on layered graphs like
    these (scipy/scipy#26147; minutes on NASNet-A large's closure).
    """
    num_rows = len(rows)
    graph = nx.Graph()
    graph.add_nodes_from(range(num_rows + num_cols))
    graph.add_edges_from((i, num_rows + int(c)) for i, cols in enumerate(rows) for c in cols)
    matched = nx.bipartite.hopcroft_karp_matching(graph, top_nodes=range(num_rows))
    out = np.full(num_rows, -1, dtype=np.int64)
    for i in range(num_rows):
        if i in matched:
            out[i] = matched[i] - num_rows
    return out


# ----------------------------------------------------------------------------------------
# graph helpers (public: the stream analysis uses them)
# ----------------------------------------------------------------------------------------

def _reach(num_nodes: int, kids: list[list[int]]) -> list[int]:
    reach = [0] * num_nodes
    for u in range(num_nodes - 1, -1, -1):  # children have larger indices: already done
        r = 0
        for c in kids[u]:
            r |= reach[c] | (1 << c)
        reach[u] = r
    return reach


def reachability(num_nodes: int, edges: Iterable[Edge]) -> list[int]:
    """Transitive closure as bitsets: bit ``v`` of ``result[u]`` is set iff a path ``u -> v`` exists.

    A node does not reach itself. Nodes must be in topological order (every edge ``u < v``).
    """
    n = _check_num_nodes(num_nodes)
    return _reach(n, _children(n, _check_edges(n, edges)))


def _reduce(num_nodes: int, kids: list[list[int]], reach: list[int]) -> list[Edge]:
    meg = []
    for u in range(num_nodes):
        # v is implied iff some child of u reaches v; reach[c] never contains c itself.
        covered = 0
        for c in kids[u]:
            covered |= reach[c]
        meg.extend((u, c) for c in kids[u] if not (covered >> c) & 1)
    return sorted(meg)


def transitive_reduction(num_nodes: int, edges: Iterable[Edge]) -> list[Edge]:
    """The minimum equivalent graph of a DAG: edges not implied by a longer path, sorted."""
    n = _check_num_nodes(num_nodes)
    kids = _children(n, _check_edges(n, edges))
    return _reduce(n, kids, _reach(n, kids))


def max_antichain_width(num_nodes: int, edges: Iterable[Edge]) -> int:
    """Largest set of pairwise unordered nodes (the DAG's width).

    By Dilworth's theorem it equals the minimum number of chains covering the closure:
    ``n - |maximum matching|`` on the bipartite graph of all reachable pairs. This is a lower
    bound on the streams any schedule with maximum logical concurrency needs.
    """
    n = _check_num_nodes(num_nodes)
    reach = _reach(n, _children(n, _check_edges(n, edges)))
    match = _matching([_bits_to_array(r, n) for r in reach], n)
    return n - int(np.count_nonzero(match >= 0))


def critical_path(num_nodes: int, edges: Iterable[Edge],
                  weights: Sequence[float]) -> tuple[float, list[int]]:
    """Heaviest path by node weights (e.g. op times): ``(total weight, nodes in order)``.

    Weights must be finite and non-negative. With 0 nodes the answer is ``(0.0, [])``.
    """
    n = _check_num_nodes(num_nodes)
    edge_list = _check_edges(n, edges)
    if len(weights) != n:
        raise ValueError(f"weights: expected {n} values (one per node), got {len(weights)}")
    w = [float(x) for x in weights]
    bad = [k for k, x in enumerate(w) if not (math.isfinite(x) and x >= 0)]
    if bad:
        raise ValueError(f"weights must be finite and >= 0; node {bad[0]} has {weights[bad[0]]!r}")
    if n == 0:
        return 0.0, []
    parents: list[list[int]] = [[] for _ in range(n)]
    for u, v in edge_list:
        parents[v].append(u)
    best = [0.0] * n  # heaviest path ending at node k
    prev = [-1] * n
    for v in range(n):
        for u in parents[v]:
            if prev[v] == -1 or best[u] > best[prev[v]]:
                prev[v] = u
        best[v] = w[v] + (best[prev[v]] if prev[v] >= 0 else 0.0)
    end = max(range(n), key=lambda k: best[k])
    path = [end]
    while prev[path[-1]] >= 0:
        path.append(prev[path[-1]])
    return best[end], path[::-1]


# ----------------------------------------------------------------------------------------
# the assignment
# ----------------------------------------------------------------------------------------

def _follow(num_items: int, next_of: np.ndarray) -> list[list[int]]:
    """Split ``0..num_items-1`` into paths along ``next_of`` (-1 = end of path)."""
    has_prev = np.zeros(num_items, dtype=bool)
    has_prev[next_of[next_of >= 0]] = True
    paths = []
    for start in np.flatnonzero(~has_prev):
        path = [int(start)]
        while next_of[path[-1]] >= 0:
            path.append(int(next_of[path[-1]]))
        paths.append(path)
    return paths


def _merge_chains(num_nodes: int, chains: list[list[int]], reach: list[int]) -> list[list[int]]:
    """Second matching: chain A -> chain B when end(A) reaches start(B); concatenate matched runs."""
    chain_of_start = np.full(num_nodes, -1, dtype=np.int64)
    for i, chain in enumerate(chains):
        chain_of_start[chain[0]] = i
    rows = []
    for chain in chains:
        later = chain_of_start[_bits_to_array(reach[chain[-1]], num_nodes)]
        rows.append(later[later >= 0])
    runs = _follow(len(chains), _matching(rows, len(chains)))
    return [[node for i in run for node in chains[i]] for run in runs]


def assign_streams(num_nodes: int, edges: Iterable[Edge], *, merge: bool = True) -> StreamPlan:
    """Nimble's stream assignment for a DAG whose nodes are numbered in execution order.

    ``edges`` are ``(u, v)`` pairs with ``u < v``; duplicates are ignored. With ``merge=True``
    chains are merged into fewer streams (same concurrency, same syncs). Returns a
    :class:`StreamPlan`.
    """
    n = _check_num_nodes(num_nodes)
    kids = _children(n, _check_edges(n, edges))
    reach = _reach(n, kids)
    meg = _reduce(n, kids, reach)

    meg_kids = _children(n, meg)
    match = _matching([np.asarray(k, dtype=np.int64) for k in meg_kids], n)
    chains = sorted(_follow(n, match), key=lambda c: c[0])

    streams = _merge_chains(n, chains, reach) if merge else chains
    streams.sort(key=lambda s: s[0])  # stream 0 holds node 0
    stream_of = [0] * n
    for s, nodes in enumerate(streams):
        for node in nodes:
            stream_of[node] = s
    syncs = [(u, v) for u, v in meg if stream_of[u] != stream_of[v]]
    return StreamPlan(stream_of=stream_of, syncs=syncs, num_streams=len(streams),
                      chains=chains, meg_edges=meg)


def critical_streams(plan: StreamPlan, edges: Iterable[Edge], weights: Sequence[float]) -> set[int]:
    """The streams that run at least one op of the heaviest path (by ``weights``).

    Giving them a higher CUDA stream priority lets the GPU schedule the critical path's
    thread blocks first when concurrent kernels compete for SMs.
    """
    _, path = critical_path(len(plan.stream_of), edges, weights)
    return {plan.stream_of[k] for k in path}


def single_stream_plan(num_nodes: int) -> StreamPlan:
    """Every op on stream 0 in index order: the single-stream ablation's plan."""
    return StreamPlan(stream_of=[0] * num_nodes, syncs=[], num_streams=1,
                      chains=[list(range(num_nodes))], meg_edges=[])
