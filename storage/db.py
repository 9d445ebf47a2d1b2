"""The DuckDB file: suites, cases, runs, samples, aggregates (docs/contract.md §8).

Connections are short-lived and opened per operation: DuckDB lets one process hold the
file at a time, and several `evalpipe run`s or Prefect workers may share one home. A
process that finds the file locked waits and retries quietly, for `EVALPIPE_DB_LOCK_WAIT_S`
seconds (default 30); past that, and for a damaged file or a full disk, it raises a
`PlatformError` naming the file and what to do. A damaged file is never written to.
`Database` is the file; the parts of `storage.store.Store` hold its tables' queries
(`storage.runs`, `storage.samples`, `storage.snapshots`, ...).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import random
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from storage import disk_full, process
from tasks.models import InputError, PlatformError
from tasks.run.samples import output_ddl, sample_ddl

# How many characters of each output `output_head` keeps (`Samples.failing` reads no more).
OUTPUT_HEAD_CHARS = 4096
# An output longer than this many characters is stored once, in chunks of this many, in
# `output_chunks` (by the sha256 of its text, the row's `output_sha`; its `output` is null):
# DuckDB reads a text column a vector (2,048 values) at a time, so a column of whole outputs
# at the cap costs gigabytes to scan, and a column of chunks at most 2,048 chunks.
OUTPUT_CHUNK_CHARS = 8192
# Columns of the samples table beyond the sample row (SAMPLE_SCHEMA): derived from it on
# every insert, never exported (an import derives them again).
DERIVED_COLUMNS = {"output_head": f"left(output, {OUTPUT_HEAD_CHARS})"}

# The schema, as the steps that build it: step i brings a file from schema version i to
# i + 1, recorded in `schema_version`. A new file takes every step; an older file takes the
# steps it lacks, in place. Steps are never edited once released: a change is a new step.
MIGRATIONS: tuple[str, ...] = (
    f"""
CREATE TABLE IF NOT EXISTS suites (
    version VARCHAR PRIMARY KEY, name VARCHAR, n_cases INTEGER, snapshot_path VARCHAR,
    created_at TIMESTAMPTZ);
CREATE TABLE IF NOT EXISTS cases (
    suite_version VARCHAR, case_id VARCHAR, case_hash VARCHAR, slices VARCHAR[], tags VARCHAR[],
    PRIMARY KEY (suite_version, case_id));
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY, suite_version VARCHAR, suite_name VARCHAR, agent VARCHAR,
    agent_fingerprint VARCHAR, n INTEGER, ks INTEGER[], seed BIGINT, status VARCHAR,
    started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, flow_run_id VARCHAR, config JSON,
    summary JSON);
{sample_ddl()};
CREATE INDEX IF NOT EXISTS samples_cache_key ON samples (cache_key);
CREATE TABLE IF NOT EXISTS aggregates (
    run_id VARCHAR, slice VARCHAR, metric VARCHAR, value DOUBLE, ci_lo DOUBLE, ci_hi DOUBLE);
""",
    # Who runs a run, so that a run whose process is gone reads as interrupted.
    """
ALTER TABLE runs ADD COLUMN IF NOT EXISTS pid INTEGER;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS host VARCHAR;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS process_started VARCHAR;
""",
    # Judge calibrations (storage/calibrations.py), keyed by judge fingerprint. Files from
    # before this step may already have the table, which `judge calibrate` created itself.
    """
CREATE TABLE IF NOT EXISTS calibrations (
    judge_fingerprint VARCHAR, judge VARCHAR, suite_version VARCHAR, truth VARCHAR,
    created_at TIMESTAMPTZ, result JSON);
""",
    # Two-level cache and usage (docs/storage.md): a sample's output key, so that a stored
    # output is found whatever it was graded by, and what its agent call took and cost.
    # Older rows keep nulls: their seeds came from the suite version, so no new key
    # finds them; they stay readable by every command.
    """
ALTER TABLE samples ADD COLUMN IF NOT EXISTS output_key VARCHAR;
ALTER TABLE samples ADD COLUMN IF NOT EXISTS latency_s DOUBLE;
ALTER TABLE samples ADD COLUMN IF NOT EXISTS input_tokens BIGINT;
ALTER TABLE samples ADD COLUMN IF NOT EXISTS output_tokens BIGINT;
ALTER TABLE samples ADD COLUMN IF NOT EXISTS usage_model VARCHAR;
ALTER TABLE samples ADD COLUMN IF NOT EXISTS cost_usd DOUBLE;
CREATE INDEX IF NOT EXISTS samples_output_key ON samples (output_key);
""",
    # The head of each output, so that what shows a few thousand characters of many outputs
    # (`report`) never reads the outputs themselves: DuckDB reads a string column a vector
    # (2,048 rows) at a time, and at the output cap that is gigabytes.
    f"""
