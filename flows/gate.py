"""The release gate: a run against a baseline run (docs/contract.md §6), from the stored runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from storage.runs import PreparedRun
from storage.store import Store
from tasks.metrics.diff import CaseResult, RunDiff, check_metric, check_same_suite, diff_runs
from tasks.metrics.gate import gate_diff
from tasks.metrics.rules import GateRules
from tasks.run import RunConfig, RunSummary
from tasks.run.loop import Gate
from tasks.run.summary import Measured


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
    if require_same_suite:
        check_same_suite(run, base)
    results = store.case_results(run["run_id"])
    diff = diff_runs(results, store.case_results(base["run_id"]),
                     run_id=run["run_id"], baseline_id=base["run_id"], metric=check_metric(metric),
                     seed=run["seed"])
    return Comparison(run, base, diff, results)


def run_gate(run: PreparedRun, config: RunConfig, store: Store) -> Gate | None:
    """The gate a prepared run applies to its figures (`tasks.run.loop.run_loop`), or None
    when it has no baseline."""
    if run.baseline is None:
        return None
    baseline = run.baseline

    def check(measured: Measured) -> dict[str, Any]:
        return gate_runs(run.spec.run_id, baseline, min_pass_at_1=config.min_pass_at_1, max_drop=config.max_drop,
                         store=store, safety_failed=measured.safety_failed, rules=run.rules, metric=config.metric,
                         slice_values=measured.slice_values(config.metric))

    return Gate(baseline, check)


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
    slice_values: Mapping[str, float | None] | None = None,
) -> dict[str, Any]:
    """Gate `run_id` against `baseline`. Runs on different suite versions are refused
    unless `shared_only`, which compares the case hashes they share and says so.
    `safety_failed`: the run's safety verdict when the caller has it (else read back).
    `rules`: the team's rules (max new failures, per-slice thresholds); the run suite's
    must-pass cases always apply. `metric`: what the paired CI compares, `pass` or `score`.
    `slice_values`: the run's slice figures when the caller has them (a run gating before
    its summary is stored; else read back)."""
    comparison = pair_runs(run_id, baseline, metric=metric, store=store, require_same_suite=not shared_only)
    return gate_comparison(comparison, min_pass_at_1=min_pass_at_1, max_drop=max_drop, store=store,
                           safety_failed=safety_failed, rules=rules, slice_values=slice_values)


def gate_comparison(
    comparison: Comparison,
    *,
    min_pass_at_1: float | None = None,
    max_drop: float = 0.0,
    store: Store,
    safety_failed: bool | None = None,
    rules: GateRules | None = None,
    slice_values: Mapping[str, float | None] | None = None,
) -> dict[str, Any]:
    """The `gate --json` document of a comparison (see `gate_runs`): the stored figures it
    needs, read here, gated by `tasks.metrics.gate.gate_diff`."""
    run, summary = comparison.run, comparison.run_summary
    if slice_values is None:
        slice_values = summary.slice_values(comparison.diff.metric) if summary else {}
    if safety_failed is None:
        safety_failed = store.safety_failed(run["run_id"])
    doc = gate_diff(comparison.diff, comparison.results, seed=run["seed"], safety_failed=safety_failed,
                    must_pass=store.must_pass_cases(run["suite_version"]), suite_version=run["suite_version"],
                    slice_values=slice_values, rules=rules, min_pass_at_1=min_pass_at_1, max_drop=max_drop)
    return imported_baseline(doc, store.imported_from(comparison.base["run_id"]))


def imported_baseline(doc: dict[str, Any], origin: dict[str, str] | None) -> dict[str, Any]:
    """A gate against an imported baseline says so in every output: its file and manifest
    hash in `baseline_import`, and a reason, which every renderer shows."""
    if origin is None:
        return doc
    note = (f"baseline {doc['baseline']} is imported from {origin['file']} (manifest sha256"
            f" {origin['manifest_sha256'][:12]}): its verdicts were graded elsewhere; `evalpipe rescore`"
            " re-grades them here")
    return {**doc, "baseline_import": origin, "reasons": [*doc["reasons"], note]}

