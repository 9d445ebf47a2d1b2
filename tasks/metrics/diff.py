"""What changed, case by case: a run against its baseline, paired by case (docs/contract.md §6).

The gate answers "can we ship?" with one paired delta; the diff answers the next question,
*which* cases got better or worse. Cases are paired as the gate pairs them, by `case_hash`:
a case measured by both runs has a before and an after; one only the run measured is `new`,
one only the baseline measured is `removed` (two suite versions are compared on their shared
cases, and the rest is counted, never silently dropped). A paired case is `regressed`,
`improved` or `unchanged` by the sign of its change in the chosen metric: the pass rate c/n
(`pass`), the mean score (`score`), or a plugin's registered per-case metric by name (its
value on each case, computed on each run's samples by `with_metric`; the built-in `pass@1`
and `mean_score` are `pass` and `score`), or an extra grader's pass rate (`grader:NAME`, on the
cases it grades). Per slice, the mean paired change comes with its bootstrap CI (none for a
single case).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from tasks.metrics.stats import DEFAULT_LEVEL, DEFAULT_N_BOOT, bootstrap_mean_ci
from tasks.metrics.tallies import SampleRecord, Tallies, per_case_values
from tasks.models import InputError
from tasks.params import GRADER_NAME
from tasks.registry import metric_families, metric_named, metrics

# What a diff and the gate compare: "pass", "score", or a registered per-case metric's name.
Metric = str
METRICS: tuple[Metric, ...] = ("pass", "score")
METRIC_NAMES: dict[str, str] = {"pass": "pass@1", "score": "mean score"}  # as reports name them
# The built-in registered metrics are these two by name (`pass@1` is each case's c/n,
# `mean_score` its mean score): one comparison, and so one CI, whichever name asks for it.
ALIASES: dict[str, Metric] = {"pass@1": "pass", "mean_score": "score"}
# What `--max-increase` may bound: the per-sample figures of `CaseResult.figures`.
INCREASE_FIGURES = ("turns", "tool_calls", "tokens", "cost")
GRADER_PREFIX = "grader:"  # an extra grader's pass rate, by its name: `grader:NAME`
Label = Literal["regressed", "improved", "new", "removed", "unchanged"]
# The order a diff lists its cases in: what needs a look first.
LABELS: tuple[Label, ...] = ("regressed", "improved", "new", "removed", "unchanged")
# Changes smaller than this are rounding, not a change.
_EPS = 1e-12


@dataclass(frozen=True)
class CaseResult:
    """One run's result on one case: what the diff (and the gate's rules) read."""

    case_id: str
    case_hash: str
    n: int
    c: int
    score: float  # the mean of the samples' scores
    slices: tuple[str, ...] = ()
    scores: tuple[float, ...] = ()  # each sample's, in index order (a registered metric's input)
    # Registered metrics' values on this case, by name (`with_metric`).
    values: Mapping[str, float] = field(default_factory=dict, compare=False)
    # Each extra grader's (samples, passed) on this case, by name (`grader:NAME` metrics), and
    # those marked `must_pass` (a gate rule).
    graders: Mapping[str, tuple[int, int]] = field(default_factory=dict, compare=False)
    must_pass_graders: frozenset[str] = field(default=frozenset(), compare=False)
    # The tool calls its samples' trajectories hold, by tool name (all samples together).
    tools: Mapping[str, int] = field(default_factory=dict, compare=False)
    unsafe: int = field(default=0, compare=False)  # samples with a safety violation
    # What its samples took, summed (`INCREASE_FIGURES`: model turns, tool calls, tokens, cost;
    # a figure no sample reported is absent): `--max-increase` compares their means per sample.
    figures: Mapping[str, float] = field(default_factory=dict, compare=False)
    # Each sample's record in index order, where a registered metric computed here reads them
    # (`needs_records`); () otherwise.
    records: tuple[SampleRecord, ...] = field(default=(), compare=False, repr=False)

    def value(self, metric: Metric) -> float:
        if metric == "pass":
            return self.c / self.n
        if metric.startswith(GRADER_PREFIX):
            n, c = self.graders[metric.removeprefix(GRADER_PREFIX)]
            return c / n
        return self.score if metric == "score" else self.values[metric]


@dataclass(frozen=True)
class CaseChange:
    case_id: str
    label: Label
    before: CaseResult | None
    after: CaseResult | None
    change: float | None  # after − before in the metric; None for new and removed cases

    @property
    def slices(self) -> tuple[str, ...]:
        return (self.after or self.before).slices  # type: ignore[union-attr]

    def to_json(self, metric: Metric = "pass") -> dict[str, Any]:
        def side(r: CaseResult | None) -> dict[str, Any] | None:
            return None if r is None else {"passes": r.c, "samples": r.n, "score": r.score, "value": r.value(metric)}

        doc = {"case_id": self.case_id, "label": self.label, "change": self.change,
               "before": side(self.before), "after": side(self.after), "slices": list(self.slices)}
        if tools := self.tool_changes():
            doc["tool_calls"] = tools
        return doc

    def tool_changes(self) -> dict[str, list[float]]:
        """Per tool whose calls per sample changed: [before, after] (a paired case's only)."""
        if self.before is None or self.after is None:
            return {}
        before, after = self.before, self.after
        rates = {name: [round(before.tools.get(name, 0) / before.n, 3), round(after.tools.get(name, 0) / after.n, 3)]
                 for name in sorted({*before.tools, *after.tools})}
        return {name: pair for name, pair in rates.items() if pair[0] != pair[1]}


@dataclass(frozen=True)
class SliceChange:
    cases: int  # paired cases in the slice
    delta: float
    ci: tuple[float, float] | None  # None for a single case

    def to_json(self) -> dict[str, Any]:
        return {"cases": self.cases, "delta": self.delta, "delta_ci": None if self.ci is None else list(self.ci)}


@dataclass(frozen=True)
class RunDiff:
    run_id: str
    baseline: str
    metric: Metric
    cases: tuple[CaseChange, ...]  # in LABELS order, the largest change first
    overall: SliceChange | None  # None when no case is shared
    slices: dict[str, SliceChange]
    ci_level: float

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(LABELS, 0)
        for case in self.cases:
            counts[case.label] += 1
        return counts

    @property
    def shared(self) -> int:
        return sum(c.before is not None and c.after is not None for c in self.cases)

    @property
    def dropped(self) -> int:
        """Cases left out of every paired figure: measured by one run only."""
        return len(self.cases) - self.shared

    def slice_means(self) -> dict[str, float]:
        """Each slice's mean value of the metric over the run's cases (shared and new)."""
        members: dict[str, list[float]] = {}
        for case in self.cases:
            for name in case.after.slices if case.after is not None else ():
                members.setdefault(name, []).append(case.after.value(self.metric))
        return {name: float(np.mean(values)) for name, values in sorted(members.items())}

    def labelled(self, label: Label) -> list[CaseChange]:
        return [c for c in self.cases if c.label == label]

    def to_json(self) -> dict[str, Any]:
        """The `diff --json` document: every case, with at least `case_id` and `label`."""
        return {
            "run_id": self.run_id, "baseline": self.baseline, "metric": self.metric,
            "counts": self.counts(), "shared_cases": self.shared, "dropped_cases": self.dropped,
            "ci_level": self.ci_level,
            "delta": None if self.overall is None else self.overall.delta,
            "delta_ci": None if self.overall is None or self.overall.ci is None else list(self.overall.ci),
            "slices": {name: s.to_json() for name, s in self.slices.items()},
            "cases": [c.to_json(self.metric) for c in self.cases],
        }


def check_same_suite(run: Mapping[str, Any], baseline: Mapping[str, Any]) -> None:
    """Refuse to gate two runs (their `runs` rows) on different suite versions, saying how to
    compare what they share."""
    if run["suite_version"] != baseline["suite_version"]:
        raise InputError(
            f"run {run['run_id']} is on suite {run['suite_version'][:12]} and baseline {baseline['run_id']} on "
            f"{baseline['suite_version'][:12]}: different suite versions (pass --shared-only to "
            "compare the cases they share)"
        )


def metric_name(metric: Metric) -> str:
    """The compared metric as reports name it."""
    return METRIC_NAMES.get(metric, metric)


def check_metric(metric: str) -> Metric:
    """`pass`, `score`, or a registered metric that has a value per case, shown as a
    fraction (the gate's CI, `--max-drop` and thresholds are in percentage points), the
    built-ins by name as `ALIASES` says; else `InputError` naming it and what it could be."""
    metric = ALIASES.get(metric, metric)
    if metric in METRICS:
        return metric
    if metric.startswith(GRADER_PREFIX):
        if not GRADER_NAME.match(metric.removeprefix(GRADER_PREFIX)):
            raise InputError(f"--metric {metric}: not a grader's name (grader:NAME, NAME as a case's grader has it)")
        return metric
    paired = sorted(name for name, spec in metrics().items() if spec.per_case and spec.percent)
    families = sorted(f.name for f in metric_families() if f.per_case and f.percent)
    choices = f"pass, score or a registered per-case metric: {', '.join(paired + families) or 'none'}"
    spec = metric_named(metric)
    if spec is None:
        raise InputError(f"--metric: unknown metric {metric!r} (expected {choices})")
    if not spec.per_case:
        raise InputError(f"--metric {metric}: it has no per-case values (it is computed over the whole run), so it"
                         f" cannot be paired case by case (expected {choices})")
    if not spec.percent:
        raise InputError(f"--metric {metric}: it is a plain number, not a fraction: the gate's CI, --max-drop and"
                         f" thresholds are in percentage points (expected {choices})")
    return metric


def needs_records(metric: Metric) -> bool:
    """Whether comparing on `metric` may compute a registered metric here, over each case's
    sample records (`CaseResult.records`): not for `pass`, `score` nor a grader's."""
    metric = ALIASES.get(metric, metric)
    return metric not in METRICS and not metric.startswith(GRADER_PREFIX)


def with_metric(results: Iterable[CaseResult], metric: Metric, side: str) -> list[CaseResult]:
    """`results` (one run's, `side` names it) with `metric`'s value on each case, a registered
    metric's computed on the run's own tallies as `run --json` computes it (`pass` and
    `score` are read from the counts); `InputError` when it has no value per case here."""
    results = list(results)
    if metric.startswith(GRADER_PREFIX):
        # Only the cases this grader grades are compared (a case it never saw has no value).
        graded = [r for r in results if metric.removeprefix(GRADER_PREFIX) in r.graders]
        if results and not graded:
            raise InputError(f"--metric {metric}: no case of {side} is graded by a grader named"
                             f" {metric.removeprefix(GRADER_PREFIX)!r} (an extra grader's name, else its kind)")
        return graded
    if metric in METRICS or all(metric in r.values for r in results):
        return results
    if not results:
        return results
    n = np.array([r.n for r in results], dtype=np.int64)
    scores = (np.array([s for r in results for s in r.scores], dtype=np.float64)
              if all(len(r.scores) == r.n for r in results) else None)
    recorded = all(len(r.records) == r.n for r in results)
    tallies = Tallies.of_samples([r.case_id for r in results], np.repeat(np.arange(len(results)), n), n,
                                 np.array([r.c for r in results], dtype=np.int64), scores,
                                 (lambda: [s for r in results for s in r.records]) if recorded else None)
    try:
        spec = metric_named(metric)
        assert spec is not None  # checked by check_metric
        values = per_case_values(spec, tallies)
    except Exception as exc:  # noqa: BLE001 - a plugin's failure, said in one line
        raise InputError(f"--metric {metric}: on {side}'s cases it raised {type(exc).__name__}: "
                         + " ".join(str(exc).split())[:300]) from None
    if values is None:
        raise InputError(f"--metric {metric}: it has no per-case values on {side}: nothing to compare")
    return [replace(r, values={**r.values, metric: float(v)}) for r, v in zip(results, values, strict=True)]


def diff_runs(
    run: Iterable[CaseResult],
    baseline: Iterable[CaseResult],
    *,
    run_id: str = "run",
    baseline_id: str = "baseline",
    metric: Metric = "pass",
    seed: int = 0,
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
) -> RunDiff:
    """Pair `run` with `baseline` by case hash and label every case."""
    metric = check_metric(metric)
    after = _by_hash(run, "run", metric, run_id)
    before = _by_hash(baseline, "baseline", metric, baseline_id)
    changes = [_change(before.get(h), after.get(h), metric) for h in after.keys() | before.keys()]
    rank = {label: i for i, label in enumerate(LABELS)}
    # Regressions most negative first, improvements most positive first, the rest by id.
    changes.sort(key=lambda c: (rank[c.label], -abs(c.change or 0.0), c.case_id))
    # The paired figures read the changes in case-hash order: the gate's order, so the same
    # seed resamples the same cases and the diff and the gate show one CI.
    paired = sorted(((h, after[h]) for h in after.keys() & before.keys()), key=lambda item: item[0])
    values = [r.value(metric) - before[h].value(metric) for h, r in paired]
    boot = {"seed": seed, "n_boot": n_boot, "level": level}
    members: dict[str, list[float]] = {}
    for (_, r), change in zip(paired, values, strict=True):
        for name in r.slices:
            members.setdefault(name, []).append(change)
    return RunDiff(
        run_id=run_id, baseline=baseline_id, metric=metric, cases=tuple(changes),
        overall=paired_change(values, **boot) if paired else None,
        slices={name: paired_change(vals, **boot) for name, vals in sorted(members.items())},
        ci_level=level,
    )


def _by_hash(results: Iterable[CaseResult], side: str, metric: Metric, run_id: str) -> dict[str, CaseResult]:
    """One side's results by case hash, checked, each with its value of `metric`."""
    checked: dict[str, CaseResult] = {}
    for r in results:
        if r.n < 1 or not 0 <= r.c <= r.n:
            raise InputError(f"diff: {side} case {r.case_id!r} has n={r.n}, c={r.c}: needs n >= 1 and 0 <= c <= n")
        checked[r.case_hash] = r
    return {r.case_hash: r for r in with_metric(checked.values(), metric, f"{side} {run_id}")}


def _change(before: CaseResult | None, after: CaseResult | None, metric: Metric) -> CaseChange:
    if before is None:
        return CaseChange(after.case_id, "new", None, after, None)  # type: ignore[union-attr]
    if after is None:
        return CaseChange(before.case_id, "removed", before, None, None)
    change = after.value(metric) - before.value(metric)
    label: Label = "regressed" if change < -_EPS else "improved" if change > _EPS else "unchanged"
    return CaseChange(after.case_id, label, before, after, change)


def paired_change(values: Sequence[float], *, seed: int = 0, n_boot: int = DEFAULT_N_BOOT,
                  level: float = DEFAULT_LEVEL) -> SliceChange:
    """The mean of paired per-case changes with its bootstrap CI (None for a single case):
    the one paired CI that the diff, the gate and every renderer show."""
    arr = np.asarray(values, dtype=np.float64)
    ci = bootstrap_mean_ci(arr, seed=seed, n_boot=n_boot, level=level) if arr.size > 1 else None
    return SliceChange(cases=int(arr.size), delta=float(arr.mean()), ci=ci)
