"""Portable baselines: one run as one file (`evalpipe runs export` / `runs import`).

The file is an uncompressed tar (Parquet members are compressed already) holding:

- `manifest.json`: `{"format": "evalpipe-run-export", "format_version": 1, "run_id",
  "suite_version", "files": {member: sha256}}`, the member every other one is checked against;
- `run.json`: the `runs` row (with its summary), its `aggregates` rows, and the suite's
  `suites` and `cases` rows;
- `samples.parquet`: every stored sample of the run (the `samples` columns);
- `snapshot.parquet`: the suite's snapshot, byte for byte.

Import checks the whole file before it writes anything: a file that is not such an archive
(foreign), or whose members do not match their checksums, whose JSON is nested deeper than
any user's JSON may be or has a field of another type or shape (the run's summary a
`RunSummary`), whose snapshot does not hash to its version, or whose samples do not belong
to the run (damaged), is refused as bad input; a value its column cannot take rolls the
import back whole.
Rows go in with `ON CONFLICT DO NOTHING`, so importing twice changes nothing; columns one
side has and the other lacks (a newer or older schema) are left to their defaults.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from storage import db, foreign_parquet
from storage.db import Database
from storage.runs import Runs
from storage.snapshots import Snapshots, read_snapshot_file
from tasks.files import atomic_path
from tasks.models import InputError
from tasks.run.samples import SAMPLE_COLUMNS, SAMPLE_SCHEMA
from tasks.run.summary import RunSummary
from tasks.suites.input_limits import parse_json

# A file holds each output whole: how this home stores it (`output_sha`, chunks) is its own.
EXPORTED_COLUMNS = tuple(c for c in SAMPLE_COLUMNS if c != "output_sha")

FORMAT = "evalpipe-run-export"
FORMAT_VERSION = 1
MEMBERS = ("run.json", "samples.parquet", "snapshot.parquet")
KNOWN_MEMBERS = ("manifest.json", *MEMBERS)
# The process that ran a run is another machine's: an imported run has none.
LOCAL_RUN_COLUMNS = ("pid", "host", "process_started")


IMPORT_MAX_BYTES_ENV = "EVALPIPE_IMPORT_MAX_BYTES"
DEFAULT_IMPORT_MAX_BYTES = 1 << 30
_CHUNK = 1 << 20
_WRITE_ROWS = 64  # samples read from the database and written at a time


def import_max_bytes() -> int:
    """The cap on an import: on the archive, on its members together, and on the samples
    and snapshot once decompressed (`EVALPIPE_IMPORT_MAX_BYTES`, default 1 GiB)."""
    raw = os.environ.get(IMPORT_MAX_BYTES_ENV)
    if not raw:
        return DEFAULT_IMPORT_MAX_BYTES
    if not raw.isdigit() or int(raw) <= 0:
        raise InputError(f"{IMPORT_MAX_BYTES_ENV}={raw!r} is not a positive whole number of bytes")
    return int(raw)


def _over_cap(path: Path, what: str, size: int, cap: int) -> InputError:
    return InputError(f"{path}: {what} is {size:,} bytes, over the {cap:,}-byte cap on an import"
                      f" ({IMPORT_MAX_BYTES_ENV})")


@contextmanager
def _members(path: Path, cap: int) -> Iterator[tuple[dict[str, Path], dict[str, Any]]]:
    """The archive's members, each streamed to a file of a scratch directory and checked
    against the manifest's sha256, and the manifest. Each header is checked before its member is read: only
    the known members, once each, regular files (not sparse), within the cap together."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    if size > cap + _CHUNK:  # the members within the cap, and their headers
        raise _over_cap(path, "the file", size, cap)
    with tempfile.TemporaryDirectory(prefix="evalpipe-import-") as scratch:
        files: dict[str, Path] = {}
        digests: dict[str, str] = {}
        try:
            with tarfile.open(path, "r:") as tar:
                total = 0
                for member in tar:  # one header at a time: getmembers() would read them all
                    total += _check_member(path, member, files, total, cap)
                    files[member.name] = Path(scratch, member.name)
                    digests[member.name] = _copy(tar.extractfile(member), files[member.name], member.size)
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise InputError(f"{path}: not an evalpipe run export, or a damaged one ({exc})") from None
        manifest = _manifest(path, files)
        for name in MEMBERS:
            if name not in files:
                raise InputError(f"{path}: damaged evalpipe export ({name} is missing)")
            if digests[name] != manifest["files"].get(name):
                raise InputError(f"{path}: damaged evalpipe export ({name} does not match its checksum)")
        yield files, manifest


