"""experiments.slice_cost: slices cut as the streamed optimizer cuts them, the row products'
rows equal to the whole product's, rows written with their environment (CPU dry run)."""
from __future__ import annotations

import csv

import pytest
import torch

from experiments import slice_cost as sc
from tensile.streamed import _slices, row_slices


def test_row_slices_are_whole_rows_of_about_the_size_and_cover_the_weight_once():
    assert row_slices(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert row_slices(3, 100, 1) == [(0, 1), (1, 2), (2, 3)]     # at least one row a slice
    assert row_slices(5, 4, 1000) == [(0, 5)]
    with pytest.raises(ValueError, match=r"expected rows, row_bytes and nbytes >= 1, got 0, 4 and 8"):
        row_slices(0, 4, 8)


def test_the_streamed_optimizer_cuts_its_slices_with_row_slices():
    p = torch.nn.Parameter(torch.zeros(10, 3))
    flat = [g.rows for g in _slices(p, 40)]
    assert flat == [(r0 * 3, r1 * 3) for r0, r1 in row_slices(10, 12, 40)]
    assert flat[0] == (0, 9) and flat[-1] == (27, 30)


def test_the_largest_linear_is_found_and_a_model_without_one_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 300),
                                torch.nn.Linear(300, 2))
    name, layer = sc.largest_linear(model)
    assert name == "2" and layer.weight.shape == (300, 8)
    with pytest.raises(ValueError, match="Sequential has no nn.Linear layer"):
        sc.largest_linear(torch.nn.Sequential(torch.nn.ReLU()))


def test_every_case_runs_whole_and_sliced_and_the_rows_equal_the_whole_product():
    rows = sc.measure_slices((40, 64), 4, [1 / 1024, 3 / 1024], device="cpu", warmup=0, iters=2,
                             progress=False)
    assert [(r["case"], r["slices"]) for r in rows] == [
        (case, n) for case in sc.CASES for n in (1, 10, 4)]      # 64 floats a row: 4 and 12 rows a slice
    for r in rows:
        assert r["median_ms"] > 0 and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["rows_equal"] is True if r["case"] == "row_products" else r["rows_equal"] == ""


# fused Adam on the CPU can round the elements past a tensor's last whole vector apart from
# the same elements inside a longer tensor (30 elements in slices of 10 differ in one element
# by 2e-10): slices of 16 elements there
@pytest.mark.parametrize("fused, cols", [(False, 5), (True, 16)])
def test_the_sliced_adam_calls_update_like_one_call(fused, cols):
    cpu = torch.device("cpu")
    one, whole = sc._adam_calls((6, cols), [(0, 6)], fused, cpu)
    sliced, pieces = sc._adam_calls((6, cols), row_slices(6, cols * 4, 2 * cols * 4), fused, cpu)
    one()
    sliced()
    assert len(pieces) == 3 and torch.equal(torch.cat(pieces).detach(), whole[0].detach())
    assert whole[0].abs().min() > 0    # two steps moved every element


def test_main_writes_one_row_per_case_and_size_with_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sc, "build_model", lambda name: torch.nn.Sequential(torch.nn.Linear(64, 40)))
    assert sc.main(["--model", "vgg16", "--batch", "4", "--slice-mb", "0.0029", "--device", "cpu",
                    "--iters", "2", "--warmup", "0", "--results", str(tmp_path)]) == 0
    with open(tmp_path / "cpu" / "slice_cost.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["case"], r["slices"], r["slice_mb"]) for r in rows] == [
        (c, n, mb) for c in sc.CASES for n, mb in (("1", ""), ("4", "0.0029"))]
    assert {r["weight_shape"] for r in rows} == {"40x64"} and {r["layer_name"] for r in rows} == {"0"}
    assert all(r["torch"] and r["commit"] and r["date"] for r in rows)
    assert "row_products 4 slices of 0.0029 MiB" in capsys.readouterr().out


@pytest.mark.parametrize("argv, said", [
    (["--slice-mb", "0"], "expected comma-separated MiB > 0, got '0'"),
    (["--slice-mb", "x"], "got 'x'"),
    (["--batch", "0"], "--batch: expected an int >= 1, got 0"),
    (["--model", "vgg16,resnet50"], "expected one model"),
])
def test_bad_arguments_say_what_was_expected(argv, said, capsys):
    with pytest.raises(SystemExit):
        sc.main(argv + ["--device", "cpu"])
    assert said in capsys.readouterr().err


def test_the_report_prints_each_case_against_its_whole(tmp_path):
    from experiments.report import slice_cost_table
    path = tmp_path / "slice_cost.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "batch_size", "layer_name", "weight_shape", "case", "slice_mb", "slices",
                    "median_ms", "p10_ms", "p90_ms", "rows_equal", "commit"])
        w.writerow(["vgg16", 16, "fc6", "4096x25088", "adam", "", 1, 3.0, 2.9, 3.1, "", "abc"])
        w.writerow(["vgg16", 16, "fc6", "4096x25088", "adam", 32, 13, 3.6, 3.5, 3.7, "", "abc"])
        w.writerow(["vgg16", 16, "fc6", "4096x25088", "adam", 32, 13, 3.48, 3.4, 3.5, "", "abd"])
    df = slice_cost_table(path)
    assert list(df["slices"]) == [1, 13]          # the later of two rows of one setting
    assert df["over_whole_ms"].tolist() == pytest.approx([0.0, 0.48])
    assert df["per_extra_slice_us"].iloc[1] == pytest.approx(40.0) and df["per_extra_slice_us"].isna().iloc[0]
