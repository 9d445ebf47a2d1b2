"""The anytime-valid sequential test: its error under repeated looks, and its stop rule (issue 24)."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.metrics.sequential import (
    confidence_sequence,
    look_points,
    sequential_looks,
    sequential_test,
    stop_decision,
)
from tasks.models import InputError

CASES, N = 300, 5


def paired(rng: np.random.Generator, runs: int, drop: float) -> np.ndarray:
    """Paired per-case differences of `runs` simulated comparisons, a true mean change of −drop."""
    p = rng.beta(0.6, 0.4, (runs, CASES))
    q = np.clip(p * (1 - drop / p.mean(axis=1, keepdims=True)), 0, 1)
    return (rng.binomial(N, q) - rng.binomial(N, p)) / N


def test_with_nothing_changed_the_test_rarely_fires_at_any_time() -> None:
    below, above = sequential_test(paired(np.random.default_rng(0), 4000, 0.0), null=0.0, horizon=CASES)
    # Checked after every case (the most peeking possible): each side at most alpha/2.
    assert below[:, -1].mean() <= 0.025 + 0.008
    assert above[:, -1].mean() <= 0.025 + 0.008


def test_a_real_loss_is_found_early() -> None:
    below, _ = sequential_test(paired(np.random.default_rng(1), 1000, 0.15), null=0.0, horizon=CASES)
    first = np.where(below.any(axis=1), below.argmax(axis=1) + 1, CASES)
    assert below[:, -1].mean() > 0.99 and first.mean() < 0.6 * CASES


def test_the_confidence_sequence_narrows_and_holds_the_truth() -> None:
    d = paired(np.random.default_rng(2), 1, 0.1)[0]
    lower, upper = confidence_sequence(d, horizon=CASES)
    assert (np.diff(lower) >= 0).all() and (np.diff(upper) <= 0).all()
    assert (lower <= upper).all() and upper[-1] - lower[-1] < upper[9] - lower[9]
    assert lower[-1] <= d.mean() <= upper[-1]


def test_the_bounds_agree_with_the_test() -> None:
    d = paired(np.random.default_rng(3), 1, 0.2)[0]
    below, _ = sequential_test(d, null=0.0, horizon=CASES)
    _, upper = confidence_sequence(d, horizon=CASES)
    t = int(below.argmax())
    assert below[t] and upper[t] <= 0.0025  # rejected at 0: the upper bound is at 0 or below


def test_looks_stop_at_the_first_decisive_round() -> None:
    d = paired(np.random.default_rng(4), 1, 0.25)[0]
    looks, decision = sequential_looks(d, look_points(CASES, 10), horizon=CASES, alpha=0.05, max_drop=0.0)
    assert decision == "block" and len(looks) < 10 and looks[-1].upper < 0
    assert [look.cases for look in looks] == [30 * (i + 1) for i in range(len(looks))]
    tie = np.zeros(CASES)
    looks, decision = sequential_looks(tie, look_points(CASES, 10), horizon=CASES, alpha=0.05, max_drop=0.0)
    assert decision is None and len(looks) == 10


def test_an_early_pass_needs_the_rules_to_allow_it() -> None:
    assert stop_decision(False, True) == "pass"
    assert stop_decision(False, True, can_pass_early=False) is None
    assert stop_decision(True, False, can_pass_early=False) == "block"
    assert stop_decision(False, False) is None


def test_look_points_cover_the_suite() -> None:
    assert look_points(7, 10) == [1, 2, 3, 4, 5, 6, 7]
    assert look_points(100, 4) == [25, 50, 75, 100]
    with pytest.raises(InputError):
        look_points(0)


def test_differences_outside_the_range_are_refused() -> None:
    with pytest.raises(InputError):
        sequential_test([0.5, 1.5], null=0.0, horizon=2)


def test_a_drop_within_the_allowance_passes_early_and_one_beyond_it_blocks() -> None:
    rng = np.random.default_rng(5)
    small = rng.permutation(np.r_[-np.ones(10), np.zeros(290)])  # a 3.3-point drop, 10 points allowed
    looks, decision = sequential_looks(small, look_points(CASES, 10), horizon=CASES, alpha=0.05, max_drop=0.10)
    assert decision == "pass" and len(looks) < 10 and looks[-1].lower > -0.10
    large = rng.permutation(np.r_[-np.ones(120), np.zeros(180)])  # a 40-point drop
    looks, decision = sequential_looks(large, look_points(CASES, 10), horizon=CASES, alpha=0.05, max_drop=0.10)
    assert decision == "block" and looks[-1].upper < -0.10


def test_the_draw_order_is_fixed_by_the_seed() -> None:
    from tasks.run.sequential import case_order

    hashes = [f"h{i:03d}" for i in range(100)]
    assert case_order(hashes, 7) == case_order(hashes, 7)
    assert case_order(hashes, 7) != case_order(hashes, 8)
    assert sorted(case_order(hashes, 7)) == hashes


def _record(decision, max_drop: float = 0.0, lower: float = -0.3, upper: float = -0.05):
    from tasks.metrics.sequential import Look, SequentialRecord

    return SequentialRecord(
        decision=decision, stopped_early=True, rounds=2, planned_rounds=10, cases_drawn=20, cases_planned=100,
        samples_drawn=40, samples_planned=200, alpha=0.05, max_drop=max_drop, order_seed=0, early_pass=True,
        looks=(Look(1, 10, -0.1, -0.9, 0.5), Look(2, 20, -0.175, lower, upper)),
    )


def test_the_stop_reason_names_the_round_and_the_bounds() -> None:
    assert _record("block").stop_reason() == (
        "sequential: stopped after round 2 of 10 (20 of 100 cases, 40 of 200 samples): change -17.5 pts,"
        " its anytime-valid 95% confidence sequence -30.0 pts to -5.0 pts lies wholly below 0 (the allowed drop)")
    assert _record("pass", max_drop=0.05, lower=0.01, upper=0.3).stop_reason().endswith(
        "+1.0 pts to +30.0 pts lies wholly above -5 pts: a larger drop is ruled out")


def test_a_stopped_gate_takes_the_sequence_decision_and_keeps_the_other_reasons() -> None:
    from tasks.run import GateSummary
    from tasks.run.sequential import stopped_gate

    gate = GateSummary(decision="pass", verdict="inconclusive", delta_pass_at_1=-0.175, delta_ci=[-0.4, 0.02],
                       shared_cases=20, run_id="r", baseline="b",
                       reasons=["inconclusive: the CI includes 0", "compared only the 20 shared cases"])
    record = _record("block")
    stopped = stopped_gate(gate, record)
    assert (stopped.decision, stopped.verdict, stopped.delta_ci) == ("block", "regressed", [-0.3, -0.05])
    assert stopped.reasons == [record.stop_reason(), "compared only the 20 shared cases"]
    assert gate.decision == "pass"  # the gate it was given is unchanged
    # A win the sequence shows still blocks when a safety failure says so.
    safety = gate.model_copy(update={"decision": "block", "reasons": ["safety: 1 violation"]})
    assert stopped_gate(safety, _record("pass", lower=0.01, upper=0.3)).decision == "block"
