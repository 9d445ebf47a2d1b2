"""Every grader counts (docs/graders.md "Several graders on one case"): each extra grader of a
run's cases, by its name (`grader:NAME`; its kind when unnamed), is a metric beside pass@1 (the
deciding grader's): its pass rate over the cases it grades, with a CI clustered by case as
pass@1's is. Read from each sample's trace (`extra_graders`), so a stored run's figures
are the same whenever they are read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from tasks.metrics.diff import GRADER_PREFIX as PREFIX
from tasks.metrics.stats import DEFAULT_LEVEL, DEFAULT_N_BOOT, bootstrap_mean_ci
from tasks.metrics.tallies import SampleRecord, Tallies


def grader_counts(records: Iterable[SampleRecord]) -> dict[str, tuple[int, int]]:
    """One case's samples graded by each extra grader: label → (samples, passed)."""
    return extra_grader_counts(r.trace_json for r in records)


def extra_grader_counts(stored: Iterable[str | None]) -> dict[str, tuple[int, int]]:
    """label → (samples, passed) over samples' stored traces, or their `extra_graders`
    arrays (JSON text): an entry is labelled by its `name`, else its kind."""
    counts: dict[str, list[int]] = {}
    for entry in _entries(stored):
        seen = counts.setdefault(str(entry.get("name") or entry.get("kind")), [0, 0])
        seen[0] += 1
        seen[1] += entry.get("passed") is True
    return {label: (n, c) for label, (n, c) in counts.items()}


def must_pass_graders(stored: Iterable[str | None]) -> frozenset[str]:
    """The labels of the extra graders marked `must_pass` in these samples' traces."""
    return frozenset(str(e.get("name") or e.get("kind")) for e in _entries(stored) if e.get("must_pass") is True)


def _entries(stored: Iterable[str | None]) -> Iterable[dict[str, Any]]:
    for text in stored:
        if text is None or '"passed"' not in text:  # no extra grader's verdict in it
            continue
        data = json.loads(text)
        entries = data.get("extra_graders") if isinstance(data, dict) else data
        yield from (e for e in (entries if isinstance(entries, list) else ()) if isinstance(e, dict))


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


