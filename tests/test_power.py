"""The power planner against simulated gates with known per-case skill (issue 24)."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.metrics.gate import gate_values
from tasks.metrics.power import (
    Variance,
    cases_needed,
    detectable,
    plan,
    variance_from_counts,
    variance_from_prior,
)
from tasks.models import InputError

# True per-case pass rates uniform on [0.2, 0.8]: a drop of 0.1 never leaves [0, 1], so the
# planner's model (a shift, spread by a correlation below 1) holds exactly.
LOW, HIGH = 0.2, 0.8
TRUE = Variance(between=(HIGH - LOW) ** 2 / 12, within=0.5 - ((HIGH - LOW) ** 2 / 12 + 0.25), mean=0.5, cases=0)
RHO, DROP, SAMPLES = 0.5, 0.1, 3


def simulated_power(cases: int, reps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    blocked = 0
    for _ in range(reps):
        p = rng.uniform(LOW, HIGH, cases)
        # With probability RHO a case keeps its difficulty, else it gets a fresh one: corr = RHO.
        p_run = np.where(rng.random(cases) < RHO, p, rng.uniform(LOW, HIGH, cases)) - DROP
        base = rng.binomial(SAMPLES, p) / SAMPLES
        run = rng.binomial(SAMPLES, p_run) / SAMPLES
        hashes = [f"h{i}" for i in range(cases)]
        result = gate_values(dict(zip(hashes, run, strict=True)), dict(zip(hashes, base, strict=True)),
                             safety_failed=False, pass_at_1=float(run.mean()), seed=int(rng.integers(1 << 30)),
                             n_boot=1000)
        blocked += result.decision == "block"
    return blocked / reps


def test_the_planned_cases_reach_the_stated_power_in_simulation() -> None:
    m = cases_needed(TRUE, DROP, SAMPLES, power=0.8, alpha=0.05, correlation=RHO)
    assert 100 < m < 200  # 7.85 × (0.03 + 2 × 0.22 / 3) / 0.01 ≈ 139
    reps = 400  # SE of a power near 0.8: 0.02
    assert abs(simulated_power(m, reps, seed=1) - 0.8) < 0.07
    # Half the cases is clearly short of it: the planner's figure is not just "a lot".
    assert simulated_power(m // 2, reps, seed=2) < 0.65


def test_the_components_are_recovered_from_a_baseline() -> None:
    rng = np.random.default_rng(3)
    n = np.full(20_000, 4)
    c = rng.binomial(4, rng.uniform(LOW, HIGH, n.size))
    v = variance_from_counts(n, c)
    assert v.between == pytest.approx(TRUE.between, abs=0.004)
    assert v.within == pytest.approx(TRUE.within, abs=0.004)
    assert v.mean == pytest.approx(0.5, abs=0.01) and v.cases == n.size and not v.assumed


def test_one_sample_per_case_cannot_split_the_variance_and_says_so() -> None:
    v = variance_from_counts([1] * 50, [1] * 30 + [0] * 20)
    assert v.assumed and "one sample" in v.assumed[0]
    assert v.between + v.within == pytest.approx(0.6 * 0.4)


def test_more_samples_trade_for_fewer_cases_down_to_the_between_case_floor() -> None:
    p = plan(TRUE, 0.05, suite_cases=None, correlation=RHO)
    cases = [row.cases for row in p.table]
    assert cases == sorted(cases, reverse=True) and len(set(cases)) > 3
    floor = cases_needed(Variance(TRUE.between, 0.0, 0.5, 0), 0.05, 1, correlation=RHO)
    assert cases[-1] >= floor  # samples never shrink the spread of the true change
    assert [row.samples for row in p.table] == [1, 2, 3, 5, 10, 20]


def test_a_suite_too_small_names_the_smallest_detectable_drop() -> None:
    p = plan(TRUE, 0.01, suite_cases=100, correlation=RHO, max_samples=20)
    assert not p.reachable and p.samples is None
    assert p.smallest_detectable == pytest.approx(detectable(TRUE, 100, 20, correlation=RHO))
    # ... and that drop is indeed reachable on the suite.
    assert plan(TRUE, p.smallest_detectable + 1e-6, suite_cases=100, correlation=RHO).reachable


def test_a_suite_large_enough_gets_the_fewest_samples_that_reach_the_power() -> None:
    p = plan(TRUE, 0.1, suite_cases=150, correlation=RHO)
    assert p.reachable and p.samples == 3
    assert cases_needed(TRUE, 0.1, 2, correlation=RHO) > 150 >= cases_needed(TRUE, 0.1, 3, correlation=RHO)
    doc = p.to_json()
    assert doc["samples_per_case"] == 3 and doc["total_samples"] == 450 and doc["reachable"]


def test_a_prior_states_its_assumption() -> None:
    v = variance_from_prior(0.7)
    assert v.assumed and "no baseline" in v.assumed[0] and v.cases == 0
    assert v.between + v.within == pytest.approx(0.21)


@pytest.mark.parametrize("kwargs", [{"detect": 0.0}, {"detect": 1.5}, {"power": 1.0}, {"alpha": 0.0},
                                    {"correlation": 2.0}, {"max_samples": 0}])
def test_bad_inputs_are_refused(kwargs) -> None:
    args = {"detect": 0.05} | kwargs
    with pytest.raises(InputError):
        plan(TRUE, args.pop("detect"), suite_cases=100, **args)
