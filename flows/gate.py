"""The release gate: a run against a baseline run (docs/contract.md §6), from the stored runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from storage import db
from tasks.metrics.gate import gate as gate_counts
from tasks.models import InputError


def gate_runs(
    run_id: str,
    baseline: str,
    *,
    min_pass_at_1: float | None = None,
    max_drop: float = 0.0,
    shared_only: bool = False,
    home: Path | None = None,
    safety_failed: bool | None = None,
) -> dict[str, Any]:
    """Gate `run_id` against `baseline`. Runs on different suite versions are refused
    unless `shared_only`, which compares the case hashes they share and says so.
    `safety_failed`: the run's safety verdict when the caller has it (else read back)."""
    run, base = db.find_run(run_id, home), db.find_run(baseline, home)
    run_id, baseline = run["run_id"], base["run_id"]
    if run["suite_version"] != base["suite_version"] and not shared_only:
        raise InputError(
            f"run {run_id} is on suite {run['suite_version'][:12]} and baseline {baseline} on "
            f"{base['suite_version'][:12]}: different suite versions (pass --shared-only to "
            "compare the cases they share)"
        )
    failed = db.safety_failed(run_id, home) if safety_failed is None else safety_failed
    result = gate_counts(
        db.case_counts(run_id, home), db.case_counts(baseline, home), safety_failed=failed,
        min_pass_at_1=min_pass_at_1, max_drop=max_drop, seed=run["seed"],
    ).to_json()
    result["run_id"], result["baseline"] = run_id, baseline
    return result
