"""`evalpipe report`: a stored run as one self-contained HTML file."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from service.gate import Comparison
from storage.store import Store
from tasks.files import atomic_write
from tasks.models import InputError
from tasks.report import render_report
from tasks.report.cases import MAX_OUTPUTS_PER_CASE, OUTPUT_CHARS, SAMPLE_FIELDS, case_rows
from tasks.run import RunSummary
from tasks.trace import SampleTrace


def read_case_rows(run_id: str, store: Store) -> list[dict[str, Any]]:
    """The report's per-case rows (`tasks.report.cases`) from the run's stored samples."""
    run = store.runs.get(run_id)
    return case_rows(
        store.samples.of_run(run_id, SAMPLE_FIELDS).to_pylist(),
        store.samples.failing(run_id, MAX_OUTPUTS_PER_CASE, OUTPUT_CHARS),
        {cid: s for cid, (_, s) in store.snapshots.cases(run["suite_version"]).items()},
    )


def write_report(run_id: str, out: Path, store: Store) -> Path:
    run = store.runs.find(run_id)
    run_id = run["run_id"]
    if not run.get("summary"):
        raise InputError(f"run {run_id!r} has no summary (status {run['status']}): nothing to report")
    summary = RunSummary.read(run["summary"])
    gate = summary.gate
    base_run = store.runs.get(gate.baseline) if gate else None
    baseline = RunSummary.read(base_run["summary"]) if base_run and base_run.get("summary") else None
    html = render_report(summary, read_case_rows(run_id, store),
                         baseline=baseline, gate=gate.model_dump(mode="json") if gate else None,
                         calibration=_calibration(summary),
                         judges=store.calibrations.of_run(run_id))
    atomic_write(out, html)
    return out


def write_diff_report(comparison: Comparison, gate: dict[str, Any], out: Path, store: Store) -> Path:
    """A run against its baseline (`comparison`) as one HTML page: the decision `gate` (as
    `evalpipe gate` gives it) at the top, the regressed and improved cases expanded with an
    output of each run side by side. Runs on different suite versions are compared on their
    shared cases (the page says how many were not)."""
    from tasks.report.diff_html import expanded, render_diff_report

    changed = expanded(comparison.diff)
    ids = [c.case_id for c in changed]
    contents = {**store.snapshots.case_contents(comparison.base["suite_version"], ids),
                **store.snapshots.case_contents(comparison.run["suite_version"], ids)}
    samples: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in store.samples.of_cases([comparison.run["run_id"], comparison.base["run_id"]], ids):
        samples[(row["run_id"], row["case_id"])].append(row)
    details = {
        c.case_id: {
            **contents.get(c.case_id, {}),
            # The side that fails shows a failing sample, the side that passes a passing one.
            "before": _sample(samples[(comparison.base["run_id"], c.case_id)], want_pass=c.label == "regressed"),
            "after": _sample(samples[(comparison.run["run_id"], c.case_id)], want_pass=c.label == "improved"),
        }
        for c in changed
    }
    html = render_diff_report(comparison.diff, gate, comparison.run_summary, comparison.base_summary, details)
    atomic_write(out, html)
    return out


def _sample(rows: list[dict[str, Any]], *, want_pass: bool) -> dict[str, Any] | None:
    if not rows:
        return None
    row = next((r for r in rows if bool(r["passed"]) == want_pass), rows[0])
    traced = SampleTrace.parse(row["trace"]).trajectory
    # A trajectory stored beside the sample (its own column) or inside its trace.
    trajectory = row.get("trajectory") or (traced and traced.model_dump(exclude_unset=True))
    return {"index": row["sample_index"], "status": row["status"], "output": row["output"],
            "detail": row["detail"], "trajectory": trajectory}


def _calibration(summary: RunSummary) -> dict[str, Any] | None:
    if summary.env_flaky_samples is None:
        return None
    return {"regraded samples": summary.samples, "environment flakes": summary.env_flaky_samples}
