"""Stage 4: fold a run's samples into the structured aggregate (docs/contract.md §1.4, §6, §7).

The reduction keeps structure: pass@k per k, per-slice rates with their own CIs, the
flaky cases, status counts, and the safety verdict beside the means, never inside them.
pass@k, pass^k and the mean score are the registered metrics `pass@{k}`, `pass^{k}` and
`mean_score` (tasks/metrics/standard.py): their per-case values, over the suite and each
slice, as every registered metric's. Everything is computed on per-case arrays (n, c) built
with pyarrow/numpy, so a million samples cost a few vectorized passes, not a Python loop per
sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray

from tasks.metrics.graders import grader_metrics
from tasks.metrics.stats import DEFAULT_LEVEL, DEFAULT_N_BOOT, standard_error
from tasks.metrics.tallies import (
    SampleRecord,
    Tallies,
    metric_values,
    per_case_figure,
    per_case_values,
)
from tasks.models import InputError
from tasks.registry import metric_family
from tasks.registry import metrics as registered_metrics

ALL_SLICE = "__all__"  # the overall slice's name in the `aggregates` table

REQUIRED_COLUMNS = ("case_id", "sample_index", "passed", "status", "safety")

Row = tuple[str, str, float | None, float | None, float | None]


@dataclass(frozen=True, eq=False)
class Metrics:
    """pass@k and the uncertainty of pass@1 over one set of cases (the suite or a slice)."""

    cases: int
    pass_at_k: dict[int, float | None]  # None: k exceeds some case's n
    pass_at_k_ci: dict[int, tuple[float, float] | None]
    pass_at_1: float
    pass_at_1_ci: tuple[float, float]
    pass_at_1_se: float | None  # None for a single case
    # pass^k (all k of k samples pass), beside pass@k: the gap is "capable but unreliable".
    pass_hat_k: dict[int, float | None]
    pass_hat_k_ci: dict[int, tuple[float, float] | None]
    # The mean of the graders' scores (partial credit, judges), per case then over cases.
    mean_score: float | None
    mean_score_ci: tuple[float, float] | None

    def rows(self, slice_name: str) -> list[Row]:
        rows: list[Row] = [(slice_name, "cases", float(self.cases), None, None)]
        for k, value in self.pass_at_k.items():
            rows.append((slice_name, f"pass@{k}", value, *(self.pass_at_k_ci[k] or (None, None))))
        for k, value in self.pass_hat_k.items():
            rows.append((slice_name, f"pass^{k}", value, *(self.pass_hat_k_ci[k] or (None, None))))
        rows.append((slice_name, "pass@1_se", self.pass_at_1_se, None, None))
        if self.mean_score is not None:
            rows.append((slice_name, "mean_score", self.mean_score, *(self.mean_score_ci or (None, None))))
        return rows

    def ci_shown(self, ci: tuple[float, float] | None) -> list[float] | None:
        """A CI as reported: none for a single case, where a bootstrap has nothing to resample
        (its zero-width interval would claim a certainty one case cannot give)."""
        return None if ci is None or self.cases < 2 else list(ci)


@dataclass(frozen=True, eq=False)
class Aggregate:
    """The structured aggregate of one run. ``case_ids``/``n``/``c`` are per-case arrays,
    sorted by case id (what the gate pairs on)."""

    ks: tuple[int, ...]
    ci_level: float
    case_ids: tuple[str, ...]
    n: NDArray[np.int64]
    c: NDArray[np.int64]
    overall: Metrics
    pass_at_k_notes: dict[int, str]
    slices: dict[str, Metrics]
    flaky_case_ids: tuple[str, ...]
    status_counts: dict[str, int]
    safety_violations: tuple[dict[str, Any], ...]
    # Every listed registered metric (tasks.registry), families at the run's k values:
    # {name: {value, ci, percent[, error]}}.
    metrics: dict[str, dict[str, Any]]
    # slice → `grader:NAME` → its figure (`tasks.metrics.graders`); {} without extra graders.
    slice_graders: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    @property
    def safety_failed(self) -> bool:
        return bool(self.safety_violations)

    def case_counts(self) -> dict[str, tuple[int, int]]:
        """case_id → (n, c): the per-case pass counts the gate compares."""
        return {
            cid: (int(n), int(c)) for cid, n, c in zip(self.case_ids, self.n, self.c, strict=True)
        }

    def to_json(self) -> dict[str, Any]:
        """The aggregate's keys of the `run --json` document (docs/contract.md §7)."""
        return {
            "pass_at_k": {str(k): self.overall.pass_at_k[k] for k in self.ks},
            "pass_at_k_notes": {str(k): note for k, note in self.pass_at_k_notes.items()},
            "pass_at_1_ci": list(self.overall.pass_at_1_ci),
            "ci_level": self.ci_level,
            "pass_at_1_se": self.overall.pass_at_1_se,
            "pass_hat_k": {str(k): self.overall.pass_hat_k[k] for k in self.ks},
            "mean_score": self.overall.mean_score,
            "mean_score_ci": self.overall.ci_shown(self.overall.mean_score_ci),
            "slices": {
                name: {
                    "cases": m.cases,
                    "pass_at_1": m.pass_at_1,
                    "pass_at_1_ci": m.ci_shown(m.pass_at_1_ci),
                    "pass_at_k": {str(k): m.pass_at_k[k] for k in self.ks},
                    "pass_hat_k": {str(k): m.pass_hat_k[k] for k in self.ks},
                    "mean_score": m.mean_score,
                    "mean_score_ci": m.ci_shown(m.mean_score_ci),
                    **({"graders": self.slice_graders[name]} if self.slice_graders.get(name) else {}),
                }
                for name, m in self.slices.items()
            },
            "flaky_cases": len(self.flaky_case_ids),
            "flaky_case_ids": list(self.flaky_case_ids),
            "status_counts": dict(self.status_counts),
            "safety_failed": self.safety_failed,
            "safety_violations": [dict(v) for v in self.safety_violations],
            "metrics": {name: dict(doc) for name, doc in self.metrics.items()},
        }

    def rows(self) -> list[Row]:
        """(slice, metric, value, ci_lo, ci_hi) rows for the DuckDB `aggregates` table.

        Metrics: ``cases``, ``pass@K`` (with its bootstrap CI), ``pass@1_se`` per slice;
        for ``__all__`` also ``flaky_cases``, ``safety_violations`` and ``status:NAME``.
        """
        rows = self.overall.rows(ALL_SLICE)
        rows.append((ALL_SLICE, "flaky_cases", float(len(self.flaky_case_ids)), None, None))
        rows.append(
            (ALL_SLICE, "safety_violations", float(len(self.safety_violations)), None, None)
        )
        rows.extend(
            (ALL_SLICE, f"status:{status}", float(count), None, None)
            for status, count in self.status_counts.items()
        )
        for name, metrics in self.slices.items():
            rows.extend(metrics.rows(name))
        return rows


