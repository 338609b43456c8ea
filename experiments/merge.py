"""Bring rows measured on another host into this checkout's ``results/``.

    python -m experiments.merge /path/to/copied/results            # every <gpu>/*.csv there
    python -m experiments.merge /path/to/copied/results --dry-run  # say what would change

The offline workflow: a GPU host without network runs the sweeps into its own results
folder (``results_dir=...``), the folder comes back (scp, a tarball, a job's output), and
this command appends its rows to ``results/<gpu>/<file>.csv`` here. Rows are raw data and
are never edited: a row already present (every column equal) is skipped, every other one
is appended as it was written (measurement rows through :class:`experiments.store.ResultStore`;
tables of their own, like the headroom's, line for line). Two files of one name with
different column lists are refused, never mixed, with one exception: an experiment's own
table whose newer code added columns (``stack_trim.csv``'s ``outside_source``) is widened
here, its rows kept as they were with those cells empty. Every file is checked before
anything is written, so a refused merge leaves this checkout as it was. Side files that experiments write next
to the rows (TENSILE's several-jobs timelines and their plots, TENSILE's planning snapshots)
are copied when absent. When a
different file of that name is here already (the same setting measured in another run, by
code that named these files per setting only), the incoming one is copied under its name plus
the date of the row that names it (``..._20261130T042653.png``), and the rows' file reference
(``extra.timeline_csv`` / ``extra.plot_png``, never a measured value) names the new file. A
differing file that no row names is refused. Reports, other plots and traces are not copied:
rebuild the report here afterwards (``python -m experiments.report``).
"""
from __future__ import annotations

import argparse
import csv
import filecmp
import fnmatch
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from experiments.store import COLUMNS, ResultStore, date_stamp, make_row, read_rows

__all__ = ["MergeReport", "merge_results", "main"]

REPO = Path(__file__).resolve().parents[1]
# Files experiments write beside the rows, kept byte for byte: TENSILE's several-jobs
# memory timelines and their plots (drawn at run time from samples that only the timeline
# keeps). Every other CSV there holds rows.
SIDE_FILES = ("tensile_multi_timeline_*.csv", "tensile_multi_*.png", "snapshot_tensile_*.json.gz")
# The keys of a row's ``extra`` that name its side files (by file name; ``snapshot_path``,
# before 2026-12-01: by the path on the host that wrote it).
SIDE_FILE_KEYS = ("timeline_csv", "plot_png", "snapshot_file", "snapshot_path")


@dataclass
class MergeReport:
    """What a merge appended, skipped and copied, per destination file."""

    appended: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    copied: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)
    widened: dict[str, list[str]] = field(default_factory=dict)   # file -> columns added here

    def __str__(self) -> str:
        lines = [f"{name}: {n} row(s) appended, {self.skipped.get(name, 0)} already there"
                 for name, n in sorted(self.appended.items())]
        lines += [f"{name}: copied" + (f" as {self.renamed[name]} (a different file of that name "
                                       "is here)" if name in self.renamed else "")
                  for name in self.copied]
        lines += [f"{name}: widened by {', '.join(cols)} (empty in the rows already there)"
                  for name, cols in self.widened.items()]
        return "\n".join(lines) or "nothing to merge"


def merge_results(source: Path, dest: Path, dry_run: bool = False) -> MergeReport:
    """Append ``source/<gpu>/*.csv`` rows missing from ``dest/<gpu>/`` (see the module notes).

    Raises ``ValueError`` when ``source`` holds no result files or a file's column list
    differs from its namesake's here, and ``FileExistsError`` when a side file differs.
    """
    source, dest = Path(source), Path(dest)
    files = sorted(p for p in source.glob("*/*") if p.is_file())
    if not any(p.suffix == ".csv" for p in files):
        raise ValueError(f"{source}: expected result files <gpu>/<name>.csv under it, found none")
    report = MergeReport()
    row_files = [p for p in files
                 if p.suffix == ".csv" and not any(fnmatch.fnmatch(p.name, s) for s in SIDE_FILES)]
    # Column lists first, all of them: a refusal must come before anything is written.
    widen = {path: _columns_to_add(path, dest / path.relative_to(source)) for path in row_files}
    # Side files next: a side file copied under a new name changes the rows that name it.
    renames: dict[Path, dict[str, str]] = {}        # per <gpu> folder: old name -> new name
    for path in files:
        if any(fnmatch.fnmatch(path.name, pattern) for pattern in SIDE_FILES):
            new_name = _copy_side_file(path, dest / path.relative_to(source), source, report, dry_run)
            if new_name != path.name:
                renames.setdefault(path.parent, {})[path.name] = new_name
    for path in row_files:        # report, plots and traces are not copied: rebuilt here
        rel = path.relative_to(source)
        target = dest / rel
        header = _header(path)
        if widen[path]:
            report.widened[str(rel)] = widen[path]
            if not dry_run:
                _widen(target, header)
        rows = read_rows(path)
        # in the source's column order, cells a widening adds empty (as in a dry run,
        # which leaves the file narrow)
        have = {tuple(r.get(c, "") for c in header) for r in read_rows(target)}
        if header == COLUMNS:   # measurement rows: through the store (normalised, locked)
            rows = [_renamed_side_files(r, renames.get(path.parent, {})) for r in rows]
            new = [r for r in rows if tuple(make_row(**r).values()) not in have]
        else:                   # an experiment's own table (the headroom's): line for line
            new = [r for r in rows if tuple(r.values()) not in have]
        report.appended[str(rel)] = len(new)
        report.skipped[str(rel)] = len(rows) - len(new)
        if dry_run or not new:
            continue
        if header == COLUMNS:
            store = ResultStore(target)
            for r in new:
                store.append(r)
        else:
            _append_plain(target, header, new)
    return report


