"""The runs of one home (the `runs` table, and each run's `aggregates`): a run's row from its
start to its end, and the runs found by id, by prefix or as the latest of a suite.

A run records the process that runs it (`pid`, `host`, `process_started`); a `running`
run whose process is gone reads as `interrupted`, and the next run to start stores that.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from storage import process
from storage.db import Database, now
from tasks.models import InputError
from tasks.run import RunSpec, RunSummary
from tasks.run.spec import RunStatus


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


@dataclass(frozen=True)
class Runs:
    """One home's runs (`storage.store.Store.runs`)."""

    db: Database

    def start(self, spec: RunSpec) -> None:
        """Record a new `running` run owned by this process; first store as `interrupted`
        every running run whose process is gone."""
        owner = process.current()
        with self.db.connect() as con:
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

    def finish(self, run_id: str, status: RunStatus, summary: RunSummary | None) -> None:
        with self.db.connect() as con:
            con.execute(
                "UPDATE runs SET status = ?, finished_at = ?, summary = ? WHERE run_id = ?",
                [status, now(), None if summary is None else json.dumps(summary.to_json()), run_id],
            )

    @contextmanager
    def recorded(self, spec: RunSpec, stopping: Callable[[], bool] | None = None) -> Iterator[None]:
        """The run's row from start to end: `running` now, `failed` if the body raises an error,
        `interrupted` if it is stopped (Ctrl-C, a termination signal: anything that is not an
        `Exception`, or any error once `stopping()` says a stop was asked for: a library the
        stop reached first may have turned it into one), which the same command resumes. The
        body records `completed` itself, with the summary."""
        self.start(spec)
        try:
            yield
        except Exception:
            stopped = stopping is not None and stopping()
            self.finish(spec.run_id, RunStatus.interrupted if stopped else RunStatus.failed, None)
            raise
        except BaseException:
            self.finish(spec.run_id, RunStatus.interrupted, None)
            raise

    def get(self, run_id: str) -> dict[str, Any] | None:
        with self.db.connect(read_only=True) as con:
            cur = con.execute("SELECT * FROM runs WHERE run_id = ?", [run_id])
            row = cur.fetchone()
            if row is None:
                return None
            return _run_dict(cur.description, row)

    def find(self, ref: str) -> dict[str, Any]:
        """The run whose id is `ref`, else the one whose id starts with it, else the one whose
        id contains it (its random suffix, say): a prefix found before keeps being found.
        Unknown or ambiguous is bad input, naming the candidates."""
        rows: list[dict[str, Any]] = []
        if ref and self.db.path.exists():
            with self.db.connect(read_only=True) as con:
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
            raise InputError(f"run {ref!r}: no such run in {self.db.path}")
        ids = ", ".join(r["run_id"] for r in candidates[:10]) + (", ..." if len(candidates) > 10 else "")
        raise InputError(f"run {ref!r} is ambiguous, it could be {ids}: give more of the id")

    def list(self, limit: int = 50) -> list[dict[str, Any]]:
        if not self.db.path.exists():
            return []
        with self.db.connect(read_only=True) as con:
            cur = con.execute("SELECT * FROM runs ORDER BY started_at DESC LIMIT ?", [limit])
            return [_run_dict(cur.description, row) for row in cur.fetchall()]

    def latest_completed_of_suite(self, suite_name: str, *, before: str | None = None) -> str | None:
        """The newest completed run of the suite of this name, whatever its version or agent
        (`--baseline previous`); with `before`, among the runs started before that run."""
        if not self.db.path.exists():
            return None
        with self.db.connect(read_only=True) as con:
            row = con.execute(
                f"SELECT run_id FROM runs WHERE status = '{RunStatus.completed}' AND suite_name = ? AND run_id <> ?"
                " AND (? IS NULL OR started_at < (SELECT started_at FROM runs WHERE run_id = ?))"
                " ORDER BY started_at DESC LIMIT 1", [suite_name, before or "", before, before],
            ).fetchone()
        return row[0] if row else None

    def write_aggregates(self, run_id: str, rows: Sequence[tuple]) -> None:
        with self.db.connect() as con:
            con.execute("DELETE FROM aggregates WHERE run_id = ?", [run_id])
            con.executemany(
                "INSERT INTO aggregates VALUES (?, ?, ?, ?, ?, ?)", [[run_id, *row] for row in rows]
            )
