"""What a run reports: `RunSummary`, the `run --json` document of docs/contract.md §7, built
once (it is frozen) from the run's stored samples (`measure`: the figures) and what the run
knows beyond them (`RunOutcome`: its gate, budget, sequential stop, sandbox, duration). The
gate reads the figures before the summary exists. A derived run of imported human labels
goes through the same functions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, ValidationError

from tasks.metrics.aggregate import REQUIRED_COLUMNS, Aggregate, Row, aggregate
from tasks.metrics.diff import METRICS
from tasks.models import EvalSuite, InputError
from tasks.run.replayed import ModelCallCounts, model_call_counts
from tasks.run.spec import RunSpec
from tasks.run.usage import USAGE_SAMPLE_COLUMNS, RunUsage, usage_summary
from tasks.trace import SampleTrace


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SliceSummary(_Doc):
    cases: int
    pass_at_1: float
    pass_at_1_ci: list[float] | None  # None for a single case: no CI rather than a zero-width one
    pass_at_k: dict[str, float | None]
    # Absent from summaries stored before pass^k and scores were reported.
    pass_hat_k: dict[str, float | None] | None = None
    mean_score: float | None = None
    mean_score_ci: list[float] | None = None
    # Each extra grader's pass rate over the slice's cases it grades (`grader:NAME`).
    graders: dict[str, MetricSummary] | None = None


class MetricSummary(_Doc):
    """A registered metric's figure (tasks.registry): its value with a CI clustered by case
    (None for one case), whether it is a fraction (shown as a percentage), and why it has no
    value if its function failed."""

    value: float | None
    ci: list[float] | None
    percent: bool = True
    error: str | None = None
    cases: int | None = None  # a grader's (`grader:NAME`): the cases it grades


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
    baseline: str | None  # None: decided without one, by the rules that need none (verdict "no baseline")
    # Absent from gates stored before the case-level rules.
    metric: str | None = None  # what the paired CI compared: "pass" (pass@1), "score" or a registered metric
    dropped_cases: int | None = None  # measured by one run only
    blocks: list[dict[str, Any]] | None = None  # the rules that blocked, each naming its cases or slice
    # Absent from gates stored before one decision was rendered everywhere (issue 30).
    added_cases: int | None = None  # measured by the run only
    removed_cases: int | None = None  # measured by the baseline only
    rules: dict[str, Any] | None = None  # what it was decided by (`GateRules.to_json`)
    baseline_choice: str | None = None  # how the baseline was chosen (`previous`), when not named
    # A baseline brought in by `runs import` (or re-graded from one): its file and manifest hash.
    baseline_import: dict[str, str] | None = None


class BudgetSummary(_Doc):
    """A budgeted run's limits, what it drew and spent, and why it stopped drawing (if it did)."""

    max_cost_usd: float | None
    max_samples: int | None
    drawn_samples: int
    spent_usd: float
    stopped: str | None


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
    pass_hat_k: dict[str, float | None] | None = None  # None only in summaries stored before pass^k
    mean_score: float | None = None
    mean_score_ci: list[float] | None = None
    slices: dict[str, SliceSummary]
    flaky_cases: int
    flaky_case_ids: list[str]
    status_counts: dict[str, int]
    safety_failed: bool
    safety_violations: list[SafetyViolation]
    env_flaky_samples: int | None = None
    gate: GateSummary | None = None
    no_baseline: str | None = None  # why a run asked to gate was not gated (never a silent pass)
    source_run: str | None = None
    labeller: str | None = None
    labelled: int | None = None
    unlabelled: int | None = None
    sandbox: str | None = None  # "bwrap", "unsafe-no-sandbox" or "not-needed" (tasks.sandbox)
    # Trajectory steps of coding agents (`--workspace`): samples with one, total, mean, max.
    agent_steps: dict[str, float] | None = None
    flow_run_id: str | None = None
    duration_s: float | None = None
    # Runs stored before usage was recorded have none; `partial`, `undrawn_samples` and
    # `budget` come with a budget, `unscored` with `rescore` (docs/contract.md §10).
    usage: RunUsage | None = None
    partial: bool | None = None
    undrawn_samples: int | None = None
    budget: BudgetSummary | None = None
    unscored: list[str] | None = None
    sequential: dict[str, Any] | None = None  # `run --sequential`: the stop and the looks (tasks.run.sequential)
    # Every registered metric by name; absent from summaries stored before metrics were registered.
    metrics: dict[str, MetricSummary] | None = None
    # Every output came from the cache (the agent was not called): the fingerprint matched, how to draw afresh.
    all_cached: dict[str, str] | None = None
    model_calls: ModelCallCounts | None = None  # `run --replay-model-calls`: replayed and forwarded calls

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

    def slice_values(self, metric: str) -> dict[str, float | None] | None:
        """Each slice's pass@1, or its mean score with `metric` "score" (the gate's slice rules);
        None for a registered metric, which the summary holds no per-slice value of."""
        if metric not in METRICS:
            return None
        return {name: s.mean_score if metric == "score" else s.pass_at_1 for name, s in self.slices.items()}

    def to_json(self) -> dict[str, Any]:
        doc = self.model_dump(mode="json")
        for key in _OPTIONAL_KEYS:
            if doc[key] is None:
                del doc[key]
        for slice_doc in doc["slices"].values():
            if slice_doc.get("graders") is None:  # only with extra graders: other slices read as before
                slice_doc.pop("graders", None)
        figures = [*(doc.get("metrics") or {}).values(),
                   *(f for slice_doc in doc["slices"].values() for f in (slice_doc.get("graders") or {}).values())]
        for figure in figures:
            for key in ("error", "cases"):  # only where they apply: a failed metric, a grader's
                if figure[key] is None:
                    del figure[key]
        return doc


