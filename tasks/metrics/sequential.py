"""An anytime-valid gate: a confidence sequence for the mean paired difference, and the stop rule
(docs/statistics.md, "The sequential gate").

Cases are drawn in a seeded random order, so their paired differences d_i ∈ [−1, 1] are
independent draws from the suite's population of cases. A *confidence sequence* holds the
mean at every time t at once with probability ≥ 1 − alpha: looking after every round, and
stopping at the first look that decides, keeps the error rate (a fixed-sample CI looked at
repeatedly does not: "peek and stop" inflates it several-fold).

The test is by betting (Waudby-Smith & Ramdas 2023, "Estimating means of bounded random
variables by betting", the hedged capital process): on x = (d+1)/2 ∈ [0, 1], for a candidate
mean m, K⁺_t = Π(1 + λ_i (x_i − m)) grows when the mean is above m and K⁻_t = Π(1 − λ_i (x_i − m))
when it is below; each is a nonnegative supermartingale when m is on its wrong side, so by
Ville's inequality it ever reaches 2/alpha with probability ≤ alpha/2. The bets λ_i are
predictable (from the cases before i: the predictable plug-in of the paper, tuned to the
suite's size as horizon) and capped at 3/4 of what keeps the capital positive. Unlike an
empirical-Bernstein bound, betting can stake more than 1 when the differences cluster near
zero, as paired differences do, so it is close to a fixed-sample CI near the horizon.
Pure numpy; the tests work on one run (1-D) or many simulated runs at once (2-D, time on
the last axis).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from tasks.metrics.percent import signed_points
from tasks.models import InputError

Decision = Literal["block", "pass"]
DEFAULT_ROUNDS = 10
# The share of the largest bet that keeps the capital positive (the paper's c: 1/2 or 3/4).
_BET_CAP = 0.75
# Bounds are reported on this grid of candidate means over [−1, 1] (steps of 0.25 points).
_GRID = 801


def _as_x(diffs: ArrayLike, alpha: float) -> NDArray[np.float64]:
    d = np.asarray(diffs, dtype=np.float64)
    if d.shape[-1] == 0:
        raise InputError("sequential test of no cases")
    if (np.abs(d) > 1.0 + 1e-12).any():
        raise InputError("sequential test: paired differences must lie in [-1, 1]")
    if not 0.0 < alpha < 1.0:
        raise InputError(f"alpha must lie in (0, 1), got {alpha}")
    return (np.clip(d, -1.0, 1.0) + 1.0) / 2.0


def _bets(x: NDArray[np.float64], horizon: int, alpha: float) -> NDArray[np.float64]:
    """The predictable plug-in bet sizes: λ_t = sqrt(2 log(2/alpha) / (horizon σ̂²_{t−1})),
    with the running mean and variance started at 1/2 and 1/4 (the paper's priors)."""
    t = np.arange(1, x.shape[-1] + 1, dtype=np.float64)
    mu = (0.5 + np.cumsum(x, axis=-1)) / (t + 1.0)
    sigma2 = (0.25 + np.cumsum((x - mu) ** 2, axis=-1)) / (t + 1.0)
    prev = np.empty_like(sigma2)
    prev[..., 0] = 0.25
    prev[..., 1:] = sigma2[..., :-1]
    return np.sqrt(2.0 * np.log(2.0 / alpha) / (max(horizon, 1) * prev))


def _log_capital(x: NDArray[np.float64], bets: NDArray[np.float64], m: ArrayLike
                 ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """log K⁺ and log K⁻ after each case at candidate mean(s) `m` (x-scale, broadcast)."""
    m = np.asarray(m, dtype=np.float64)
    up = np.minimum(bets, _BET_CAP / np.maximum(m, 1e-12))
    down = np.minimum(bets, _BET_CAP / np.maximum(1.0 - m, 1e-12))
    return (np.cumsum(np.log1p(up * (x - m)), axis=-1), np.cumsum(np.log1p(-down * (x - m)), axis=-1))


def sequential_test(diffs: ArrayLike, *, null: float, horizon: int, alpha: float = 0.05
                    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    """After each case, whether the mean of `diffs` has been shown below `null` (`below`) or
    above it (`above`), at any time so far; each side wrong with probability ≤ alpha/2 over
    all times at once."""
    x = _as_x(diffs, alpha)
    up, down = _log_capital(x, _bets(x, horizon, alpha), (null + 1.0) / 2.0)
    threshold = np.log(2.0 / alpha)
    return (np.maximum.accumulate(down, axis=-1) >= threshold,
            np.maximum.accumulate(up, axis=-1) >= threshold)


def confidence_sequence(diffs: ArrayLike, *, horizon: int, alpha: float = 0.05
                        ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Lower and upper bounds of the mean of one run's `diffs` after each case: the candidate
    means (on a grid of 0.25 points) not yet rejected, intersected over time. Valid at all
    times at once with probability ≥ 1 − alpha."""
    x = _as_x(diffs, alpha)
    if x.ndim != 1:
        raise InputError("confidence_sequence takes one run's differences")
    grid = np.linspace(0.0, 1.0, _GRID)[:, None]
    up, down = _log_capital(x[None, :], _bets(x, horizon, alpha)[None, :], grid)
    threshold = np.log(2.0 / alpha)
    kept = ~((np.maximum.accumulate(up, axis=-1) >= threshold) | (np.maximum.accumulate(down, axis=-1) >= threshold))
    values = 2.0 * grid - 1.0
    lower = np.where(kept, values, np.inf).min(axis=0)
    upper = np.where(kept, values, -np.inf).max(axis=0)
    # Every candidate rejected (possible only at grid resolution): the interval is the estimate.
    mean = np.cumsum(2.0 * x - 1.0) / np.arange(1, x.size + 1)
    empty = ~kept.any(axis=0)
    return np.where(empty, mean, lower), np.where(empty, mean, upper)


def look_points(cases: int, rounds: int = DEFAULT_ROUNDS) -> list[int]:
    """The number of cases drawn by the end of each round: `rounds` near-equal rounds."""
    if cases < 1:
        raise InputError("a sequential run needs at least one case")
    if rounds < 1:
        raise InputError(f"--rounds: expected >= 1, got {rounds}")
    return sorted({max(1, round(cases * (r + 1) / rounds)) for r in range(rounds)})


def stop_decision(below: bool, above: bool, *, can_pass_early: bool = True) -> Decision | None:
    """The gate's decision once it can no longer change: `block` when the mean is shown below
    −max_drop, `pass` when shown above it (a drop larger than max_drop ruled out) and nothing
    else needs every case; else None (draw on)."""
    if below:
        return "block"
    if above and can_pass_early:
        return "pass"
    return None


@dataclass(frozen=True)
class Look:
    round: int
    cases: int  # drawn so far
    mean: float
    lower: float
    upper: float


@dataclass(frozen=True)
class SequentialRecord:
    """What a sequential run did: stored in the run summary under `sequential`."""

    decision: Decision | None  # None: ran to the end (the ordinary gate decided)
    stopped_early: bool
    rounds: int  # looks taken
    planned_rounds: int
    cases_drawn: int
    cases_planned: int
    samples_drawn: int
    samples_planned: int
    alpha: float
    max_drop: float
    order_seed: int
    early_pass: bool  # False when a rule needs every case (min pass@1, must-pass, slices, new failures)
    looks: tuple[Look, ...]
    rule: str | None = None  # the gate rule, broken for good, that stopped the run (decision "block")

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["looks"] = [asdict(look) for look in self.looks]
        return doc

    def stop_reason(self) -> str:
        """The gate's reason when the run stopped early: where it stopped, and the rule broken
        or the last look's confidence sequence against the allowed drop."""
        last = self.looks[-1]
        allowed = f"-{100 * self.max_drop:g} pts" if self.max_drop else "0"
        where = (f"sequential: stopped after round {self.rounds} of {self.planned_rounds}"
                 f" ({self.cases_drawn} of {self.cases_planned} cases, {self.samples_drawn} of"
                 f" {self.samples_planned} samples)")
        if self.rule:
            return f"{where}: {self.rule}"
        return (f"{where}: change {signed_points(last.mean)}, its anytime-valid"
                f" {100 * (1 - self.alpha):g}% confidence sequence {signed_points(last.lower)} to"
                f" {signed_points(last.upper)} lies wholly "
                + (f"below {allowed} (the allowed drop)" if self.decision == "block"
                   else f"above {allowed}: a larger drop is ruled out"))


def sequential_looks(diffs: ArrayLike, points: list[int], *, horizon: int, alpha: float, max_drop: float,
                     can_pass_early: bool = True) -> tuple[list[Look], Decision | None]:
    """Replay the looks at `points` (cases drawn at each) over the differences in draw order:
    the looks taken, and the decision of the first look that decided (None: none did)."""
    d = np.asarray(diffs, dtype=np.float64)
    below, above = sequential_test(d, null=-max_drop, horizon=horizon, alpha=alpha)
    lower, upper = confidence_sequence(d, horizon=horizon, alpha=alpha)
    looks: list[Look] = []
    for i, t in enumerate(p for p in points if p <= d.size):
        looks.append(Look(i + 1, t, float(d[:t].mean()), float(lower[t - 1]), float(upper[t - 1])))
        decision = stop_decision(bool(below[t - 1]), bool(above[t - 1]), can_pass_early=can_pass_early)
        if decision is not None:
            return looks, decision
    return looks, None