def _check_member(path: Path, member: tarfile.TarInfo, seen: dict[str, Path], total: int, cap: int) -> int:
    """The member's size, if it may be read; else bad input naming it."""
    name = member.name
    if name not in KNOWN_MEMBERS:
        raise InputError(f"{path}: unexpected member {name!r} (an evalpipe export holds only "
                         f"{', '.join(KNOWN_MEMBERS)})")
    if name in seen:
        raise InputError(f"{path}: member {name!r} appears twice")
    if member.issparse():
        raise InputError(f"{path}: member {name!r} is a sparse file ({member.size:,} bytes when read)")
    if not member.isreg():
        raise InputError(f"{path}: member {name!r} is not a regular file")
    if total + member.size > cap:
        raise _over_cap(path, f"member {name!r} (with those before it)", total + member.size, cap)
    return member.size


def _copy(source: IO[bytes] | None, target: Path, size: int) -> str:
    """Stream `size` bytes to `target`; their sha256."""
    digest = hashlib.sha256()
    copied = 0
    with target.open("wb") as out:
        while source is not None and (chunk := source.read(min(_CHUNK, size - copied))):
            digest.update(chunk)
            out.write(chunk)
            copied += len(chunk)
    if copied != size:
        raise EOFError(f"{target.name} is cut short")
    return digest.hexdigest()


def _json_member(path: Path, files: dict[str, Path], name: str) -> Any:
    """A JSON member parsed within the depth and integer limits of every user's JSON."""
    try:
        return parse_json(files[name].read_text(encoding="utf-8"))
    except ValueError as exc:  # malformed, not UTF-8, too deep, an integer too long
        raise InputError(f"{path}: damaged evalpipe export ({name}: {exc})") from None


def _manifest(path: Path, files: dict[str, Path]) -> dict[str, Any]:
    if "manifest.json" not in files:
        raise InputError(f"{path}: not an evalpipe run export (no evalpipe manifest)")
    manifest = _json_member(path, files, "manifest.json")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InputError(f"{path}: not an evalpipe run export (no evalpipe manifest)")
    version = manifest.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise InputError(f"{path}: export format version {version!r}; this evalpipe reads {FORMAT_VERSION}")
    listed = manifest.get("files")
    for key, value in (("run_id", manifest.get("run_id")), ("suite_version", manifest.get("suite_version"))):
        if not isinstance(value, str):
            raise InputError(f"{path}: damaged evalpipe export (manifest.json: {key} is not a string)")
    if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
        raise InputError(f"{path}: damaged evalpipe export (manifest.json: files is not a mapping of checksums)")
    return manifest


# run.json's rows: a column's value is a scalar or a list of them (`ks`, `slices`); the
# run's `config` and `summary` are objects, the summary a `RunSummary`. A row of another
# shape would fail in DuckDB half way through the import, or later in whatever reads it.
_Scalar = StrictStr | StrictInt | StrictFloat | StrictBool | None
_Cell = _Scalar | list[_Scalar]


class _RunRow(BaseModel):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, _Cell]
    run_id: StrictStr
    suite_version: StrictStr
    config: dict[str, Any] | None = None
    summary: dict[str, Any]


