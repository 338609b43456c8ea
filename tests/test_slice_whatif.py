"""experiments.slice_whatif: a recorded step with its last slices' state kept on the device."""
from __future__ import annotations

import pytest

import tensile
from experiments import slice_whatif

MIB = 2**20


def step() -> tensile.AccessTimeline:
    """Forward saves A (8 MiB) for backward's last op; backward streams three slices' state
    (two 2 MiB entries each way a slice, the last slice 1 MiB an entry)."""
    ops = [("conv", "forward", 1.0, [], [1]),
           ("copy_", "backward", 1.0, [], []),
           ("adam", "backward", 1.0, [], []),
           ("copy_", "backward", 1.0, [], []),
           ("conv_backward", "backward", 1.0, [1], [])]
    copies = [(1, "h2d", 2 * MIB), (1, "h2d", 2 * MIB), (1, "h2d", 2 * MIB), (1, "h2d", 2 * MIB),
              (1, "h2d", 1 * MIB), (1, "h2d", 1 * MIB),
              (3, "d2h", 2 * MIB), (3, "d2h", 2 * MIB), (3, "d2h", 2 * MIB), (3, "d2h", 2 * MIB),
              (3, "d2h", 1 * MIB), (3, "d2h", 1 * MIB)]
    return tensile.AccessTimeline.from_ops(ops, {1: 8 * MIB}, transfers=copies)


def test_keeping_the_last_slices_drops_their_copies_and_counts_their_state():
    tl = step()
    left, kept = slice_whatif.keep_last(tl, 1)
    assert kept == 2 * MIB and len(left.transfers) == 8
    assert [b for _, d, b in left.transfers if d == "d2h"] == [2 * MIB] * 4
    left, kept = slice_whatif.keep_last(tl, 2)
    assert kept == 6 * MIB and [b for _, _, b in left.transfers] == [2 * MIB, 2 * MIB] * 2
    left, kept = slice_whatif.keep_last(tl, 0)
    assert kept == 0 and left.transfers == tl.transfers


@pytest.mark.parametrize("kept, entries", [(4, 2), (-1, 2), (1, 0)])
def test_more_slices_than_the_step_copies_are_refused(kept, entries):
    with pytest.raises(ValueError, match=r"kept: expected 0 to \d+ slices of .* copies each way "
                                         r"\(the step has 6 copies in and 6 out\)"):
        slice_whatif.keep_last(step(), kept, entries)


def _snapshot(tl, budget):
    plan = tensile.plan(tl, budget_bytes=budget, d2h_bw=1e9, h2d_bw=1e9)
    return tensile.PlanningSnapshot(tl, budget, 1e9, 1e9, 0.0, 1, plan,
                                    {"model": "toy", "batch_size": 2}, {"allow_swaps": True})


def test_the_command_plans_each_count_with_the_kept_state_off_the_budget(tmp_path, capsys):
    path = _snapshot(step(), 100 * MIB).save(tmp_path / "snap.json.gz")
    slice_whatif.main([str(path), "--kept", "0,1,3", "--budget-mib", "16"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "budget 16.0 MiB; toy b=2; 12 copies, 10 MiB each way"
    assert out[1].startswith("note: this snapshot records no op workspaces")
    rows = out[2:]
    assert rows[0].startswith("0 kept: state 0 MiB on the device, 10 MiB each way; unplanned peak 8 MiB")
    assert rows[1].startswith("1 kept: state 2 MiB on the device, 8 MiB each way; unplanned peak 10 MiB")
    assert rows[2].startswith("3 kept: state 10 MiB on the device, 0 MiB each way; unplanned peak 18 MiB")
    assert "(fits)" in rows[0] and "(fits)" in rows[1]
    assert "(does not fit)" in rows[2]   # 6 MiB left for A's 8 while forward writes it


def test_the_command_says_what_it_needs(tmp_path, capsys):
    bare = tensile.AccessTimeline.from_ops([("conv", "forward", 1.0, [], [1])], {1: MIB})
    with pytest.raises(SystemExit):
        slice_whatif.main([str(_snapshot(bare, 4 * MIB).save(tmp_path / "bare.json.gz"))])
    assert "made no copies of its own (no streamed optimizer)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        slice_whatif.main([str(_snapshot(step(), 100 * MIB).save(tmp_path / "s.json.gz")), "--kept", "7"])
    assert "kept: expected 0 to 3 slices of 2 copies each way" in capsys.readouterr().err