ALTER TABLE samples ADD COLUMN IF NOT EXISTS output_head VARCHAR;
UPDATE samples SET output_head = left(output, {OUTPUT_HEAD_CHARS});
""",
    # Drawn outputs not yet graded (storage/outputs.py): stored as the agent returns them.
    f"""
{output_ddl()};
CREATE INDEX IF NOT EXISTS outputs_output_key ON outputs (output_key);
""",
    # Runs brought in by `runs import` (storage/export.py), and the file each came from: their
    # samples never serve the cache (`FROM_THIS_HOME`), and a baseline says it is one.
    """
CREATE TABLE IF NOT EXISTS imported_runs (
    run_id VARCHAR PRIMARY KEY, file VARCHAR, manifest_sha256 VARCHAR, imported_at TIMESTAMPTZ);
""",
    # Long outputs stored once, in chunks (OUTPUT_CHUNK_CHARS), by the sha256 of their text;
    # the rows refer to them by `output_sha`. Rows stored before keep their outputs inline,
    # read as they were. `sample_outputs` gives every sample's output whole, for SQL readers.
    """
ALTER TABLE samples ADD COLUMN IF NOT EXISTS output_sha VARCHAR;
ALTER TABLE outputs ADD COLUMN IF NOT EXISTS output_sha VARCHAR;
CREATE TABLE IF NOT EXISTS output_chunks (
    output_sha VARCHAR, chunk INTEGER, text VARCHAR, PRIMARY KEY (output_sha, chunk));
CREATE OR REPLACE VIEW sample_outputs AS
    SELECT run_id, case_id, sample_index, coalesce(output, (SELECT string_agg(c.text, '' ORDER BY c.chunk)
        FROM output_chunks c WHERE c.output_sha = samples.output_sha)) AS output FROM samples;
""",
    # Every tool call of every stored trajectory (OpenAI chat messages: tasks/trajectory.py),
    # with the result that answered it: `step` is the model turn's position in the trajectory,
    # `arguments` the call's JSON text as the model sent it.
    """
CREATE OR REPLACE VIEW tool_calls AS
WITH entries AS (
    SELECT s.run_id, s.case_id, s.sample_index, e.step, e.entry FROM samples s, LATERAL (
        SELECT generate_subscripts(arr, 1) - 1 AS step, unnest(arr) AS entry
        FROM (SELECT json_extract(s.trace, '$.trajectory.entries[*]') AS arr)) e
    WHERE s.trace LIKE '%"trajectory"%'),
calls AS (
    SELECT run_id, case_id, sample_index, step, c.call FROM entries, LATERAL (
        SELECT unnest(json_extract(entry, '$.tool_calls[*]')) AS call) c
    WHERE entry->>'$.role' = 'assistant'),
results AS (
    SELECT run_id, case_id, sample_index, entry->>'$.tool_call_id' AS call_id,
        entry->>'$.content' AS result, entry->>'$.error' AS error
    FROM entries WHERE entry->>'$.role' = 'tool')
SELECT c.run_id, c.case_id, c.sample_index AS sample, c.step, c.call->>'$.id' AS call_id,
    c.call->>'$.function.name' AS name, c.call->>'$.function.arguments' AS arguments, r.result, r.error
FROM calls c LEFT JOIN results r ON r.run_id = c.run_id AND r.case_id = c.case_id
    AND r.sample_index = c.sample_index AND r.call_id = c.call->>'$.id';
