"""A memory plan as plain data: what to copy, drop and recompute, after which op.

The planner (:mod:`tensile.planner`) makes a :class:`Plan`, the simulator
(:mod:`tensile.simulate`) replays it on a timeline, the runtime (:mod:`tensile.runtime`)
executes it. Ops are indices into the traced iteration; times are on the planner's
simulated timeline (ms from the iteration start) and only say where the copies were
placed on their channel: the runtime anchors every action to op boundaries.

Semantics of one :class:`Swap` of a transient tensor (an activation saved for
backward): the device→host copy is issued after ``out_issue_op``; the device copy is
dropped after ``release_after_op``; the host→device copy is issued after
``in_issue_op``; op ``use_op`` is the first that reads it back (its backward access, or
a rebuild that reads it). A
*cross-iteration* swap (parameter or optimizer state) is copied out after its last
update, dropped at the end of the step, and copied back in the next iteration
(``in_issue_op`` then counts ops of the next iteration; ``-1`` = at its start). Its
copy-out may run past the iteration end (``out_end_ms`` > the iteration's length): its
memory is then free only from the first op of the next iteration after the copy ends.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Swap", "Recompute", "Plan"]


@dataclass
class Swap:
    """A device→host copy and the later host→device copy of one tensor."""

    sid: int
    nbytes: int
    cross_iteration: bool
    out_issue_op: int
    out_start_ms: float
    out_end_ms: float
    release_after_op: int
    in_issue_op: int
    in_start_ms: float
    in_end_ms: float
    use_op: int


@dataclass
class Recompute:
    """Drop a tensor after ``release_after_op``; rerun ``producer_op`` before ``before_op``,
    then the in-place ops ``then_ops`` that updated the tensor after it was produced (a
    batch norm's output that ``ReLU(inplace=True)`` overwrote, a residual ``add_``).

    ``sources`` are the storages these ops read; the plan keeps them resident and
    unmodified until ``before_op``. ``scratch`` are storages the producer also writes
    (a batch norm's running statistics in training mode): the rerun writes them in
    scratch copies, so the step's real ones are updated once, as without the plan.
    ``transient`` are recomputed tensors that this rebuild reads but that are not back
    yet (their own ``before_op`` is later): they are rebuilt for it and dropped again
    right after (present, for the memory count, during ``before_op``). ``cost_ms`` is
    the time of all rerun ops, theirs included. ``kept`` are sources that the step no
    longer reads after their forward use (a DenseNet layer's new features, read only by
    the concatenations after it): the plan keeps them from their last read until this
    recompute runs, which needs them (by ``before_op``; the runtime's recipe holds them).
    ``issue_op``: rebuild ahead of need, on a side stream, right after this op (from then
    on the tensor is resident again, for the memory count), so that the rerun overlaps the
    compute stream's work up to ``before_op`` (``tensile.planner.plan(rebuild_ahead=...)``);
    None: when backward first needs it, on the compute stream.
    """

    sid: int
    nbytes: int
    producer_op: int
    release_after_op: int
    before_op: int
    cost_ms: float
    sources: list[int] = field(default_factory=list)
    then_ops: list[int] = field(default_factory=list)
    scratch: list[int] = field(default_factory=list)
    transient: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    issue_op: int | None = None


@dataclass
class Plan:
    """The planner's answer for one iteration of ``num_ops`` ops.

    ``peak_before``/``peak_after`` are simulated resident bytes without/with the plan,
    ``feasible`` says whether ``peak_after <= budget_bytes`` (always True without a
    budget), ``est_overhead_ms`` the simulated extra time (recomputation; planned swaps
    are hidden behind compute by construction), ``planner_ms`` the planner's wall time.
    """

    num_ops: int
    budget_bytes: int | None
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    swaps: list[Swap] = field(default_factory=list)
    recomputes: list[Recompute] = field(default_factory=list)
    peak_before: int = 0
    peak_after: int = 0
    feasible: bool = True
    est_overhead_ms: float = 0.0
    iteration_ms: float = 0.0
    planner_ms: float = 0.0

    # ------------------------------------------------------------------ views
    @property
    def host_bytes(self) -> int:
        """Pinned host memory the runtime needs: one region per swapped tensor."""
        return sum(s.nbytes for s in self.swaps)

    @property
    def chained_recomputes(self) -> dict[str, int]:
        """How many recomputes rerun in-place updates too (``in_place``), rebuild a dropped
        input first (``rebuild_first``; ``transient``: for themselves alone), rerun a batch
        norm on scratch statistics (``scratch``), or are rebuilt ahead of need on a side
        stream (``ahead``)."""
        rebuilt = {r.sid for r in self.recomputes}
        return {"in_place": sum(bool(r.then_ops) for r in self.recomputes),
                "ahead": sum(r.issue_op is not None for r in self.recomputes),
                "rebuild_first": sum(bool(set(r.sources) & rebuilt) for r in self.recomputes),
                "transient": sum(bool(r.transient) for r in self.recomputes),
                "scratch": sum(bool(r.scratch) for r in self.recomputes)}

    @property
    def bytes_moved(self) -> int:
        """Bytes copied per iteration, both directions together."""
        return 2 * self.host_bytes

    def same_actions(self, other: "Plan") -> bool:
        """Whether a step under ``other`` does just what it does under this plan: the same
        copies, releases and recomputes (sources, kept and scratch storages included) at the
        same ops, in the same order. Only the planner's times and estimates may differ, so a
        CUDA graph captured with one plan serves the other."""
        def swaps(p: Plan) -> list[tuple]:
            return sorted((s.sid, s.nbytes, s.cross_iteration, s.out_issue_op, s.release_after_op,
                           s.in_issue_op, s.use_op) for s in p.swaps)

        def recomputes(p: Plan) -> list[tuple]:
            return sorted((r.sid, r.nbytes, r.producer_op, r.release_after_op, r.before_op,
                           tuple(r.sources), tuple(r.then_ops), tuple(r.scratch),
                           tuple(r.transient), tuple(r.kept), r.issue_op) for r in p.recomputes)

        return (self.num_ops == other.num_ops and swaps(self) == swaps(other)
                and recomputes(self) == recomputes(other) and self.actions() == other.actions())

    def actions(self) -> dict[int, list[str]]:
        """Per op, what happens around it, in the order the runtime does it.

        Key ``-1`` is the iteration start. Entries read ``"after: swap_out 12"``,
        ``"after: release 12"``, ``"after: swap_in 12 (for op 80)"``,
        ``"before: recompute 7 (op 3, 4)"`` (the ops rerun).
        """
        acts: dict[int, list[tuple[int, float, str]]] = defaultdict(list)
        for r in self.recomputes:
            ops = ", ".join(map(str, [r.producer_op, *r.then_ops]))
            also = f"; rebuilding {', '.join(map(str, r.transient))} for it" if r.transient else ""
            if r.issue_op is None:
                acts[r.before_op].append((0, 0.0, f"before: recompute {r.sid} (op {ops}{also})"))
            else:
                acts[r.issue_op].append((4, 0.0, f"after: recompute {r.sid} ahead, on a side "
                                                 f"stream (op {ops}; for op {r.before_op})"))
            acts[r.release_after_op].append((2, 0.0, f"after: release {r.sid}"))
        for s in self.swaps:
            tag = " [next iteration]" if s.cross_iteration else ""
            acts[s.out_issue_op].append((1, s.out_start_ms, f"after: swap_out {s.sid}"))
            acts[s.release_after_op].append((2, 0.0, f"after: release {s.sid}"))
            acts[s.in_issue_op].append(
                (3, s.in_start_ms, f"after: swap_in {s.sid} (for op {s.use_op}){tag}"))
        return {k: [a for _, _, a in sorted(v)] for k, v in sorted(acts.items())}

    def summary(self) -> str:
        """A few lines: peaks, budget, counts, overhead."""
        mib = 1 << 20
        saved = 1 - self.peak_after / self.peak_before if self.peak_before else 0.0
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / mib:.1f} MiB"
        cross = sum(s.cross_iteration for s in self.swaps)
        return (
            f"TENSILE plan over {self.num_ops} ops ({self.iteration_ms:.2f} ms simulated)\n"
            f"  peak {self.peak_before / mib:.1f} MiB -> {self.peak_after / mib:.1f} MiB "
            f"(-{100 * saved:.1f} %), budget {budget}, feasible {self.feasible}\n"
            f"  swaps {len(self.swaps)} ({cross} across iterations, "
            f"{self.host_bytes / mib:.1f} MiB each way), recomputes {len(self.recomputes)}"
            f"{self._chains_text()}\n"
            f"  est. overhead {self.est_overhead_ms:.3f} ms, planner {self.planner_ms:.1f} ms"
        )

    def _chains_text(self) -> str:
        c = self.chained_recomputes
        if not any(c.values()):
            return ""
        return (f" ({c['in_place']} with in-place updates, {c['rebuild_first']} rebuilding an "
                f"input first, {c['transient']} of them for themselves alone, {c['scratch']} "
                f"batch norms on scratch statistics, {c['ahead']} rebuilt ahead)")

    def __str__(self) -> str:
        lines = [self.summary()]
        for k, acts in self.actions().items():
            where = "start" if k < 0 else f"op {k}"
            lines.extend(f"  {where}: {a}" for a in acts)
        return "\n".join(lines)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        expected = set(cls.__dataclass_fields__)
        if set(data) != expected:
            raise ValueError(f"not a TENSILE plan: keys {sorted(set(data) ^ expected)} "
                             "are missing or unexpected")
        data["swaps"] = [Swap(**s) for s in data["swaps"]]
        data["recomputes"] = [Recompute(**r) for r in data["recomputes"]]
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())
