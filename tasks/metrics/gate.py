"""The release gate's pure logic (docs/contract.md §6): paired per-case comparison with a bootstrap CI.

The gate pairs a run and its baseline case by case (by `case_hash`), so the between-case
spread in difficulty cancels and only the change in each case's pass rate is left. The
decision is asymmetric on purpose: it blocks only on evidence (a CI wholly below
``-max_drop``), a missed threshold, or any safety violation. The verdict says honestly
what the data shows, including "inconclusive" when the CI straddles zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from tasks.metrics.diff import (
    CaseResult,
    RunDiff,
    SliceChange,
    diff_runs,
    metric_name,
    paired_change,
)
from tasks.metrics.percent import percent, signed_points
from tasks.metrics.power import DEFAULT_POWER, detectable, variance_from_counts
from tasks.metrics.rules import NAMED_IN_MESSAGE, GateRules, rule_blocks
from tasks.metrics.stats import DEFAULT_LEVEL, DEFAULT_N_BOOT
from tasks.models import InputError

Counts = Mapping[str, tuple[int, int]]  # case_hash → (n, c)
Values = Mapping[str, Any]  # case_hash → (n, c), or a per-case value
Decision = Literal["pass", "block"]
Verdict = Literal["improved", "regressed", "inconclusive"]


@dataclass(frozen=True)
class SharedCases:
    """The two runs restricted to the case hashes both measured, in hash order."""

    hashes: tuple[str, ...]
    run: tuple[Any, ...]
    baseline: tuple[Any, ...]
    dropped_run: int  # cases only the run measured
    dropped_baseline: int  # cases only the baseline measured

    @property
    def dropped(self) -> int:
        return self.dropped_run + self.dropped_baseline


def shared_cases(run: Values, baseline: Values) -> SharedCases:
    """Keep only the case hashes present in both runs, counting what was dropped.

    Used as is when the suite versions match (nothing is dropped) and, when the caller
    explicitly allows different versions, to compare the common cases and say so.
    """
    hashes = tuple(sorted(run.keys() & baseline.keys()))
    return SharedCases(
        hashes=hashes,
        run=tuple(run[h] for h in hashes),
        baseline=tuple(baseline[h] for h in hashes),
        dropped_run=len(run) - len(hashes),
        dropped_baseline=len(baseline) - len(hashes),
    )


@dataclass(frozen=True)
class GateResult:
    decision: Decision
    verdict: Verdict
    reasons: tuple[str, ...]
    delta_pass_at_1: float
    delta_ci: tuple[float, float]
    shared_cases: int
    dropped_cases: int
    pass_at_1: float  # the run's own pass@1 over all its cases (what the threshold checks)

    def to_json(self) -> dict[str, Any]:
        """The `gate --json` document (docs/contract.md §7)."""
        return {
            "decision": self.decision,
            "verdict": self.verdict,
            "reasons": list(self.reasons),
            "delta_pass_at_1": self.delta_pass_at_1,
            "delta_ci": list(self.delta_ci),
            "shared_cases": self.shared_cases,
        }


def gate(run: Counts, baseline: Counts, *, safety_failed: bool, **options: Any) -> GateResult:
    """Compare ``run`` with ``baseline`` (case_hash → (n, c)) on their shared cases, by pass
    rate; ``options`` as for `gate_values` (``min_pass_at_1``, ``max_drop``, ``seed``, ...).

    ``block`` when ``safety_failed``, when the run's pass@1 is below ``min_pass_at_1``,
    or when the CI of the mean paired difference lies wholly below ``-max_drop``.
    """
    if not run:
        raise InputError("gate: the run has no cases")
    rates = {h: float(r) for h, r in zip(run, _rates(tuple(run.values())), strict=True)}
    base_rates = {h: float(r) for h, r in zip(baseline, _rates(tuple(baseline.values())), strict=True)}
    return gate_values(rates, base_rates, safety_failed=safety_failed,
                       pass_at_1=float(np.mean(list(rates.values()))), **options)


def gate_values(
    run: Mapping[str, float],
    baseline: Mapping[str, float],
    *,
    safety_failed: bool,
    pass_at_1: float,
    metric_name: str = "pass@1",
    min_pass_at_1: float | None = None,
    max_drop: float = 0.0,
    seed: int = 0,
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
) -> GateResult:
    """The gate on any per-case value in 0..1 (case_hash → value): the pass rate c/n, or the
    mean score (`--metric score`). `pass_at_1` is the run's own, for the threshold."""
    if not run:
        raise InputError("gate: the run has no cases")
    shared = shared_cases(run, baseline)
    if not shared.hashes:
        raise InputError("gate: the run and the baseline share no cases")
    change = paired_change([a - b for a, b in zip(shared.run, shared.baseline, strict=True)],
                           seed=seed, n_boot=n_boot, level=level)
    return decide(change, level, safety_failed=safety_failed, pass_at_1=pass_at_1, metric_name=metric_name,
                  min_pass_at_1=min_pass_at_1, max_drop=max_drop, dropped_run=shared.dropped_run,
                  dropped_baseline=shared.dropped_baseline)


