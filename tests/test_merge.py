"""experiments.merge: rows from another host's results folder, appended once, never edited."""
from __future__ import annotations

import json

import pytest

from experiments import merge
from experiments.store import ResultStore, read_rows


def _row(backend: str, ms: float) -> dict:
    return dict(experiment="inference", mode="inference", model="resnet50", backend=backend,
                batch_size=1, status="ok", median_ms=ms, device="cuda", gpu="NVIDIA H200",
                extra={"b": 2, "a": 1})


def test_rows_missing_here_are_appended_once_and_side_files_copied(tmp_path, capsys):
    src, dest = tmp_path / "src", tmp_path / "dest"
    ResultStore(src / "h200" / "inference.csv").append(_row("eager", 6.3))
    ResultStore(src / "h200" / "inference.csv").append(_row("nimble", 0.9))
    ResultStore(dest / "h200" / "inference.csv").append(_row("eager", 6.3))
    (src / "h200" / "tensile_multi_timeline_x.csv").write_text("t,mb\n0,1\n")
    (src / "h200" / "tensile_multi_x.png").write_bytes(b"\x89PNG plot")
    (src / "h200" / "report.md").write_text("their report")            # rebuilt here, not copied

    dry = merge.merge_results(src, dest, dry_run=True)
    assert dry.appended == {"h200/inference.csv": 1}
    assert dry.copied == ["h200/tensile_multi_timeline_x.csv", "h200/tensile_multi_x.png"]
    assert len(read_rows(dest / "h200" / "inference.csv")) == 1           # nothing written

    assert merge.main([str(src), "--into", str(dest)]) == 0
    out = capsys.readouterr().out
    assert "h200/inference.csv: 1 row(s) appended, 1 already there" in out
    rows = read_rows(dest / "h200" / "inference.csv")
    assert [(r["backend"], r["median_ms"]) for r in rows] == [("eager", "6.3"), ("nimble", "0.9")]
    assert rows[1] == read_rows(src / "h200" / "inference.csv")[1]       # as written there
    assert (dest / "h200" / "tensile_multi_timeline_x.csv").read_text() == "t,mb\n0,1\n"
    assert (dest / "h200" / "tensile_multi_x.png").read_bytes() == b"\x89PNG plot"
    assert not (dest / "h200" / "report.md").exists()

    again = merge.merge_results(src, dest)                               # idempotent
    assert again.appended == {"h200/inference.csv": 0} and again.copied == []


def test_what_cannot_be_merged_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="expected result files <gpu>/<name>.csv under it, found none"):
        merge.merge_results(tmp_path / "empty", tmp_path / "dest")
    with pytest.raises(SystemExit):            # the command line says it in one line, no traceback
        merge.main([str(tmp_path / "empty"), "--into", str(tmp_path / "dest")])
    assert "found none" in capsys.readouterr().err
    src = tmp_path / "src"
    (src / "h200").mkdir(parents=True)
    (src / "h200" / "inference.csv").write_text("model,ms\nresnet50,1.0\n")
    ResultStore(tmp_path / "dest" / "h200" / "inference.csv").append(_row("eager", 6.3))
    with pytest.raises(ValueError, match="has columns \\['model', 'ms'\\], but .* has \\['experiment'"):
        merge.merge_results(src, tmp_path / "dest")
    (src / "h200" / "inference.csv").unlink()
    (src / "h200" / "tensile_multi_timeline_x.csv").write_text("new\n")
    (tmp_path / "dest" / "h200" / "tensile_multi_timeline_x.csv").write_text("old\n")
    with pytest.raises(FileExistsError, match="no row there names it: raw files are never overwritten"):
        merge.merge_results(src, tmp_path / "dest")
    assert (tmp_path / "dest" / "h200" / "tensile_multi_timeline_x.csv").read_text() == "old\n"


def _multi_row(date: str, timeline: str, msr: float) -> dict:
    return dict(experiment="tensile_multi", mode="copies_resnet50x1", model="resnet50",
                backend="GPU", batch_size=2, status="ok", device="cuda", gpu="NVIDIA H200",
                date=date, extra={"timeline_csv": timeline, "plot_png": "tensile_multi_x.png",
                                  "msr_nvml": msr})


