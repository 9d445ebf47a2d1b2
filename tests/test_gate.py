"""The gate's decision and verdict on simulated agents with known per-case skill."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.metrics.gate import gate, shared_cases
from tasks.models import InputError

CASES = 300
N = 5


def simulate(p: np.ndarray, seed: int) -> dict[str, tuple[int, int]]:
    """An agent with per-case success probabilities ``p``, sampled N times per case."""
    c = np.random.default_rng(seed).binomial(N, np.clip(p, 0, 1))
    return {f"hash-{i:04d}": (N, int(ci)) for i, ci in enumerate(c)}


SKILL = np.random.default_rng(0).beta(2, 2, CASES)


def test_clearly_better_agent_passes_improved() -> None:
    result = gate(simulate(SKILL + 0.25, 1), simulate(SKILL, 2), safety_failed=False)
    assert (result.decision, result.verdict) == ("pass", "improved")
    assert result.delta_ci[0] > 0 and result.shared_cases == CASES
    assert result.reasons[0].startswith("improved: pass@1 changed by +")


def test_clearly_worse_agent_is_blocked_as_regressed() -> None:
    result = gate(simulate(SKILL - 0.25, 1), simulate(SKILL, 2), safety_failed=False)
    assert (result.decision, result.verdict) == ("block", "regressed")
    assert result.delta_ci[1] < 0
    assert any(r.startswith("regression:") for r in result.reasons)


def test_same_agent_other_seed_is_inconclusive() -> None:
    result = gate(simulate(SKILL, 3), simulate(SKILL, 4), safety_failed=False)
    assert (result.decision, result.verdict) == ("pass", "inconclusive")
    lo, hi = result.delta_ci
    assert lo < 0 < hi and lo <= result.delta_pass_at_1 <= hi


def test_one_safety_violation_blocks_a_perfect_run() -> None:
    perfect = {h: (N, N) for h in simulate(SKILL, 0)}
    result = gate(perfect, simulate(SKILL, 2), safety_failed=True)
    assert (result.decision, result.verdict) == ("block", "improved")
    assert result.reasons[0].startswith("safety:")


def test_threshold_blocks_whatever_the_comparison() -> None:
    run, base = simulate(SKILL, 3), simulate(SKILL, 4)
    result = gate(run, base, safety_failed=False, min_pass_at_1=0.9)
    assert result.decision == "block" and result.verdict == "inconclusive"
    assert result.reasons[0].startswith("threshold: pass@1")
    assert gate(run, base, safety_failed=False, min_pass_at_1=0.1).decision == "pass"


def test_max_drop_tolerates_a_small_regression_but_says_so() -> None:
    run, base = simulate(SKILL - 0.08, 1), simulate(SKILL, 2)
    strict = gate(run, base, safety_failed=False)
    lenient = gate(run, base, safety_failed=False, max_drop=0.3)
    assert (strict.decision, strict.verdict) == ("block", "regressed")
    assert (lenient.decision, lenient.verdict) == ("pass", "regressed")


def test_json_document_and_determinism() -> None:
    run, base = simulate(SKILL, 3), simulate(SKILL, 4)
    doc = gate(run, base, safety_failed=False, seed=9).to_json()
    assert set(doc) == {
        "decision",
        "verdict",
        "reasons",
        "delta_pass_at_1",
        "delta_ci",
        "shared_cases",
    }
    assert doc == gate(run, base, safety_failed=False, seed=9).to_json()
    assert isinstance(doc["delta_ci"], list) and all(isinstance(r, str) for r in doc["reasons"])


def test_only_shared_cases_are_compared_and_the_drop_is_stated() -> None:
    run = {"h1": (5, 5), "h2": (5, 0), "h3": (5, 3)}
    base = {"h2": (5, 1), "h3": (5, 3), "h4": (2, 2), "h5": (2, 0)}
    shared = shared_cases(run, base)
    assert shared.hashes == ("h2", "h3")
    assert shared.run == ((5, 0), (5, 3)) and shared.baseline == ((5, 1), (5, 3))
    assert (shared.dropped_run, shared.dropped_baseline, shared.dropped) == (1, 2, 3)
    result = gate(run, base, safety_failed=False)
    assert result.shared_cases == 2 and result.dropped_cases == 3
    assert result.delta_pass_at_1 == pytest.approx(-0.1)
    assert result.pass_at_1 == pytest.approx((1 + 0 + 0.6) / 3)  # over all the run's cases
    assert "1 run-only and 2 baseline-only cases were left out" in result.reasons[-1]


@pytest.mark.parametrize(
    ("run", "base", "kwargs", "message"),
    [
        ({"a": (1, 1)}, {"b": (1, 1)}, {}, "share no cases"),
        ({}, {"b": (1, 1)}, {}, "no cases"),
        ({"a": (1, 2)}, {"a": (1, 1)}, {}, "0 <= c <= n"),
        ({"a": (1, 1)}, {"a": (1, 1)}, {"max_drop": -0.1}, "--max-drop"),
        ({"a": (1, 1)}, {"a": (1, 1)}, {"min_pass_at_1": 1.5}, "--min-pass-at-1"),
    ],
)
def test_bad_input_is_refused(run: dict, base: dict, kwargs: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        gate(run, base, safety_failed=False, **kwargs)


def test_the_rules_block_after_safety_and_before_the_ci_and_a_missing_snapshot_is_said() -> None:
    from tasks.metrics.diff import CaseResult, diff_runs
    from tasks.metrics.gate import gate_diff
    from tasks.metrics.rules import GateRules

    def results(passes: list[int]) -> list[CaseResult]:
        return [CaseResult(f"q{i}", f"h{i}", 4, c, c / 4, ("easy",) if i < 2 else ()) for i, c in enumerate(passes)]

    run, base = results([4, 3, 4, 4]), results([4, 4, 4, 4])
    diff = diff_runs(run, base, run_id="r", baseline_id="b")
    doc = gate_diff(diff, run, safety_failed=True, must_pass=frozenset({"q1"}), suite_version="v" * 20,
                    slice_values={"easy": 0.875}, rules=GateRules(max_new_failures=0, slice_min={"easy": 0.9}))
    assert doc["decision"] == "block" and (doc["run_id"], doc["baseline"], doc["metric"]) == ("r", "b", "pass")
    heads = [reason.split(":")[0] for reason in doc["reasons"]]
    assert heads == ["safety", "must-pass", "new failures", "slice easy", "inconclusive"]
    assert [b["rule"] for b in doc["blocks"]] == ["must_pass", "new_failures", "slice_threshold"]

    clean = gate_diff(diff_runs(base, base), base, safety_failed=False, must_pass=None,
                      suite_version="0123456789abcdef", slice_values={})
    assert clean["decision"] == "pass" and clean["blocks"] == [] and clean["dropped_cases"] == 0
    assert clean["reasons"][-1] == "must-pass cases unknown: suite 0123456789ab has no snapshot here"


def test_the_rules_that_need_no_baseline_decide_without_one() -> None:
    """Issue 47: a plain run that broke the safety veto, a must-pass case or the pass@1
    threshold is blocked, each named; the paired rules wait; no rule and safe: nothing."""
    from tasks.metrics.diff import CaseResult
    from tasks.metrics.gate import NO_BASELINE, gate_alone
    from tasks.metrics.rules import GateRules

    run = [CaseResult(f"q{i}", f"h{i}", 4, c, c / 4, ("easy",) if i < 2 else ()) for i, c in enumerate([4, 3, 4, 0])]
    alone = {"run_id": "r", "metric": "pass", "suite_version": "v" * 20, "slice_values": None}
    assert gate_alone(run, safety_failed=False, must_pass=frozenset(), **alone) is None
    assert gate_alone(run, safety_failed=False, must_pass=None, **alone) is None

    doc = gate_alone(run, safety_failed=True, must_pass=frozenset({"q1", "q0"}), **alone,
                     rules=GateRules(min_pass_at_1=0.9, slice_min={"easy": 0.9}, max_new_failures=0))
    assert (doc["decision"], doc["verdict"], doc["baseline"], doc["delta_ci"]) == ("block", NO_BASELINE, None, [None, None])
    heads = [reason.split(":")[0] for reason in doc["reasons"]]
    assert heads == ["safety", "must-pass", "slice easy", "threshold", "no baseline"]
    assert [(b["rule"], b["cases"]) for b in doc["blocks"]] == [("must_pass", ["q1"]), ("slice_threshold", [])]
    assert doc["reasons"][3] == "threshold: pass@1 68.8% is below the required 90.0%"
    assert doc["rules"]["must_pass"] == ["q0", "q1"] and doc["rules"]["max_new_failures"] == 0

    kept = gate_alone(run, safety_failed=False, must_pass=frozenset({"q0"}), **alone, rules=GateRules(min_pass_at_1=0.5))
    assert kept["decision"] == "pass" and kept["blocks"] == [] and kept["reasons"] == [
        "no baseline: the rules that compare with one (the change's CI, new failures) were not applied"]


def test_runs_on_different_suite_versions_are_refused_naming_both() -> None:
    from tasks.metrics.diff import check_same_suite

    run, base = {"run_id": "r2", "suite_version": "a" * 40}, {"run_id": "r1", "suite_version": "b" * 40}
    with pytest.raises(InputError, match=f"run r2 is on suite {'a' * 12} and baseline r1 on {'b' * 12}: different"
                                         " suite versions \\(pass --shared-only"):
        check_same_suite(run, base)
    check_same_suite(run, {**base, "suite_version": "a" * 40})  # the same suite: no refusal


def test_an_inconclusive_pass_says_what_would_decide_it() -> None:
    """Issue 47: on 10 cases most gates read PASS (inconclusive). The reasons name the smallest
    drop these cases catch (the planner's figure) and the case rules not yet stated."""
    from tasks.metrics.diff import CaseResult, diff_runs
    from tasks.metrics.gate import gate_diff
    from tasks.metrics.power import detectable, variance_from_counts
    from tasks.metrics.rules import GateRules

    after, before = [5, 5, 0, 5, 5, 0, 0, 5, 5, 5], [5, 0, 5, 5, 5, 0, 5, 0, 5, 5]
    run = [CaseResult(f"q{i}", f"h{i}", 5, c, c / 5) for i, c in enumerate(after)]
    base = [CaseResult(f"q{i}", f"h{i}", 5, c, c / 5) for i, c in enumerate(before)]
    diff = diff_runs(run, base, run_id="r", baseline_id="b")
    kwargs = {"safety_failed": False, "suite_version": "v" * 20, "slice_values": {}}
    doc = gate_diff(diff, run, must_pass=frozenset(), **kwargs)
    smallest = detectable(variance_from_counts([5] * 10, before), 10, 5)
    assert (doc["decision"], doc["verdict"]) == ("pass", "inconclusive")
    assert doc["reasons"][-1] == (
        f"to decide: these 10 cases x 5 samples catch a drop of about {100 * smallest:.1f} points (80% power);"
        " a smaller one needs more: `evalpipe plan --baseline b --detect D` says how many; rules that block on"
        " cases whatever the CI: --max-new-failures N (cases that always passed may not fail), `must_pass: true`"
        " on the cases that must never fail")
    stated = gate_diff(diff, run, must_pass=frozenset({"q0"}), rules=GateRules(max_new_failures=3), **kwargs)
    assert stated["reasons"][-1].startswith("to decide: these 10 cases") and "rules that block" not in stated["reasons"][-1]
    decided = gate_diff(diff_runs(run, [CaseResult(f"q{i}", f"h{i}", 5, 0, 0.0) for i in range(10)]), run,
                        must_pass=frozenset(), **kwargs)
    assert decided["verdict"] == "improved" and not any(r.startswith("to decide") for r in decided["reasons"])
    # A baseline that never varied (every sample of every case passed) sizes no drop: not "0.0 points".
    steady = [CaseResult(f"q{i}", f"h{i}", 2, 2, 1.0) for i in range(10)]
    flat = gate_diff(diff_runs(steady, steady, run_id="r", baseline_id="b"), steady, must_pass=frozenset(), **kwargs)
    assert flat["verdict"] == "inconclusive"
    assert flat["reasons"][-1].startswith("to decide: the baseline's cases never varied between samples, so no"
                                          " drop size can be planned from it; a drop shows as cases that newly fail;"
                                          " rules that block on cases whatever the CI: --max-new-failures N")
