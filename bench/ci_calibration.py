"""Does the 95% CI mean 95%, and does the gate cry wolf? Simulated suites with known skill.

Each simulated case has a true success probability p_i drawn from a Beta distribution;
an agent "run" samples n Bernoulli(p_i) outcomes per case. Printed (no assertions):

- coverage: how often the bootstrap CI of pass@1 contains the true pass@1 (target 93–97%);
  the same for pass^5 and for the mean score (partial credit: each sample's score drawn
  around its case's true mean), both through `aggregate`, the code path a run takes.
  "population" is the mean of the Beta (cases drawn fresh each replication: what the CI
  estimates); "fixed suite" is the mean p_i of one suite re-sampled (the CI is then
  conservative, because it also covers the spread of which cases were picked);
- false `regressed` rate of the gate when nothing changed (target <= 5%);
- power: how often the gate blocks a 5-point drop on 500 cases × 5 samples.

Usage: python bench/ci_calibration.py [--reps 1000] [--n-boot 2000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa

from tasks.metrics.aggregate import aggregate
from tasks.metrics.gate import gate
from tasks.metrics.stats import bootstrap_mean_ci

A, B = 1.2, 0.8  # Beta(A, B): mean 0.6, a realistic spread of easy and hard cases


def draw_counts(rng: np.random.Generator, p: np.ndarray, n: int) -> np.ndarray:
    return rng.binomial(n, p)


def coverage(
    rng: np.random.Generator, cases: int, n: int, reps: int, n_boot: int
) -> tuple[float, float]:
    truth = A / (A + B)
    fixed_p = rng.beta(A, B, cases)
    population_hits = fixed_hits = 0
    for rep in range(reps):
        p = rng.beta(A, B, cases)
        lo, hi = bootstrap_mean_ci(draw_counts(rng, p, n) / n, seed=rep, n_boot=n_boot)
        population_hits += lo <= truth <= hi
        lo, hi = bootstrap_mean_ci(draw_counts(rng, fixed_p, n) / n, seed=rep, n_boot=n_boot)
        fixed_hits += lo <= fixed_p.mean() <= hi
    return population_hits / reps, fixed_hits / reps


def reliability_and_score_coverage(
    rng: np.random.Generator, cases: int, n: int, reps: int, n_boot: int, k: int = 5
) -> tuple[float, float]:
    """Population coverage of the pass^k CI and of the mean-score CI, from `aggregate`."""
    truth_hat = float(np.prod([(A + i) / (A + B + i) for i in range(k)]))  # E[p^k], p ~ Beta(A, B)
    truth_score = A / (A + B)
    kappa = 4.0  # spread of sample scores around the case's mean
    hat_hits = score_hits = 0
    ids = np.repeat(np.char.add("c", np.arange(cases).astype(str)), n)
    for rep in range(reps):
        p = rng.beta(A, B, cases)
        passed = rng.random((cases, n)) < p[:, None]
        s = rng.beta(A, B, cases)
        scores = rng.beta(np.maximum(s * kappa, 1e-3)[:, None].repeat(n, 1), np.maximum((1 - s) * kappa, 1e-3)[:, None].repeat(n, 1))
        table = pa.table({"case_id": ids, "sample_index": np.tile(np.arange(n), cases), "passed": passed.ravel(),
                          "status": np.where(passed.ravel(), "passed", "failed"),
                          "safety": pa.array([[]] * ids.size, pa.list_(pa.string())), "score": scores.ravel()})
        overall = aggregate(table, {}, [1, k], seed=rep, n_boot=n_boot).overall
        lo, hi = overall.pass_hat_k_ci[k]
        hat_hits += lo <= truth_hat <= hi
        lo, hi = overall.mean_score_ci
        score_hits += lo <= truth_score <= hi
    return hat_hits / reps, score_hits / reps


def gate_rates(
    rng: np.random.Generator, cases: int, n: int, drop: float, reps: int, n_boot: int
) -> dict[str, float]:
    """Fractions of reps per verdict, and blocked, when the run's true pass@1 is `drop` lower."""
    base_p = rng.beta(A, B, cases)
    run_p = base_p * (1 - drop / base_p.mean())  # exactly `drop` lower on average, stays in [0, 1]
    hashes = [f"h{i}" for i in range(cases)]
    tally = {"improved": 0, "regressed": 0, "inconclusive": 0, "block": 0}
    for rep in range(reps):
        run = dict(zip(hashes, ((n, int(c)) for c in draw_counts(rng, run_p, n)), strict=True))
        base = dict(zip(hashes, ((n, int(c)) for c in draw_counts(rng, base_p, n)), strict=True))
        result = gate(run, base, safety_failed=False, seed=rep, n_boot=n_boot)
        tally[result.verdict] += 1
        tally["block"] += result.decision == "block"
    return {key: value / reps for key, value in tally.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--n-boot", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    print(
        f"per-case p ~ Beta({A}, {B}); {args.reps} replications; {args.n_boot} resamples; 95% CIs"
    )
    print("\ncoverage of the pass@1 CI (target 93-97%)")
    print(f"{'cases':>6} {'n':>3} {'population':>11} {'fixed suite':>12}")
    for cases, n in ((50, 1), (164, 5), (500, 5), (1000, 10)):
        population, fixed = coverage(rng, cases, n, args.reps, args.n_boot)
        print(f"{cases:>6} {n:>3} {population:>10.1%} {fixed:>12.1%}")
    print("\ncoverage (population) of the pass^5 and mean-score CIs, through aggregate (target 93-97%)")
    print(f"{'cases':>6} {'n':>3} {'pass^5':>8} {'mean score':>11}")
    for cases, n in ((164, 5), (500, 10)):
        hat, score = reliability_and_score_coverage(rng, cases, n, max(args.reps // 4, 50), args.n_boot)
        print(f"{cases:>6} {n:>3} {hat:>7.1%} {score:>11.1%}")
    print("\ngate on 500 cases x 5 samples")
    print(
        f"{'true change':>12} {'improved':>9} {'regressed':>10} {'inconclusive':>13} {'blocked':>8}"
    )
    for drop, label in ((0.0, "none"), (0.05, "-5 points")):
        rates = gate_rates(rng, 500, 5, drop, args.reps, args.n_boot)
        print(
            f"{label:>12} {rates['improved']:>9.1%} {rates['regressed']:>10.1%} "
            f"{rates['inconclusive']:>13.1%} {rates['block']:>8.1%}"
        )
    print("\nfalse `regressed` when nothing changed: the 'none' row (target <= 5%)")
    print("power to detect a 5-point drop: the '-5 points' row, regressed/blocked")
    print(f"\n{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