def aggregate(
    samples: pa.Table,
    case_slices: Mapping[str, Sequence[str]],
    ks: Sequence[int],
    *,
    seed: int = 0,
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
) -> Aggregate:
    """Reduce one row per sample (`case_id`, `sample_index`, `passed`, `status`, `safety`)
    to the structured aggregate. ``case_slices`` maps case id → its slice names; cases may
    have different n (each case's own n is used). A missing ``passed`` counts as failed.
    """
    missing = [col for col in REQUIRED_COLUMNS if col not in samples.column_names]
    if missing:
        raise InputError(f"samples table: missing column(s) {', '.join(missing)}")
    if samples.num_rows == 0:
        raise InputError("samples table: no samples to aggregate")
    ks = _check_ks(ks)  # always holds 1: pass@1 is the headline its CI and SE refer to
    case_ids, case_index = _case_index(samples["case_id"])
    passed = pc.fill_null(samples["passed"], False).to_numpy(zero_copy_only=False).astype(np.int64)
    n = np.bincount(case_index, minlength=len(case_ids))
    c = np.bincount(case_index, weights=passed, minlength=len(case_ids)).astype(np.int64)

    boot = {"seed": seed, "n_boot": n_boot, "level": level}
    tallies = Tallies.of_samples(case_ids, case_index, n, c, _sample_scores(samples), lambda: sample_records(samples))
    # The headline's figures are registered metrics' per-case values, as a plugin's are.
    per_case = {k: per_case_values(metric_family("pass@{k}").at(k), tallies) for k in ks}
    hat = {k: per_case_values(metric_family("pass^{k}").at(k), tallies) for k in ks}
    scores = per_case_values(registered_metrics()["mean_score"], tallies)
    overall = _metrics(per_case, hat, scores, np.arange(len(case_ids)), **boot)
    members_of = _slice_members(case_ids, case_slices)
    slices = {name: _metrics(per_case, hat, scores, members, **boot) for name, members in members_of.items()}
    graded = grader_metrics(tallies, **boot)
    flaky = (c > 0) & (c < n)
    return Aggregate(
        ks=ks,
        ci_level=level,
        case_ids=tuple(case_ids),
        n=n,
        c=c,
        overall=overall,
        pass_at_k_notes={k: f"k={k} > n={int(n.min())}" for k in ks if per_case[k] is None},
        slices=slices,
        flaky_case_ids=tuple(np.asarray(case_ids, dtype=object)[flaky]),
        status_counts=_status_counts(samples["status"]),
        safety_violations=_safety_violations(samples),
        metrics={**metric_values(tallies, ks, **boot), **graded},
        # Each extra grader's pass rate per slice too, where the run has extra graders.
        slice_graders={name: grader_metrics(tallies.take(members), **boot) for name, members in members_of.items()}
        if graded else {},
    )


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    if not ks:
        raise InputError("k: give at least one value")
    bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1]
    if bad:
        raise InputError(f"k: every value must be an integer >= 1, got {bad[0]!r}")
    return tuple(sorted({1, *(int(k) for k in ks)}))


