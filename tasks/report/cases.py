"""The report's per-case rows: a run's samples grouped by case, with counts, statuses, the
first failure details and failing outputs (what the agent said), safety hits and slices."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from tasks.report.html import MAX_OUTPUT_CHARS
from tasks.report.trajectory import trajectory_lines
from tasks.trace import SampleTrace

MAX_DETAILS_PER_CASE = 5
MAX_OUTPUTS_PER_CASE = 2
OUTPUT_CHARS = MAX_OUTPUT_CHARS + 1  # one past what the page shows, so it still marks the cut; the rest is never read
SAMPLE_FIELDS = ["case_id", "passed", "status", "detail", "safety"]  # what `case_rows` reads of each sample


def case_rows(samples: Iterable[Mapping[str, Any]], failing: Iterable[Mapping[str, Any]],
              slices: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    """One row per case, in case id order. `samples`: every sample's SAMPLE_FIELDS;
    `failing`: the first MAX_OUTPUTS_PER_CASE failing samples of each case (`case_id`,
    `sample_index`, `output` clipped to OUTPUT_CHARS, `trace` as stored JSON text), in
    index order; `slices`: case id → its slices."""
    grouped: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"n": 0, "c": 0, "statuses": Counter(), "details": [], "safety": [], "outputs": []}
    )
    for sample in failing:
        case = grouped[sample["case_id"]]
        case["outputs"].append(sample["output"] or "")
        # The first failing sample that has a coding agent's steps shows them.
        if "trajectory" not in case and (steps := trajectory_lines(SampleTrace.parse(sample["trace"]).trajectory)):
            case["trajectory"] = {"sample_index": sample["sample_index"], "lines": steps}
    for row in samples:
        case = grouped[row["case_id"]]
        case["n"] += 1
        case["c"] += bool(row["passed"])
        case["statuses"][row["status"]] += 1
        if not row["passed"] and row["detail"] and len(case["details"]) < MAX_DETAILS_PER_CASE:
            case["details"].append(row["detail"])
        case["safety"].extend(row["safety"] or [])
    return [
        {"case_id": cid, "slices": slices.get(cid, []), **{**v, "statuses": dict(v["statuses"])}}
        for cid, v in sorted(grouped.items())
    ]
