"""`Store(home)`: one evalpipe home's DuckDB file and snapshots as the object the run loop
keeps its samples in (`tasks.run.loop.SampleStore`), instead of `home` passed to each call."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from storage import db, evalpipe_home
from storage.snapshots import snapshot_path, write_snapshot
from tasks.metrics.diff import CaseResult
from tasks.models import EvalSuite
from tasks.run import RunSpec, RunStatus, RunSummary


@dataclass(frozen=True)
class Store:
    home: Path

    @classmethod
    def default(cls) -> Store:
        """The home `EVALPIPE_HOME` names (default ./.evalpipe)."""
        return cls(evalpipe_home())

    def cached_samples(self, keys: Sequence[tuple[str, str]]) -> pa.Table:
        return db.cached_samples(keys, self.home)

    def copy_samples(self, run_id: str, copied: pa.Table) -> None:
        db.copy_samples(run_id, copied, self.home)

    def stored_outputs(self, places: pa.Table) -> dict[str, str]:
        return db.stored_outputs(places, self.home)

    def insert_samples(self, rows: pa.Table) -> None:
        db.insert_samples(rows, self.home)

    def run_samples(self, run_id: str, columns: Sequence[str] | None = None) -> pa.Table:
        return db.run_samples(run_id, self.home, columns)

    def write_aggregates(self, run_id: str, rows: Sequence[tuple]) -> None:
        db.write_aggregates(run_id, rows, self.home)

    @contextmanager
    def recorded_run(self, spec: RunSpec) -> Iterator[None]:
        with db.recorded_run(spec, self.home):
            yield

    def finish_run(self, run_id: str, status: RunStatus, summary: RunSummary | None) -> None:
        db.finish_run(run_id, status, summary, self.home)

    def case_results(self, run_id: str) -> list[CaseResult]:
        return db.case_results(run_id, self.home)

    def find_run(self, ref: str) -> dict[str, Any]:
        return db.find_run(ref, self.home)

    def latest_completed_run_of_suite(self, suite_version: str) -> str | None:
        return db.latest_completed_run_of_suite(suite_version, self.home)

    def has_snapshot(self, suite: EvalSuite) -> bool:
        return snapshot_path(suite.version, self.home).exists()

    def snapshot(self, suite: EvalSuite) -> Path:
        """Write the suite's snapshot (once per version) and record the suite."""
        path = write_snapshot(suite, self.home)
        db.record_suite(suite, path, self.home)
        return path
