"""`evalpipe report`: a stored run as one self-contained HTML file."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from storage import db
from storage.calibrations import run_calibrations
from tasks.files import atomic_write
from tasks.models import InputError
from tasks.report import render_report
from tasks.report.trajectory import trajectory_lines
from tasks.run import RunSummary

MAX_DETAILS_PER_CASE = 5


def case_rows(run_id: str, home: Path | None = None) -> list[dict[str, Any]]:
    """Per-case counts, statuses, failure details and safety hits, from the samples table."""
    samples = db.run_samples(run_id, home).select(["case_id", "sample_index", "passed", "status", "detail",
                                                   "safety", "trace"])
    run = db.get_run(run_id, home)
    slices = {cid: s for cid, (_, s) in db.suite_cases(run["suite_version"], home).items()}
    grouped: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"n": 0, "c": 0, "statuses": Counter(), "details": [], "safety": []}
    )
    for row in samples.to_pylist():
        case = grouped[row["case_id"]]
        case["n"] += 1
        case["c"] += bool(row["passed"])
        case["statuses"][row["status"]] += 1
        if not row["passed"] and row["detail"] and len(case["details"]) < MAX_DETAILS_PER_CASE:
            case["details"].append(row["detail"])
        case["safety"].extend(row["safety"] or [])
        if not row["passed"] and "trajectory" not in case:
            if steps := trajectory_lines(json.loads(row["trace"] or "{}")):
                case["trajectory"] = {"sample_index": row["sample_index"], "lines": steps}
    return [
        {"case_id": cid, "slices": slices.get(cid, []), **{**v, "statuses": dict(v["statuses"])}}
        for cid, v in sorted(grouped.items())
    ]


def write_report(run_id: str, out: Path, home: Path | None = None) -> Path:
    run = db.find_run(run_id, home)
    run_id = run["run_id"]
    if not run.get("summary"):
        raise InputError(f"run {run_id!r} has no summary (status {run['status']}): nothing to report")
    summary = RunSummary.read(run["summary"])
    gate = summary.gate
    base_run = db.get_run(gate.baseline, home) if gate else None
    baseline = RunSummary.read(base_run["summary"]) if base_run and base_run.get("summary") else None
    html = render_report(summary, case_rows(run_id, home),
                         baseline=baseline, gate=gate.model_dump(mode="json") if gate else None,
                         calibration=_calibration(summary),
                         judges=run_calibrations(run_id, home))
    atomic_write(out, html)
    return out


def _calibration(summary: RunSummary) -> dict[str, Any] | None:
    if summary.env_flaky_samples is None:
        return None
    return {"regraded samples": summary.samples, "environment flakes": summary.env_flaky_samples}