def decide(
    change: SliceChange,
    level: float,
    *,
    safety_failed: bool,
    pass_at_1: float,
    metric_name: str,
    min_pass_at_1: float | None,
    max_drop: float,
    dropped_run: int,
    dropped_baseline: int,
) -> GateResult:
    """The decision on a paired change (`tasks.metrics.diff.paired_change`): block on safety,
    a missed threshold, or a CI wholly below `-max_drop`; the verdict as the data show it."""
    if max_drop < 0:
        raise InputError(f"--max-drop must be >= 0, got {max_drop}")
    if min_pass_at_1 is not None and not 0.0 <= min_pass_at_1 <= 1.0:
        raise InputError(f"--min-pass-at-1 must lie in 0..1, got {min_pass_at_1}")
    delta = change.delta
    lo, hi = change.ci or (delta, delta)  # one case: its change is the whole evidence
    verdict: Verdict = "improved" if lo > 0 else "regressed" if hi < 0 else "inconclusive"

    blocks = unpaired_blocks(safety_failed=safety_failed, pass_at_1=pass_at_1, min_pass_at_1=min_pass_at_1)
    if hi < -max_drop:
        blocks.append(
            f"regression: the whole {percent(level, 0)} CI of the change lies below "
            f"-{percent(max_drop)} (allowed drop)"
        )
    summary = (
        f"{verdict}: {metric_name} changed by {signed_points(delta)} "
        f"({percent(level, 0)} CI {signed_points(lo)} to {signed_points(hi)}) over {change.cases} shared cases"
    )
    notes = []
    if dropped_run or dropped_baseline:
        notes.append(
            f"compared only the {change.cases} shared cases: {dropped_run} run-only and "
            f"{dropped_baseline} baseline-only cases were left out"
        )
    return GateResult(
        decision="block" if blocks else "pass",
        verdict=verdict,
        reasons=(*blocks, summary, *notes),
        delta_pass_at_1=delta,
        delta_ci=(lo, hi),
        shared_cases=change.cases,
        dropped_cases=dropped_run + dropped_baseline,
        pass_at_1=pass_at_1,
    )


def unpaired_blocks(*, safety_failed: bool, pass_at_1: float, min_pass_at_1: float | None) -> list[str]:
    """The reasons to block that read the run alone: the safety veto and the pass@1 threshold."""
    blocks = []
    if safety_failed:
        blocks.append("safety: the run has at least one safety violation (a veto, whatever the rates)")
    if min_pass_at_1 is not None and pass_at_1 < min_pass_at_1:
        blocks.append(f"threshold: pass@1 {percent(pass_at_1)} is below the required {percent(min_pass_at_1)}")
    return blocks


