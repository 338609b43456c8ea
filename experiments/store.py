"""Append-only CSV store for raw measurement rows.

One row per (experiment, model, backend, batch size, mode) measurement, appended the moment it
finishes, so an interrupted sweep keeps everything it measured. Several jobs of one sweep (joblib
workers, SLURM array tasks on a shared file system with working ``flock``) may append to the same
file: every append takes an exclusive ``fcntl.flock`` on a sidecar ``.lock`` file and writes one
complete line with ``flush`` + ``fsync``.

``COLUMNS`` is the one place that defines a row. Keys a caller passes that are not columns go into
the ``extra`` column as JSON (backend-specific metrics such as stream or sync counts), so adding a
metric never changes the file format.
"""
from __future__ import annotations

import csv
import fcntl
import io
import json
import math
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["COLUMNS", "KEY_COLUMNS", "ResultStore", "append_table_row", "file_slug", "make_row", "row_key",
           "row_allocator", "read_rows", "date_stamp"]

COLUMNS: list[str] = [
    # what was measured
    "experiment", "mode", "model", "backend", "batch_size",
    # outcome
    "status", "reason",
    # timing (ms): GPU time from CUDA events (host perf_counter on CPU); wall_ms is host time
    "median_ms", "p10_ms", "p90_ms", "mean_ms", "std_ms", "wall_ms", "warmup", "iters",
    # cost of the backend
    "prepare_s", "peak_mem_mb", "graph_mem_mb",
    # backend-specific metrics and unknown keys, as a JSON object
    "extra",
    # environment
    "device", "gpu", "host", "torch", "cuda", "cudnn", "python", "backend_version",
    "tf32_matmul", "tf32_cudnn", "cudnn_benchmark", "commit", "date",
]

# A row with the same values in these columns measures the same thing: the sweep skips it.
KEY_COLUMNS: tuple[str, ...] = ("experiment", "model", "backend", "batch_size", "mode", "device", "gpu")

STATUSES = ("ok", "unavailable", "error")


def make_row(**fields: Any) -> dict[str, str]:
    """A complete row: every column present (empty string if not given), unknown keys in ``extra``.

    ``extra`` may be given as a dict or as a JSON string; unknown keyword arguments are merged into
    it. Values are turned into strings the way ``csv`` would write them, floats unchanged.
    """
    extra = fields.pop("extra", None) or {}
    if isinstance(extra, str):
        extra = json.loads(extra) if extra else {}
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or a JSON object string, got {type(extra).__name__}")
    extra = dict(extra)
    for key in [k for k in fields if k not in COLUMNS]:
        extra[key] = fields.pop(key)
    status = fields.get("status", "")
    if status not in STATUSES:
        raise ValueError(f"row status must be one of {STATUSES}, got {status!r}")
    row = {c: _text(fields.get(c)) for c in COLUMNS}
    row["extra"] = json.dumps(extra, sort_keys=True, default=str) if extra else ""
    return row


def _text(value: Any) -> str:
    """A cell: None and NaN (not measured, e.g. GPU memory on a CPU run) become empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def row_key(row: dict[str, Any]) -> tuple[str, ...]:
    """The identity of a measurement (see ``KEY_COLUMNS``), as strings so CSV and dict rows agree,
    plus the CUDA allocator backend it ran under (:func:`row_allocator`)."""
    return tuple(str(row.get(c, "")) for c in KEY_COLUMNS) + (row_allocator(row),)


def row_allocator(row: dict[str, Any]) -> str:
    """The CUDA allocator backend a row ran under: its ``allocator`` (a dict row) or
    ``extra.allocator`` (a stored row); ``"native"`` for a CUDA row that predates that record
    (PyTorch's default then), ``""`` for a CPU row."""
    allocator = row.get("allocator")
    if not allocator:
        extra = row.get("extra") or {}
        if isinstance(extra, str):
            extra = json.loads(extra) if extra else {}
        allocator = extra.get("allocator")
    if not allocator and str(row.get("device", "")).startswith("cuda"):
        allocator = "native"
    return str(allocator or "")


def date_stamp(date: str) -> str:
    """A row's ``date`` (ISO 8601) as ``YYYYMMDDTHHMMSS``, for file names that belong to it."""
    return "".join(c for c in date[:19] if c.isalnum())


def file_slug(label: str) -> str:
    """``label`` (a backend, a setting) as a piece of a file name: runs of anything but
    letters, digits, ``.``, ``_`` and ``-`` become one ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """All rows of one CSV file as dicts of strings (empty list if the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def append_table_row(path: str | Path, row: dict[str, Any]) -> None:
    """Append ``row`` to an experiment's own table (``headroom.csv``, ``kernels.csv``).

    The file's header, once written, decides the columns: a key the header lacks is refused
    (a pandas append would shift the line under the wrong names), a column the row lacks is
    left empty. The first row writes the header in its own key order.
    """
    path = Path(path)
    header = None
    if path.exists() and path.stat().st_size:
        with path.open(newline="") as f:
            header = next(csv.reader(f))
    new = header is None
    if new:
        header = list(row)
    unknown = [k for k in row if k not in header]
    if unknown:
        raise ValueError(f"{path.name} has no column(s) {unknown}: its rows were written by other "
                         f"code; write to another results folder (its columns: {header})")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        if new:
            writer.writeheader()
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in header})


class ResultStore:
    """One results CSV (e.g. ``results/h200/inference.csv``), safe for concurrent appenders."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    @contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        # flock on a sidecar file, not the CSV itself: the CSV may not exist yet, and readers that
        # open the CSV (pandas, editors) must never be able to block or be blocked by writers.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def append(self, row: dict[str, Any]) -> dict[str, str]:
        """Append one row (normalised by :func:`make_row`); write the header if the file is new.

        Returns the row as written. Raises ``ValueError`` if the existing file has another header
        (a results file from an older column list must be moved aside, never silently mixed).
        """
        row = make_row(**row)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
        with self._locked(fcntl.LOCK_EX):
            new = not self.path.exists() or self.path.stat().st_size == 0
            if new:
                writer.writeheader()
            else:
                self._check_header()
            writer.writerow(row)
            # One write of the complete text: a crash leaves whole lines or nothing of this row.
            with self.path.open("a", newline="") as f:
                f.write(buf.getvalue())
                f.flush()
                os.fsync(f.fileno())
        return row

    def _check_header(self) -> None:
        with self.path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != COLUMNS:
            raise ValueError(
                f"{self.path} has columns {header}, expected {COLUMNS}. It was written with another "
                "column list: move it aside (or convert it) before appending new rows."
            )

    def rows(self) -> list[dict[str, str]]:
        """All rows, read under a shared lock so a concurrent append is never seen half-written."""
        with self._locked(fcntl.LOCK_SH):
            return read_rows(self.path)

    def done_keys(self, redo: bool = False, min_iters: int = 0) -> set[tuple[str, ...]]:
        """Keys of rows already measured, which a sweep skips; empty when ``redo`` is set.

        Every status counts as done (``ok``, ``unavailable``, ``error``): re-running a sweep must
        not retry a crashing backend forever; pass ``redo=True`` to measure again. Rows recorded for
        fewer than ``min_iters`` timed iterations (smoke rows) do not count, so a full-protocol
        sweep after a quick one measures everything again.
        """
        if redo:
            return set()
        done = set()
        for row in self.rows():
            iters = int(row["iters"]) if row.get("iters", "").isdigit() else 0
            if iters < min_iters:
                continue
            done.add(row_key(row))
        return done
