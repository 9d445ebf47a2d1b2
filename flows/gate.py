"""The release gate: a run against a baseline run (SPEC §6), as a plain function and a flow."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from prefect import flow
from pydantic import Field

from storage import db
from tasks.gate import gate as gate_counts
from tasks.models import InputError


def gate_runs(
    run_id: str,
    baseline: str,
    *,
    min_pass_at_1: float | None = None,
    max_drop: float = 0.0,
    shared_only: bool = False,
    home: Path | None = None,
    summary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Gate `run_id` against `baseline`. Runs on different suite versions are refused
    unless `shared_only`, which compares the case hashes they share and says so."""
    run, base = db.find_run(run_id, home), db.find_run(baseline, home)
    run_id, baseline = run["run_id"], base["run_id"]
    if run["suite_version"] != base["suite_version"] and not shared_only:
        raise InputError(
            f"run {run_id} is on suite {run['suite_version'][:12]} and baseline {baseline} on "
            f"{base['suite_version'][:12]}: different suite versions (pass --shared-only to "
            "compare the cases they share)"
        )
    failed = summary["safety_failed"] if summary else db.safety_failed(run_id, home)
    result = gate_counts(
        db.case_counts(run_id, home), db.case_counts(baseline, home), safety_failed=failed,
        min_pass_at_1=min_pass_at_1, max_drop=max_drop, seed=run["seed"],
    ).to_json()
    result["run_id"], result["baseline"] = run_id, baseline
    return result


@flow(name="gate", persist_result=False)
def gate(
    run_id: Annotated[str, Field(description="The run to judge.")],
    baseline: Annotated[str, Field(description="The run to compare it with.")],
    min_pass_at_1: Annotated[float | None, Field(ge=0, le=1, description="Block below this pass@1.")] = None,
    max_drop: Annotated[float, Field(ge=0, le=1, description="Allowed drop in pass@1 (fraction).")] = 0.0,
    shared_only: Annotated[bool, Field(description="Compare only the case hashes both runs share.")] = False,
) -> dict[str, Any]:
    return gate_runs(run_id, baseline, min_pass_at_1=min_pass_at_1, max_drop=max_drop,
                     shared_only=shared_only)
