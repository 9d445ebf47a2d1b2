"""The DuckDB file: suites, cases, runs, samples, aggregates (SPEC §8).

Connections are short-lived and opened per operation: DuckDB lets one process hold the
file at a time, and several `evalpipe run`s or Prefect workers may share one home. A
process that finds the file locked waits and retries quietly instead of failing.
Samples are inserted with `ON CONFLICT DO NOTHING` on their primary key, so a sample is
written once however often a batch is retried.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from storage import evalpipe_home
from tasks.models import EvalSuite, InputError

SCHEMA = """
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
CREATE TABLE IF NOT EXISTS samples (
    run_id VARCHAR, case_id VARCHAR, sample_index INTEGER, seed BIGINT, output VARCHAR,
    status VARCHAR, passed BOOLEAN, score DOUBLE, detail VARCHAR, safety VARCHAR[], trace JSON,
    duration_s DOUBLE, cache_key VARCHAR, cached BOOLEAN, case_hash VARCHAR,
    PRIMARY KEY (run_id, case_id, sample_index));
CREATE INDEX IF NOT EXISTS samples_cache_key ON samples (cache_key);
CREATE TABLE IF NOT EXISTS aggregates (
    run_id VARCHAR, slice VARCHAR, metric VARCHAR, value DOUBLE, ci_lo DOUBLE, ci_hi DOUBLE);
