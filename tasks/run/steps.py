"""The steps of a run between its spec and its summary: plan the samples, find what is
still to draw, cut it into sampling tasks, draw and grade a batch."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa

from tasks.models import EvalCase, EvalSuite
from tasks.run.samples import samples_table
from tasks.run.sampling import PlannedSample, plan_samples, run_batch
from tasks.run.spec import RunSpec

# What a kill can throw away is bounded by count and by time, whatever the suite's size: a
# sampling task draws at most MAX_BATCH samples and starts no new one after BATCH_BUDGET_S
# (the caller submits the rest again). Within that, aim for TASKS_PER_WORKER tasks per
# worker: enough to balance uneven cases and move the progress bar, few enough that
# Prefect's ~10 ms per task stays small.
MAX_BATCH = 64
BATCH_BUDGET_S = 2.0
TASKS_PER_WORKER = 16


def plan(suite: EvalSuite, spec: RunSpec) -> list[PlannedSample]:
    """Every sample the run needs, in (case id, index) order."""
    return plan_samples(suite, spec.agent_fingerprint, spec.n, spec.seed)


def pending(spec: RunSpec, planned: Sequence[PlannedSample], hits: pa.Table) -> tuple[pa.Table, list[PlannedSample]]:
    """Given the stored samples found by cache key (`hits`): the rows this run reuses, and
    the planned samples it still has to draw (or, with `regrade`, to grade again)."""
    if spec.regrade:
        return hits.slice(0, 0), _with_stored_outputs(planned, hits)
    return _reuse_cached(spec.run_id, planned, hits)


def _reuse_cached(run_id: str, planned: Sequence[PlannedSample], hits: pa.Table) -> tuple[pa.Table, list[PlannedSample]]:
    if hits.num_rows:
        hits = hits.set_column(hits.schema.get_field_index("run_id"), "run_id",
                               pa.array([run_id] * hits.num_rows, pa.string()))
        hits = hits.set_column(hits.schema.get_field_index("cached"), "cached",
                               pa.array([True] * hits.num_rows, pa.bool_()))
    found = set(hits["cache_key"].to_pylist())
    return hits, [p for p in planned if p.cache_key not in found]


def _with_stored_outputs(planned: Sequence[PlannedSample], hits: pa.Table) -> list[PlannedSample]:
    """`--regrade`: the stored output of every finished sample is graded again rather than
    drawn again, so the agent is not asked twice (nor paid twice) for the same output."""
    outputs = dict(zip(hits["cache_key"].to_pylist(), hits["output"].to_pylist(), strict=True))
    return [replace(p, output=outputs.get(p.cache_key)) for p in planned]


def samples_per_task(missing: int, workers: int) -> int:
    return max(1, min(MAX_BATCH, math.ceil(missing / (workers * TASKS_PER_WORKER))))


def batches(missing: Sequence[PlannedSample], n: int, batch_size: int | None, workers: int) -> list[list[PlannedSample]]:
    """The sampling tasks: `batch_size` cases each, or by default about TASKS_PER_WORKER per
    worker of at most MAX_BATCH samples."""
    per_batch = batch_size * n if batch_size else samples_per_task(len(missing), workers)
    return [list(missing[i : i + per_batch]) for i in range(0, len(missing), per_batch)]


def batch_label(chunk: Sequence[PlannedSample]) -> str:
    ids = sorted({p.case_id for p in chunk})
    return ids[0] if len(ids) == 1 else f"{ids[0]}…{ids[-1]} ({len(chunk)})"


def batch_cases(cases: Mapping[str, EvalCase], chunk: Sequence[PlannedSample]) -> list[EvalCase]:
    """The cases a batch draws from (`cases` by id), in id order."""
    return [cases[case_id] for case_id in sorted({p.case_id for p in chunk})]


def undrawn(chunk: Sequence[PlannedSample], drawn: pa.Table) -> list[PlannedSample]:
    """What a batch left to draw: `draw_batch` stopped by its time budget drew a prefix of it."""
    return list(chunk[drawn.num_rows :])


def draw_batch(agent: Any, cases: Sequence[EvalCase], planned: Sequence[PlannedSample], spec: RunSpec) -> pa.Table:
    """Draw and grade a batch for up to BATCH_BUDGET_S; the graded samples (a prefix of
    `planned`) as rows of the samples table."""
    drawn = run_batch(agent, cases, planned, spec.n, spec.regrade, BATCH_BUDGET_S)
    return samples_table(spec.run_id, drawn, planned[: len(drawn)])
