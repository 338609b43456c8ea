"""The stream analysis job (experiments/analysis.py)."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from torch import nn

from experiments import analysis, models
from experiments.models import ModelSpec
from nimble.graph import OpNode, TaskGraph

REQUIRED = [
    "model", "ops", "edges", "meg_edges", "streams", "syncs", "width", "critical_path_flop_share",
    "chains_before_merge", "total_gflops", "live_peak_mb", "arena_one_stream_mb", "arena_plan_mb",
    "trace_s", "plan_s", "status", "error",
    "torch", "torchvision", "timm", "commit", "date",
]


class ThreeBranches(nn.Module):
    """A stem conv feeding three independent convs, concatenated: width 3."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.branches = nn.ModuleList(nn.Conv2d(4, 4, k, padding=k // 2) for k in (1, 3, 5))

    def forward(self, x):
        x = self.stem(x)
        return torch.cat([b(x) for b in self.branches], dim=1)


class Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("this model is broken\non purpose")


def _register(monkeypatch, name, build):
    monkeypatch.setitem(models.MODELS, name, ModelSpec(name=name, build=lambda num_classes=1000: build(),
                                                       image_size=16, source="test", in_paper=False))


def test_analyze_graph_on_a_hand_built_diamond():
    # 0 -> {1, 2} -> 3, plus a redundant edge 0 -> 3; node 1 carries most FLOPs.
    flops = [10, 100, 1, 10]
    graph = TaskGraph(nodes=[OpNode(index=k, name=f"op{k}", flops=f) for k, f in enumerate(flops)],
                      edges=[(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)])
    row = analysis.analyze_graph(graph)
    assert row["ops"] == 4 and row["edges"] == 5 and row["meg_edges"] == 4
    assert row["streams"] == row["width"] == 2
    assert row["syncs"] == 2  # fork to and join from the side stream
    assert row["critical_path_flop_share"] == pytest.approx(120 / 121)
    assert row["longest_path_op_share"] == pytest.approx(3 / 4)
    assert row["live_peak_mb"] == row["arena_plan_mb"] == 0   # no storages recorded
    empty = analysis.analyze_graph(TaskGraph(nodes=[OpNode(index=0, name="op")], edges=[]))
    assert math.isnan(empty["critical_path_flop_share"])


def test_run_analysis_writes_csv_and_markdown(tmp_path, monkeypatch):
    _register(monkeypatch, "three_branches", ThreeBranches)
    _register(monkeypatch, "broken", Broken)
    df = analysis.run_analysis(["mobilenet_v2", "three_branches", "broken"], tmp_path)

    csv = pd.read_csv(tmp_path / "streams.csv", keep_default_na=False)
    assert set(REQUIRED) <= set(csv.columns)
    assert list(csv["model"]) == ["mobilenet_v2", "three_branches", "broken"]
    assert list(df["status"]) == ["ok", "ok", "error"]
    ok = df[df["status"] == "ok"].set_index("model")

    mb = ok.loc["mobilenet_v2"]
    assert mb["streams"] == 1 and mb["width"] == 1 and mb["syncs"] == 0  # a pure op chain
    assert mb["critical_path_flop_share"] == pytest.approx(1.0)
    assert mb["ops"] > 100 and mb["edges"] >= mb["meg_edges"] >= mb["ops"] - 1
    assert 0.2 < mb["total_gflops"] < 1.0  # ~0.3 G multiply-adds at 224x224
    # one stream: the arena is the one-stream arena (test_memplan has the branchy cases)
    assert mb["live_peak_mb"] > 0 and mb["arena_plan_mb"] == mb["arena_one_stream_mb"]

    tb = ok.loc["three_branches"]
    assert tb["streams"] == tb["width"] == 3
    assert tb["syncs"] >= 4  # fork to two side streams, join back from both
    assert 0 < tb["critical_path_flop_share"] < 1
    assert 0 < tb["live_peak_mb"] <= tb["arena_one_stream_mb"] <= tb["arena_plan_mb"]
    # Nimble's assignment reaches maximum logical concurrency with exactly `width` streams.
    assert (ok["streams"] == ok["width"]).all()

    broken = df[df["model"] == "broken"].iloc[0]
    assert "RuntimeError: this model is broken on purpose" in broken["error"]
    assert "\n" not in broken["error"]
    assert csv["torch"].iloc[0] == torch.__version__

    md = (tmp_path / "streams.md").read_text()
    assert "| mobilenet_v2" in md and "| broken" in md and "§8.4" in md
    assert "ATen ops, not TorchScript nodes" in md


def test_unknown_names_fail_before_any_work(tmp_path):
    with pytest.raises(KeyError, match="valid names"):
        analysis.run_analysis(["mobilenet_v2", "no_such_net"], tmp_path)
    assert not (tmp_path / "streams.csv").exists()
    with pytest.raises(SystemExit):
        analysis.main(["--models", "no_such_net", "--out", str(tmp_path)])


def test_build_failure_is_an_error_row():
    def fail():
        raise ImportError("missing dependency")

    row = analysis.analyze_module("needs_something", fail, lambda: torch.randn(1, 3, 8, 8))
    assert row["status"] == "error" and row["error"] == "ImportError: missing dependency"


def test_darts_needs_several_streams():
    row = analysis.analyze_model("darts")
    assert row["status"] == "ok", row["error"]
    assert row["streams"] > 1
    assert row["streams"] == row["width"]
    assert row["critical_path_flop_share"] < 0.8