"""

SAMPLE_COLUMNS = (
    "run_id", "case_id", "sample_index", "seed", "output", "status", "passed", "score",
    "detail", "safety", "trace", "duration_s", "cache_key", "cached", "case_hash",
)
SAMPLE_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()), ("case_id", pa.string()), ("sample_index", pa.int32()),
        ("seed", pa.int64()), ("output", pa.string()), ("status", pa.string()),
        ("passed", pa.bool_()), ("score", pa.float64()), ("detail", pa.string()),
        ("safety", pa.list_(pa.string())), ("trace", pa.string()), ("duration_s", pa.float64()),
        ("cache_key", pa.string()), ("cached", pa.bool_()), ("case_hash", pa.string()),
    ]
)
# Samples not reused from the cache: the agent or the grader's environment failed, which
# says nothing about the output, so a re-run should try again.
NOT_CACHED_STATUSES = ("agent_error", "error")


def db_path(home: Path | None = None) -> Path:
    return (home or evalpipe_home()) / "evalpipe.duckdb"


@contextmanager
def connect(home: Path | None = None, *, read_only: bool = False, wait_s: float = 120.0) -> Iterator[duckdb.DuckDBPyConnection]:
    path = db_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    read_only = read_only and path.exists()  # a reader of a new home creates the schema
    deadline = time.monotonic() + wait_s
    while True:
        try:
            con = duckdb.connect(str(path), read_only=read_only)
            break
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.05 + random.random() * 0.1)
    try:
        if not read_only:
            con.execute(SCHEMA)
        yield con
    finally:
        con.close()


def now() -> datetime:
    return datetime.now(UTC)


def record_suite(suite: EvalSuite, snapshot_path: Path, home: Path | None = None) -> None:
    with connect(home) as con:
        con.execute(
            "INSERT INTO suites VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [suite.version, suite.name, len(suite.cases), str(snapshot_path), now()],
        )
        con.executemany(
            "INSERT INTO cases VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [[suite.version, c.id, c.case_hash, list(c.slices), list(c.tags)] for c in suite.cases],
        )


def start_run(run: dict[str, Any], home: Path | None = None) -> None:
    with connect(home) as con:
        con.execute(
            "INSERT INTO runs (run_id, suite_version, suite_name, agent, agent_fingerprint, n, ks,"
            " seed, status, started_at, flow_run_id, config) VALUES (?, ?, ?, ?, ?, ?, ?, ?,"
            " 'running', ?, ?, ?)",
            [
                run["run_id"], run["suite_version"], run["suite_name"], run["agent"],
                run["agent_fingerprint"], run["n"], run["ks"], run["seed"], now(),
                run.get("flow_run_id"), json.dumps(run.get("config", {})),
            ],
        )


def finish_run(run_id: str, status: str, summary: dict[str, Any] | None, home: Path | None = None) -> None:
    with connect(home) as con:
        con.execute(
            "UPDATE runs SET status = ?, finished_at = ?, summary = ? WHERE run_id = ?",
            [status, now(), None if summary is None else json.dumps(summary), run_id],
        )


def cached_samples(cache_keys: Sequence[str], home: Path | None = None) -> pa.Table:
    """The newest stored sample for each of `cache_keys` (one query for the whole run)."""
    if not cache_keys:
        return SAMPLE_SCHEMA.empty_table()
    keys = pa.table({"cache_key": pa.array(list(cache_keys), pa.string())})  # noqa: F841 - read by DuckDB
    with connect(home) as con:
        return con.sql(
            f"""SELECT {", ".join(SAMPLE_COLUMNS)} FROM samples JOIN keys USING (cache_key)
                WHERE status NOT IN {NOT_CACHED_STATUSES}
                QUALIFY row_number() OVER (PARTITION BY cache_key ORDER BY run_id DESC) = 1"""
        ).to_arrow_table()


def insert_samples(rows: pa.Table, home: Path | None = None) -> None:
    """Write samples; rows already present (same run, case, index) are left as they are."""
    if rows.num_rows == 0:
        return
    batch = rows.select(list(SAMPLE_COLUMNS))  # noqa: F841 - read by DuckDB
    with connect(home) as con:
        con.execute(
            f"INSERT INTO samples ({', '.join(SAMPLE_COLUMNS)}) SELECT * FROM batch ON CONFLICT DO NOTHING"
        )


def write_aggregates(run_id: str, rows: Sequence[tuple], home: Path | None = None) -> None:
    with connect(home) as con:
        con.execute("DELETE FROM aggregates WHERE run_id = ?", [run_id])
        con.executemany(
            "INSERT INTO aggregates VALUES (?, ?, ?, ?, ?, ?)", [[run_id, *row] for row in rows]
        )


def run_samples(run_id: str, home: Path | None = None) -> pa.Table:
    with connect(home, read_only=True) as con:
        return con.sql(
            f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE run_id = ? ORDER BY case_id, sample_index",
            params=[run_id],
        ).to_arrow_table()


def get_run(run_id: str, home: Path | None = None) -> dict[str, Any] | None:
    with connect(home, read_only=True) as con:
        cur = con.execute("SELECT * FROM runs WHERE run_id = ?", [run_id])
        row = cur.fetchone()
        if row is None:
            return None
        return _run_dict(cur.description, row)


def find_run(ref: str, home: Path | None = None) -> dict[str, Any]:
    """The run whose id is `ref` or, failing that, the one run whose id starts with it.
    Unknown or ambiguous is bad input, naming the candidates."""
    rows: list[dict[str, Any]] = []
    if ref and db_path(home).exists():
        with connect(home, read_only=True) as con:
            cur = con.execute(
                "SELECT * FROM runs WHERE starts_with(run_id, ?) ORDER BY run_id = ? DESC, run_id LIMIT 11",
                [ref, ref])
            rows = [_run_dict(cur.description, row) for row in cur.fetchall()]
    if rows and (len(rows) == 1 or rows[0]["run_id"] == ref):
        return rows[0]
    if not rows:
        raise InputError(f"run {ref!r}: no such run in {db_path(home)}")
    ids = ", ".join(r["run_id"] for r in rows[:10]) + (", ..." if len(rows) > 10 else "")
    raise InputError(f"run {ref!r} is ambiguous, it could be {ids}: give more of the id")


def list_runs(home: Path | None = None, limit: int = 50) -> list[dict[str, Any]]:
    if not db_path(home).exists():
        return []
    with connect(home, read_only=True) as con:
        cur = con.execute("SELECT * FROM runs ORDER BY started_at DESC LIMIT ?", [limit])
        return [_run_dict(cur.description, row) for row in cur.fetchall()]


def _run_dict(description, row) -> dict[str, Any]:
    run = dict(zip([d[0] for d in description], row, strict=True))
    for key in ("config", "summary"):
        if isinstance(run.get(key), str):
            run[key] = json.loads(run[key])
    for key in ("started_at", "finished_at"):
        if run.get(key) is not None:
            run[key] = run[key].isoformat()
    return run


def suite_cases(suite_version: str, home: Path | None = None) -> dict[str, tuple[str, list[str]]]:
    """case_id → (case_hash, slices) for a stored suite version."""
    with connect(home, read_only=True) as con:
        rows = con.execute(
            "SELECT case_id, case_hash, slices FROM cases WHERE suite_version = ?", [suite_version]
        ).fetchall()
    return {cid: (h, list(s)) for cid, h, s in rows}


def samples_table(run_id: str, samples: Sequence[Any], planned: Sequence[Any]) -> pa.Table:
    """`Sample`s (with their `PlannedSample`s, for keys and case hashes) as sample rows."""
    cols: dict[str, list] = {c: [] for c in SAMPLE_COLUMNS}
    for s, p in zip(samples, planned, strict=True):
        v = s.verdict
        for col, value in (
            ("run_id", run_id), ("case_id", s.case_id), ("sample_index", s.index), ("seed", s.seed),
            ("output", s.output), ("status", v.status.value), ("passed", v.passed), ("score", v.score),
            ("detail", v.detail), ("safety", list(v.safety)), ("trace", json.dumps(s.trace, default=str)),
            ("duration_s", s.duration_s), ("cache_key", p.cache_key), ("cached", s.cached),
            ("case_hash", p.case_hash),
        ):
            cols[col].append(value)
    return pa.table(cols, schema=SAMPLE_SCHEMA)


def case_counts(run_id: str, home: Path | None = None) -> dict[str, tuple[int, int]]:
    """case_hash → (n, c) for one run: the gate's paired input."""
    with connect(home, read_only=True) as con:
        rows = con.execute(
            "SELECT case_hash, count(*), count(*) FILTER (WHERE passed) FROM samples"
            " WHERE run_id = ? GROUP BY case_hash", [run_id]
        ).fetchall()
    return {h: (int(n), int(c)) for h, n, c in rows}


def safety_failed(run_id: str, home: Path | None = None) -> bool:
    with connect(home, read_only=True) as con:
        (hits,) = con.execute(
            "SELECT count(*) FROM samples WHERE run_id = ? AND len(safety) > 0", [run_id]
        ).fetchone()
    return hits > 0


def latest_completed_run(suite_version: str, agent_fingerprint: str, home: Path | None = None) -> str | None:
    """The newest completed run of this suite version and agent (a scheduled run's baseline)."""
    if not db_path(home).exists():
        return None
    with connect(home, read_only=True) as con:
        row = con.execute(
            "SELECT run_id FROM runs WHERE status = 'completed' AND suite_version = ?"
            " AND agent_fingerprint = ? ORDER BY started_at DESC LIMIT 1",
            [suite_version, agent_fingerprint],
        ).fetchone()
    return row[0] if row else None
