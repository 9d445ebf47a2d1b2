"""Registered metrics (`tasks.registry.metric`) over a run's per-case tallies, each with a CI
clustered by case (docs/contract.md §7, `metrics`).

A metric sees one `Tally` per case: `n` samples, `passes` of them passed, their `scores`, and
each sample's record (`samples`: its verdict, score, tokens, cost, latency and trace, with the
trajectory's typed steps), so that pass@k and the count of an agent's tool calls are metrics of
one kind.
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
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, overload

import numpy as np
from numpy.typing import NDArray

from tasks.metrics.stats import DEFAULT_LEVEL, DEFAULT_N_BOOT, bootstrap_mean_ci
from tasks.registry import MetricSpec, metrics
from tasks.trace import SampleTrace
from tasks.trajectory import Steps, total_tokens


@dataclass(frozen=True)
class SampleRecord:
    """One sample as a metric sees it: its verdict, score, what its call took, and its trace
    (parsed when first read: most metrics never read it; None when the run's figures were
    reduced without traces)."""

    index: int
    passed: bool
    status: str
    score: float
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost_usd: float | None = None
    latency_s: float | None = None
    trace_json: str | None = field(default=None, repr=False)

    @cached_property
    def trace(self) -> SampleTrace | None:
        return None if self.trace_json is None else SampleTrace.parse(self.trace_json)

    @property
    def steps(self) -> Steps | None:
        """What the agent did, typed; None when it recorded no trajectory."""
        if self.trace_json is None or '"trajectory"' not in self.trace_json:  # most traces: no parse
            return None
        trace = self.trace
        return trace.trajectory.typed if trace is not None and trace.trajectory is not None else None

    @property
    def tokens(self) -> int | None:
        return total_tokens(self.input_tokens, self.output_tokens)


@dataclass(frozen=True)
class Tally:
    """One case's samples: how many, how many passed, each one's score (0 when a grader gave
    none), and each sample's record (`SampleRecord`: verdict, usage, trace), in index order."""

    case_id: str
    n: int
    passes: int
    scores: tuple[float, ...]
    samples: tuple[SampleRecord, ...] = ()


