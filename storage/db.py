"""The DuckDB file: suites, cases, runs, samples, aggregates (docs/contract.md §8).

Connections are short-lived and opened per operation: DuckDB lets one process hold the
file at a time, and several `evalpipe run`s or Prefect workers may share one home. A
process that finds the file locked waits and retries quietly, for `EVALPIPE_DB_LOCK_WAIT_S`
seconds (default 30); past that, and for a damaged file or a full disk, it raises a
`PlatformError` naming the file and what to do. A damaged file is never written to.
Samples are inserted with `ON CONFLICT DO NOTHING` on their primary key, so a sample is
written once however often a batch is retried.

A run records the process that runs it (`pid`, `host`, `process_started`); a `running`
run whose process is gone reads as `interrupted`, and the next run to start stores that.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from storage import disk_full, process
from tasks.metrics.aggregate import RECORD_COLUMNS, sample_records
from tasks.metrics.diff import CaseResult
from tasks.metrics.graders import extra_grader_counts, must_pass_graders
from tasks.metrics.tallies import SampleRecord
from tasks.models import EvalSuite, InputError, PlatformError
from tasks.run import RunSpec, RunSummary
from tasks.run.samples import SAMPLE_COLUMNS, SAMPLE_SCHEMA, output_ddl, sample_ddl
from tasks.run.spec import RunStatus
from tasks.run.steps import CACHE_LOOKUP_COLUMNS, COPY_COLUMNS
from tasks.run.stored import StoredOutput, row_output
from tasks.run.usage import USAGE_SAMPLE_COLUMNS
from tasks.trace import SampleTrace

# How many characters of each output `output_head` keeps (`failing_samples` reads no more).
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


def _figures(turns: Any, calls: Mapping[str, int] | None, tokens: Any, cost: Any) -> dict[str, float]:
    """A case's summed figures (`CaseResult.figures`): those its samples reported. Tool calls
    count wherever there are model turns (none made is 0)."""
    found = {"turns": turns, "tool_calls": sum((calls or {}).values()) if turns is not None else None,
             "tokens": tokens, "cost": cost}
    return {name: float(value) for name, value in found.items() if value is not None}


def migrate(con: duckdb.DuckDBPyConnection) -> int:
    """Bring the file to `SCHEMA_VERSION`; returns the version it was at."""
    con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER)")
    ((current,),) = con.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchall()
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


def _run_dict(description, row) -> dict[str, Any]:
    run = dict(zip([d[0] for d in description], row, strict=True))
    if run["status"] == RunStatus.running and run.get("pid") is not None and process.gone(
        process.Owner(run["pid"], run["host"], run["process_started"])
    ):
        run["status"] = RunStatus.interrupted.value
    for key in ("config", "summary"):
        if isinstance(run.get(key), str):
            run[key] = json.loads(run[key])
    for key in ("started_at", "finished_at"):
        if run.get(key) is not None:
            run[key] = run[key].isoformat()
    return run


DB_FILE = "evalpipe.duckdb"


class Database:
    """The queries of one home's DuckDB file, as methods of `storage.store.Store`."""

    home: Path

    @property
    def db_path(self) -> Path:
        return self.home / DB_FILE

    @contextmanager
    def connect(self, *, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        path = self.db_path
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
        if self.db_path.exists():
            with self.connect(read_only=True) as con:
                con.execute("SELECT * FROM runs").fetchall()

    def record_suite(self, suite: EvalSuite, snapshot_path: Path) -> None:
        with self.connect() as con:
            con.execute(
                "INSERT INTO suites VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [suite.version, suite.name, len(suite.cases), str(snapshot_path), now()],
            )
            # One statement over an Arrow table: executemany is a statement a case (seconds at 2,000).
            new_cases = pa.table({  # noqa: F841 - read by DuckDB
                "suite_version": pa.array([suite.version] * len(suite.cases), pa.string()),
                "case_id": pa.array([c.id for c in suite.cases], pa.string()),
                "case_hash": pa.array([c.case_hash for c in suite.cases], pa.string()),
                "slices": pa.array([list(c.slices) for c in suite.cases], pa.list_(pa.string())),
                "tags": pa.array([list(c.tags) for c in suite.cases], pa.list_(pa.string())),
            })
            con.execute("INSERT INTO cases SELECT * FROM new_cases ON CONFLICT DO NOTHING")

    def start_run(self, spec: RunSpec) -> None:
        """Record a new `running` run owned by this process; first store as `interrupted`
        every running run whose process is gone."""
        owner = process.current()
        with self.connect() as con:
            running = con.execute(
                f"SELECT run_id, pid, host, process_started FROM runs WHERE status = '{RunStatus.running}' AND pid IS NOT NULL"
            ).fetchall()
            stale = [[rid] for rid, *who in running if process.gone(process.Owner(*who))]
            if stale:
                con.executemany(f"UPDATE runs SET status = '{RunStatus.interrupted}' WHERE run_id = ?"
                                f" AND status = '{RunStatus.running}'", stale)
            con.execute(
                "INSERT INTO runs (run_id, suite_version, suite_name, agent, agent_fingerprint, n, ks,"
                " seed, status, started_at, flow_run_id, config, pid, host, process_started)"
                f" VALUES (?, ?, ?, ?, ?, ?, ?, ?, '{RunStatus.running}', ?, ?, ?, ?, ?, ?)",
                [
                    spec.run_id, spec.suite_version, spec.suite_name, spec.agent,
                    spec.agent_fingerprint, spec.n, spec.ks, spec.seed, now(),
                    spec.flow_run_id, json.dumps(spec.config),
                    owner.pid, owner.host, owner.started,
                ],
            )

    def finish_run(self, run_id: str, status: RunStatus, summary: RunSummary | None) -> None:
        with self.connect() as con:
            con.execute(
                "UPDATE runs SET status = ?, finished_at = ?, summary = ? WHERE run_id = ?",
                [status, now(), None if summary is None else json.dumps(summary.to_json()), run_id],
            )

    @contextmanager
    def recorded_run(self, spec: RunSpec, stopping: Callable[[], bool] | None = None) -> Iterator[None]:
        """The run's row from start to end: `running` now, `failed` if the body raises an error,
        `interrupted` if it is stopped (Ctrl-C, a termination signal: anything that is not an
        `Exception`, or any error once `stopping()` says a stop was asked for: a library the
        stop reached first may have turned it into one), which the same command resumes. The
        body records `completed` itself, with the summary."""
        self.start_run(spec)
        try:
            yield
        except Exception:
            stopped = stopping is not None and stopping()
            self.finish_run(spec.run_id, RunStatus.interrupted if stopped else RunStatus.failed, None)
            raise
        except BaseException:
            self.finish_run(spec.run_id, RunStatus.interrupted, None)
            raise

    def cached_samples(self, planned: Sequence[tuple[str, str]]) -> pa.Table:
        """For each planned (output key, cache key): the stored sample that serves it best, one
        graded under the same cache key (and not by a failed grader) if there is one, else the
        newest with that output; as lookup rows (`CACHE_LOOKUP_COLUMNS`: never the output,
        which `copy_samples` and `stored_outputs` read in the database). Two queries on one
        connection, the second only for what the first did not find: an unchanged re-run costs
        the one lookup it always did."""
        if not planned:
            return SAMPLE_SCHEMA.select(list(CACHE_LOOKUP_COLUMNS)).empty_table()
        out_keys, wanted = zip(*planned, strict=True)
        keys = pa.table({"cache_key": pa.array(wanted, pa.string()), "output_key": pa.array(out_keys, pa.string())})
        columns = ", ".join(f"samples.{c}" for c in CACHE_LOOKUP_COLUMNS)
        with self.connect() as con:
            whole = con.sql(
                f"""SELECT {columns} FROM samples JOIN keys USING (cache_key)
                    WHERE status NOT IN ('{NOT_CACHED_STATUS}', 'error') AND {FROM_THIS_HOME}
                    QUALIFY row_number() OVER (PARTITION BY samples.cache_key ORDER BY run_id DESC) = 1"""
            ).to_arrow_table()
            rest = keys.filter(pc.invert(pc.is_in(keys["output_key"], value_set=whole["output_key"])))  # noqa: F841
            if rest.num_rows == 0:
                return whole
            outputs = con.sql(
                f"""SELECT {columns} FROM samples JOIN rest USING (output_key)
                    WHERE status <> '{NOT_CACHED_STATUS}' AND {FROM_THIS_HOME}
                    QUALIFY row_number() OVER (PARTITION BY samples.output_key ORDER BY run_id DESC) = 1"""
            ).to_arrow_table()
        return pa.concat_tables([whole, outputs])

    def bought_unfinished(self, output_keys: Sequence[str]) -> pa.Table:
        """Of the stored outputs with these keys, those no run that finished (`completed` or
        `partial`) holds: bought by runs that were killed, stopped or failed, and counted by
        no budget yet. One row each, with what its call took (`USAGE_SAMPLE_COLUMNS`)."""
        keys = pa.table({"output_key": pa.array(list(output_keys), pa.string())})  # noqa: F841
        with self.connect(read_only=True) as con:
            return con.sql(
                f"""SELECT output_key, {', '.join(f'any_value(s.{c}) AS {c}' for c in USAGE_SAMPLE_COLUMNS)}
                    FROM samples s JOIN keys USING (output_key) JOIN runs r USING (run_id)
                    WHERE s.status <> '{NOT_CACHED_STATUS}' GROUP BY output_key
                    HAVING NOT bool_or(r.status IN ('{RunStatus.completed}', '{RunStatus.partial}'))"""
            ).to_arrow_table()

    def copy_samples(self, run_id: str, copied: pa.Table) -> None:
        """Store the samples `copied` names (`COPY_COLUMNS`) as `run_id`'s cached ones, with the
        case hashes and costs it gives: row to row in the database, outputs and all, never through this
        process. Rows already present are left as they are."""
        if copied.num_rows == 0:
            return
        places = copied.select(list(COPY_COLUMNS)).rename_columns(  # noqa: F841
            ["src_run", "src_case", "src_index", "new_hash", "new_cost"])
        set_to = {"run_id": "?", "cached": "true", "case_hash": "places.new_hash", "cost_usd": "places.new_cost"}
        values = ", ".join(set_to.get(c, f"samples.{c}") for c in (*SAMPLE_COLUMNS, *DERIVED_COLUMNS))
        with self.connect() as con:
            con.execute(
                f"INSERT INTO samples ({', '.join([*SAMPLE_COLUMNS, *DERIVED_COLUMNS])}) SELECT {values}"
                " FROM samples JOIN places ON samples.run_id = places.src_run AND samples.case_id = places.src_case"
                " AND samples.sample_index = places.src_index ON CONFLICT DO NOTHING", [run_id])

    def stored_outputs(self, places: pa.Table) -> dict[str, tuple[str | StoredOutput, SampleTrace]]:
        """Output key → output of the stored samples `places` names (run id, case id, index):
        its text, or a long one as a `StoredOutput`, read when it is graded; with what its
        agent recorded (its trajectory: graded again with the output)."""
        if places.num_rows == 0:
            return {}
        with self.connect(read_only=True) as con:
            rows = con.sql("SELECT output_key, output, output_sha, trace FROM samples"
                           " JOIN places USING (run_id, case_id, sample_index)").to_arrow_table().to_pylist()
        return {row["output_key"]: (row_output(row, self), SampleTrace.parse(row["trace"]).agent_part())
                for row in rows}

    def read_output(self, sha: str) -> str:
        """The stored output whose text hashes to `sha` (a `StoredOutput`'s)."""
        # Not read-only: it is read while the run's loop writes, and one process opens the
        # file in one mode at a time.
        with self.connect() as con:
            return read_text(con, sha)

    def insert_samples(self, rows: pa.Table) -> None:
        """Write samples; rows already present (same run, case, index) are left as they are.
        The drawn outputs they grade leave the `outputs` table in the same transaction."""
        if rows.num_rows == 0:
            return
        with self.connect() as con:
            con.execute("BEGIN")
            insert_rows(con, rows.select(list(SAMPLE_COLUMNS)))
            graded = rows.select(["output_key"])  # noqa: F841 - read by DuckDB
            con.execute("DELETE FROM outputs WHERE output_key IN (SELECT output_key FROM graded)")
            con.execute("COMMIT")

    def write_aggregates(self, run_id: str, rows: Sequence[tuple]) -> None:
        with self.connect() as con:
            con.execute("DELETE FROM aggregates WHERE run_id = ?", [run_id])
            con.executemany(
                "INSERT INTO aggregates VALUES (?, ?, ?, ?, ?, ?)", [[run_id, *row] for row in rows]
            )

    def run_samples(self, run_id: str, columns: Sequence[str] | None = None, *,
                    whole_outputs: bool = True) -> pa.Table:
        """The run's samples in (case, index) order: every column, or only `columns` (the
        outputs and traces of thousands of samples are gigabytes a summary never reads).
        `whole_outputs=False`: each output as stored, a long one null beside its `output_sha`
        (`tasks.run.stored.row_output`)."""
        wanted = list(SAMPLE_COLUMNS if columns is None else columns)
        unknown = set(wanted) - set(SAMPLE_COLUMNS)
        if unknown:
            raise ValueError(f"not sample columns: {sorted(unknown)}")
        read = [*wanted, *(["output_sha"] if "output" in wanted and "output_sha" not in wanted else [])]
        with self.connect(read_only=True) as con:
            table = con.sql(
                f"SELECT {', '.join(read)} FROM samples WHERE run_id = ? ORDER BY case_id, sample_index",
                params=[run_id],
            ).to_arrow_table()
            if whole_outputs and "output" in wanted and table["output_sha"].null_count < table.num_rows:
                rows = with_whole_outputs(con, table.select(["output", "output_sha"]).to_pylist())
                table = table.set_column(read.index("output"), "output",
                                         pa.array([row["output"] for row in rows], pa.string()))
        return table.select(wanted)

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        with self.connect(read_only=True) as con:
            cur = con.execute("SELECT * FROM runs WHERE run_id = ?", [run_id])
            row = cur.fetchone()
            if row is None:
                return None
            return _run_dict(cur.description, row)

    def find_run(self, ref: str) -> dict[str, Any]:
        """The run whose id is `ref`, else the one whose id starts with it, else the one whose
        id contains it (its random suffix, say): a prefix found before keeps being found.
        Unknown or ambiguous is bad input, naming the candidates."""
        rows: list[dict[str, Any]] = []
        if ref and self.db_path.exists():
            with self.connect(read_only=True) as con:
                cur = con.execute(
                    "SELECT * FROM runs WHERE contains(run_id, ?)"
                    " ORDER BY run_id = ? DESC, starts_with(run_id, ?) DESC, run_id LIMIT 11",
                    [ref, ref, ref])
                rows = [_run_dict(cur.description, row) for row in cur.fetchall()]
        prefixed = [r for r in rows if r["run_id"].startswith(ref)]
        candidates = prefixed or rows
        if candidates and (len(candidates) == 1 or candidates[0]["run_id"] == ref):
            return candidates[0]
        if not rows:
            raise InputError(f"run {ref!r}: no such run in {self.db_path}")
        ids = ", ".join(r["run_id"] for r in candidates[:10]) + (", ..." if len(candidates) > 10 else "")
        raise InputError(f"run {ref!r} is ambiguous, it could be {ids}: give more of the id")

    def list_runs(self, limit: int = 50) -> list[dict[str, Any]]:
        if not self.db_path.exists():
            return []
        with self.connect(read_only=True) as con:
            cur = con.execute("SELECT * FROM runs ORDER BY started_at DESC LIMIT ?", [limit])
            return [_run_dict(cur.description, row) for row in cur.fetchall()]

    def suite_cases(self, suite_version: str) -> dict[str, tuple[str, list[str]]]:
        """case_id → (case_hash, slices) for a stored suite version."""
        with self.connect(read_only=True) as con:
            rows = con.execute(
                "SELECT case_id, case_hash, slices FROM cases WHERE suite_version = ?", [suite_version]
            ).fetchall()
        return {cid: (h, list(s)) for cid, h, s in rows}

    def case_counts(self, run_id: str) -> dict[str, tuple[int, int]]:
        """case_hash → (n, c) for one run: the gate's paired input."""
        with self.connect(read_only=True) as con:
            rows = con.execute(
                "SELECT case_hash, count(*), count(*) FILTER (WHERE passed) FROM samples"
                " WHERE run_id = ? GROUP BY case_hash", [run_id]
            ).fetchall()
        return {h: (int(n), int(c)) for h, n, c in rows}

    def commonest_detail(self, run_id: str, status: str) -> tuple[str, int] | None:
        """The detail most samples of the run with `status` share, and how many share it."""
        with self.connect(read_only=True) as con:
            return con.execute(
                "SELECT detail, count(*) AS n FROM samples WHERE run_id = ? AND status = ? "
                "GROUP BY detail ORDER BY n DESC, detail LIMIT 1", [run_id, status]).fetchone()

    def failing_samples(self, run_id: str, per_case: int, chars: int) -> list[dict[str, Any]]:
        """The first `per_case` failing samples of each case of a run, in (case, index) order:
        `case_id`, `sample_index`, the first `chars` (at most OUTPUT_HEAD_CHARS) characters of
        `output`, and `trace`."""
        if chars > OUTPUT_HEAD_CHARS:
            raise ValueError(f"failing_samples reads at most {OUTPUT_HEAD_CHARS} characters of an output")
        with self.connect(read_only=True) as con:
            cur = con.execute(
                "SELECT case_id, sample_index, left(output_head, ?) AS output, trace FROM samples"
                " WHERE run_id = ? AND NOT coalesce(passed, false)"
                " QUALIFY row_number() OVER (PARTITION BY case_id ORDER BY sample_index) <= ?"
                " ORDER BY case_id, sample_index", [chars, run_id, per_case])
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def safety_failed(self, run_id: str) -> bool:
        with self.connect(read_only=True) as con:
            (hits,) = con.execute(
                "SELECT count(*) FROM samples WHERE run_id = ? AND len(safety) > 0", [run_id]
            ).fetchone()
        return hits > 0

    def case_results(self, run_id: str, *, records: bool = False) -> list[CaseResult]:
        """One `CaseResult` per case of a run (counts, mean score, the case's slices in the run's
        suite, each sample's score for a registered metric): what `diff` and the gate's rules read.
        With `records`, each case's sample records too (`needs_records`: a registered metric
        computed on them)."""
        with self.connect(read_only=True) as con:
            rows = con.execute(
                "SELECT s.case_id, s.case_hash, count(*), count(*) FILTER (WHERE s.passed),"
                " coalesce(avg(s.score), 0), any_value(c.slices),"
                " list(coalesce(s.score, 0) ORDER BY s.sample_index),"
                " list(json_extract_string(s.trace, '$.extra_graders')) FILTER (WHERE s.trace LIKE '%\"extra_graders\"%'),"
                " count(*) FILTER (WHERE len(s.safety) > 0),"
                " sum(len(list_filter(coalesce(json_extract_string(s.trace, '$.trajectory.entries[*].role'), []),"
                " lambda r: r = 'assistant'))) FILTER (WHERE s.trace LIKE '%\"trajectory\"%'),"
                " sum(coalesce(s.input_tokens, 0) + coalesce(s.output_tokens, 0))"
                " FILTER (WHERE s.input_tokens IS NOT NULL OR s.output_tokens IS NOT NULL), sum(s.cost_usd)"
                " FROM samples s JOIN runs r ON r.run_id = s.run_id"
                " LEFT JOIN cases c ON c.suite_version = r.suite_version AND c.case_id = s.case_id"
                " WHERE s.run_id = ? GROUP BY s.case_id, s.case_hash ORDER BY s.case_id", [run_id]
            ).fetchall()
            calls: dict[str, dict[str, int]] = {}
            for cid, name, count in con.execute(
                    "SELECT case_id, name, count(*) FROM tool_calls WHERE run_id = ? GROUP BY ALL", [run_id]).fetchall():
                calls.setdefault(cid, {})[str(name)] = int(count)
            kept: dict[str, list[SampleRecord]] = {}
            if records:
                table = con.sql(f"SELECT case_id, {', '.join(RECORD_COLUMNS)} FROM samples WHERE run_id = $run"
                                " ORDER BY case_id, sample_index", params={"run": run_id}).to_arrow_table()
                for cid, record in zip(table["case_id"].to_pylist(), sample_records(table), strict=True):
                    kept.setdefault(cid, []).append(record)
        return [CaseResult(cid, h, int(n), int(c), float(score), tuple(slices or ()), tuple(map(float, scores)),
                           graders=extra_grader_counts(extras or ()), must_pass_graders=must_pass_graders(extras or ()),
                           tools=calls.get(cid, {}), unsafe=int(unsafe),
                           figures=_figures(turns, calls.get(cid), tokens, cost), records=tuple(kept.get(cid, ())))
                for cid, h, n, c, score, slices, scores, extras, unsafe, turns, tokens, cost in rows]

    def latest_completed_run_of_suite(self, suite_name: str, *, before: str | None = None) -> str | None:
        """The newest completed run of the suite of this name, whatever its version or agent
        (`--baseline previous`); with `before`, among the runs started before that run."""
        if not self.db_path.exists():
            return None
        with self.connect(read_only=True) as con:
            row = con.execute(
                f"SELECT run_id FROM runs WHERE status = '{RunStatus.completed}' AND suite_name = ? AND run_id <> ?"
                " AND (? IS NULL OR started_at < (SELECT started_at FROM runs WHERE run_id = ?))"
                " ORDER BY started_at DESC LIMIT 1", [suite_name, before or "", before, before],
            ).fetchone()
        return row[0] if row else None

    def case_samples(self, run_id: str, case_id: str) -> list[dict[str, Any]]:
        """Every stored sample of one case of a run, in index order (`runs show --case`), a long
        output as a `StoredOutput`, read when it is shown."""
        with self.connect(read_only=True) as con:
            cur = con.execute(
                f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE run_id = ? AND case_id = ? ORDER BY sample_index",
                [run_id, case_id])
            names = [d[0] for d in cur.description]
            rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        return [{**row, "output": row_output(row, self)} for row in rows]

    def samples_of_cases(self, run_ids: Sequence[str], case_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The samples of some cases in some runs (the diff report's expanded cases), in
        (run, case, index) order."""
        if not case_ids:
            return []
        with self.connect(read_only=True) as con:
            cur = con.execute(
                f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE list_contains(?, run_id) AND list_contains(?, case_id) ORDER BY run_id, case_id, sample_index",
                [list(run_ids), list(case_ids)])
            names = [d[0] for d in cur.description]
            return with_whole_outputs(con, [dict(zip(names, row, strict=True)) for row in cur.fetchall()])

