"""The built-in registered metrics, in `run --json` under `metrics` beside every plugin's.
Registered as a plugin's are (`tasks.registry.metric`); numpy is imported when one is computed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tasks.registry import metric

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from tasks.metrics.tallies import SampleRecord, Tallies, Tally


# The headline's figures (docs/statistics.md): `aggregate` reports these members at the run's
# k values under `pass_at_k` and `pass_hat_k`, per slice too, so they are not listed again.
@metric("pass@{k}", per_case=True, listed=False)
def pass_at(tallies: Tallies, k: int) -> NDArray | None:
    """Each case's unbiased pass@k; none where k exceeds some case's n (the run notes why)."""
    from tasks.metrics.stats import pass_at_k

    return pass_at_k(tallies.n, tallies.passes, k) if k <= tallies.n.min() else None


@metric("pass^{k}", per_case=True, listed=False)
def pass_hat(tallies: Tallies, k: int) -> NDArray | None:
    """Each case's unbiased pass^k (all k of k samples pass); none where k exceeds some case's n."""
    from tasks.metrics.stats import pass_hat_k

    return pass_hat_k(tallies.n, tallies.passes, k) if k <= tallies.n.min() else None


@metric("pass@1", per_case=True)
def pass_at_1(tallies: Tallies) -> NDArray | None:
    """pass@{k}'s member every run has (k always holds 1), under `metrics` as before families."""
    return pass_at(tallies, 1)


@metric("mean_score", per_case=True)
def mean_score(tallies: Tallies) -> NDArray | None:
    """The graders' scores (partial credit, judges), per case then over the cases."""
    return tallies.mean_scores


# --- what an agent's samples took (issue #43): per sample, averaged per case, then over cases;
# and per passing sample over the run. A figure no sample of some case reports has no value
# there, and the metric then has none (never a silent zero).


def _per_sample(figure: Callable[[SampleRecord], float | None]) -> Callable[[Tallies], NDArray | None]:
    def per_case(tallies: Tallies) -> NDArray | None:
        import numpy as np

        means = []
        for tally in tallies:
            values = [v for v in map(figure, tally.samples) if v is not None]
            if not values:
                return None
            means.append(sum(values) / len(values))
        return np.array(means, dtype=float)

    return per_case


def _per_pass(figure: Callable[[SampleRecord], float | None]) -> Callable[[Tallies], float | None]:
    import math

    def total(tally: Tally) -> float:
        values = [figure(s) for s in tally.samples if s.passed]
        return math.nan if any(v is None for v in values) else sum(values)

    def passes(tally: Tally) -> float:
        return sum(s.passed for s in tally.samples)

    def per_pass(tallies: Tallies) -> float | None:
        # Per-case sums, made once (`Tallies.column`): each bootstrap resample only adds them.
        sums, counts = tallies.column(total), tallies.column(passes)
        if counts.sum() == 0 or math.isnan(sums.sum()):
            return None
        return float(sums.sum() / counts.sum())

    return per_pass


def _turns(record: SampleRecord) -> float | None:
    steps = record.steps
    return None if steps is None else len(steps.turns)


def _tool_calls(record: SampleRecord) -> float | None:
    steps = record.steps
    return None if steps is None else steps.tool_calls


def _tokens(record: SampleRecord) -> float | None:
    return record.tokens


def _cost(record: SampleRecord) -> float | None:
    return record.cost_usd


for _name, _figure in (("turns", _turns), ("tool_calls", _tool_calls), ("tokens", _tokens), ("cost", _cost)):
    metric(_name, per_case=True, percent=False)(_per_sample(_figure))
    metric(f"{_name}_per_pass", percent=False)(_per_pass(_figure))
