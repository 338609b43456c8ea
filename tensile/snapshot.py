"""What a plan was made from, saved to a file: plan again offline, on any machine.

A plan on a GPU host comes from the step's access timeline with that machine's measured op
times, the budget and the copy bandwidths. :meth:`tensile.Scheduler.snapshot` keeps all
of it with the plan it made; :meth:`PlanningSnapshot.save` writes it as gzipped JSON. On a
laptop, :meth:`PlanningSnapshot.load` and :meth:`PlanningSnapshot.replan` then try another
planner setting (or a changed planner) on exactly the inputs the GPU run had, and
:func:`tensile.bound.extra_time_bound` prices what any plan could cost there, with no GPU::

    snap = PlanningSnapshot.load("snapshot_tensile_resnet50_b16_tensile_graph_….json.gz")
    print(snap.plan.summary())
    print(snap.replan(allow_swaps=False).summary())
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from .plan import Plan
from .planner import plan as make_plan
from .protocol import ProtocolError, timeline_from_wire, timeline_to_wire
from .timeline import AccessTimeline

__all__ = ["PlanningSnapshot"]

_KEYS = {"format", "timeline", "op_ms", "budget_bytes", "d2h_bw", "h2d_bw", "copy_latency_ms",
         "min_bytes", "plan", "meta", "options"}
FORMAT = "tensile-planning-snapshot/1"


@dataclass
class PlanningSnapshot:
    """A planner's inputs (timeline with its op times, budget, bandwidths in bytes/s, copy
    latency, smallest tensor moved) and the plan it made from them. ``options``: the
    options of :func:`tensile.planner.plan` it was made with (``allow_swaps``, ...), or
    None when another planner made it (``Scheduler(planner=...)``: vDNN, Capuchin).
    ``meta``: free-form facts about where it came from (model, batch, GPU, commit)."""

    timeline: AccessTimeline
    budget_bytes: int | None
    d2h_bw: float
    h2d_bw: float
    copy_latency_ms: float
    min_bytes: int
    plan: Plan
    meta: dict
    options: dict | None = None

    def replan(self, **options) -> Plan:
        """Plan again with TENSILE's planner from these inputs and the saved options;
        ``options`` replace them (``allow_swaps``, ``max_overhead``, ``rebuild_ahead``, or a
        ``budget_bytes`` other than the saved one). Without saved options (another planner
        made the plan) the planner's defaults apply, which is said by a ValueError unless
        ``options`` are given."""
        if self.options is None and not options:
            raise ValueError("this plan was made by another planner than TENSILE's (options "
                             "unknown): give replan() the options to plan with")
        kwargs = dict(budget_bytes=self.budget_bytes, d2h_bw=self.d2h_bw, h2d_bw=self.h2d_bw,
                      copy_latency_ms=self.copy_latency_ms, min_bytes=self.min_bytes)
        return make_plan(self.timeline, **{**kwargs, **(self.options or {}), **options})

    def to_dict(self) -> dict:
        return {"format": FORMAT, "timeline": timeline_to_wire(self.timeline),
                "op_ms": [float(x) for x in self.timeline.op_ms],
                "budget_bytes": self.budget_bytes, "d2h_bw": float(self.d2h_bw),
                "h2d_bw": float(self.h2d_bw), "copy_latency_ms": float(self.copy_latency_ms),
                "min_bytes": int(self.min_bytes), "plan": json.loads(self.plan.to_json()),
                "meta": self.meta, "options": self.options}

    @classmethod
    def from_dict(cls, data: dict) -> "PlanningSnapshot":
        if not isinstance(data, dict) or data.get("format") != FORMAT \
                or not _KEYS - {"options"} <= set(data) <= _KEYS:   # files of 2026-12-01: none
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a TENSILE planning snapshot ({FORMAT}): expected keys "
                             f"{sorted(_KEYS)}, got {got}")
        try:
            tl = timeline_from_wire(data["timeline"], data["op_ms"])
        except ProtocolError as e:
            raise ValueError(f"planning snapshot: {e}") from None
        return cls(timeline=tl, budget_bytes=data["budget_bytes"], d2h_bw=data["d2h_bw"],
                   h2d_bw=data["h2d_bw"], copy_latency_ms=data["copy_latency_ms"],
                   min_bytes=data["min_bytes"], plan=Plan.from_json(json.dumps(data["plan"])),
                   meta=data["meta"], options=data.get("options"))

    def save(self, path: str | Path) -> Path:
        """Write gzipped JSON to ``path``; returns it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            json.dump(self.to_dict(), f)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "PlanningSnapshot":
        with gzip.open(path, "rt") as f:
            return cls.from_dict(json.load(f))
