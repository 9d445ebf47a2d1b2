"""How many cases and samples a comparison needs (docs/statistics.md, "Planning a comparison").

The gate tests the mean of per-case paired differences d_i = c/n (run) − c/n (baseline). Its
variance per case has three parts (Miller 2024, "Adding Error Bars to Evals", §3–4):

    V(n) = tau² + 2 w / n

- `w`, the within-case sampling variance E[p(1−p)]: the noise of n samples of one case,
  which more samples per case shrink (both runs draw n, hence the 2);
- `tau²` = 2 sigma_b² (1 − rho), the spread of the *true* change across cases: sigma_b² is
  the between-case variance of the true pass rates, rho the correlation of the two runs'
  per-case rates. More samples never shrink it; only more cases do.

The gate blocks when its two-sided 1−alpha CI of the mean lies wholly below zero, so a true
drop D is caught with probability `power` when m ≥ (z_{1−alpha/2} + z_power)² V(n) / D².
Plain functions, numpy and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from tasks.models import InputError

DEFAULT_POWER = 0.8
DEFAULT_ALPHA = 0.05
# Assumed, and said in the plan: one run cannot measure how its per-case rates correlate with
# the next run's. Two versions of one agent usually correlate more, so this errs towards more cases.
DEFAULT_CORRELATION = 0.5
# Without a baseline (or with one sample per case) the split of the variance p(1−p) between
# cases and within cases cannot be measured: half and half, stated in the plan.
DEFAULT_BETWEEN_SHARE = 0.5
DEFAULT_MAX_SAMPLES = 20
TABLE_SAMPLES = (1, 2, 3, 5, 10, 20, 50)


@dataclass(frozen=True)
class Variance:
    """The variance components of per-case pass rates, and where they came from."""

    between: float  # sigma_b²: variance of the true per-case pass rates across cases
    within: float  # w = E[p(1−p)]: one sample's variance inside a case
    mean: float  # the mean pass rate
    cases: int  # how many cases they were measured on (0: assumed from a prior)
    assumed: tuple[str, ...] = ()  # what was assumed rather than measured, in words


def variance_from_counts(n: ArrayLike, c: ArrayLike) -> Variance:
    """Estimate the components from a run's per-case counts (n samples, c passes).

    Unbiased per case: p(1−p) by x(1−x)·n/(n−1), and the between-case variance as the
    variance of x = c/n minus the mean within-case noise w/n. With one sample per case the
    two cannot be told apart: the split is assumed (`DEFAULT_BETWEEN_SHARE`) and said.
    """
    n_arr = np.asarray(n, dtype=np.float64).ravel()
    c_arr = np.asarray(c, dtype=np.float64).ravel()
    if n_arr.size < 2:
        raise InputError("plan: the baseline needs at least 2 cases to measure the spread between cases")
    if (n_arr < 1).any() or ((c_arr < 0) | (c_arr > n_arr)).any():
        raise InputError("plan: every baseline case needs n >= 1 and 0 <= c <= n")
    x = c_arr / n_arr
    mean = float(x.mean())
    if (n_arr < 2).any():
        prior = variance_from_prior(mean)
        return Variance(prior.between, prior.within, mean, int(x.size), (
            "the baseline has cases with one sample, so the within-case variance cannot be measured: "
            f"assumed {prior_share_words()} of the variance p(1-p) lies between cases",))
    within_each = x * (1.0 - x) * n_arr / (n_arr - 1.0)
    within = float(within_each.mean())
    between = max(0.0, float(x.var(ddof=1) - (within_each / n_arr).mean()))
    return Variance(between, within, mean, int(x.size))


def variance_from_prior(pass_rate: float, between_share: float = DEFAULT_BETWEEN_SHARE) -> Variance:
    """The components assumed from a stated mean pass rate: p(1−p) split between cases
    (`between_share`) and within them."""
    if not 0.0 < pass_rate < 1.0:
        raise InputError(f"--prior: expected a pass rate strictly between 0 and 1, got {pass_rate:g}")
    total = pass_rate * (1.0 - pass_rate)
    return Variance(between_share * total, (1.0 - between_share) * total, pass_rate, 0, (
        f"no baseline: assumed a mean pass rate of {pass_rate:g}, with {prior_share_words(between_share)}"
        " of its variance p(1-p) between cases",))


def prior_share_words(share: float = DEFAULT_BETWEEN_SHARE) -> str:
    return f"{100 * share:.0f}%"


def case_variance(v: Variance, samples: int, correlation: float) -> float:
    """V(n): the variance of one case's paired difference when both runs draw `samples`."""
    return 2.0 * v.between * (1.0 - correlation) + 2.0 * v.within / samples


