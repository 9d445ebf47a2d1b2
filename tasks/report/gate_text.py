"""The gate's decision as text for a terminal (`evalpipe gate`, and the last lines of a gated
run's summary), and `suite validate`'s findings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def gate_lines(gate: Mapping[str, Any]) -> list[str]:
    """The decision and verdict, then each reason on its own line."""
    return [f"{gate['decision'].upper()} ({gate['verdict']})", *(f"  - {r}" for r in gate["reasons"])]


def no_baseline_message(run: Mapping[str, Any]) -> str:
    """`gate --baseline previous` with no completed run of the suite before `run`."""
    return (f"no baseline: no completed run of suite {run['suite_version'][:12]} before {run['run_id']};"
            " nothing was gated")


def validation_text(report: Mapping[str, Any]) -> str:
    """`suite validate`: whether every reference was sound, then each broken, flaky or
    vacuous case with its statuses and the first 200 characters of its detail."""
    lines = [f"{report['cases']} cases, reference graded {report['reps']}x each: "
             + ("all sound" if report["valid"] else "problems found")]
    for kind in ("broken", "flaky", "vacuous"):
        lines.extend(f"  {kind:<8} {c['case_id']}: reference {'/'.join(c['reference_statuses'])},"
                     f" empty output {c['empty_status']}  {c['detail'][:200]}" for c in report[kind])
    return "\n".join(lines)
