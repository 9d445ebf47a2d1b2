"""Registered metrics (`tasks.registry.metric`) over a run's per-case tallies, each with a CI
clustered by case (docs/contract.md §7, `metrics`).

A metric sees one `Tally` per case: `n` samples, `passes` of them passed, and their `scores`.
`Tallies` is that sequence and also the same figures as arrays over the cases (`n`,
`passes`, `mean_scores`), for metrics written with numpy. The case is the unit of
resampling, as for pass@1: a per-case metric's CI is `bootstrap_mean_ci` of its per-case
values; any other metric is computed again on each of the bootstrap's resamples of the
cases (so it should be cheap: it runs `n_boot` times).

A metric is total like a grader: one that raises, or returns something that is not a
finite number, is reported with its `error` and no value, and the run goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
from numpy.typing import NDArray

from tasks.metrics.stats import DEFAULT_LEVEL, DEFAULT_N_BOOT, bootstrap_mean_ci
from tasks.registry import MetricSpec, metrics


@dataclass(frozen=True)
class Tally:
    """One case's samples: how many, how many passed, each one's score (0 when a grader gave none)."""

    case_id: str
    n: int
    passes: int
    scores: tuple[float, ...]


class Tallies(Sequence[Tally]):
    """One `Tally` per case, in case-id order. `mean_scores` is None when the samples carry
    no scores (a metric of scores then has no value)."""

    def __init__(
        self,
        case_ids: Sequence[str],
        n: NDArray[np.int64],
        passes: NDArray[np.int64],
        mean_scores: NDArray[np.float64] | None,
        scores: Callable[[], list[NDArray[np.float64]]] | None,
    ) -> None:
        self.case_ids = tuple(case_ids)
        self.n, self.passes, self.mean_scores = n, passes, mean_scores
        self._scores = scores
        self._score_lists: list[NDArray[np.float64]] | None = None

    @classmethod
    def of_samples(
        cls,
        case_ids: Sequence[str],
        case_index: NDArray[np.int64],
        n: NDArray[np.int64],
        passes: NDArray[np.int64],
        scores: NDArray[np.float64] | None,
    ) -> Tallies:
        """From per-sample arrays: each sample's case (an index into `case_ids`) and score."""
        if scores is None:
            return cls(case_ids, n, passes, None, None)

        def split() -> list[NDArray[np.float64]]:
            order = np.argsort(case_index, kind="stable")
            return np.split(scores[order], np.cumsum(n)[:-1])

        means = np.bincount(case_index, weights=scores, minlength=n.size) / n
        return cls(case_ids, n, passes, means, split)

    def score_lists(self) -> list[NDArray[np.float64]]:
        """Each case's sample scores (split once, on first use)."""
        if self._scores is None:
            raise ValueError("the samples carry no scores")
        if self._score_lists is None:
            self._score_lists = self._scores()
        return self._score_lists

    def take(self, indices: NDArray[np.int64]) -> Tallies:
        """The cases at `indices` (repeats allowed): one bootstrap resample."""
        ids = [self.case_ids[i] for i in indices]
        if self.mean_scores is None:
            return Tallies(ids, self.n[indices], self.passes[indices], None, None)
        return Tallies(ids, self.n[indices], self.passes[indices], self.mean_scores[indices],
                       lambda: [self.score_lists()[i] for i in indices])

    def __len__(self) -> int:
        return len(self.case_ids)

    @overload
    def __getitem__(self, i: int) -> Tally: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Tally]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        scores = () if self.mean_scores is None else tuple(map(float, self.score_lists()[i]))
        return Tally(self.case_ids[i], int(self.n[i]), int(self.passes[i]), scores)

    def __iter__(self) -> Iterator[Tally]:
        return (self[i] for i in range(len(self)))


def metric_values(
    tallies: Tallies, *, seed: int = 0, n_boot: int = DEFAULT_N_BOOT, level: float = DEFAULT_LEVEL
) -> dict[str, dict[str, Any]]:
    """Every registered metric: {name: {value, ci, percent[, error]}}. The CI is None for a
    single case (nothing to resample) and for a metric with no value."""
    return {name: _one(spec, tallies, seed, n_boot, level) for name, spec in metrics().items()}


def _one(spec: MetricSpec, tallies: Tallies, seed: int, n_boot: int, level: float) -> dict[str, Any]:
    doc: dict[str, Any] = {"value": None, "ci": None, "percent": spec.percent}
    try:
        if spec.per_case:
            per_case = spec.fn(tallies)
            if per_case is None:
                return doc
            values = np.asarray(per_case, dtype=np.float64).ravel()
            if values.size != len(tallies) or not np.isfinite(values).all():
                raise ValueError(f"expected {len(tallies)} finite per-case values, got {values.size}")
            doc["value"] = float(values.mean())
            if len(tallies) > 1:
                doc["ci"] = list(bootstrap_mean_ci(values, seed=seed, n_boot=n_boot, level=level))
            return doc
        value = _finite(spec.fn(tallies))
        if value is None:
            return doc
        doc["value"] = value
        if len(tallies) > 1:
            doc["ci"] = _resampled_ci(spec.fn, tallies, value, seed, n_boot, level)
    except Exception as exc:  # noqa: BLE001 - a metric's failure is reported, the run goes on
        return {"value": None, "ci": None, "percent": spec.percent,
                "error": f"metric {spec.name} raised {type(exc).__name__}: {exc}"[:500]}
    return doc


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.number) or not math.isfinite(value):
        raise ValueError(f"returned {value!r}, not a finite number")
    return float(value)


def _resampled_ci(
    fn: Callable[[Tallies], Any], tallies: Tallies, point: float, seed: int, n_boot: int, level: float
) -> list[float] | None:
    """Percentile bootstrap over cases: `fn` on `n_boot` resamples of as many cases, drawn
    with replacement. Resamples where the metric has no value are left out."""
    rng = np.random.default_rng(seed)
    m = len(tallies)
    values = [_finite(fn(tallies.take(rng.integers(0, m, size=m)))) for _ in range(n_boot)]
    kept = np.array([v for v in values if v is not None], dtype=np.float64)
    if kept.size == 0:
        return None
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(kept, [alpha, 1.0 - alpha])
    return [min(float(lo), point), max(float(hi), point)]
