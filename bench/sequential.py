"""Does the sequential gate keep its error rate under peeking, and what does it save? Simulated runs.

Each simulated comparison draws a suite of cases from a realistic population of per-case
pass rates (most cases nearly always pass or nearly always fail, a fifth in between), a
baseline and a run of n samples per case each, and the paired differences in a random
order. The run's per-case rates are the baseline's, a tenth of the cases given a fresh
difficulty (correlation 0.9), then moved by a true mean change Δ, in multiples of the
detectable drop D that `tasks.metrics.power` plans for this suite (power 0.8, alpha 0.05).

Three gates read the same data, with looks after each of 10 equal rounds:
- fixed: the ordinary gate (`tasks.metrics.gate`: a paired bootstrap CI) on every case;
- sequential: `tasks.metrics.sequential`, stopping at the first look whose anytime-valid test
  decides (block: shown below 0; pass: shown above 0), else the fixed gate at the end;
- naive (the peer): stop at the first look whose bootstrap CI excludes 0, else the fixed gate.

Printed (no assertions): the false-block rate by each look when nothing changed (target: ≤
alpha at every look), agreement with the fixed gate on clear cases (|Δ| ≥ 2D; target ≥ 95%),
and the samples drawn on clear wins and losses (target: ≥ 40% fewer than the full suite).

Usage: python bench/sequential.py [--runs 10000] [--cases 300] [--samples 5] [--n-boot 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tasks.metrics.power import Variance, detectable
from tasks.metrics.sequential import DEFAULT_ROUNDS, look_points, sequential_test

ALPHA = 0.05
CORRELATION = 0.9
# The population of per-case pass rates: (share, Beta a, Beta b).
POPULATION = ((0.35, 0.3, 3.0), (0.45, 3.0, 0.3), (0.20, 2.0, 2.0))
# Δ in multiples of D, and the share of the runs each gets.
SCENARIOS = ((0, 0.4), (-1, 0.1), (1, 0.1), (-2, 0.1), (2, 0.1), (-3, 0.1), (3, 0.1))


def pass_rates(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    shares = np.array([s for s, _, _ in POPULATION])
    kind = rng.choice(len(POPULATION), size=shape, p=shares)
    a = np.array([a for _, a, _ in POPULATION])[kind]
    b = np.array([b for _, _, b in POPULATION])[kind]
    return rng.beta(a, b)


def moved(p: np.ndarray, delta: float, mean: float) -> np.ndarray:
    """Per-case rates whose population mean moves by exactly `delta`: a drop scales every rate
    down, a gain scales every failure rate down (no rate leaves [0, 1])."""
    if delta < 0:
        return p * (1.0 + delta / mean)
    return 1.0 - (1.0 - p) * (1.0 - delta / (1.0 - mean))


def simulate(rng: np.random.Generator, runs: int, cases: int, n: int, delta: float, mean: float) -> np.ndarray:
    p = pass_rates(rng, (runs, cases))
    fresh = rng.random((runs, cases)) >= CORRELATION
    q = moved(np.where(fresh, pass_rates(rng, (runs, cases)), p), delta, mean)
    return (rng.binomial(n, q) - rng.binomial(n, p)) / n


def bootstrap_ci(levels: np.ndarray, index: np.ndarray, rng: np.random.Generator, n_boot: int,
                 chunk: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """The gate's percentile bootstrap CI of each row's mean, drawn as multinomial counts over
    the few values a paired difference takes (as `tasks.metrics.stats.bootstrap_mean_ci`)."""
    runs, t = index.shape
    counts = np.zeros((runs, levels.size))
    np.add.at(counts, (np.repeat(np.arange(runs), t), index.ravel()), 1.0)
    lo, hi = np.empty(runs), np.empty(runs)
    for start in range(0, runs, chunk):
        part = slice(start, start + chunk)
        means = rng.multinomial(t, counts[part] / t, size=(n_boot, counts[part].shape[0])) @ levels / t
        lo[part], hi[part] = np.quantile(means, [ALPHA / 2, 1 - ALPHA / 2], axis=0)
    return lo, hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--n-boot", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    m, n = args.cases, args.samples

    population = pass_rates(rng, (1_000_000,))
    mean = float(population.mean())
    truth = Variance(float(population.var()), float((population * (1 - population)).mean()), mean, 0)
    d_min = detectable(truth, m, n, power=0.8, alpha=ALPHA, correlation=CORRELATION)
    print(f"population: mean pass rate {mean:.3f}, between-case variance {truth.between:.4f}, within {truth.within:.4f}")
    print(f"suite: {m} cases x {n} samples per run; the planner's detectable drop D = {100 * d_min:.2f} points"
          f" (power 0.8, alpha {ALPHA}); {args.runs} simulated runs, seed {args.seed}")

    points = look_points(m, DEFAULT_ROUNDS)
    levels = np.arange(-n, n + 1) / n
    rows = []
    for k, share in SCENARIOS:
        runs = int(round(args.runs * share))
        d = simulate(rng, runs, m, n, k * d_min, mean)
        index = np.rint(d * n).astype(np.int64) + n
        below, above = sequential_test(d, null=0.0, horizon=m, alpha=ALPHA)
        naive_lo, naive_hi = np.empty((runs, len(points))), np.empty((runs, len(points)))
        for j, t in enumerate(points):
            naive_lo[:, j], naive_hi[:, j] = bootstrap_ci(levels, index[:, :t], rng, args.n_boot)
        fixed = np.where(naive_hi[:, -1] < 0, "block", "pass")
        look_idx = np.array(points) - 1
        rows.append((k, runs, fixed, _stops(below[:, look_idx], above[:, look_idx], fixed, points),
                     _stops(naive_hi < 0, naive_lo > 0, fixed, points)))

    print(f"\nfalse-block rate when nothing changed (Δ = 0), by look (cumulative; target <= {ALPHA}):")
    _, runs, fixed, seq, naive = rows[0]
    print("  look (cases)        " + " ".join(f"{t:>6}" for t in points))
    for name, (decision, stop) in (("sequential", seq), ("naive peek", naive)):
        by_look = [np.mean((decision == "block") & (stop <= t)) for t in points]
        print(f"  {name:<19} " + " ".join(f"{100 * v:5.1f}%" for v in by_look))
    print(f"  {'fixed (end only)':<19} " + " ".join(" " * 6 for _ in points[:-1])
          + f" {100 * np.mean(fixed == 'block'):5.1f}%")

    print("\nby true change (block rate, agreement with the fixed gate, samples drawn vs the full suite):")
    print("  Δ          runs   fixed block   seq block   naive block   seq agrees   naive agrees   seq samples   naive samples")
    for k, runs, fixed, seq, naive in rows:
        print(f"  {k:+d}D {100 * k * d_min:+6.2f}pt {runs:>5}   {100 * np.mean(fixed == 'block'):10.1f}%"
              f" {100 * np.mean(seq[0] == 'block'):10.1f}% {100 * np.mean(naive[0] == 'block'):12.1f}%"
              f" {100 * np.mean(seq[0] == fixed):11.1f}% {100 * np.mean(naive[0] == fixed):13.1f}%"
              f" {100 * seq[1].mean() / m:12.1f}% {100 * naive[1].mean() / m:14.1f}%")

    clear = [r for r in rows if abs(r[0]) >= 2]
    agree = np.mean(np.concatenate([r[3][0] == r[2] for r in clear]))
    for label, sign in (("losses", -1), ("wins", 1)):
        picked = [r for r in clear if np.sign(r[0]) == sign]
        drawn = np.mean(np.concatenate([r[3][1] for r in picked])) / m
        print(f"clear {label} (|Δ| >= 2D): sequential draws {100 * drawn:.1f}% of the samples"
              f" ({100 * (1 - drawn):.1f}% fewer; target >= 40%)")
    print(f"clear cases: the sequential gate agrees with the fixed gate in {100 * agree:.1f}% (target >= 95%)")
    print(f"time: {time.perf_counter() - started:.1f} s")


def _stops(block: np.ndarray, pas: np.ndarray, fixed: np.ndarray, points: list[int]
           ) -> tuple[np.ndarray, np.ndarray]:
    """Each run's decision and the cases drawn when it stopped: the first look where `block`
    or `pas` fired, else the fixed gate's decision on the whole suite."""
    fired = block | pas
    first = np.where(fired.any(axis=1), fired.argmax(axis=1), len(points) - 1)
    rows = np.arange(block.shape[0])
    decision = np.where(fired.any(axis=1), np.where(block[rows, first], "block", "pass"), fixed)
    return decision, np.array(points)[first]


if __name__ == "__main__":
    main()
