"""TENSILE access timeline: built by hand and from a nimble TaskGraph."""
from __future__ import annotations

import numpy as np
import pytest

from nimble.graph import OpNode, TaskGraph
from tensile.simulate import simulate
from tensile.timeline import AccessTimeline


def _node(k, name, phase, reads, writes, sizes):
    return OpNode(k, name, reads=reads, writes=writes, phase=phase,
                  storage_bytes={s: sizes[s] for s in reads + writes})


def _training_graph() -> TaskGraph:
    """x(0) and w(1) → y(2) → loss(3) → grads → Adam state(4) updated in place."""
    sizes = {0: 64, 1: 32, 2: 128, 3: 4, 4: 32, 5: 128, 6: 32}
    nodes = [
        _node(0, "aten.mm.default", "forward", [0, 1], [2], sizes),
        _node(1, "aten.sum.default", "loss", [2], [3], sizes),
        _node(2, "aten.ones_like.default", "backward", [3], [5], sizes),
        _node(3, "aten.mm.default", "backward", [5, 0], [6], sizes),
        _node(4, "aten.lerp_.Scalar", "optimizer", [6], [4], sizes),   # state: in-place first touch
        _node(5, "aten.add_.Tensor", "optimizer", [1, 4], [1], sizes),
    ]
    return TaskGraph(nodes=nodes, edges=[], inputs=[0], params=[1])


def test_from_graph_roles_and_ranges():
    tl = AccessTimeline.from_graph(_training_graph(), [1.0, 0.5, 0.5, 1.0, 0.25, 0.25])
    roles = {s: t.role for s, t in tl.tensors.items()}
    assert roles == {0: "input", 1: "param", 2: "activation", 3: "activation",
                     4: "opt_state", 5: "activation", 6: "activation"}
    assert tl.vanilla_range(1) == (0, 5) and tl.vanilla_range(2) == (0, 1)
    assert tl.tensors[1].needed_by == 0 and not tl.tensors[1].swappable  # used by op 0
    assert tl.tensors[4].swappable and tl.tensors[4].needed_by == 4
    np.testing.assert_allclose(tl.start, [0, 1, 1.5, 2, 3, 3.25])
    assert tl.iteration_ms == pytest.approx(3.5)
    # the curve counts persistent tensors everywhere, activations from write to last access
    assert tl.vanilla_curve()[0] == 64 + 32 + 32 + 128


def test_backward_gap_only_between_forward_and_backward():
    sizes = {1: 8, 2: 8, 3: 8}
    ops = [("a", "forward", 1, [], [1]), ("b", "forward", 1, [1], [2]),
           ("c", "loss", 1, [2], [3]), ("d", "backward", 1, [3], []),
           ("e", "backward", 1, [1], [])]
    tl = AccessTimeline.from_ops(ops, sizes)
    assert tl.backward_gap(1) == (1, 4) and tl.tensors[1].swappable
    assert tl.backward_gap(2) is None            # never read in backward
    assert tl.backward_gap(3) is None            # read by the very next op: no gap
    tl2 = AccessTimeline.from_ops(ops, sizes, swappable={1: False, 2: True})
    assert not tl2.tensors[1].swappable and not tl2.tensors[2].swappable  # an override cannot
    # make a tensor without a gap movable


def test_with_op_times_keeps_accesses():
    tl = AccessTimeline.from_graph(_training_graph(), [1.0] * 6)
    tl2 = tl.with_op_times([2.0] * 6)
    assert tl2.iteration_ms == pytest.approx(12.0) and tl2.tensors is tl.tensors
    with pytest.raises(ValueError, match="expected 6"):
        tl.with_op_times([1.0])


@pytest.mark.parametrize("ops, sizes, roles, match", [
    ([("a", "forward", 1.0, [1], [])], {1: 4}, {1: "activation"}, "before any op writes it"),
    ([("a", "sideways", 1.0, [], [1])], {1: 4}, None, "phase"),
    ([("a", "forward", 0.0, [], [1])], {1: 4}, None, "positive"),
    ([("a", "forward", 1.0, [], [2])], {1: 4}, None, "no size"),
    ([("a", "forward", 1.0, [], [1])], {1: -4}, None, "non-negative"),
    ([("a", "forward", 1.0, [], [1])], {1: 4}, {1: "weights"}, "role"),
    ([("a", "forward", 1.0)], {}, None, "expected"),
])
def test_bad_timelines_are_rejected_clearly(ops, sizes, roles, match):
    with pytest.raises(ValueError, match=match):
        AccessTimeline.from_ops(ops, sizes, roles)