class _RunDoc(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run: _RunRow
    suite: list[dict[str, _Cell]]
    cases: list[dict[str, _Cell]]
    aggregates: list[dict[str, _Cell]]


def _run_doc(path: Path, files: dict[str, Path]) -> dict[str, Any]:
    """run.json, each field of the type its column takes; bad input naming the first that is not."""
    try:
        doc = _RunDoc.model_validate(_json_member(path, files, "run.json")).model_dump()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise InputError(f"{path}: damaged evalpipe export (run.json: {where}: {first['msg']})") from None
    try:
        RunSummary.read(doc["run"]["summary"])
    except InputError as exc:  # naming the first bad key
        raise InputError(f"{path}: damaged evalpipe export (run.json: {exc})") from None
    return doc


def _decoded_samples(path: Path, files: dict[str, Path], cap: int) -> pa.Table:
    """The samples, once both Parquet members are known to decode within the cap: their
    footers say so (read first), and a child process under a memory limit sized from the
    cap decoded them, counting (`storage.foreign_parquet`), before this one does."""
    names = ("samples.parquet", "snapshot.parquet")
    for name in names:
        declared = foreign_parquet.declared_size(files[name])
        if declared > cap:
            raise _over_cap(path, f"member {name!r} decompressed", declared, cap)
    for name, probe in zip(names, foreign_parquet.probe([files[n] for n in names], cap), strict=True):
        if probe.memory:
            raise InputError(f"{path}: member {name!r} needs over {probe.limit:,} bytes of memory to decode, more"
                             f" than the {cap:,}-byte cap on an import allows ({IMPORT_MAX_BYTES_ENV})")
        if probe.error:
            raise InputError(f"{path}: damaged evalpipe export ({name}: {probe.error})")
        if probe.decoded > cap:
            raise _over_cap(path, f"member {name!r} decompressed", probe.decoded, cap)
    return foreign_parquet.read(files["samples.parquet"])


def _write_samples(con, run_id: str, target: Path) -> int:
    """Write the run's samples (EXPORTED_COLUMNS, each output whole) to a Parquet file, a
    batch of rows at a time: a run of outputs at the cap is never in memory whole."""
    schema = pa.schema([SAMPLE_SCHEMA.field(c) for c in EXPORTED_COLUMNS])
    written = 0
    # The chunks are read beside the rows streaming from `con`.
    with db.beside(con) as reader, pq.ParquetWriter(target, schema) as writer:
        rows = con.sql(f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE run_id = ?"
                       " ORDER BY case_id, sample_index", params=[run_id]).fetch_record_batch(_WRITE_ROWS)
        for batch in rows:
            whole = db.with_whole_outputs(reader, batch.to_pylist())
            writer.write_table(pa.Table.from_pylist(whole, schema=schema))
            written += len(whole)
    return written


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """A member as the format has it: only its name and size (no owner, mode or time of this machine)."""
    plain = tarfile.TarInfo(info.name)
    plain.size = info.size
    return plain


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


@dataclass(frozen=True)
class Exports:
    """Runs out of and into one home (`storage.store.Store.exports`): a run's row is found in
    `runs` and its suite's snapshot in `snapshots`."""

    db: Database
    runs: Runs
    snapshots: Snapshots

    def export_run(self, run_id: str, out: Path) -> dict[str, Any]:
        """Write `run_id` (id or prefix) to `out`; returns what was written."""
        run = self.runs.find(run_id)
        run_id = run["run_id"]
        if not run.get("summary"):
            raise InputError(f"run {run_id} has no summary (status {run['status']}): only a finished run can be exported")
        snapshot = self.snapshots.path(run["suite_version"])
        if not snapshot.exists():
            raise InputError(f"run {run_id}: the snapshot of suite {run['suite_version'][:12]} is missing from {snapshot.parent}")
        with tempfile.TemporaryDirectory(prefix="evalpipe-export-") as scratch:
            members = {"run.json": Path(scratch, "run.json"), "samples.parquet": Path(scratch, "samples.parquet"),
                       "snapshot.parquet": snapshot}
            with self.db.connect(read_only=True) as con:
                suite = _rows(con, "SELECT * FROM suites WHERE version = ?", run["suite_version"])
                cases = _rows(con, "SELECT * FROM cases WHERE suite_version = ?", run["suite_version"])
                aggregates = _rows(con, "SELECT * FROM aggregates WHERE run_id = ?", run_id)
                written = _write_samples(con, run_id, members["samples.parquet"])
            row = {k: v for k, v in run.items() if k not in LOCAL_RUN_COLUMNS}
            doc = {"run": row, "suite": suite, "cases": cases, "aggregates": aggregates}
            members["run.json"].write_bytes(json.dumps(doc, default=str).encode())
            manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "run_id": run_id,
                        "suite_version": run["suite_version"],
                        "files": {name: _sha256(file) for name, file in members.items()}}
            Path(scratch, "manifest.json").write_bytes(json.dumps(manifest, indent=1).encode())
            with atomic_path(out) as tmp, tarfile.open(tmp, "w") as tar:
                for name, file in {"manifest.json": Path(scratch, "manifest.json"), **members}.items():
                    tar.add(file, arcname=name, recursive=False, filter=_plain)
        return {"run_id": run_id, "path": str(out), "samples": written, "bytes": out.stat().st_size}

    def import_run(self, path: Path) -> dict[str, Any]:
        """Bring an exported run into this home; `imported` is false when it was already here
        (then nothing is written: a run id of this home is never added to by a file). The
        run is recorded in `imported_runs`, whose samples the cache never serves."""
        cap = import_max_bytes()
        with _members(path, cap) as (files, manifest):
            doc = _run_doc(path, files)
            run, version = doc["run"], manifest["suite_version"]
            try:
                samples = _decoded_samples(path, files, cap)  # the snapshot's size too, before it is read
            except InputError:
                raise
            except (ValueError, KeyError, TypeError, pa.ArrowException) as exc:
                raise InputError(f"{path}: damaged evalpipe export ({type(exc).__name__}: {exc})") from None
            if run.get("run_id") != manifest["run_id"] or run.get("suite_version") != version:
                raise InputError(f"{path}: damaged evalpipe export (its run does not match its manifest)")
            if samples.num_rows and set(samples["run_id"].unique().to_pylist()) != {run["run_id"]}:
                raise InputError(f"{path}: damaged evalpipe export (samples of another run)")
            with self.db.connect(read_only=True) as con:
                if con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run["run_id"]]).fetchone():
                    return {"run_id": run["run_id"], "imported": False, "samples": samples.num_rows,
                            "suite_version": version}
            origin = {"run_id": run["run_id"], "file": str(path.resolve()), "imported_at": db.now(),
                      "manifest_sha256": hashlib.sha256(files["manifest.json"].read_bytes()).hexdigest()}
            with self.db.connect() as con:
                con.execute("BEGIN")
                new = not con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run["run_id"]]).fetchone()
                if new:  # else another import won the race: it wrote the same rows
                    try:
                        self._insert_run(con, doc, samples, origin, version)
                    except duckdb.Error as exc:  # a value its column cannot take ("n": "many")
                        con.execute("ROLLBACK")
                        problem = str(exc).splitlines()[0]
                        raise InputError(f"{path}: damaged evalpipe export (run.json: {problem})") from None
                    # Last, so that a refused row leaves no snapshot behind.
                    self._import_snapshot(path, version, files["snapshot.parquet"])
                con.execute("COMMIT")
        return {"run_id": run["run_id"], "imported": new, "samples": samples.num_rows, "suite_version": version}

    def _insert_run(self, con, doc: dict[str, Any], samples: pa.Table, origin: dict[str, str], version: str) -> None:
        suites = [{**row, "snapshot_path": str(self.snapshots.path(version))} for row in doc["suite"]]  # here
        for table, rows in (("suites", suites), ("cases", doc["cases"]), ("runs", [_run_row(doc["run"])]),
                            ("imported_runs", [origin])):
            _insert(con, table, rows)
        _insert(con, "aggregates", doc["aggregates"], keyed=False)  # no key: written with the run, once
        columns = [c for c in _columns(con, "samples") if c in samples.column_names and c in EXPORTED_COLUMNS]
        db.insert_rows(con, samples.select(columns))

    def imported_from(self, run_id: str) -> dict[str, str] | None:
        """Where an imported run's outputs came from (`file`, `manifest_sha256`); None for a
        run of this home."""
        with self.db.connect(read_only=True) as con:
            row = con.execute("SELECT file, manifest_sha256 FROM imported_runs WHERE run_id = ?", [run_id]).fetchone()
        return {"file": row[0], "manifest_sha256": row[1]} if row else None

    def record_imported_outputs(self, run_id: str, origin: dict[str, str]) -> None:
        """Mark `run_id` as holding the outputs of an imported file (a rescore of an imported
        run): re-graded here, its outputs are still the file's, so they serve no cache."""
        with self.db.connect() as con:
            _insert(con, "imported_runs", [{**origin, "run_id": run_id, "imported_at": db.now()}])

    def _import_snapshot(self, path: Path, version: str, source: Path) -> None:
        target = self.snapshots.path(version)
        if target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp:
            shutil.copyfile(source, tmp)
            try:
                found = read_snapshot_file(tmp).version
            except Exception as exc:  # any failure to read it back is a damaged file
                raise InputError(f"{path}: damaged evalpipe export (its snapshot: {exc})") from None
            if found != version:
                raise InputError(f"{path}: damaged evalpipe export (its snapshot is suite {found[:12]}, not {version[:12]})")
