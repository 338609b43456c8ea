"""experiments.optimizer_floor: the planner's optimizer-phase floor, both state-return rules."""
from __future__ import annotations

import pandas as pd

from experiments import optimizer_floor


def test_state_back_at_first_use_lowers_the_floor_of_a_looping_adam():
    rows = pd.DataFrame(optimizer_floor.floor_rows(
        "mobilenet_v2", 2, [1, 0], flops=50e12, mem_bw=4e12, slowdown=4.0, copy_bps=53e9,
        image_size=32)).set_index(["optimizer", "state_back"])
    assert list(rows.index) == [("adam, 1 group(s)", "before step()"), ("adam, 1 group(s)", "at first use"),
                                ("adam, foreach=False", "before step()"),
                                ("adam, foreach=False", "at first use")]
    loop = rows.loc["adam, foreach=False"]
    # at batch 2 (32x32) the optimizer's step is the peak: state back op by op lowers it
    assert loop.loc["at first use", "planned_msr"] > loop.loc["before step()", "planned_msr"]
    assert (rows["peak_after_mb"] <= rows["peak_before_mb"]).all()


def test_the_command_writes_its_table_and_refuses_bad_input(tmp_path, capsys):
    assert optimizer_floor.main(["--models", "mobilenet_v2", "--batch-size", "1", "--groups", "0",
                                 "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "optimizer_floor.csv")
    assert len(df) == 2 and {"commit", "torch", "date", "planned_msr"} <= set(df.columns)
    for bad in (["--models", "nope"], ["--groups", "x"], ["--groups", "-1"]):
        try:
            optimizer_floor.main(bad + ["--out", str(tmp_path)])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{bad} was accepted")
    assert "unknown model(s) ['nope']" in capsys.readouterr().err