@pytest.mark.parametrize("share, match", [
    ({6: 0.5}, r"op index in \[0, 1\)"), ({0: -0.5}, "finite share of its time >= 0"),
    ({0: float("nan")}, "finite share"), ({True: 0.5}, "op index"),
    ([0.5], "a mapping of op index"),
])
def test_bad_rerun_shares_are_rejected_clearly(share, match):
    with pytest.raises(ValueError, match=match):
        AccessTimeline.from_ops([("a", "forward", 1.0, [], [1])], {1: 4}, rerun_share=share)


def test_an_ops_scratch_counts_in_every_curve_while_that_op_runs():
    """A workspace (``scratch``) is resident during its op only, in the vanilla curve and in
    the simulator's alike; new op times keep it, ``with_scratch`` replaces it."""
    from tensile.simulate import simulate
    ops = [("a", "forward", 1.0, [], [1]), ("b", "forward", 1.0, [1], [2]),
           ("c", "loss", 1.0, [2], [3])]
    sizes = {1: 4, 2: 4, 3: 4}
    plain = AccessTimeline.from_ops(ops, sizes)
    tl = AccessTimeline.from_ops(ops, sizes, scratch={1: 100, 2: 0})
    assert tl.scratch == {1: 100}                      # zeros are not kept
    np.testing.assert_array_equal(tl.vanilla_curve() - plain.vanilla_curve(), [0, 100, 0])
    np.testing.assert_array_equal(simulate(tl).curve, tl.vanilla_curve())
    assert simulate(tl).peak_op == 1
    assert tl.with_op_times([2.0] * 3).scratch == {1: 100}
    np.testing.assert_array_equal(tl.with_scratch({}).vanilla_curve(), plain.vanilla_curve())


@pytest.mark.parametrize("scratch, match", [
    ({6: 8}, r"op index in \[0, 1\)"), ({0: -8}, "whole number of bytes >= 0"),
    ({0: 1.5}, "whole number of bytes"), ({True: 8}, "op index"), ({0: True}, "whole number"),
    ([8], "a mapping of op index to bytes"),
])
def test_bad_scratch_is_rejected_clearly(scratch, match):
    with pytest.raises(ValueError, match=match):
        AccessTimeline.from_ops([("a", "forward", 1.0, [], [1])], {1: 4}, scratch=scratch)


def test_from_graph_checks_lengths():
    with pytest.raises(ValueError, match="6 nodes"):
        AccessTimeline.from_graph(_training_graph(), [1.0])


def test_from_nimble_trace_if_available():
    trace = pytest.importorskip("nimble.trace", reason="nimble.trace is not written yet")
    import torch
    from torch import nn
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(4, 8)
    graph = trace.trace_graph(model, x, training=True, loss_fn=lambda out: out.sum(), optimizer=opt)
    tl = AccessTimeline.from_graph(graph, [0.1] * graph.num_nodes)
    assert tl.num_ops == graph.num_nodes
    assert {"forward", "backward", "optimizer"} <= set(tl.phases)
    assert any(t.role == "param" for t in tl.tensors.values())


def test_gradients_held_to_the_end_count_until_the_iteration_ends():
    """zero_grad frees the gradients only after optimizer.step(): a gradient last read by the
    optimizer's first op still takes memory during the rest of the optimizer phase."""
    ops = [("f", "forward", 1.0, [1], [2]), ("b", "backward", 1.0, [2], [3, 4]),
           ("o1", "optimizer", 1.0, [1, 3], [1]), ("o2", "optimizer", 1.0, [5, 4], [5])]
    sizes = {1: 10, 2: 20, 3: 100, 4: 100, 5: 10}
    roles = {1: "param", 5: "param"}
    free = AccessTimeline.from_ops(ops, sizes, roles)
    held = AccessTimeline.from_ops(ops, sizes, roles, held_to_end=[3, 4, 1])   # 1: persistent
    assert free.vanilla_range(3) == (1, 2) and held.vanilla_range(3) == (1, 3)
    assert held.tensors[3].held_to_end and not held.tensors[1].held_to_end
    assert list(free.vanilla_curve()) == [40, 240, 220, 120]
    assert list(held.vanilla_curve()) == [40, 240, 220, 220]


