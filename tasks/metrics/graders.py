"""Every grader counts (docs/graders.md "Several graders on one case"): each extra grader of a
run's cases, by its name (`grader:NAME`; its kind when unnamed), is a metric beside pass@1 (the
deciding grader's): its pass rate over the cases it grades, with a CI clustered by case as
pass@1's is. Read from each sample's trace (`extra_graders`), so a stored run's figures
are the same whenever they are read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tasks.metrics.stats import DEFAULT_LEVEL, DEFAULT_N_BOOT, bootstrap_mean_ci
from tasks.metrics.tallies import SampleRecord, Tallies

PREFIX = "grader:"


def grader_counts(records: Iterable[SampleRecord]) -> dict[str, tuple[int, int]]:
    """One case's samples graded by each extra grader: label → (samples, passed)."""
    counts: dict[str, list[int]] = {}
    for record in records:
        if record.trace_json is None or '"extra_graders"' not in record.trace_json:
            continue
        for extra in record.trace.extra_graders or ():
            seen = counts.setdefault(extra.label, [0, 0])
            seen[0] += 1
            seen[1] += extra.verdict.passed
    return {label: (n, c) for label, (n, c) in counts.items()}


def grader_metrics(tallies: Tallies, *, seed: int = 0, n_boot: int = DEFAULT_N_BOOT,
                   level: float = DEFAULT_LEVEL) -> dict[str, dict[str, Any]]:
    """`{"grader:NAME": {value, ci, percent, cases}}` for every extra grader the samples
    record, in name order; {} when none does."""
    per_case = [grader_counts(t.samples) for t in tallies]
    labels = sorted({label for counts in per_case for label in counts})
    return {f"{PREFIX}{label}": rate_doc([c[label] for c in per_case if label in c], seed, n_boot, level)
            for label in labels}


def rate_doc(counts: list[tuple[int, int]], seed: int, n_boot: int, level: float) -> dict[str, Any]:
    """A pass rate over cases: the mean of each case's rate, and its bootstrap CI over cases."""
    rates = np.array([c / n for n, c in counts], dtype=np.float64)
    ci = list(bootstrap_mean_ci(rates, seed=seed, n_boot=n_boot, level=level)) if rates.size > 1 else None
    return {"value": float(rates.mean()), "ci": ci, "percent": True, "cases": int(rates.size)}


def case_rate(counts: Mapping[str, tuple[int, int]], metric: str) -> float | None:
    """A case's pass rate on the grader `metric` names (`grader:NAME`); None when no grader
    of that name graded it."""
    found = counts.get(metric.removeprefix(PREFIX))
    return None if found is None else found[1] / found[0]
