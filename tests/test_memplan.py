"""The arena analysis (nimble/memplan.py) on hand-made graphs: chains, branches, syncs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from nimble.graph import OpNode, TaskGraph
from nimble.memplan import (HappensBefore, arena_bytes, interleaved_peak, lifetimes, live_peak,
                            round_robin_order)
from nimble.streams import StreamPlan, assign_streams, single_stream_plan

MB = 2 ** 20


def graph(ops, edges, inputs=(0,), outputs=()):
    """``ops``: per op (reads, writes); every storage is 1 MiB unless named in ``big``."""
    nodes = []
    for k, (reads, writes) in enumerate(ops):
        nodes.append(OpNode(index=k, name=f"op{k}", reads=list(reads), writes=list(writes),
                            storage_bytes={s: MB for s in [*reads, *writes]}))
    return TaskGraph(nodes=nodes, edges=edges, inputs=list(inputs), outputs=list(outputs))


def one_stream(n):
    return single_stream_plan(n)


def test_a_chain_reuses_memory_every_other_op():
    # x(0) -> a(1) -> b(2) -> c(3) -> d(4): each op reads one tensor and writes the next
    g = graph([([0], [1]), ([1], [2]), ([2], [3]), ([3], [4])], [(0, 1), (1, 2), (2, 3)],
              outputs=[4])
    ts = lifetimes(g)
    assert [t.sid for t in ts] == [1, 2, 3, 4] and ts[-1].last == 3
    assert live_peak(ts, g.num_nodes) == 2 * MB
    assert arena_bytes(ts, HappensBefore(g.num_nodes, one_stream(4))) == 2 * MB


def branches(plan_streams):
    """Two branches of two ops from input 0, joined by op 4. Streams per op given."""
    ops = [([0], [1]), ([1], [2]),      # branch A: 0 -> 1 -> 2
           ([0], [3]), ([3], [4]),      # branch B: 0 -> 3 -> 4
           ([2, 4], [5])]               # join
    edges = [(0, 1), (2, 3), (1, 4), (3, 4)]
    g = graph(ops, edges, outputs=[5])
    syncs = [(u, v) for u, v in edges if plan_streams[u] != plan_streams[v]]
    plan = StreamPlan(stream_of=plan_streams, syncs=syncs, num_streams=max(plan_streams) + 1,
                      chains=[], meg_edges=edges)
    return g, plan


def test_concurrent_branches_cannot_share_what_one_stream_can():
    g, two = branches([0, 0, 1, 1, 0])
    ts = lifetimes(g)
    one = arena_bytes(ts, HappensBefore(g.num_nodes, one_stream(5)))
    both = arena_bytes(ts, HappensBefore(g.num_nodes, two))
    # In program order tensor 1 is dead before branch B starts; on two streams it is not.
    assert one == live_peak(ts, g.num_nodes) == 3 * MB
    assert both == 4 * MB


def test_happens_before_follows_streams_and_syncs_transitively():
    g, plan = branches([0, 0, 1, 1, 0])
    hb = HappensBefore(g.num_nodes, plan)
    assert hb.ordered(0, 1) and hb.ordered(3, 4) and hb.ordered(2, 4)  # stream order, sync
    assert not hb.ordered(1, 2) and not hb.ordered(2, 1)               # concurrent branches
    assert not hb.ordered(4, 4) and not hb.ordered(4, 0)


def test_a_read_on_another_stream_keeps_a_tensor_alive():
    # t1 written by op 0 (stream 0), read by op 1 (stream 1) and op 2 (stream 0); op 3 on
    # stream 0 writes t3 after op 2 but is not ordered after op 1: t1 and t3 may not share.
    ops = [([0], [1]), ([1], [2]), ([1], [5]), ([5], [3])]
    edges = [(0, 1), (0, 2), (2, 3)]
    g = graph(ops, edges, outputs=[2, 3])
    plan = StreamPlan(stream_of=[0, 1, 0, 0], syncs=[(0, 1)], num_streams=2, chains=[],
                      meg_edges=edges)
    ts = {t.sid: t for t in lifetimes(g)}
    assert ts[1].uses == (0, 1, 2) and ts[1].last == 2
    hb = HappensBefore(g.num_nodes, plan)
    assert hb.ordered(2, 3) and not hb.ordered(1, 3)
    sized = arena_bytes(list(ts.values()), hb)
    assert sized == 4 * MB   # t1, t2 (output), t5, t3 (output) all overlap somewhere


def test_on_a_traced_model_one_stream_matches_the_live_peak_and_the_plan_needs_more():
    from nimble.trace import trace_graph

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(4))

        def forward(self, x):
            return sum(c(x).relu() for c in self.convs)

    g = trace_graph(Branchy().eval(), (torch.randn(1, 4, 32, 32),))
    ts = lifetimes(g)
    plan = assign_streams(g.num_nodes, g.edges)
    assert plan.num_streams == 4
    single = arena_bytes(ts, HappensBefore(g.num_nodes, one_stream(g.num_nodes)))
    multi = arena_bytes(ts, HappensBefore(g.num_nodes, plan))
    assert live_peak(ts, g.num_nodes) <= single < multi
    assert max(live_peak(ts, g.num_nodes), interleaved_peak(ts, plan)) <= multi


def test_round_robin_runs_one_op_per_stream_in_turn_and_bounds_the_arena():
    g, plan = branches([0, 0, 1, 1, 0])
    assert round_robin_order(plan) == [0, 2, 1, 3, 4]     # op 4 waits for op 3 (a sync)
    ts = lifetimes(g)
    bound = interleaved_peak(ts, plan)
    assert bound == 3 * MB <= arena_bytes(ts, HappensBefore(g.num_nodes, plan))


def test_a_cyclic_plan_is_refused():
    plan = StreamPlan(stream_of=[0, 1], syncs=[(1, 0)], num_streams=2, chains=[], meg_edges=[])
    plan.syncs.append((0, 1))
    with pytest.raises(ValueError, match="cycle"):
        round_robin_order(plan)
