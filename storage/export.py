"""Portable baselines: one run as one file (`evalpipe runs export` / `runs import`).

The file is an uncompressed tar (Parquet members are compressed already) holding:

- `manifest.json`: `{"format": "evalpipe-run-export", "format_version": 1, "run_id",
  "suite_version", "files": {member: sha256}}`, the member every other one is checked against;
- `run.json`: the `runs` row (with its summary), its `aggregates` rows, and the suite's
  `suites` and `cases` rows;
- `samples.parquet`: every stored sample of the run (the `samples` columns);
- `snapshot.parquet`: the suite's snapshot, byte for byte.

Import checks the whole file before it writes anything: a file that is not such an archive
(foreign), or whose members do not match their checksums, whose snapshot does not hash to
its version, or whose samples do not belong to the run (damaged), is refused as bad input.
Rows go in with `ON CONFLICT DO NOTHING`, so importing twice changes nothing; columns one
side has and the other lacks (a newer or older schema) are left to their defaults.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage import db
from storage.db import Database
from storage.snapshots import Snapshots, read_snapshot_file
from tasks.files import atomic_path
from tasks.models import InputError
from tasks.run.samples import SAMPLE_COLUMNS

FORMAT = "evalpipe-run-export"
FORMAT_VERSION = 1
MEMBERS = ("run.json", "samples.parquet", "snapshot.parquet")
# The process that ran a run is another machine's: an imported run has none.
LOCAL_RUN_COLUMNS = ("pid", "host", "process_started")


def _read_members(path: Path) -> dict[str, Any]:
    """The archive's members, each checked against the manifest's sha256."""
    try:
        with tarfile.open(path, "r:") as tar:
            data = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise InputError(f"{path}: not an evalpipe run export, or a damaged one ({exc})") from None
    try:
        manifest = json.loads(data["manifest.json"])
        if manifest.get("format") != FORMAT:
            raise ValueError("another format")
    except (KeyError, ValueError, AttributeError):
        raise InputError(f"{path}: not an evalpipe run export (no evalpipe manifest)") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{path}: export format version {manifest.get('format_version')!r}; this evalpipe reads"
                         f" {FORMAT_VERSION}")
    for name in MEMBERS:
        if name not in data:
            raise InputError(f"{path}: damaged evalpipe export ({name} is missing)")
        if hashlib.sha256(data[name]).hexdigest() != manifest.get("files", {}).get(name):
            raise InputError(f"{path}: damaged evalpipe export ({name} does not match its checksum)")
    return {"manifest.json": manifest, **{name: data[name] for name in MEMBERS}}


def _run_row(run: dict[str, Any]) -> dict[str, Any]:
    row = dict(run)
    for key in ("config", "summary"):
        if row.get(key) is not None and not isinstance(row[key], str):
            row[key] = json.dumps(row[key])
    return row


def _rows(con, sql: str, *params: Any) -> list[dict[str, Any]]:
    cur = con.execute(sql, list(params))
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def _columns(con, table: str) -> list[str]:
    return [row[0] for row in con.execute(f"DESCRIBE {table}").fetchall()]


def _insert(con, table: str, rows: list[dict[str, Any]], *, keyed: bool = True) -> None:
    known = _columns(con, table)
    for row in rows:
        columns = [c for c in known if c in row]
        con.execute(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
                    + (" ON CONFLICT DO NOTHING" if keyed else ""), [row[c] for c in columns])


class Exports(Database, Snapshots):
    """Runs out of and into one home, as methods of `storage.store.Store`."""

    def export_run(self, run_id: str, out: Path) -> dict[str, Any]:
        """Write `run_id` (id or prefix) to `out`; returns what was written."""
        run = self.find_run(run_id)
        run_id = run["run_id"]
        if not run.get("summary"):
            raise InputError(f"run {run_id} has no summary (status {run['status']}): only a finished run can be exported")
        snapshot = self.snapshot_path(run["suite_version"])
        if not snapshot.exists():
            raise InputError(f"run {run_id}: the snapshot of suite {run['suite_version'][:12]} is missing from {snapshot.parent}")
        with self.connect(read_only=True) as con:
            suite = _rows(con, "SELECT * FROM suites WHERE version = ?", run["suite_version"])
            cases = _rows(con, "SELECT * FROM cases WHERE suite_version = ?", run["suite_version"])
            aggregates = _rows(con, "SELECT * FROM aggregates WHERE run_id = ?", run_id)
            samples = con.sql(f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE run_id = ? ORDER BY case_id, sample_index",
                              params=[run_id]).to_arrow_table()
        row = {k: v for k, v in run.items() if k not in LOCAL_RUN_COLUMNS}
        doc = {"run": row, "suite": suite, "cases": cases, "aggregates": aggregates}
        parquet = io.BytesIO()
        pq.write_table(samples, parquet)
        members = {"run.json": json.dumps(doc, default=str).encode(), "samples.parquet": parquet.getvalue(),
                   "snapshot.parquet": snapshot.read_bytes()}
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "run_id": run_id,
                    "suite_version": run["suite_version"],
                    "files": {name: hashlib.sha256(data).hexdigest() for name, data in members.items()}}
        with atomic_path(out) as tmp, tarfile.open(tmp, "w") as tar:
            for name, data in {"manifest.json": json.dumps(manifest, indent=1).encode(), **members}.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return {"run_id": run_id, "path": str(out), "samples": samples.num_rows, "bytes": out.stat().st_size}

    def import_run(self, path: Path) -> dict[str, Any]:
        """Bring an exported run into this home; `imported` is false when it was already here."""
        members = _read_members(path)
        manifest = members.pop("manifest.json")
        try:
            doc = json.loads(members["run.json"])
            run, version = doc["run"], manifest["suite_version"]
            samples = pq.read_table(pa.BufferReader(members["samples.parquet"]))
        except (ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            raise InputError(f"{path}: damaged evalpipe export ({type(exc).__name__}: {exc})") from None
        if run.get("run_id") != manifest["run_id"] or run.get("suite_version") != version:
            raise InputError(f"{path}: damaged evalpipe export (its run does not match its manifest)")
        if samples.num_rows and set(samples["run_id"].unique().to_pylist()) != {run["run_id"]}:
            raise InputError(f"{path}: damaged evalpipe export (samples of another run)")
        self._import_snapshot(path, version, members["snapshot.parquet"])
        with self.connect() as con:
            con.execute("BEGIN")
            new = not con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run["run_id"]]).fetchone()
            suites = [{**row, "snapshot_path": str(self.snapshot_path(version))} for row in doc["suite"]]  # here, not there
            for table, rows in (("suites", suites), ("cases", doc["cases"]), ("runs", [_run_row(run)])):
                _insert(con, table, rows)
            if new:  # aggregates have no key: written with the run, once
                _insert(con, "aggregates", doc["aggregates"], keyed=False)
            columns = [c for c in _columns(con, "samples") if c in samples.column_names and c not in db.DERIVED_COLUMNS]
            db.insert_rows(con, samples.select(columns))
            con.execute("COMMIT")
        return {"run_id": run["run_id"], "imported": new, "samples": samples.num_rows, "suite_version": version}

    def _import_snapshot(self, path: Path, version: str, data: bytes) -> None:
        target = self.snapshot_path(version)
        if target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp:
            tmp.write_bytes(data)
            try:
                found = read_snapshot_file(tmp).version
            except Exception as exc:  # any failure to read it back is a damaged file
                raise InputError(f"{path}: damaged evalpipe export (its snapshot: {exc})") from None
            if found != version:
                raise InputError(f"{path}: damaged evalpipe export (its snapshot is suite {found[:12]}, not {version[:12]})")