""",
)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(con: duckdb.DuckDBPyConnection) -> int:
    """Bring the file to `SCHEMA_VERSION`; returns the version it was at."""
    # Read first: every connection that writes comes through here, and the CREATE, which a
    # file at the current version does not need, was 0.4 ms of a write connection's 3.1 ms.
    try:
        ((current,),) = con.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchall()
    except duckdb.CatalogException:  # a new file
        con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER)")
        current = 0
    if current < SCHEMA_VERSION:
        con.execute("BEGIN")
        for step in MIGRATIONS[current:]:
            con.execute(step)
        con.execute("DELETE FROM schema_version")
        con.execute("INSERT INTO schema_version VALUES (?)", [SCHEMA_VERSION])
        con.execute("COMMIT")
    return current


# A sample whose agent call failed has no output to reuse: a re-run draws it again.
NOT_CACHED_STATUS = "agent_error"
# Only samples drawn and graded in this home serve its cache: an imported file's verdicts
# and outputs are whatever its author wrote (a forged "passed" would pass a fresh run).
FROM_THIS_HOME = "samples.run_id NOT IN (SELECT run_id FROM imported_runs)"


LOCK_WAIT_ENV = "EVALPIPE_DB_LOCK_WAIT_S"
DEFAULT_LOCK_WAIT_S = 30.0


def lock_wait_s() -> float:
    raw = os.environ.get(LOCK_WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_WAIT_S
    try:
        wait = float(raw)
    except ValueError:
        wait = -1.0
    if not wait >= 0:
        raise InputError(f"{LOCK_WAIT_ENV}={raw!r}: expected a number of seconds, 0 or more")
    return wait


def _current(con: duckdb.DuckDBPyConnection) -> bool:
    try:
        ((version,),) = con.execute("SELECT max(version) FROM schema_version").fetchall()
    except duckdb.CatalogException:
        return False
    return version == SCHEMA_VERSION


@dataclass
class _Attachment:
    alias: str
    read_only: bool
    users: int = 0


# One DuckDB instance per process, to which a home's file is attached while a connection to
# it is open and detached after (releasing the file's lock for other processes): a new
# instance costs ~12 ms of CPU building its catalog of built-in functions, an attachment
# 1-2 ms, and a run opens its file 9 times, then once per write. Threads share an attachment
# (a reader that of a writer; a writer waits for the readers of a read-only one), and take
# and give them back one at a time.
_OPENING = threading.Lock()
_instance: duckdb.DuckDBPyConnection | None = None
_attached: dict[str, _Attachment] = {}
_aliases = itertools.count()


def _shared_instance() -> duckdb.DuckDBPyConnection:
    global _instance
    if _instance is None:
        _instance = duckdb.connect(":memory:")
    return _instance


def _forget_after_fork() -> None:
    """A forked child makes its own instance. Its copy of the parent's holds the parent's
    files and none of its threads: it is never used, and never freed, even at exit (freeing
    it would checkpoint the parent's files from the child)."""
    global _OPENING, _instance, _attached
    if _instance is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_instance))
    _OPENING, _instance, _attached = threading.Lock(), None, {}


os.register_at_fork(after_in_child=_forget_after_fork)


def _attach(key: str, read_only: bool) -> duckdb.DuckDBPyConnection | None:
    """A connection to the file `key`, attached as its default database; None while this
    process's readers hold it read-only and a writer asks."""
    instance = _shared_instance()
    entry = _attached.get(key)
    if entry is not None and entry.read_only and not read_only:
        return None
    if entry is None:
        alias = f"home{next(_aliases)}"
        quoted = key.replace("'", "''")
        instance.execute(f"ATTACH '{quoted}' AS {alias}" + (" (READ_ONLY)" if read_only else ""))
        entry = _attached[key] = _Attachment(alias, read_only)
    entry.users += 1
    try:
        con = instance.cursor()
        con.execute(f"USE {entry.alias}")
    except BaseException:
        _give_back(key)
        raise
    return con


def _give_back(key: str) -> None:
    entry = _attached.get(key)
    if entry is None:  # its instance was dropped meanwhile
        return
    entry.users -= 1
    if entry.users == 0:
        del _attached[key]
        try:
            _shared_instance().execute(f"DETACH {entry.alias}")  # checkpoints, then unlocks
        except BaseException:
            _drop_instance()  # never leave the file attached (and locked) by a failed detach
            raise


def _drop_instance() -> None:
    global _instance, _attached
    instance, _instance, _attached = _instance, None, {}
    if instance is not None:
        try:
            instance.close()
        except duckdb.Error:
            pass


def _open(path: Path, read_only: bool, wait_s: float) -> duckdb.DuckDBPyConnection:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with _OPENING:
                con = _attach(str(path), read_only)
            if con is not None:
                return con
            held = f"Conflicting lock is held in this process's readers (PID {os.getpid()})"
        except duckdb.IOException as exc:
            if "could not set lock" not in str(exc).lower():
                raise
            held = str(exc)
        if time.monotonic() > deadline:
            raise PlatformError(_locked(path, held, wait_s)) from None
        time.sleep(0.05 + random.random() * 0.1)