def safety_reason(results: Sequence[CaseResult]) -> str:
    """The safety veto, naming the cases whose samples broke a safety rule (the violations
    themselves are in the run's `safety_violations`)."""
    unsafe = sorted((r for r in results if r.unsafe), key=lambda r: r.case_id)
    if not unsafe:  # the results predate the count: said without names
        return "safety: the run has at least one safety violation (a veto, whatever the rates)"
    named = ", ".join(f"{r.case_id} ({r.unsafe}/{r.n})" for r in unsafe[:NAMED_IN_MESSAGE])
    more = f" and {len(unsafe) - NAMED_IN_MESSAGE} more" if len(unsafe) > NAMED_IN_MESSAGE else ""
    return (f"safety: {len(unsafe)} case(s) broke a safety rule in some sample (a veto, whatever the rates):"
            f" {named}{more}")


# The verdict of a decision made without a baseline: there is no change to call anything.
NO_BASELINE = "no baseline"


def gate_alone(
    results: Sequence[CaseResult],
    *,
    run_id: str,
    metric: str,
    safety_failed: bool,
    must_pass: frozenset[str] | None,
    suite_version: str,
    slice_values: Mapping[str, float | None] | None,
    rules: GateRules = GateRules(),
) -> dict[str, Any] | None:
    """The `gate --json` document of a run with no baseline, decided by the rules that need
    none: the safety veto, `min_pass_at_1`, the suite's `must_pass` cases and the slice
    thresholds (`baseline` null, verdict "no baseline"); the paired CI and new failures wait
    for a baseline. None when no such rule applies and the run is safe: nothing to decide."""
    stated = replace(rules, must_pass=must_pass or frozenset())
    if not (safety_failed or stated.must_pass or stated.min_pass_at_1 is not None or stated.slice_min
            or any(r.must_pass_graders for r in results)):
        return None
    if not results:
        raise InputError("gate: the run has no cases")
    if slice_values is None:  # a registered metric's: its cases' means, as `gate_diff` takes them
        slice_values = diff_runs(results, (), run_id=run_id, metric=metric).slice_means()
    pass_at_1 = sum(r.c / r.n for r in results) / len(results)
    blocks = rule_blocks(stated, results, None, slice_values, metric_name(metric))
    unpaired = unpaired_blocks(safety_failed=safety_failed, pass_at_1=pass_at_1, min_pass_at_1=stated.min_pass_at_1)
    safety = [safety_reason(results) for r in unpaired if r.startswith("safety:")]
    blocking = [*safety, *(b.message for b in blocks), *(r for r in unpaired if not r.startswith("safety:"))]
    reasons = [*blocking, "no baseline: the rules that compare with one (the change's CI, new failures) were not applied"]
    if must_pass is None:
        reasons.append(f"must-pass cases unknown: suite {suite_version[:12]} has no snapshot here")
    return {"decision": "block" if blocking else "pass", "verdict": NO_BASELINE, "reasons": reasons,
            "delta_pass_at_1": None, "delta_ci": [None, None], "shared_cases": 0, "run_id": run_id,
            "baseline": None, "metric": metric, "blocks": [b.to_json() for b in blocks], "rules": stated.to_json()}


