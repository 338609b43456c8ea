"""The results store: append, header, resume/skip, redo, unknown keys, concurrent writers."""
from __future__ import annotations

import csv
import json
import multiprocessing as mp

import pytest

from experiments.store import COLUMNS, KEY_COLUMNS, ResultStore, make_row, read_rows, row_allocator, row_key


def _row(**kw):
    base = dict(experiment="inference", mode="inference", model="resnet50", backend="eager",
                batch_size=1, status="ok", median_ms=1.5, iters=200, warmup=50, device="cuda",
                gpu="NVIDIA H200")
    base.update(kw)
    return base


def test_append_writes_header_once_and_complete_rows(tmp_path):
    store = ResultStore(tmp_path / "h200" / "inference.csv")
    store.append(_row())
    store.append(_row(backend="nimble", median_ms=0.5))
    lines = store.path.read_text().splitlines()
    assert lines[0].split(",") == COLUMNS
    assert len(lines) == 3
    rows = store.rows()
    assert [r["backend"] for r in rows] == ["eager", "nimble"]
    assert rows[1]["median_ms"] == "0.5"
    assert set(rows[0]) == set(COLUMNS)


def test_unknown_keys_go_into_extra_as_json(tmp_path):
    store = ResultStore(tmp_path / "x.csv")
    store.append(_row(streams=6, syncs=70, extra={"critical_path_ms": 1.25}))
    extra = json.loads(store.rows()[0]["extra"])
    assert extra == {"streams": 6, "syncs": 70, "critical_path_ms": 1.25}


def test_bad_status_and_bad_extra_are_rejected():
    with pytest.raises(ValueError, match="status must be one of"):
        make_row(**_row(status="fine"))
    with pytest.raises(TypeError, match="extra must be a dict"):
        make_row(**_row(extra=[1, 2]))


def test_reasons_with_commas_quotes_and_newlines_survive(tmp_path):
    store = ResultStore(tmp_path / "x.csv")
    reason = 'TensorRT missing: "No module named tensorrt",\nsecond line'
    store.append(_row(status="unavailable", reason=reason))
    assert store.rows()[0]["reason"] == reason


def test_done_keys_resume_skip_and_redo(tmp_path):
    store = ResultStore(tmp_path / "x.csv")
    assert store.done_keys() == set()  # no file yet
    store.append(_row())
    store.append(_row(backend="tensorrt", status="unavailable", reason="not installed"))
    store.append(_row(backend="nimble", status="error", reason="capture failed"))
    done = store.done_keys()
    assert row_key(_row()) in done
    # error and unavailable rows count as done too: a re-run does not retry them unless asked
    assert row_key(_row(backend="nimble")) in done
    assert row_key(_row(backend="tensorrt")) in done
    assert row_key(_row(batch_size=32)) not in done
    assert row_key(_row(device="cpu", gpu="cpu")) not in done
    assert store.done_keys(redo=True) == set()


def test_smoke_rows_do_not_count_for_a_full_protocol_run(tmp_path):
    store = ResultStore(tmp_path / "x.csv")
    store.append(_row(iters=10, warmup=3))
    assert row_key(_row()) in store.done_keys(min_iters=10)
    assert row_key(_row()) not in store.done_keys(min_iters=200)


def test_key_is_typed_consistently_between_dict_and_csv(tmp_path):
    store = ResultStore(tmp_path / "x.csv")
    store.append(_row(batch_size=32))
    (stored,) = store.rows()
    assert row_key(stored) == row_key(_row(batch_size=32))
    assert len(KEY_COLUMNS) + 1 == len(row_key(stored))          # + the allocator


def test_the_allocator_is_part_of_a_measurement_s_identity(tmp_path):
    """A cudaMallocAsync run measures what a native one measured again, and is kept apart;
    a CUDA row from before the allocator was recorded ran PyTorch's default, native."""
    store = ResultStore(tmp_path / "x.csv")
    store.append(_row())                                          # no allocator recorded
    store.append(_row(backend="nimble", allocator="cudaMallocAsync"))
    done = store.done_keys()
    assert row_key(_row(allocator="native")) in done
    assert row_key(_row(allocator="cudaMallocAsync")) not in done
    assert row_key(_row(backend="nimble", allocator="cudaMallocAsync")) in done
    assert row_key(_row(backend="nimble", allocator="native")) not in done
    assert row_allocator(_row(device="cpu", gpu="cpu")) == ""


def test_foreign_header_is_refused(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("model,backend\nresnet50,eager\n")
    with pytest.raises(ValueError, match="move it aside"):
        ResultStore(path).append(_row())


def _writer(path: str, worker: int, n: int) -> None:
    store = ResultStore(path)
    for i in range(n):
        # long reasons make torn writes likely if locking were broken
        store.append(_row(model=f"m{worker}", batch_size=i + 1, reason="x" * 2000, status="error"))


def test_concurrent_writers_never_corrupt_the_file(tmp_path):
    path = tmp_path / "h200" / "inference.csv"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 50)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        body = list(reader)
    assert header == COLUMNS
    assert len(body) == 200
    assert all(len(r) == len(COLUMNS) for r in body)
    rows = read_rows(path)
    assert {(r["model"], r["batch_size"]) for r in rows} == {
        (f"m{w}", str(i + 1)) for w in range(4) for i in range(50)}
    assert all(r["reason"] == "x" * 2000 for r in rows)


def test_suite_commit_overrides_what_git_says(monkeypatch):
    """A tree copied to a GPU host can carry a stale .git: $SUITE_COMMIT must win."""
    from experiments import env
    env.git_commit.cache_clear()
    monkeypatch.setenv("SUITE_COMMIT", "abc1234")
    try:
        assert env.git_commit() == "abc1234"
        monkeypatch.delenv("SUITE_COMMIT")
        env.git_commit.cache_clear()
        assert env.git_commit() != "abc1234" and env.git_commit()
    finally:
        env.git_commit.cache_clear()


def test_table_rows_keep_the_files_columns_and_refuse_new_ones(tmp_path):
    from experiments.store import append_table_row
    path = tmp_path / "h200" / "kernels.csv"
    append_table_row(path, {"model": "resnet50", "median_ms": 0.5, "commit": "17e2523"})
    append_table_row(path, {"commit": "abc", "model": "darts"})          # other order, one missing
    assert read_rows(path) == [{"model": "resnet50", "median_ms": "0.5", "commit": "17e2523"},
                               {"model": "darts", "median_ms": "", "commit": "abc"}]
    with pytest.raises(ValueError, match=r"kernels.csv has no column\(s\) \['alloc_conf'\]"):
        append_table_row(path, {"model": "darts", "alloc_conf": "expandable_segments:True"})
    assert len(read_rows(path)) == 2                                     # nothing half-written