@contextmanager
def beside(con: duckdb.DuckDBPyConnection) -> Iterator[duckdb.DuckDBPyConnection]:
    """A second connection to the home `con` is on, for queries beside one streaming from
    `con` (made before that one starts: asking `con` its database would end the stream)."""
    ((name,),) = con.execute("SELECT current_database()").fetchall()
    second = con.cursor()
    try:
        second.execute(f"USE {name}")
        yield second
    finally:
        second.close()


def _close(path: Path, con: duckdb.DuckDBPyConnection) -> None:
    with _OPENING:
        try:
            con.close()
        finally:
            _give_back(str(path))


def _locked(path: Path, message: str, wait_s: float) -> str:
    # DuckDB names the holder: 'Conflicting lock is held in /usr/bin/python3 (PID 123)'.
    held = re.search(r"held in (.*?) \(PID (\d+)\)", message)
    holder = "another process"
    if held:
        pid = int(held.group(2))
        holder = f"PID {pid} ({process.describe(pid) or held.group(1)})"
    return (f"database {path} is locked by {holder}; gave up after {wait_s:g} s: let it finish or"
            f" stop it, then run again ({LOCK_WAIT_ENV} sets the wait)")


# What DuckDB raises when a signal's handler raised during a query.
_QUERY_INTERRUPTED = "Query interrupted"
# DuckDB's words for a file it cannot trust: bad header, short read, failed checksum.
_DAMAGED = ("not a valid duckdb database", "could not read enough bytes", "corrupt", "checksum")


@contextmanager
def _platform_errors(path: Path) -> Iterator[None]:
    """DuckDB failures that are the machine's, not evalpipe's, as one-line `PlatformError`s;
    anything else (a query bug) propagates as it is."""
    try:
        yield
    except duckdb.Error as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        lowered = detail.lower()
        # The cause may be on a later line: a DETACH whose checkpoint failed says so first.
        whole = str(exc).lower()
        if "no space left on device" in whole or "disk is full" in whole:
            raise disk_full(path) from None
        if any(word in lowered for word in _DAMAGED) or isinstance(
            exc, duckdb.SerializationException | duckdb.InternalException
        ):
            raise PlatformError(
                f"database {path} is damaged ({detail}): evalpipe leaves it as it is; move it aside to"
                " start afresh, or restore it from a backup"
            ) from None
        if isinstance(exc, duckdb.IOException):
            raise PlatformError(f"cannot use database {path}: {detail}") from None
        raise
    except RuntimeError as exc:
        # A signal that arrives during a query (Ctrl-C, SIGTERM) runs its handler, whose
        # exception DuckDB drops, ending the query with this error instead: it is the stop it
        # was, so that the run is recorded `interrupted` (not `failed`) and resumable.
        if str(exc) == _QUERY_INTERRUPTED:
            raise KeyboardInterrupt from exc
        raise


def now() -> datetime:
    return datetime.now(UTC)


def insert_rows(con: duckdb.DuckDBPyConnection, rows: pa.Table) -> None:
    """Insert sample rows (any subset of the sample columns that includes `output`) with
    their derived columns, long outputs in chunks (`chunked`); rows already present are
    left as they are."""
    batch = chunked(con, rows)
    derived = ", ".join(DERIVED_COLUMNS.values())
    source = "batch"
    if pc.any(pc.and_(pc.is_null(batch["output"]), pc.is_valid(batch["output_sha"]))).as_py():
        # A row that refers to a stored output (no text) takes the head of its first chunk.
        derived = f"left(coalesce(batch.output, head.text), {OUTPUT_HEAD_CHARS})"
        source = "batch LEFT JOIN output_chunks head ON head.output_sha = batch.output_sha AND head.chunk = 0"
    con.execute(
        f"INSERT INTO samples ({', '.join([*batch.column_names, *DERIVED_COLUMNS])})"
        f" SELECT {stored_columns(batch, 'batch')}, {derived} FROM {source} ON CONFLICT DO NOTHING"
    )


