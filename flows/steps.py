"""The Prefect tasks of an evaluate run: snapshot, sample (mapped), aggregate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from storage import db
from storage.snapshots import write_snapshot
from tasks.models import EvalSuite
from tasks.run import RunSpec, RunSummary, draw_batch, summarize
from tasks.run.sampling import PlannedSample


def _snapshot_key(context, parameters) -> str:
    return f"evalpipe-snapshot-{parameters['home']}-{parameters['suite'].version}"


@task(name="snapshot", cache_key_fn=_snapshot_key, task_run_name="snapshot {suite.name}")
def snapshot(suite: EvalSuite, home: str) -> str:
    """Write the suite's snapshot (once per version) and record the suite in DuckDB."""
    path = write_snapshot(suite, Path(home))
    db.record_suite(suite, path, Path(home))
    return str(path)


@task(name="sample", cache_policy=NO_CACHE, persist_result=False, task_run_name="sample {label}")
def sample_batch(agent: Any, cases: list, planned: list[PlannedSample], spec: RunSpec, label: str):
    return draw_batch(agent, cases, planned, spec)


@task(name="aggregate", cache_policy=NO_CACHE, persist_result=False)
def reduce_run(spec: RunSpec, suite: EvalSuite, home: str) -> RunSummary:
    """The one reduction: read the run's samples back, summarize, store the aggregates."""
    summary, rows = summarize(spec, suite, db.run_samples(spec.run_id, Path(home)))
    db.write_aggregates(spec.run_id, rows, Path(home))
    return summary
