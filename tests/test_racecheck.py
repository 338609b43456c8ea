"""The CPU race detector: real plans are race-free, broken ones are reported."""
from __future__ import annotations

import itertools
import random

import pytest

from nimble.graph import OpNode, TaskGraph
from nimble.racecheck import (
    Race,
    RaceError,
    check_schedule,
    find_races,
    static_races,
    storage_dependencies,
)
from nimble.streams import assign_streams


def conflict_edges(ops: list[tuple[list[int], list[int]]]) -> list[tuple[int, int]]:
    """All (u, v), u < v, that touch a common storage with at least one write (the test's oracle)."""
    edges = []
    for (u, (ru, wu)), (v, (rv, wv)) in itertools.combinations(enumerate(ops), 2):
        if set(wu) & (set(rv) | set(wv)) or set(ru) & set(wv):
            edges.append((u, v))
    return edges


def make_graph(ops: list[tuple[str, list[int], list[int]]]) -> TaskGraph:
    """Nodes from (name, reads, writes); edges from storage conflicts."""
    nodes = [OpNode(index=k, name=name, reads=list(r), writes=list(w))
             for k, (name, r, w) in enumerate(ops)]
    return TaskGraph(nodes=nodes, edges=conflict_edges([(r, w) for _, r, w in ops]))


def inception_graph() -> TaskGraph:
    """Stem, four branches of different lengths, concat, in-place ReLU, and a buffer reuse."""
    return make_graph([
        ("stem", [0], [1]),          # 0
        ("b1_conv", [1], [2]),       # 1
        ("b2_conv_a", [1], [3]),     # 2
        ("b2_conv_b", [3], [4]),     # 3
        ("b3_conv_a", [1], [5]),     # 4
        ("b3_conv_b", [5], [6]),     # 5
        ("b3_conv_c", [6], [7]),     # 6
        ("b4_pool", [1], [8]),       # 7
        ("concat", [2, 4, 7, 8], [9]),  # 8
        ("relu_", [9], [9]),         # 9  in place
        ("reuse_3", [0], [3]),       # 10 overwrites b2's temporary: must wait for its reader
        ("head", [9, 3], [10]),      # 11
    ])


def plan_of(graph: TaskGraph):
    return assign_streams(graph.num_nodes, graph.edges)


# ---------------------------------------------------------------------------------------------


def test_storage_dependencies_on_a_small_program():
    g = make_graph([
        ("w0", [], [0]),       # 0
        ("r0", [0], [1]),      # 1 reads 0 after 0 wrote it
        ("r0b", [0], [2]),     # 2
        ("inplace", [0], [0]),  # 3 overwrites 0: after readers 1, 2 (its own read covers WAW)
        ("w0again", [], [0]),  # 4 write-after-write on 3 (which also covers 3's own read)
    ])
    assert sorted(storage_dependencies(g)) == sorted([
        (0, 1, "read-before-write", 0),
        (0, 2, "read-before-write", 0),
        (0, 3, "read-before-write", 0),
        (1, 3, "write-after-read", 0),
        (2, 3, "write-after-read", 0),
        (3, 4, "write-after-write", 0),
    ])


def test_nimble_plan_is_race_free():
    g = inception_graph()
    plan = plan_of(g)
    assert plan.num_streams == 4
    assert find_races(g, plan.stream_of, plan.syncs, trials=300) == []
    assert static_races(g, plan.stream_of, plan.syncs) == []
    check_schedule(g, plan.stream_of, plan.syncs)


def test_one_stream_is_race_free():
    g = inception_graph()
    assert find_races(g, [0] * g.num_nodes, []) == []
    assert static_races(g, [0] * g.num_nodes, []) == []


def test_each_removed_sync_is_reported():
    g = inception_graph()
    plan = plan_of(g)
    assert len(plan.syncs) == 7  # 3 forks, 3 joins, and reuse_3 waiting for b2_conv_b
    for drop, (u, v) in enumerate(plan.syncs):
        syncs = plan.syncs[:drop] + plan.syncs[drop + 1:]
        races = find_races(g, plan.stream_of, syncs, trials=200)
        assert any(r.op == v and r.other == u for r in races), (u, v, races)
        assert all(r.trial >= 0 for r in races)
        static = static_races(g, plan.stream_of, syncs)
        assert any(r.op == v and r.other == u and r.trial == -1 for r in static)
        with pytest.raises(RaceError, match=f"op {v} \\({g.nodes[v].name}\\)") as err:
            check_schedule(g, plan.stream_of, syncs)
        assert err.value.races