def chunked(con: duckdb.DuckDBPyConnection, rows: pa.Table) -> pa.Table:
    """`rows` (with an `output` column) with every output longer than OUTPUT_CHUNK_CHARS
    written to `output_chunks` (once per text: a text stored before is not written again) and
    its sha256 in `output_sha`. A row without its text (`output` null) keeps the `output_sha`
    it names; a row with its text has the one derived from it. Written in this transaction;
    `stored_columns` leaves the chunked texts out of the row."""
    given = rows["output_sha"] if "output_sha" in rows.column_names else pa.nulls(rows.num_rows, pa.string())
    shas = pc.if_else(pc.is_valid(rows["output"]), pa.scalar(None, pa.string()), given).to_pylist()
    long = pc.fill_null(pc.greater(pc.utf8_length(rows["output"]), OUTPUT_CHUNK_CHARS), False)
    for i in pc.indices_nonzero(long).to_pylist():  # one text at a time: rows may hold many
        shas[i] = _store_text(con, rows["output"][i].as_py())
    rows = rows.drop_columns([c for c in ("output_sha",) if c in rows.column_names])
    return rows.append_column("output_sha", pa.array(shas, pa.string()))


def stored_columns(rows: pa.Table, table: str) -> str:
    """The SELECT list that stores `chunked` rows (of `table`): an output kept in chunks is not kept inline too."""
    return ", ".join(f"CASE WHEN {table}.output_sha IS NULL THEN {table}.output END" if c == "output"
                     else f"{table}.{c}" for c in rows.column_names)


def _store_text(con: duckdb.DuckDBPyConnection, text: str) -> str:
    sha = hashlib.sha256(text.encode()).hexdigest()
    pieces = [text[i:i + OUTPUT_CHUNK_CHARS] for i in range(0, len(text), OUTPUT_CHUNK_CHARS)]
    chunks = pa.table({"output_sha": pa.array([sha] * len(pieces), pa.string()),  # noqa: F841 - read by DuckDB
                       "chunk": pa.array(range(len(pieces)), pa.int32()), "text": pa.array(pieces, pa.string())})
    con.execute("INSERT INTO output_chunks SELECT * FROM chunks ON CONFLICT DO NOTHING")
    return sha


def read_text(con: duckdb.DuckDBPyConnection, sha: str) -> str:
    """The stored output whose text hashes to `sha`, whole."""
    pieces = con.execute("SELECT text FROM output_chunks WHERE output_sha = ? ORDER BY chunk", [sha]).fetchall()
    if not pieces:
        raise PlatformError(f"database: the stored output {sha[:12]} is missing from output_chunks (a damaged"
                            " file?): restore it from a backup, or run the same command in a fresh home")
    return "".join(text for (text,) in pieces)


def with_whole_outputs(con: duckdb.DuckDBPyConnection, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sample rows (dicts) with each output kept in chunks read back whole into `output`."""
    for row in rows:
        if row.get("output_sha") is not None:
            row["output"] = read_text(con, row["output_sha"])
    return rows


DB_FILE = "evalpipe.duckdb"


@dataclass(frozen=True)
class Database:
    """One home's DuckDB file: its connections (through this process's one instance, above)
    and the long outputs its tables share (`output_chunks`). The parts of `storage.store.Store`
    that keep their rows in it share one."""

    home: Path

    @property
    def path(self) -> Path:
        return self.home / DB_FILE

    @contextmanager
    def connect(self, *, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        read_only = read_only and path.exists()  # a reader of a new home creates the schema
        with _platform_errors(path):
            con = _open(path, read_only, lock_wait_s())
            try:
                current = not read_only or _current(con)
            except BaseException:
                _close(path, con)
                raise
            if not current:
                # A file from an older evalpipe: brought up to date before anything reads it.
                _close(path, con)
                read_only = False
                con = _open(path, read_only, lock_wait_s())
            try:
                if not read_only:
                    migrate(con)
                yield con
            finally:
                _close(path, con)

    def check(self) -> None:
        """Read the database's runs, if there is one, so that a damaged or locked file is
        reported before any work starts. (Damage elsewhere is reported when it is read.)"""
        if self.path.exists():
            with self.connect(read_only=True) as con:
                con.execute("SELECT * FROM runs").fetchall()

    def read_output(self, sha: str) -> str:
        """The stored output whose text hashes to `sha` (a `StoredOutput`'s)."""
        # Not read-only: it is read while the run's loop writes, and one process opens the
        # file in one mode at a time.
        with self.connect() as con:
            return read_text(con, sha)
