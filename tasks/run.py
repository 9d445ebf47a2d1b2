"""The run layer: what a run is (`RunSpec`), what it reports (`RunSummary`, the `run --json`
document of docs/contract.md §7), and the plain steps between them — plan, draw a batch, summarize.

Flows call these and add only orchestration (task runners, artifacts) and storage; a
derived run (imported human labels) goes through the same `summarize`, so every run's
summary is assembled here and nowhere else.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.aggregate import Row, aggregate
from tasks.models import EvalCase, EvalSuite, InputError
from tasks.samples import samples_table
from tasks.sampling import PlannedSample, plan_samples, run_batch

# What a kill can throw away is bounded by count and by time, whatever the suite's size: a
# sampling task draws at most MAX_BATCH samples and starts no new one after BATCH_BUDGET_S
# (the caller submits the rest again). Within that, aim for TASKS_PER_WORKER tasks per
# worker: enough to balance uneven cases and move the progress bar, few enough that
# Prefect's ~10 ms per task stays small.
MAX_BATCH = 64
BATCH_BUDGET_S = 2.0
TASKS_PER_WORKER = 16


def new_run_id() -> str:
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


class RunSpec(BaseModel):
    """One run as recorded in the `runs` table when it starts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(default_factory=new_run_id)
    suite_version: str
    suite_name: str
    agent: str
    agent_fingerprint: str
    n: int = Field(ge=1)
    ks: list[int]
    seed: int = Field(ge=0)
    regrade: int = Field(default=0, ge=0)
    flow_run_id: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)


def check_ks(ks: Sequence[int]) -> list[int]:
    if any(x < 1 for x in ks):
        raise InputError(f"k: every k must be at least 1, got {list(ks)}")
    return list(ks)


# --- planning and drawing ----------------------------------------------------------------


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


def draw_batch(agent: Any, cases: Sequence[EvalCase], planned: Sequence[PlannedSample], spec: RunSpec) -> pa.Table:
    """Draw and grade a batch for up to BATCH_BUDGET_S; the graded samples (a prefix of
    `planned`) as rows of the samples table."""
    drawn = run_batch(agent, cases, planned, spec.n, spec.regrade, BATCH_BUDGET_S)
    return samples_table(spec.run_id, drawn, planned[: len(drawn)])


# --- the summary ---------------------------------------------------------------------------


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SliceSummary(_Doc):
    cases: int
    pass_at_1: float
    pass_at_1_ci: list[float]
    pass_at_k: dict[str, float | None]


class SafetyViolation(_Doc):
    case_id: str
    sample_index: int
    violation: str


class GateSummary(_Doc):
    """The gate's verdict on this run against `baseline` (the `gate --json` document)."""

    decision: Literal["pass", "block"]
    verdict: str
    reasons: list[str]
    delta_pass_at_1: float | None
    delta_ci: list[float | None]
    shared_cases: int
    run_id: str
    baseline: str


class RunSummary(_Doc):
    """The `run --json` document. Optional keys appear only where they apply: the gate with
    a baseline, environment flakes with `--regrade`, the label keys on an imported-labels run."""

    run_id: str
    suite_version: str
    suite_name: str
    agent: str
    n: int
    cases: int
    samples: int
    cached_samples: int
    pass_at_k: dict[str, float | None]
    pass_at_k_notes: dict[str, str]
    pass_at_1_ci: list[float]
    ci_level: float
    pass_at_1_se: float | None
    slices: dict[str, SliceSummary]
    flaky_cases: int
    flaky_case_ids: list[str]
    status_counts: dict[str, int]
    safety_failed: bool
    safety_violations: list[SafetyViolation]
    env_flaky_samples: int | None = None
    gate: GateSummary | None = None
    source_run: str | None = None
    labeller: str | None = None
    labelled: int | None = None
    unlabelled: int | None = None
    sandbox: str | None = None  # "bwrap", "unsafe-no-sandbox" or "not-needed" (tasks.sandbox)
    flow_run_id: str | None = None
    duration_s: float | None = None

    @classmethod
    def read(cls, doc: RunSummary | Mapping[str, Any]) -> RunSummary:
        """A `run --json` document read back (from the database, or a caller's dict) as the
        model: a document that drifted from it is an input error naming the first bad key."""
        if isinstance(doc, cls):
            return doc
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise InputError(f"run {doc.get('run_id', '?')!r}: summary key {where}: {first['msg']}") from None

    def to_json(self) -> dict[str, Any]:
        doc = self.model_dump(mode="json")
        for key in _OPTIONAL_KEYS:
            if doc[key] is None:
                del doc[key]
        return doc


# Absent from the document when they do not apply (`flow_run_id` and `duration_s` are always there).
_OPTIONAL_KEYS = ("env_flaky_samples", "gate", "source_run", "labeller", "labelled", "unlabelled", "sandbox")


def summarize(spec: RunSpec, suite: EvalSuite, samples: pa.Table) -> tuple[RunSummary, list[Row]]:
    """The run's summary from its stored samples, and the rows of its `aggregates` table."""
    agg = aggregate(samples, {c.id: c.slices for c in suite.cases}, spec.ks, seed=spec.seed)
    summary = RunSummary(
        run_id=spec.run_id,
        suite_version=suite.version,
        suite_name=suite.name,
        agent=spec.agent,
        n=spec.n,
        cases=len(suite.cases),
        samples=samples.num_rows,
        cached_samples=pc.sum(samples["cached"]).as_py() or 0,
        **agg.to_json(),
        env_flaky_samples=_env_flakes(samples) if spec.regrade else None,
        flow_run_id=spec.flow_run_id,
    )
    return summary, agg.rows()


def _env_flakes(samples: pa.Table) -> int:
    return sum(bool(json.loads(t).get("env_flaky")) for t in samples["trace"].to_pylist())