def test_all_streams_no_syncs_reports_each_kind():
    g = inception_graph()
    races = find_races(g, list(range(g.num_nodes)), [], trials=200)
    kinds = {r.kind for r in races}
    assert kinds == {"read-before-write", "write-after-read", "write-after-write"}
    war = [r for r in races if r.kind == "write-after-read"]
    assert any(r.op == 10 and r.other == 3 and r.storage == 3 for r in war)
    waw = [r for r in races if r.kind == "write-after-write"]
    assert [(r.op, r.other, r.storage) for r in waw] == [(10, 2, 3)]
    # duplicates are merged: one report per (kind, op, other, storage)
    keys = [(r.kind, r.op, r.other, r.storage) for r in races]
    assert len(keys) == len(set(keys))


def test_write_after_write_is_reported():
    g = make_graph([("w", [], [0]), ("w_again", [], [0])])
    races = find_races(g, [0, 1], [], trials=200)
    assert [(r.kind, r.op, r.other, r.storage) for r in races] == [("write-after-write", 1, 0, 0)]


def test_wrong_graph_is_caught():
    # The graph forgot that op 1 reads what op 0 wrote, so the planner calls them independent.
    ops = [("producer", [], [0]), ("consumer", [0], [1]), ("other", [5], [2])]
    g = make_graph(ops)
    g.edges = []
    plan = plan_of(g)
    assert plan.stream_of[0] != plan.stream_of[1] and plan.syncs == []
    races = find_races(g, plan.stream_of, plan.syncs)
    assert [(r.kind, r.op, r.other, r.storage) for r in races] == [("read-before-write", 1, 0, 0)]


def test_race_str_is_readable():
    r = Race("read-before-write", 8, 3, 4, 17, "concat", "b2_conv_b")
    assert str(r) == ("read-before-write: op 8 (concat) read storage 4 before its writer "
                      "op 3 (b2_conv_b) finished [trial 17]")
    assert "static check" in str(Race("write-after-read", 10, 2, 3, -1))


def random_program(rng: random.Random, n: int) -> TaskGraph:
    """Ops that read 1-3 live storages and write a fresh, a reused or an input storage."""
    live, fresh = [0, 1], 2
    ops = []
    for k in range(n):
        reads = rng.sample(live, min(len(live), rng.randint(1, 3)))
        roll = rng.random()
        if roll < 0.6:
            writes = [fresh]
            live.append(fresh)
            fresh += 1
        elif roll < 0.8:
            writes = [reads[0]]  # in place
        else:
            writes = [rng.choice(live)]  # buffer reuse
        ops.append((f"op{k}", reads, writes))
    return make_graph(ops)


def test_random_programs_real_plan_is_race_free():
    rng = random.Random(7)
    for _ in range(150):
        g = random_program(rng, rng.randint(1, 40))
        plan = plan_of(g)
        assert static_races(g, plan.stream_of, plan.syncs) == []
        assert find_races(g, plan.stream_of, plan.syncs, trials=30, seed=rng.randint(0, 99)) == []


def test_simulation_agrees_with_static_check_on_broken_schedules():
    """Random stream assignments with random missing syncs: the simulator never reports a race the
    static (exact, worst-case) check rules out, and finds most of the ones it predicts."""
    rng = random.Random(11)
    predicted = found = 0
    for _ in range(150):
        g = random_program(rng, rng.randint(2, 25))
        plan = plan_of(g)
        stream_of = [rng.randrange(4) for _ in range(g.num_nodes)]
        syncs = [e for e in g.edges if rng.random() < 0.7]
        key = lambda r: (r.kind, r.op, r.other, r.storage)  # noqa: E731
        static = {key(r) for r in static_races(g, stream_of, syncs)}
        simulated = {key(r) for r in find_races(g, stream_of, syncs, trials=200, seed=1)}
        assert simulated <= static
        predicted += len(static)
        found += len(simulated)
        # the real plan stays clean
        assert find_races(g, plan.stream_of, plan.syncs, trials=20) == []
    assert predicted > 100
    assert found >= 0.9 * predicted, (found, predicted)


@pytest.mark.parametrize(
    "stream_of, syncs, match",
    [
        ([0, 0], [], "expected 3 entries"),
        ([0, -1, 0], [], "stream_of\\[1\\]"),
        ([0, 0, 0], [(2, 1)], "u < v"),
        ([0, 0, 0], [(0, 7)], "num_nodes=3"),
    ],
)
def test_bad_schedule_is_rejected(stream_of, syncs, match):
    g = make_graph([("a", [], [0]), ("b", [0], [1]), ("c", [1], [2])])
    with pytest.raises(ValueError, match=match):
        find_races(g, stream_of, syncs)
    with pytest.raises(ValueError, match=match):
        static_races(g, stream_of, syncs)


def test_bad_trials_is_rejected():
    g = make_graph([("a", [], [0])])
    with pytest.raises(ValueError, match="trials"):
        find_races(g, [0], [], trials=0)
