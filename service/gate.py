"""The release gate: a run against a baseline run (docs/contract.md §6), from the stored runs:
the decision a run makes as it ends (`run_gate`) and the one `gate` and `report --baseline`
show (`decision`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from storage.store import Store
from tasks.metrics.diff import (
    CaseResult,
    RunDiff,
    check_metric,
    check_same_suite,
    diff_runs,
    needs_records,
    with_metric,
)
from tasks.metrics.gate import gate_alone, gate_diff
from tasks.metrics.rules import GateRules, newly_failing, newly_failing_graders
from tasks.models import InputError
from tasks.report.markdown import MAX_FAILING, comparison_markdown
from tasks.run import RunConfig, RunSummary
from tasks.run.loop import Gate
from tasks.run.prepare import PreparedRun
from tasks.run.summary import Measured
from tasks.trace import SampleTrace


@dataclass(frozen=True)
class Comparison:
    """A run against its baseline: the case-by-case diff, and the summaries it came from."""

    run: dict[str, Any]  # the `runs` rows
    base: dict[str, Any]
    diff: RunDiff
    results: list[CaseResult]  # the run's cases, all of them
    store: Store = field(repr=False, compare=False)  # where they are kept

    def markdown(self, gate: Mapping[str, Any] | None = None) -> str:
        """The pull-request comment (`tasks.report.markdown`), with each newly failing case's
        first failing sample read from the store."""
        return comparison_markdown(self.diff, gate, self.run_summary, self.base_summary, self.failing_samples(),
                                   self.failing_graders())

    def failing_graders(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(grader name, case id) → the first sample of the run its extra grader newly fails,
        `sample_index` and `detail`, for the comment (at most MAX_FAILING)."""
        wanted = sorted((name, cid) for name, ids in newly_failing_graders(self.diff).items() for cid in ids)
        wanted = wanted[:MAX_FAILING]
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for row in self.store.samples.of_cases([self.run["run_id"]], sorted({cid for _, cid in wanted})):
            for extra in SampleTrace.parse(row["trace"]).extra_graders or ():
                key = (extra.label, row["case_id"])
                if key in wanted and key not in found and not extra.verdict.passed:
                    found[key] = {"sample_index": row["sample_index"], "detail": extra.verdict.detail or ""}
        return {key: found[key] for key in wanted if key in found}

    def failing_samples(self) -> dict[str, dict[str, Any]]:
        """Case id → its first failing sample in the run (`sample_index`, `status`, `detail`) and
        the case's grader `kind`, for the newly failing cases the comment shows."""
        ids = newly_failing(self.diff)[:MAX_FAILING]
        if not ids:
            return {}
        try:
            kinds = {c.id: c.grader["kind"] for c in self.store.snapshots.read(self.run["suite_version"]).cases}
        except (InputError, OSError):  # a run imported without its snapshot: the kind is not known here
            kinds = {}
        failing: dict[str, dict[str, Any]] = {}
        for row in self.store.samples.of_cases([self.run["run_id"]], ids):
            if not row["passed"] and row["case_id"] not in failing:
                failing[row["case_id"]] = {"sample_index": row["sample_index"], "status": row["status"],
                                           "detail": row["detail"] or "", "kind": kinds.get(row["case_id"])}
        return failing

    @property
    def run_summary(self) -> RunSummary | None:
        return RunSummary.read(self.run["summary"]) if self.run.get("summary") else None

    @property
    def base_summary(self) -> RunSummary | None:
        return RunSummary.read(self.base["summary"]) if self.base.get("summary") else None


def pair_runs(run_id: str, baseline: str, *, metric: str = "pass", store: Store,
                 require_same_suite: bool = False) -> Comparison:
    """Pair two stored runs case by case. With `require_same_suite`, runs on different suite
    versions are refused (the gate's default); otherwise they are compared on their shared
    cases and the diff counts the rest."""
    run, base = store.runs.find(run_id), store.runs.find(baseline)
    if require_same_suite:
        check_same_suite(run, base)
    metric = check_metric(metric)
    records = needs_records(metric)
    results = with_metric(store.samples.case_results(run["run_id"], records=records), metric, f"run {run['run_id']}")
    diff = diff_runs(results, store.samples.case_results(base["run_id"], records=records),
                     run_id=run["run_id"], baseline_id=base["run_id"], metric=metric, seed=run["seed"])
    return Comparison(run, base, diff, results, store)