# Absent from the document when they do not apply (`flow_run_id` and `duration_s` are always there).
_OPTIONAL_KEYS = ("env_flaky_samples", "gate", "no_baseline", "source_run", "labeller", "labelled", "unlabelled", "sandbox",
                  "agent_steps", "usage", "partial", "undrawn_samples", "budget", "unscored",
                  "sequential", "metrics", "all_cached", "model_calls")


def summary_columns(spec: RunSpec, suite: EvalSuite | None = None) -> tuple[str, ...]:
    """The sample columns `summarize` reads: never the outputs; the traces only to count
    environment flakes, what an agent did (a coding agent's, or one given tools) and what
    each extra grader said."""
    traces = (spec.regrade or spec.config.get("workspace") or spec.config.get("replay_model_calls")
              or (suite is not None and any("tools" in c.inputs or c.extra_graders for c in suite.cases)))
    return (*REQUIRED_COLUMNS, "score", "cached", *USAGE_SAMPLE_COLUMNS, *(("trace",) if traces else ()))


@dataclass(frozen=True)
class RunOutcome:
    """What a run knows beyond its samples, gathered by the loop (or a flow) and put into
    the summary when it is built. `cases`: how many cases the figures cover when fewer than
    the suite's (a sequential run stopped early, a rescore's unscored cases)."""

    gate: GateSummary | None = None
    no_baseline: str | None = None  # why a run asked to gate was not gated (never a silent pass)
    budget: BudgetSummary | None = None
    undrawn_samples: int = 0
    sequential: dict[str, Any] | None = None
    cases: int | None = None
    source_run: str | None = None
    unscored: list[str] | None = None
    sandbox: str | None = None
    duration_s: float | None = None


