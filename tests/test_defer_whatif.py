"""experiments.defer_whatif: a recorded step with a layer's weight-gradient ops moved to its end."""
from __future__ import annotations

from dataclasses import replace

import pytest

import tensile
from experiments import defer_whatif
from tensile.simulate import simulate

MIB = 2**20


def step() -> tensile.AccessTimeline:
    """Forward saves A (8 MiB) for backward's last op; backward's first ops make a weight
    gradient G (4 MiB) and update with it (a 4 MiB temporary T), where A is still held."""
    ops = [("conv", "forward", 1.0, [], [1]),
           ("mm", "backward", 1.0, [], [2]),          # the weight gradient
           ("adam", "backward", 1.0, [2], [3]),       # its update's temporary
           ("adam", "backward", 1.0, [3], []),
           ("conv_backward", "backward", 1.0, [1], [])]
    return tensile.AccessTimeline.from_ops(ops, {1: 8 * MIB, 2: 4 * MIB, 3: 4 * MIB})


def test_moving_the_gradients_ops_last_takes_them_off_the_activations_peak():
    tl = step()
    moved = defer_whatif.move_to_end(tl, [1, 2, 3])
    assert moved.names == ["conv", "conv_backward", "mm", "adam", "adam"]
    assert moved.tensors[1].accesses == [0, 1] and moved.tensors[2].accesses == [2, 3]
    assert moved.tensors[3].writes == [3] and list(moved.op_ms) == list(tl.op_ms)
    assert simulate(tl).peak == 16 * MIB        # A, G and T at once
    assert simulate(moved).peak == 8 * MIB      # A alone, then G and T


@pytest.mark.parametrize("ops", [[], [1, 1], [5], [-1]])
def test_bad_ops_are_refused(ops):
    with pytest.raises(ValueError, match=r"ops: expected distinct op indices in \[0, 5\)"):
        defer_whatif.move_to_end(step(), ops)


def test_op_ranges_parse_in_order_and_bad_ones_say_what_was_expected():
    assert defer_whatif.parse_ops("3-5,1-2") == [3, 4, 5, 1, 2]
    assert defer_whatif.parse_ops("7") == [7]
    with pytest.raises(ValueError, match=r"--ops: expected ranges like 95-113"):
        defer_whatif.parse_ops("a-b")


def test_the_command_plans_both_steps_from_a_snapshot(tmp_path, capsys):
    tl = step()
    budget = 10 * MIB
    plan = tensile.plan(tl, budget_bytes=budget, d2h_bw=1e9, h2d_bw=1e9)
    snap = tensile.PlanningSnapshot(tl, budget, 1e9, 1e9, 0.0, 1, plan, {"model": "toy", "batch_size": 2},
                                    {"allow_swaps": True})
    path = snap.save(tmp_path / "snap.json.gz")
    defer_whatif.main([str(path), "--ops", "1-3"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "budget 10.0 MiB; toy b=2" and out[1] == defer_whatif.NO_WORKSPACES
    assert out[2].startswith("as recorded: unplanned peak 16 MiB at adam")
    assert out[3].startswith("ops 1-3 last: unplanned peak 8 MiB at conv") and "(fits), priced 0.000 ms" in out[3]
    assert "; plan 8 MiB at conv {'activation': 8} (fits)" in out[3]    # where the plan peaks, what it holds


def test_a_snapshot_without_workspaces_is_said_to_understate_its_peaks(tmp_path, capsys):
    """A timeline with no op workspaces leaves cuDNN's out of every peak: the command says so
    first, and says nothing of it where the timeline has them."""
    for scratch, noted in (({}, True), ({4: 2 * MIB}, False)):
        tl = replace(step(), scratch=scratch)
        plan = tensile.plan(tl, budget_bytes=12 * MIB, d2h_bw=1e9, h2d_bw=1e9)
        snap = tensile.PlanningSnapshot(tl, 12 * MIB, 1e9, 1e9, 0.0, 1, plan, {"model": "toy", "batch_size": 2},
                                        {"allow_swaps": True})
        defer_whatif.main([str(snap.save(tmp_path / f"snap{noted}.json.gz")), "--ops", "1-3"])
        out = capsys.readouterr().out.splitlines()
        assert (out[1] == defer_whatif.NO_WORKSPACES) is noted
        assert out[-1].startswith("ops 1-3 last: unplanned peak")