def test_a_tensor_held_after_its_last_access_counts_until_it_is_let_go():
    """``held_to``: Python kept a reference past the last op that touched the storage (a
    streamed optimizer's ring slot); the memory counts until then, in every curve."""
    ops = [("f", "forward", 1.0, [1], [2]), ("g", "forward", 1.0, [2], [3]),
           ("h", "backward", 1.0, [3], [4]), ("i", "backward", 1.0, [4], [5])]
    sizes = {1: 10, 2: 20, 3: 100, 4: 40, 5: 1}
    free = AccessTimeline.from_ops(ops, sizes, {1: "param"})
    held = AccessTimeline.from_ops(ops, sizes, {1: "param"}, held_to={2: 3, 1: 3})
    assert free.vanilla_range(2) == (0, 1) and held.vanilla_range(2) == (0, 3)
    assert held.tensors[2].held_to == 3 and held.tensors[1].held_to is None   # 1: persistent
    assert list(free.vanilla_curve()) == [30, 130, 150, 51]
    assert list(held.vanilla_curve()) == [30, 130, 170, 71]
    assert simulate(held).peak == 170
    # the same as its last access: nothing to add
    assert AccessTimeline.from_ops(ops, sizes, held_to={2: 1}).tensors[2].held_to is None
    with pytest.raises(ValueError, match=r"held_to\[2\]: expected an op index from its last "
                                         r"access \(1\) to 3, got 0"):
        AccessTimeline.from_ops(ops, sizes, held_to={2: 0})
    with pytest.raises(ValueError, match=r"held_to\[2\]: .* got 4"):
        AccessTimeline.from_ops(ops, sizes, held_to={2: 4})
    with pytest.raises(ValueError, match="held_to names storage 9, which no op accesses"):
        AccessTimeline.from_ops(ops, sizes, held_to={9: 2})


def test_a_module_input_leaves_the_device_only_after_the_call_that_took_it_returns():
    """``forward_hold``: a residual block's input is read by its first conv and its add, but
    its caller references it until the block returns, so its backward gap (where a plan may
    swap or drop it) starts there."""
    ops = [("conv1", "forward", 1.0, [1], [2]), ("conv2", "forward", 1.0, [2], [3]),
           ("add", "forward", 1.0, [3, 1], [4]), ("relu_", "forward", 1.0, [4], [4]),
           ("next", "forward", 1.0, [4], [5]), ("loss", "loss", 1.0, [5], [6]),
           ("b2", "backward", 1.0, [6, 4], [7]), ("b1", "backward", 1.0, [7, 1, 2], [8])]
    sizes = {s: 10 for s in range(1, 9)}
    free = AccessTimeline.from_ops([("stem", "forward", 1.0, [], [1])] + ops, sizes)
    held = AccessTimeline.from_ops([("stem", "forward", 1.0, [], [1])] + ops, sizes,
                                   forward_hold={1: 4, 2: 2})
    assert free.backward_gap(1) == (3, 8) and held.backward_gap(1) == (4, 8)
    assert held.tensors[1].forward_hold == 4 and held.tensors[1].swappable
    # held to its own last forward access or earlier: nothing changes
    assert held.backward_gap(2) == free.backward_gap(2) == (2, 8)
    # held to the op before its first backward access: no gap left to move it in
    closed = AccessTimeline.from_ops([("stem", "forward", 1.0, [], [1])] + ops, sizes,
                                     forward_hold={4: 6})
    assert free.backward_gap(4) == (5, 7) and closed.backward_gap(4) is None
    assert not closed.tensors[4].swappable and free.tensors[4].swappable
    for bad, match in (({9: 3}, "forward_hold names storage 9"),
                       ({1: 7}, r"forward_hold\[1\]: expected the index of a forward op"),
                       ({2: 0}, r"forward_hold\[2\]: .* from its first access \(1\) on, got 0")):
        with pytest.raises(ValueError, match=match):
            AccessTimeline.from_ops([("stem", "forward", 1.0, [], [1])] + ops, sizes,
                                    forward_hold=bad)
