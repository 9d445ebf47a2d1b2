"""The release gate: a run against a baseline run (docs/contract.md §6), from the stored runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from storage.runs import PreparedRun
from storage.store import Store
from tasks.metrics.diff import METRIC_NAMES, CaseResult, Metric, RunDiff, check_metric, diff_runs
from tasks.metrics.gate import gate_values
from tasks.metrics.rules import GateRules, rule_blocks
from tasks.models import InputError
from tasks.run import RunConfig, RunSummary


@dataclass(frozen=True)
class Comparison:
    """A run against its baseline: the case-by-case diff, and the summaries it came from."""

    run: dict[str, Any]  # the `runs` rows
    base: dict[str, Any]
    diff: RunDiff
    results: list[CaseResult]  # the run's cases, all of them

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
    run, base = store.find_run(run_id), store.find_run(baseline)
    if require_same_suite and run["suite_version"] != base["suite_version"]:
        raise InputError(
            f"run {run['run_id']} is on suite {run['suite_version'][:12]} and baseline {base['run_id']} on "
            f"{base['suite_version'][:12]}: different suite versions (pass --shared-only to "
            "compare the cases they share)"
        )
    results = store.case_results(run["run_id"])
    diff = diff_runs(results, store.case_results(base["run_id"]),
                     run_id=run["run_id"], baseline_id=base["run_id"], metric=check_metric(metric),
                     seed=run["seed"])
    return Comparison(run, base, diff, results)


def run_gate(run: PreparedRun, config: RunConfig,
             store: Store) -> Callable[[RunSummary], dict[str, Any]] | None:
    """The gate a prepared run applies to its summary (`tasks.run.loop.run_loop`), or None
    when it has no baseline."""
    if run.baseline is None:
        return None
    baseline = run.baseline

    def gate(summary: RunSummary) -> dict[str, Any]:
        return gate_runs(run.spec.run_id, baseline, min_pass_at_1=config.min_pass_at_1, max_drop=config.max_drop,
                         store=store, safety_failed=summary.safety_failed, rules=run.rules, metric=config.metric,
                         summary=summary)

    return gate


def gate_runs(
    run_id: str,
    baseline: str,
    *,
    min_pass_at_1: float | None = None,
    max_drop: float = 0.0,
    shared_only: bool = False,
    store: Store,
    safety_failed: bool | None = None,
    rules: GateRules | None = None,
    metric: str = "pass",
    summary: RunSummary | None = None,
) -> dict[str, Any]:
    """Gate `run_id` against `baseline`. Runs on different suite versions are refused
    unless `shared_only`, which compares the case hashes they share and says so.
    `safety_failed`: the run's safety verdict when the caller has it (else read back).
    `rules`: the team's rules (max new failures, per-slice thresholds); the run suite's
    must-pass cases always apply. `metric`: what the paired CI compares, `pass` or `score`.
    `summary`: the run's summary when the caller has it (a flow gating before storing it)."""
    comparison = pair_runs(run_id, baseline, metric=metric, store=store, require_same_suite=not shared_only)
    return gate_comparison(comparison, min_pass_at_1=min_pass_at_1, max_drop=max_drop, store=store,
                           safety_failed=safety_failed, rules=rules, summary=summary)


def gate_comparison(
    comparison: Comparison,
    *,
    min_pass_at_1: float | None = None,
    max_drop: float = 0.0,
    store: Store,
    safety_failed: bool | None = None,
    rules: GateRules | None = None,
    summary: RunSummary | None = None,
) -> dict[str, Any]:
    """The `gate --json` document of a comparison (see `gate_runs`)."""
    run, base, diff = comparison.run, comparison.base, comparison.diff
    run_id, baseline = run["run_id"], base["run_id"]
    metric: Metric = diff.metric
    results = comparison.results
    values = {r.case_hash: r.value(metric) for r in results}
    base_values = {c.before.case_hash: c.before.value(metric) for c in diff.cases if c.before is not None}
    failed = store.safety_failed(run_id) if safety_failed is None else safety_failed
    pass_at_1 = sum(r.c / r.n for r in results) / len(results) if results else 0.0
    result = gate_values(
        values, base_values, safety_failed=failed, pass_at_1=pass_at_1, metric_name=METRIC_NAMES[metric],
        min_pass_at_1=min_pass_at_1, max_drop=max_drop, seed=run["seed"],
    ).to_json()

    must_pass = store.must_pass_cases(run["suite_version"])
    stated = GateRules(must_pass=must_pass or frozenset(),
                       max_new_failures=rules.max_new_failures if rules else None,
                       slice_min=rules.slice_min if rules else {})
    blocks = rule_blocks(stated, results, diff, _slice_values(summary or comparison.run_summary, metric), METRIC_NAMES[metric])
    if blocks:
        safety = [r for r in result["reasons"] if r.startswith("safety:")]
        rest = [r for r in result["reasons"] if not r.startswith("safety:")]
        result["reasons"] = [*safety, *(b.message for b in blocks), *rest]
        result["decision"] = "block"
    if must_pass is None:
        result["reasons"].append(f"must-pass cases unknown: suite {run['suite_version'][:12]} has no snapshot here")
    result.update(run_id=run_id, baseline=baseline, metric=metric, dropped_cases=diff.dropped,
                  blocks=[b.to_json() for b in blocks])
    return result


def _slice_values(summary: RunSummary | None, metric: Metric) -> dict[str, float | None]:
    if summary is None:
        return {}
    if metric == "score":
        return {name: s.mean_score for name, s in summary.slices.items()}
    return {name: s.pass_at_1 for name, s in summary.slices.items()}
