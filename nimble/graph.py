"""The task graph: one node per ATen op of one real run, edges from storage dependencies.

The graph is plain data. It is produced by :mod:`nimble.trace`, consumed by the stream
planner (:mod:`nimble.streams`), the race detector (:mod:`nimble.racecheck`), the
capture (:mod:`nimble.capture`) and TENSILE's access timeline. Node ``k`` is the k-th
GPU-task-producing ATen op of the run, in execution order, so every edge ``(u, v)`` has
``u < v``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import networkx as nx

__all__ = ["OpNode", "TaskGraph"]

Shape = tuple[int, ...]


@dataclass
class OpNode:
    """One ATen op call.

    ``reads`` and ``writes`` are storage ids (small integers, unique within one trace):
    views and in-place ops name their base storage, so aliasing is explicit.
    ``storage_bytes`` maps each storage id the op touches to its size in bytes.
    ``phase`` is ``"forward"``, ``"backward"`` or ``"optimizer"`` (``"loss"`` for the
    loss computation of a training trace).
    """

    index: int
    name: str
    input_shapes: list[Shape] = field(default_factory=list)
    input_dtypes: list[str] = field(default_factory=list)
    output_shapes: list[Shape] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0
    flops: int = 0
    reads: list[int] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)
    storage_bytes: dict[int, int] = field(default_factory=dict)
    phase: str = "forward"
    host_sync: bool = False

    def signature(self) -> tuple:
        """What must be identical between two runs of a static model."""
        return (self.name, tuple(self.input_shapes), tuple(self.input_dtypes))


@dataclass
class TaskGraph:
    """Nodes in execution order plus dependency edges ``(u, v)`` with ``u < v``.

    ``inputs`` are the storage ids of the example inputs, ``params`` those of parameters
    and buffers, ``outputs`` those of the module's outputs. ``num_view_ops`` counts the
    metadata-only ops (views, detach, ...) that were seen but launch no GPU task;
    ``raw_ops`` has one entry per op seen, in order: its node index, or -1 for such ops.
    """

    nodes: list[OpNode]
    edges: list[tuple[int, int]]
    inputs: list[int] = field(default_factory=list)
    params: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    num_view_ops: int = 0
    device: str = "cpu"
    raw_ops: list[int] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def to_networkx(self) -> nx.DiGraph:
        """A ``networkx.DiGraph`` with node attribute ``op`` (the :class:`OpNode`)."""
        g = nx.DiGraph()
        g.add_nodes_from((n.index, {"op": n}) for n in self.nodes)
        g.add_edges_from(self.edges)
        return g

    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def save(self, path: str | Path) -> None:
        """Write the graph as JSON (nodes, edges, storage roles)."""
        data = asdict(self)
        for n in data["nodes"]:
            n["storage_bytes"] = {str(k): v for k, v in n["storage_bytes"].items()}
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> "TaskGraph":
        data = json.loads(Path(path).read_text())
        nodes = []
        for n in data.pop("nodes"):
            n["storage_bytes"] = {int(k): v for k, v in n["storage_bytes"].items()}
            for key in ("input_shapes", "output_shapes"):
                n[key] = [tuple(s) for s in n[key]]
            nodes.append(OpNode(**n))
        edges = [tuple(e) for e in data.pop("edges")]
        return cls(nodes=nodes, edges=edges, **data)