def run_gate(run: PreparedRun, config: RunConfig, store: Store) -> Gate:
    """The gate a prepared run applies to its figures (`tasks.run.loop.run_loop`). A baseline
    on another suite version is compared on the cases the two share (the decision says how
    many were shared, added and removed). Without a baseline, the rules that need none decide
    (`tasks.metrics.gate.gate_alone`: nothing to decide when none applies)."""
    if run.baseline is None:
        return Gate(None, lambda measured: unpaired_decision(run, config, store, measured), run.rules)
    baseline = run.baseline

    def check(measured: Measured) -> dict[str, Any]:
        comparison = pair_runs(run.spec.run_id, baseline.run_id, metric=config.metric, store=store)
        return gate_comparison(comparison, rules=run.rules, store=store, safety_failed=measured.safety_failed,
                               slice_values=measured.slice_values(config.metric), choice=baseline.choice)

    return Gate(baseline.run_id, check, run.rules)


def unpaired_decision(run: PreparedRun, config: RunConfig, store: Store, measured: Measured) -> dict[str, Any] | None:
    """A run's decision without a baseline, from its stored results."""
    run_id, slice_values = run.spec.run_id, measured.slice_values(config.metric)
    computed = slice_values is None and bool(run.rules.slice_min)  # a registered metric's slices: per case
    results = store.samples.case_results(run_id, records=computed and needs_records(config.metric))
    if computed:
        results = with_metric(results, config.metric, f"run {run_id}")
    return gate_alone(results, run_id=run_id, metric=config.metric, safety_failed=measured.safety_failed,
                      must_pass=frozenset(c.id for c in run.suite.cases if c.must_pass),
                      suite_version=run.spec.suite_version,
                      slice_values=slice_values, rules=run.rules)


def gate_comparison(
    comparison: Comparison,
    *,
    rules: GateRules,
    store: Store,
    safety_failed: bool | None = None,
    slice_values: Mapping[str, float | None] | None = None,
    choice: str | None = None,
) -> dict[str, Any]:
    """The `gate --json` document of a comparison, decided by `rules` (the suite's must-pass
    cases always apply), gated by `tasks.metrics.gate.gate_diff`. `safety_failed` and
    `slice_values`: the run's, when the caller has them (a run gating before its summary is
    stored; else read back). `choice`: how the baseline was chosen (`previous`), said."""
    run, summary = comparison.run, comparison.run_summary
    if slice_values is None and summary is not None:  # still None: the diff's (a registered metric)
        slice_values = summary.slice_values(comparison.diff.metric)
    if safety_failed is None:
        safety_failed = store.samples.safety_failed(run["run_id"])
    doc = gate_diff(comparison.diff, comparison.results, safety_failed=safety_failed,
                    must_pass=store.snapshots.must_pass_cases(run["suite_version"]), suite_version=run["suite_version"],
                    slice_values=slice_values, rules=rules)
    return imported_baseline(doc | {"baseline_choice": choice}, store.exports.imported_from(comparison.base["run_id"]))


def imported_baseline(doc: dict[str, Any], origin: dict[str, str] | None) -> dict[str, Any]:
    """A gate against an imported baseline says so in every output: its file and manifest
    hash in `baseline_import`, and a reason, which every renderer shows."""
    if origin is None:
        return doc
    note = (f"baseline {doc['baseline']} is imported from {origin['file']} (manifest sha256"
            f" {origin['manifest_sha256'][:12]}): its verdicts were graded elsewhere; `evalpipe rescore`"
            " re-grades them here")
    return {**doc, "baseline_import": origin, "reasons": [*doc["reasons"], note]}


def decision(comparison: Comparison, rules: GateRules | None, *, store: Store, shared_only: bool = False,
             choice: str | None = None) -> dict[str, Any]:
    """The decision on a stored run against its baseline (`comparison`), as `gate` and
    `report --baseline` show it: the one stored with the run when it was gated against that
    baseline on that metric and no rule is given now (`rules` None; the rules it was decided
    by are in it), else decided now by `rules` (None: the defaults). Deciding anew, runs on
    different suite versions are refused unless `shared_only`."""
    summary = comparison.run_summary
    stored = summary.gate if summary else None
    if (stored is not None and rules is None and stored.baseline == comparison.base["run_id"]
            and (stored.metric or "pass") == comparison.diff.metric):
        return stored.model_dump(mode="json") | {"decided": "at run time"}
    if not shared_only:
        check_same_suite(comparison.run, comparison.base)
    return gate_comparison(comparison, rules=rules or GateRules(), store=store, choice=choice) | {"decided": "now"}