@dataclass(frozen=True)
class Measured:
    """A run's figures from its stored samples: what the gate reads, then the summary's body."""

    spec: RunSpec
    suite_version: str
    suite_name: str
    cases: int
    samples: int
    cached_samples: int
    aggregate: Aggregate
    env_flaky_samples: int | None
    agent_steps: dict[str, float] | None
    usage: RunUsage | None
    model_calls: ModelCallCounts | None = None

    @property
    def safety_failed(self) -> bool:
        return self.aggregate.safety_failed

    def slice_values(self, metric: str) -> dict[str, float | None] | None:
        """Each slice's pass@1, or its mean score with `metric` "score" (the gate's slice rules);
        None for a registered metric, which the aggregate holds no per-slice value of."""
        if metric not in METRICS:
            return None
        return {name: m.mean_score if metric == "score" else m.pass_at_1 for name, m in self.aggregate.slices.items()}

    def rows(self) -> list[Row]:
        """The rows of the run's `aggregates` table."""
        return self.aggregate.rows()

    def summary(self, outcome: RunOutcome = RunOutcome()) -> RunSummary:
        """The run's summary: these figures with what the run knew beyond them."""
        spec = self.spec
        return RunSummary(
            run_id=spec.run_id,
            suite_version=self.suite_version,
            suite_name=self.suite_name,
            agent=spec.agent,
            n=spec.n,
            cases=self.cases if outcome.cases is None else outcome.cases,
            samples=self.samples,
            cached_samples=self.cached_samples,
            **self.aggregate.to_json(),
            env_flaky_samples=self.env_flaky_samples,
            gate=outcome.gate,
            no_baseline=outcome.no_baseline,
            source_run=outcome.source_run,
            sandbox=outcome.sandbox,
            agent_steps=self.agent_steps,
            flow_run_id=spec.flow_run_id,
            duration_s=outcome.duration_s,
            usage=self.usage,
            partial=True if outcome.undrawn_samples else None,
            undrawn_samples=outcome.undrawn_samples or None,
            budget=outcome.budget,
            unscored=outcome.unscored,
            sequential=outcome.sequential,
            # A rescore calls no agent by design: it says so itself.
            all_cached=all_cached(spec) if self.samples and self.cached_samples == self.samples
            and outcome.source_run is None else None,
            model_calls=self.model_calls,
        )


def all_cached(spec: RunSpec) -> dict[str, str]:
    """What a run none of whose outputs was drawn says: a changed agent whose fingerprint
    did not change (a file or variable it did not declare) would be served its old outputs."""
    fingerprint = spec.agent_fingerprint
    return {"agent_fingerprint": fingerprint, "message": (
        f"every output came from the cache: the agent was not called (its fingerprint {fingerprint[:12]}"
        " matched stored outputs). A change its fingerprint cannot see, in a file or environment variable"
        " the agent reads but does not declare in evalpipe-agent.toml (docs/agents.md), is not measured;"
        f" draw afresh with a new seed: --seed {spec.seed + 1}")}


def measure(spec: RunSpec, suite: EvalSuite, samples: pa.Table) -> Measured:
    """The run's figures from its stored samples (read with `summary_columns`)."""
    return Measured(
        spec=spec,
        suite_version=suite.version,
        suite_name=suite.name,
        cases=len(suite.cases),
        samples=samples.num_rows,
        cached_samples=pc.sum(samples["cached"]).as_py() or 0,
        aggregate=aggregate(samples, {c.id: c.slices for c in suite.cases}, spec.ks, seed=spec.seed),
        env_flaky_samples=_env_flakes(samples) if spec.regrade else None,
        agent_steps=_agent_steps(samples),
        usage=usage_summary(samples),
        model_calls=model_call_counts(samples) if spec.config.get("replay_model_calls") else None,
    )


def summarize(spec: RunSpec, suite: EvalSuite, samples: pa.Table,
              outcome: RunOutcome = RunOutcome()) -> tuple[RunSummary, list[Row]]:
    """The run's summary from its stored samples, and the rows of its `aggregates` table."""
    measured = measure(spec, suite, samples)
    return measured.summary(outcome), measured.rows()


def _env_flakes(samples: pa.Table) -> int:
    return sum(bool((r := SampleTrace.parse(t).regrade) and r.env_flaky) for t in samples["trace"].to_pylist())


def _agent_steps(samples: pa.Table) -> dict[str, float] | None:
    """Steps per sample of the samples that kept a trajectory (its model turns where it
    recorded them, else its entries); None when none did."""
    if "trace" not in samples.column_names:  # no trajectories were read
        return None
    steps = [len(t.trajectory.typed.turns) or t.trajectory.steps
             for t in map(SampleTrace.parse, samples["trace"].to_pylist()) if t.trajectory]
    if not steps:
        return None
    return {"samples": len(steps), "total": sum(steps), "mean": round(sum(steps) / len(steps), 3),
            "max": max(steps)}
