"""A CPU race detector for multi-stream schedules: does a stream plan respect the data?

A schedule is ``stream_of`` (node -> stream) plus ``syncs`` (``(u, v)``: an event recorded after
``u`` is waited on before ``v``). On a GPU, ops of one stream run one at a time in order; ops of
different streams overlap arbitrarily unless an event orders them. Nothing else orders them.

The ground truth is the *storages* each node reads and writes, in program order (not
``graph.edges``, so a wrong graph is caught too). Every op ``v`` depends on:

* the last earlier writer of each storage it reads (**read-before-write** if violated: ``v``
  started before that producer finished);
* the readers since the last write of each storage it writes (**write-after-read**: ``v``
  overwrote data a pending reader still needed);
* the last earlier writer of each storage it writes (**write-after-write**).

These direct dependencies imply all others, so checking them is enough.

Two checks:

* :func:`find_races` simulates a GPU: each trial gives every op a random duration (heavy-tailed,
  with a random slowdown per stream) and starts each op as soon as its stream and its event waits
  allow, then reports every dependency whose producer had not finished when the consumer started.
* :func:`static_races` is the worst case: a dependency ``u -> v`` is safe in *every* interleaving
  iff ``u`` happens-before ``v`` (a path of stream-order and sync edges). It is exact and cheap.
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nimble.graph import TaskGraph
from nimble.streams import _check_edges, _is_int, reachability

__all__ = [
    "Race",
    "RaceError",
    "storage_dependencies",
    "find_races",
    "static_races",
    "check_schedule",
]


@dataclass(frozen=True)
class Race:
    """Op ``op`` started before op ``other`` (an earlier op it depends on through ``storage``)
    had finished. ``trial`` is the simulated run that showed it (-1: found by :func:`static_races`).
    """

    kind: str  # "read-before-write" | "write-after-read" | "write-after-write"
    op: int
    other: int
    storage: int
    trial: int
    op_name: str = ""
    other_name: str = ""

    def __str__(self) -> str:
        op = f"op {self.op}" + (f" ({self.op_name})" if self.op_name else "")
        other = f"op {self.other}" + (f" ({self.other_name})" if self.other_name else "")
        where = "static check" if self.trial < 0 else f"trial {self.trial}"
        if self.kind == "read-before-write":
            what = f"{op} read storage {self.storage} before its writer {other} finished"
        elif self.kind == "write-after-read":
            what = f"{op} overwrote storage {self.storage} while earlier reader {other} had not finished"
        else:
            what = f"{op} overwrote storage {self.storage} while earlier writer {other} had not finished"
        return f"{self.kind}: {what} [{where}]"


class RaceError(RuntimeError):
    """Raised by :func:`check_schedule`; ``races`` holds every race found."""

    def __init__(self, races: list[Race], shown: int = 5):
        self.races = races
        lines = [str(r) for r in races[:shown]]
        more = f"\n  ... and {len(races) - shown} more" if len(races) > shown else ""
        super().__init__(f"{len(races)} race(s) in the stream schedule:\n  "
                         + "\n  ".join(lines) + more)


# (before, after, kind, storage): `after` must not start before `before` has finished.
Dependency = tuple[int, int, str, int]


def storage_dependencies(graph: TaskGraph) -> list[Dependency]:
    """Direct dependencies ``(u, v, kind, storage)`` from the nodes' reads/writes in program order."""
    last_writer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}  # readers since the last write
    deps: list[Dependency] = []
    for v, node in enumerate(graph.nodes):
        reads, writes = sorted(set(node.reads)), sorted(set(node.writes))
        for s in reads:
            if s in last_writer:
                deps.append((last_writer[s], v, "read-before-write", s))
        for s in writes:
            deps.extend((u, v, "write-after-read", s) for u in readers.get(s, ()))
            if s in last_writer and s not in reads:  # in-place: the read dependency covers it
                deps.append((last_writer[s], v, "write-after-write", s))
        for s in reads:
            readers.setdefault(s, []).append(v)
        for s in writes:  # v's own read of s is covered: later writers wait for v anyway
            last_writer[s] = v
            readers[s] = []
    return deps