def _header(path: Path) -> list[str] | None:
    if not path.exists() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def _columns_to_add(path: Path, target: Path) -> list[str]:
    """The columns ``target`` must gain to take ``path``'s rows: none when the lists agree
    (or ``target`` is new); ``path``'s extra ones for an experiment's own table that lacks
    only those. Raises ``ValueError`` for any other difference."""
    header, target_header = _header(path), _header(target)
    if target_header is None or header == target_header:
        return []
    added = [c for c in header if c not in target_header]
    if header != COLUMNS and target_header != COLUMNS and added and \
            [c for c in header if c in target_header] == target_header:
        return added
    raise ValueError(f"{path} has columns {header}, but {target} has {target_header}: "
                     "files of two column lists are never mixed (an experiment's own table "
                     "may only gain columns, its old ones in the same order)")


def _widen(target: Path, header: list[str]) -> None:
    """Rewrite ``target`` with ``header``; its rows keep every cell, the new columns empty."""
    rows = read_rows(target)
    tmp = target.with_name(target.name + ".widening")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(target)


def _append_plain(target: Path, header: list[str], rows: list[dict]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    new_file = _header(target) is None
    with target.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, lineterminator="\n")
        if new_file:
            writer.writeheader()
        writer.writerows(rows)


def _copy_side_file(path: Path, target: Path, source: Path, report: MergeReport,
                    dry_run: bool) -> str:
    """Copy one side file unless an identical one is here; returns the name it has here."""
    rel = str(path.relative_to(source))
    if target.exists() and not filecmp.cmp(path, target, shallow=False):
        stamp = _date_of_row_naming(path)
        if stamp is None:
            raise FileExistsError(f"{target} exists and differs from {path}, and no row there "
                                  "names it: raw files are never overwritten; move one aside")
        stem, ext = _split_ext(target.name)
        target = target.with_name(f"{stem}_{stamp}{ext}")
        if target.exists() and not filecmp.cmp(path, target, shallow=False):
            raise FileExistsError(f"{target} exists and differs from {path}: raw files are "
                                  "never overwritten; move one aside")
        report.renamed[rel] = target.name
    if target.exists():
        return target.name             # merged before
    report.copied.append(rel)
    if not dry_run:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return target.name


def _split_ext(name: str) -> tuple[str, str]:
    """``name`` as (stem, extension), ``.json.gz`` whole (names hold other dots: ``_0.1_``)."""
    if name.endswith(".json.gz"):
        return name[:-len(".json.gz")], ".json.gz"
    return Path(name).stem, Path(name).suffix


def _names(extra: dict) -> dict[str, str]:
    """The side files ``extra`` names: key -> file name."""
    return {k: Path(extra[k]).name for k in SIDE_FILE_KEYS if isinstance(extra.get(k), str)}


def _date_of_row_naming(side_file: Path) -> str | None:
    """``YYYYMMDDTHHMMSS`` of the (last) row beside ``side_file`` whose extra names it."""
    stamp = None
    for csv_path in sorted(side_file.parent.glob("*.csv")):
        if _header(csv_path) != COLUMNS:
            continue
        for row in read_rows(csv_path):
            extra = json.loads(row["extra"]) if row.get("extra") else {}
            if side_file.name in _names(extra).values():
                stamp = date_stamp(row["date"])
    return stamp


def _renamed_side_files(row: dict, renames: dict[str, str]) -> dict:
    """``row`` with its extra's side-file names replaced by the names they were copied as."""
    if not renames or not row.get("extra"):
        return row
    extra = json.loads(row["extra"])
    named = {k: renames[v] for k, v in _names(extra).items() if v in renames}
    if not named:
        return row
    extra.update(named)
    return {**row, "extra": json.dumps(extra, sort_keys=True)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="a results folder from another host (<gpu>/*.csv)")
    ap.add_argument("--into", type=Path, default=REPO / "results",
                    help="this checkout's results folder (default: %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="only say what would be appended")
    args = ap.parse_args(argv)
    try:
        print(merge_results(args.source, args.into, args.dry_run))
    except (ValueError, FileExistsError) as e:   # nothing to merge, or files that must not mix
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