def _z(alpha: float, power: float) -> float:
    normal = NormalDist()
    return normal.inv_cdf(1.0 - alpha / 2.0) + normal.inv_cdf(power)


def cases_needed(v: Variance, detect: float, samples: int, *, power: float = DEFAULT_POWER,
                 alpha: float = DEFAULT_ALPHA, correlation: float = DEFAULT_CORRELATION) -> int:
    """The fewest cases that catch a paired drop of `detect` with `power` at `samples` per case."""
    need = _z(alpha, power) ** 2 * case_variance(v, samples, correlation) / detect**2
    return max(2, math.ceil(need - 1e-9))


def detectable(v: Variance, cases: int, samples: int, *, power: float = DEFAULT_POWER,
               alpha: float = DEFAULT_ALPHA, correlation: float = DEFAULT_CORRELATION) -> float:
    """The smallest drop `cases` × `samples` catch with `power` (the inverse of `cases_needed`)."""
    return _z(alpha, power) * math.sqrt(case_variance(v, samples, correlation) / cases)


@dataclass(frozen=True)
class PlanRow:
    samples: int  # per case, in each run
    cases: int  # needed at that many samples
    total_samples: int  # cases × samples, one run's cost
    fits: bool | None  # within the suite's cases (None: no suite size known)


@dataclass(frozen=True)
class Plan:
    detect: float
    power: float
    alpha: float
    correlation: float
    variance: Variance
    suite_cases: int | None
    max_samples: int
    samples: int | None  # per case on the suite's cases, the fewest that reach `power`; None: cannot
    smallest_detectable: float | None  # with the suite's cases at `max_samples`
    table: tuple[PlanRow, ...]

    @property
    def reachable(self) -> bool:
        return self.suite_cases is None or self.samples is not None

    def to_json(self) -> dict[str, Any]:
        """The `plan --json` document (docs/contract.md §7)."""
        v = self.variance
        return {
            "detect": self.detect, "power": self.power, "alpha": self.alpha, "correlation": self.correlation,
            "between_case_variance": v.between, "within_case_variance": v.within, "mean_pass_rate": v.mean,
            "measured_cases": v.cases, "assumptions": list(v.assumed),
            "suite_cases": self.suite_cases, "max_samples": self.max_samples, "reachable": self.reachable,
            "samples_per_case": self.samples,
            "total_samples": None if self.samples is None or self.suite_cases is None
            else self.samples * self.suite_cases,
            "smallest_detectable": self.smallest_detectable,
            "table": [asdict(row) for row in self.table],
        }


def plan(v: Variance, detect: float, *, suite_cases: int | None, power: float = DEFAULT_POWER,
         alpha: float = DEFAULT_ALPHA, correlation: float = DEFAULT_CORRELATION,
         max_samples: int = DEFAULT_MAX_SAMPLES, table_samples: Sequence[int] = TABLE_SAMPLES) -> Plan:
    """Cases × samples to catch a paired drop of `detect` (a fraction: 0.05 is 5 points).

    On a suite of `suite_cases`, the fewest samples per case (up to `max_samples`) that reach
    `power`, or none and the smallest drop the suite can catch; and the trade-off table: the
    cases needed at each number of samples per case."""
    check_plan_inputs(detect, power, alpha, correlation, max_samples)
    rows = tuple(
        PlanRow(n, m := cases_needed(v, detect, n, power=power, alpha=alpha, correlation=correlation), m * n,
                None if suite_cases is None else m <= suite_cases)
        for n in sorted({*table_samples, max_samples}) if n <= max_samples
    )
    samples = smallest = None
    if suite_cases is not None:
        samples = next((n for n in range(1, max_samples + 1)
                        if cases_needed(v, detect, n, power=power, alpha=alpha, correlation=correlation)
                        <= suite_cases), None)
        smallest = detectable(v, suite_cases, max_samples, power=power, alpha=alpha, correlation=correlation)
    return Plan(detect, power, alpha, correlation, v, suite_cases, max_samples, samples, smallest, rows)


def check_plan_inputs(detect: float, power: float, alpha: float, correlation: float, max_samples: int) -> None:
    if not 0.0 < detect <= 1.0:
        raise InputError(f"--detect: expected a drop in (0, 1] (0.05 is 5 points), got {detect:g}")
    if not 0.0 < power < 1.0:
        raise InputError(f"--power: expected a probability in (0, 1), got {power:g}")
    if not 0.0 < alpha < 1.0:
        raise InputError(f"--alpha: expected a probability in (0, 1), got {alpha:g}")
    if not -1.0 <= correlation <= 1.0:
        raise InputError(f"--correlation: expected -1..1, got {correlation:g}")
    if max_samples < 1:
        raise InputError(f"--max-samples: expected >= 1, got {max_samples}")