def _check_schedule_args(graph: TaskGraph, stream_of: Sequence[int],
                         syncs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    n = graph.num_nodes
    if len(stream_of) != n:
        raise ValueError(f"stream_of: expected {n} entries (one per node), got {len(stream_of)}")
    for k, s in enumerate(stream_of):
        if not _is_int(s) or s < 0:
            raise ValueError(f"stream_of[{k}] must be a non-negative int, got {s!r}")
    return _check_edges(n, syncs, what="sync")


def _happens_before_edges(stream_of: Sequence[int], syncs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Same-stream consecutive pairs (FIFO order) plus the syncs."""
    last_on: dict[int, int] = {}
    edges = list(syncs)
    for v, s in enumerate(stream_of):
        if s in last_on:
            edges.append((last_on[s], v))
        last_on[s] = v
    return edges


def _race(graph: TaskGraph, dep: Dependency, trial: int) -> Race:
    u, v, kind, s = dep
    return Race(kind, v, u, s, trial, graph.nodes[v].name, graph.nodes[u].name)


def static_races(graph: TaskGraph, stream_of: Sequence[int],
                 syncs: Iterable[tuple[int, int]]) -> list[Race]:
    """Every dependency not ordered by stream order + syncs (i.e. a race in *some* interleaving)."""
    sync_list = _check_schedule_args(graph, stream_of, syncs)
    reach = reachability(graph.num_nodes, _happens_before_edges(stream_of, sync_list))
    return [_race(graph, d, -1) for d in storage_dependencies(graph) if not (reach[d[0]] >> d[1]) & 1]


def find_races(graph: TaskGraph, stream_of: Sequence[int], syncs: Iterable[tuple[int, int]], *,
               trials: int = 200, seed: int = 0) -> list[Race]:
    """Run the schedule ``trials`` times on a simulated multi-stream GPU; report each race once.

    Per trial every stream gets a random slowdown (log-uniform over 1e-2..1e2) and every op a
    random duration and launch delay, so any stream can run far ahead of any other. An op starts
    when the previous op of its stream and every sync source waiting into it have finished.
    Races are deduplicated by ``(kind, op, other, storage)``, keeping the first trial.
    """
    if not _is_int(trials) or trials < 1:
        raise ValueError(f"trials must be a positive int, got {trials!r}")
    sync_list = _check_schedule_args(graph, stream_of, syncs)
    n = graph.num_nodes
    waits: list[list[int]] = [[] for _ in range(n)]
    for u, v in _happens_before_edges(stream_of, sync_list):
        waits[v].append(u)
    deps_of: list[list[Dependency]] = [[] for _ in range(n)]
    for d in storage_dependencies(graph):
        deps_of[d[1]].append(d)

    rng = random.Random(seed)
    streams = sorted(set(stream_of))
    found: dict[tuple, Race] = {}
    for trial in range(trials):
        slow = {s: math.exp(rng.uniform(-4.6, 4.6)) for s in streams}
        start = [0.0] * n
        finish = [0.0] * n
        for v in range(n):  # every wait source has a smaller index: already simulated
            ready = max((finish[u] for u in waits[v]), default=0.0)
            start[v] = ready + rng.random() * rng.random()  # mostly tiny launch delay
            finish[v] = start[v] + slow[stream_of[v]] * rng.expovariate(1.0)
            for d in deps_of[v]:
                if finish[d[0]] > start[v]:
                    key = (d[2], v, d[0], d[3])
                    if key not in found:
                        found[key] = _race(graph, d, trial)
    return sorted(found.values(), key=lambda r: (r.op, r.other, r.storage, r.kind))


def check_schedule(graph: TaskGraph, stream_of: Sequence[int], syncs: Iterable[tuple[int, int]], *,
                   trials: int = 200, seed: int = 0) -> None:
    """Raise :class:`RaceError` if the static check or the simulation finds any race."""
    sync_list = list(syncs)
    races = static_races(graph, stream_of, sync_list)
    races += find_races(graph, stream_of, sync_list, trials=trials, seed=seed)
    if races:
        raise RaceError(races)