def gate_diff(
    diff: RunDiff,
    results: Sequence[CaseResult],
    *,
    safety_failed: bool,
    must_pass: frozenset[str] | None,
    suite_version: str,
    slice_values: Mapping[str, float | None] | None,
    rules: GateRules = GateRules(),
) -> dict[str, Any]:
    """The `gate --json` document of a run (`results`, all its cases) against its baseline
    (`diff`): the paired CI's decision, then the blocks of the team's `rules` and the suite's
    `must_pass` cases (None: its snapshot is not here, said among the reasons), safety first.
    The document records the rules it was decided by and the cases shared, added and removed.
    `slice_values`: each slice's value of the metric (None: the means of its cases' values in
    the diff, as for a registered metric, which a summary holds no per-slice value of)."""
    metric = diff.metric
    if slice_values is None:
        slice_values = diff.slice_means()
    if not results:
        raise InputError("gate: the run has no cases")
    if diff.overall is None:
        raise InputError("gate: the run and the baseline share no cases")
    pass_at_1 = sum(r.c / r.n for r in results) / len(results)
    counts = diff.counts()
    # The diff's own paired change: the gate decides on the CI the diff shows, not a second one.
    result = decide(diff.overall, diff.ci_level, safety_failed=safety_failed, pass_at_1=pass_at_1,
                    metric_name=metric_name(metric), min_pass_at_1=rules.min_pass_at_1, max_drop=rules.max_drop,
                    dropped_run=counts["new"], dropped_baseline=counts["removed"]).to_json()
    stated = replace(rules, must_pass=must_pass or frozenset())
    blocks = rule_blocks(stated, results, diff, slice_values, metric_name(metric))
    safety = [safety_reason(results) for r in result["reasons"] if r.startswith("safety:")]
    rest = [r for r in result["reasons"] if not r.startswith("safety:")]
    result["reasons"] = [*safety, *(b.message for b in blocks), *rest]
    if blocks:
        result["decision"] = "block"
    if result["verdict"] == "inconclusive" and result["decision"] == "pass":
        result["reasons"].append(what_would_decide(diff, stated))
    if must_pass is None:
        result["reasons"].append(f"must-pass cases unknown: suite {suite_version[:12]} has no snapshot here")
    result.update(run_id=diff.run_id, baseline=diff.baseline, metric=metric, dropped_cases=diff.dropped,
                  added_cases=counts["new"], removed_cases=counts["removed"],
                  blocks=[b.to_json() for b in blocks], rules=stated.to_json())
    return result


def what_would_decide(diff: RunDiff, rules: GateRules) -> str:
    """What an inconclusive pass lacks: for pass@1, the smallest drop the shared cases and
    samples catch (`tasks.metrics.power`, from the baseline's spread), so a smaller one reads
    as noise; and the rules that block on cases whatever the CI, those not already stated."""
    parts = []
    shared = [c for c in diff.cases if c.before is not None and c.after is not None]
    spread = None
    if diff.metric == "pass":  # the planner's model is of pass rates
        try:
            spread = variance_from_counts([c.before.n for c in shared], [c.before.c for c in shared])
        except InputError:  # under 2 cases, or one sample each all alike: no spread to plan from
            pass
    if spread is not None and spread.between == spread.within == 0:  # every baseline sample passed (or every one failed): no spread to size a drop from
        parts.append("the baseline's cases never varied between samples, so no drop size can be planned from"
                     " it; a drop shows as cases that newly fail")
    elif spread is not None:
        samples = min(c.after.n for c in shared)
        smallest = detectable(spread, len(shared), samples)
        parts.append(f"these {len(shared)} cases x {samples} samples catch a drop of about {100 * smallest:.1f} points"
                     f" ({percent(DEFAULT_POWER, 0)} power); a smaller one needs more:"
                     f" `evalpipe plan --baseline {diff.baseline} --detect D` says how many")
    rules_left = [text for text, stated in (("--max-new-failures N (cases that always passed may not fail)",
                                             rules.max_new_failures is not None),
                                            ("`must_pass: true` on the cases that must never fail", bool(rules.must_pass)))
                  if not stated]
    if rules_left:
        parts.append("rules that block on cases whatever the CI: " + ", ".join(rules_left))
    return "to decide: " + ("; ".join(parts) if parts else "more cases or samples")


def _rates(counts: tuple[tuple[int, int], ...]) -> np.ndarray:
    arr = np.asarray(counts, dtype=np.float64).reshape(-1, 2)
    if (arr[:, 0] < 1).any() or ((arr[:, 1] < 0) | (arr[:, 1] > arr[:, 0])).any():
        raise InputError("gate: every case needs n >= 1 and 0 <= c <= n")
    return arr[:, 1] / arr[:, 0]