def test_a_side_file_of_another_run_is_kept_under_its_rows_date(tmp_path, capsys):
    """Files named per setting only (before 2026-11-30): a re-run's timeline differs from the
    one here. Both stay; the incoming rows name the incoming files under their new names."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    ResultStore(dest / "h200" / "tensile_multi.csv").append(
        _multi_row("2026-11-28T10:00:00+00:00", "tensile_multi_timeline_x.csv", 0.1))
    (dest / "h200" / "tensile_multi_timeline_x.csv").write_text("old\n")
    (dest / "h200" / "tensile_multi_x.png").write_bytes(b"old plot")
    ResultStore(src / "h200" / "tensile_multi.csv").append(
        _multi_row("2026-11-30T04:26:53+00:00", "tensile_multi_timeline_x.csv", 0.2))
    (src / "h200" / "tensile_multi_timeline_x.csv").write_text("new\n")
    (src / "h200" / "tensile_multi_x.png").write_bytes(b"new plot")

    assert merge.main([str(src), "--into", str(dest)]) == 0
    assert "h200/tensile_multi_x.png: copied as tensile_multi_x_20261130T042653.png" in capsys.readouterr().out
    h200 = dest / "h200"
    assert (h200 / "tensile_multi_timeline_x.csv").read_text() == "old\n"          # kept
    assert (h200 / "tensile_multi_timeline_x_20261130T042653.csv").read_text() == "new\n"
    assert (h200 / "tensile_multi_x_20261130T042653.png").read_bytes() == b"new plot"
    old, new = (json.loads(r["extra"]) for r in read_rows(h200 / "tensile_multi.csv"))
    assert old["timeline_csv"] == "tensile_multi_timeline_x.csv"                    # untouched
    assert (new["timeline_csv"], new["plot_png"], new["msr_nvml"]) == (
        "tensile_multi_timeline_x_20261130T042653.csv", "tensile_multi_x_20261130T042653.png", 0.2)

    again = merge.merge_results(src, dest)                     # idempotent: nothing new
    assert again.appended == {"h200/tensile_multi.csv": 0} and again.copied == []


def test_an_experiments_own_table_is_merged_line_for_line(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "h200").mkdir(parents=True)
    (dest / "h200").mkdir(parents=True)
    (src / "h200" / "headroom.csv").write_text("model,copies,overlap\ndarts,2,1.30\ngooglenet,2,1.17\n")
    (dest / "h200" / "headroom.csv").write_text("model,copies,overlap\ndarts,2,1.30\n")
    rep = merge.merge_results(src, dest)
    assert rep.appended == {"h200/headroom.csv": 1} and rep.skipped == {"h200/headroom.csv": 1}
    assert (dest / "h200" / "headroom.csv").read_text() == \
        "model,copies,overlap\ndarts,2,1.30\ngooglenet,2,1.17\n"
    (src / "h200" / "headroom.csv").write_text("model,overlap\ndarts,1.3\n")
    with pytest.raises(ValueError, match="files of two column lists are never mixed"):
        merge.merge_results(src, dest)


def test_an_own_table_that_gained_columns_is_widened_and_its_old_rows_kept(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "h200").mkdir(parents=True)
    (dest / "h200").mkdir(parents=True)
    (dest / "h200" / "stack_trim.csv").write_text("model,idle_mb,saved_mb\nvgg16,3.0,222.1\n")
    (src / "h200" / "stack_trim.csv").write_text(
        "model,idle_mb,outside_source,saved_mb\nvgg16,3.0,,222.1\nresnet50,3.0,nvml,252.0\n")
    rep = merge.merge_results(src, dest, dry_run=True)
    assert rep.widened == {"h200/stack_trim.csv": ["outside_source"]}
    assert rep.appended == {"h200/stack_trim.csv": 1}     # vgg16's row is there already
    assert (dest / "h200" / "stack_trim.csv").read_text().startswith("model,idle_mb,saved_mb\n")
    rep = merge.merge_results(src, dest)
    assert "widened by outside_source" in str(rep) and rep.appended == {"h200/stack_trim.csv": 1}
    assert rep.skipped == {"h200/stack_trim.csv": 1}
    assert (dest / "h200" / "stack_trim.csv").read_text() == (
        "model,idle_mb,outside_source,saved_mb\nvgg16,3.0,,222.1\nresnet50,3.0,nvml,252.0\n")
    again = merge.merge_results(src, dest)
    assert again.widened == {} and again.appended == {"h200/stack_trim.csv": 0}


def test_a_refused_merge_writes_nothing(tmp_path):
    """One file that may not be merged stops the whole merge before any file is touched:
    side files and the other tables stay as they were."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "h200").mkdir(parents=True)
    (dest / "h200").mkdir(parents=True)
    (src / "h200" / "headroom.csv").write_text("model,copies\ndarts,2\n")
    (dest / "h200" / "headroom.csv").write_text("model,overlap\ndarts,1.3\n")  # columns lost
    (src / "h200" / "tensile_multi_timeline_a.csv").write_text("t,mb\n0,1\n")
    ResultStore(src / "h200" / "tensile_multi.csv").append(_row("eager", 6.3))
    with pytest.raises(ValueError, match="may only gain columns"):
        merge.merge_results(src, dest)
    assert sorted(p.name for p in (dest / "h200").iterdir()) == ["headroom.csv"]


def test_planning_snapshots_travel_with_their_rows(tmp_path):
    """TENSILE's planning snapshots are side files; rows before 2026-12-01 name theirs by
    the writing host's path: a differing one of the same name is kept under its row's date."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    name = "snapshot_tensile_resnet50_b16_tensile_graph_copy_latency_ms_0.1.json.gz"
    ResultStore(dest / "h200" / "tensile.csv").append(
        dict(_multi_row("2026-12-01T07:40:04+00:00", "t.csv", 0.1), extra={"snapshot_path": f"/tmp/w/res/h200/{name}"}))
    (dest / "h200" / name).write_bytes(b"old")
    ResultStore(src / "h200" / "tensile.csv").append(
        dict(_multi_row("2026-12-01T07:49:01+00:00", "t.csv", 0.2), extra={"snapshot_path": f"/tmp/w/res/h200/{name}"}))
    (src / "h200" / name).write_bytes(b"new")
    (src / "h200" / "snapshot_tensile_x_20261201T075443.json.gz").write_bytes(b"named by file")
    report = merge.merge_results(src, dest)
    kept = "snapshot_tensile_resnet50_b16_tensile_graph_copy_latency_ms_0.1_20261201T074901.json.gz"
    assert report.renamed == {f"h200/{name}": kept}
    assert (dest / "h200" / name).read_bytes() == b"old" and (dest / "h200" / kept).read_bytes() == b"new"
    assert (dest / "h200" / "snapshot_tensile_x_20261201T075443.json.gz").read_bytes() == b"named by file"
    old, new = (json.loads(r["extra"]) for r in read_rows(dest / "h200" / "tensile.csv"))
    assert old["snapshot_path"].endswith(name) and new["snapshot_path"] == kept