class Tallies(Sequence[Tally]):
    """One `Tally` per case, in case-id order, and the same figures as arrays over the cases
    (`case_ids`, `n`, `passes`, `mean_scores`). `mean_scores` is None when the samples carry
    no scores (a metric of scores then has no value). The `Tally` objects are made on first
    use and shared by every resample."""

    def __init__(
        self,
        case_ids: NDArray[np.object_],
        n: NDArray[np.int64],
        passes: NDArray[np.int64],
        mean_scores: NDArray[np.float64] | None,
        items: Callable[[], list[Tally]],
        source: tuple[Tallies, NDArray[np.int64]] | None = None,
    ) -> None:
        self.case_ids, self.n, self.passes, self.mean_scores = case_ids, n, passes, mean_scores
        self._make_items = items
        self._items: list[Tally] | None = None
        # A resample's: the tallies it was drawn from, and which of their cases it holds.
        self._source = source
        self._columns: dict[Callable[[Tally], float], NDArray[np.float64]] = {}

    def column(self, fn: Callable[[Tally], float]) -> NDArray[np.float64]:
        """`fn` of each case, as an array: computed once on the tallies a resample was drawn
        from and indexed for each resample, so a metric written on it costs the bootstrap a
        numpy gather per resample, not a walk over every sample."""
        if self._source is not None:
            base, indices = self._source
            return base.column(fn)[indices]
        if fn not in self._columns:
            self._columns[fn] = np.array([fn(t) for t in self], dtype=np.float64)
        return self._columns[fn]

    @classmethod
    def of_samples(
        cls,
        case_ids: Sequence[str],
        case_index: NDArray[np.int64],
        n: NDArray[np.int64],
        passes: NDArray[np.int64],
        scores: NDArray[np.float64] | None,
        records: Callable[[], Sequence[SampleRecord]] | None = None,
    ) -> Tallies:
        """From per-sample arrays: each sample's case (an index into `case_ids`) and score;
        `records`, each sample's record in the same order, made when a metric first asks."""
        ids = np.asarray(case_ids, dtype=object)
        means = None if scores is None else np.bincount(case_index, weights=scores, minlength=n.size) / n

        def items() -> list[Tally]:
            order = np.argsort(case_index, kind="stable")
            cuts = np.cumsum(n)[:-1]
            if scores is None:
                per_case = [()] * n.size
            else:
                per_case = [tuple(s.tolist()) for s in np.split(scores[order], cuts)]
            if records is None:
                kept = [()] * n.size
            else:
                made = records()
                kept = [tuple(sorted((made[i] for i in part.tolist()), key=lambda r: r.index))
                        for part in np.split(order, cuts)]
            return [Tally(*t) for t in zip(ids.tolist(), n.tolist(), passes.tolist(), per_case, kept, strict=True)]

        return cls(ids, n, passes, means, items)

    def take(self, indices: NDArray[np.int64]) -> Tallies:
        """The cases at `indices` (repeats allowed): one bootstrap resample."""
        means = None if self.mean_scores is None else self.mean_scores[indices]
        base, at = (self, indices) if self._source is None else (self._source[0], self._source[1][indices])
        return Tallies(self.case_ids[indices], self.n[indices], self.passes[indices], means,
                       lambda: [self._all()[i] for i in indices.tolist()], (base, at))

    def _all(self) -> list[Tally]:
        if self._items is None:
            self._items = self._make_items()
        return self._items

    def __len__(self) -> int:
        return len(self.n)

    @overload
    def __getitem__(self, i: int) -> Tally: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Tally]: ...
    def __getitem__(self, i):
        return self._all()[i]

    def __iter__(self) -> Iterator[Tally]:
        return iter(self._all())


def metric_values(
    tallies: Tallies, ks: Sequence[int] = (), *, seed: int = 0, n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
) -> dict[str, dict[str, Any]]:
    """Every listed registered metric, the families' members at `ks` (the run's k values):
    {name: {value, ci, percent[, error]}}. The CI is None for a single case (nothing to
    resample) and for a metric with no value."""
    return {name: _one(spec, tallies, seed, n_boot, level) for name, spec in metrics(ks).items() if spec.listed}


def per_case_figure(values: NDArray[np.float64], *, seed: int, n_boot: int,
                    level: float) -> tuple[float, tuple[float, float]]:
    """A per-case metric's value over these cases (the mean of its per-case values) and its
    bootstrap CI clustered by case: one computation for the headline and every other metric."""
    return float(values.mean()), bootstrap_mean_ci(values, seed=seed, n_boot=n_boot, level=level)


def _one(spec: MetricSpec, tallies: Tallies, seed: int, n_boot: int, level: float) -> dict[str, Any]:
    doc: dict[str, Any] = {"value": None, "ci": None, "percent": spec.percent}
    try:
        if spec.per_case:
            values = per_case_values(spec, tallies)
            if values is None:
                return doc
            value, ci = per_case_figure(values, seed=seed, n_boot=n_boot, level=level)
            doc["value"] = value
            if len(tallies) > 1:
                doc["ci"] = list(ci)
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


def per_case_values(spec: MetricSpec, tallies: Tallies) -> NDArray[np.float64] | None:
    """A per-case metric's value on each case (None: it has none here, as the mean score of
    samples that carry no scores); `ValueError` when it returns other than one finite
    number per case. What it raises, it raises."""
    per_case = spec.fn(tallies)
    if per_case is None:
        return None
    values = np.asarray(per_case, dtype=np.float64).ravel()
    if values.size != len(tallies) or not np.isfinite(values).all():
        raise ValueError(f"expected {len(tallies)} finite per-case values, got {values.size}")
    return values


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