def _case_index(case_id: pa.ChunkedArray) -> tuple[list[str], NDArray[np.int64]]:
    """Sorted distinct case ids and each sample's position among them."""
    encoded = pc.dictionary_encode(case_id.combine_chunks())
    order = pc.array_sort_indices(encoded.dictionary).to_numpy()
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    return encoded.dictionary.take(pa.array(order)).to_pylist(), rank[indices]


def _slice_members(
    case_ids: list[str], case_slices: Mapping[str, Sequence[str]]
) -> dict[str, NDArray[np.int64]]:
    """slice name → indices of its cases that have samples, slices in name order."""
    pairs = [(cid, name) for cid, names in case_slices.items() for name in names]
    if not pairs:
        return {}
    # One flat (case, slice) list and vectorized lookups: no Python work per pair beyond it.
    position = pc.index_in(
        pa.array([p[0] for p in pairs], pa.string()), value_set=pa.array(case_ids)
    )
    has_samples = pc.is_valid(position)
    names = pc.dictionary_encode(pa.array([p[1] for p in pairs], pa.string()).filter(has_samples))
    position = position.filter(has_samples).to_numpy().astype(np.int64)
    codes = names.indices.to_numpy(zero_copy_only=False)
    return {
        name: np.unique(position[codes == code])
        for code, name in sorted(enumerate(names.dictionary.to_pylist()), key=lambda item: item[1])
    }


def sample_records(samples: pa.Table) -> list[SampleRecord]:
    """Each sample's record, in the table's order, from the columns it has (a metric reads
    what it needs: usage columns and the trace are there when the run's reduce read them)."""
    have = set(samples.column_names)
    columns = {name: samples[name].to_pylist() for name in RECORD_COLUMNS if name in have}
    rows = samples.num_rows
    passed = [bool(p) for p in columns["passed"]]
    scores = columns.get("score", [0.0] * rows)
    none = [None] * rows
    return [SampleRecord(index, ok, status, score or 0.0, *more) for index, ok, status, score, *more in zip(
        columns["sample_index"], passed, columns["status"], scores,
        *(columns.get(name, none) for name in RECORD_COLUMNS[4:]), strict=True)]


# The columns a `SampleRecord` is read from, in its fields' order.
RECORD_COLUMNS = ("sample_index", "passed", "status", "score",
                  "input_tokens", "output_tokens", "cost_usd", "latency_s", "trace")


def _sample_scores(samples: pa.Table) -> NDArray[np.float64] | None:
    """Each sample's score (a missing score counts as 0), or None when the samples carry no
    score column."""
    if "score" not in samples.column_names:
        return None
    return pc.fill_null(samples["score"], 0.0).to_numpy(zero_copy_only=False).astype(np.float64)


def _metrics(
    per_case: Mapping[int, NDArray[np.float64] | None],
    hat: Mapping[int, NDArray[np.float64] | None],
    scores: NDArray[np.float64] | None,
    members: NDArray[np.int64],
    *,
    seed: int,
    n_boot: int,
    level: float,
) -> Metrics:
    def means_cis(arrays: Mapping[int, NDArray[np.float64] | None]):
        values = {k: None if v is None else v[members] for k, v in arrays.items()}
        figures = {k: None if v is None else per_case_figure(v, seed=seed, n_boot=n_boot, level=level)
                   for k, v in values.items()}
        means = {k: None if f is None else f[0] for k, f in figures.items()}
        cis = {k: None if f is None else f[1] for k, f in figures.items()}
        return values, means, cis

    values, means, cis = means_cis(per_case)
    _, hat_means, hat_cis = means_cis(hat)
    _, score_mean, score_ci = means_cis({0: scores})
    return Metrics(
        cases=int(members.size),
        pass_at_k=means,
        pass_at_k_ci=cis,
        pass_at_1=means[1],
        pass_at_1_ci=cis[1],
        pass_at_1_se=standard_error(values[1]),
        pass_hat_k=hat_means,
        pass_hat_k_ci=hat_cis,
        mean_score=score_mean[0],
        mean_score_ci=score_ci[0],
    )


def _status_counts(status: pa.ChunkedArray) -> dict[str, int]:
    counts = pc.value_counts(pc.fill_null(status, "error").combine_chunks())
    pairs = zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(), strict=True)
    return dict(sorted(pairs, key=lambda pair: (-pair[1], pair[0])))


def _safety_violations(samples: pa.Table) -> tuple[dict[str, Any], ...]:
    """One entry per violation string, ordered by case id and sample index."""
    safety = samples["safety"].combine_chunks()
    flagged = pc.fill_null(pc.greater(pc.list_value_length(safety), 0), False)
    if not pc.any(flagged).as_py():
        return ()
    hits = samples.filter(flagged).sort_by(
        [("case_id", "ascending"), ("sample_index", "ascending")]
    )
    return tuple(
        {"case_id": cid, "sample_index": index, "violation": violation}
        for cid, index, violations in zip(
            hits["case_id"].to_pylist(),
            hits["sample_index"].to_pylist(),
            hits["safety"].to_pylist(),
            strict=True,
        )
        for violation in violations
    )
