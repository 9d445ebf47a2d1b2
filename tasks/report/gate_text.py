"""The gate's decision as text for a terminal (`evalpipe gate`, and the last lines of a gated
run's summary), and `suite validate`'s findings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.metrics.percent import percent


def gate_lines(gate: Mapping[str, Any]) -> list[str]:
    """The decision and verdict, what it was decided against and by, then each reason."""
    basis = decided_by(gate)
    return [f"{gate['decision'].upper()} ({gate['verdict']})", *([f"  {basis}"] if basis else []),
            *(f"  - {r}" for r in gate["reasons"])]


def decided_by(gate: Mapping[str, Any]) -> str | None:
    """The baseline (and how it was chosen), the cases shared, added and removed, and the
    rules: the line every output of a decision shows (None for a document stored before
    decisions recorded their rules)."""
    if gate.get("rules") is None:
        return None
    if gate.get("baseline") is None:  # the paired rules (max drop, new failures) waited for one
        return f"without a baseline; rules: {rules_text({**gate['rules'], 'max_drop': None}) or 'the safety veto'}"
    choice = f" ({gate['baseline_choice']})" if gate.get("baseline_choice") else ""
    cases = f"{gate['shared_cases']} shared"
    if gate.get("added_cases") is not None:
        cases += f", {gate['added_cases']} added, {gate['removed_cases']} removed"
    when = {"at run time": "decided when the run was made", "now": "decided now"}.get(gate.get("decided", ""), "")
    return (f"against {gate['baseline']}{choice}: {cases} cases; rules: {rules_text(gate['rules'])}"
            + (f"; {when}" if when else ""))


def rules_text(rules: Mapping[str, Any]) -> str:
    """A gate's rules (`GateRules.to_json`) in one line."""
    # A document stored before rules were recorded in full has no max drop: it was 0.
    parts = [f"max drop {percent(rules.get('max_drop', 0.0))}"] if rules.get("max_drop", 0.0) is not None else []
    if rules.get("min_pass_at_1") is not None:
        parts.append(f"min pass@1 {percent(rules['min_pass_at_1'])}")
    if rules.get("max_new_failures") is not None:
        parts.append(f"max new failures {rules['max_new_failures']}")
    parts += [f"slice {name} >= {percent(value)}" for name, value in (rules.get("min_slice") or {}).items()]
    parts += [f"{name} per sample up to +{percent(value)}" for name, value in (rules.get("max_increase") or {}).items()]
    if rules.get("must_pass"):
        parts.append(f"{len(rules['must_pass'])} must-pass case(s)")
    return ", ".join(parts)


def validation_text(report: Mapping[str, Any]) -> str:
    """`suite validate`: whether every reference was sound, then each broken, flaky or
    vacuous case with its statuses and the first 200 characters of its detail."""
    lines = [f"{report['cases']} cases, reference graded {report['reps']}x each: "
             + ("all sound" if report["valid"] else "problems found")]
    for kind in ("broken", "flaky", "vacuous"):
        lines.extend(f"  {kind:<8} {c['case_id']}: reference {'/'.join(c['reference_statuses'])},"
                     f" empty output {c['empty_status']}  {c['detail'][:200]}" for c in report[kind])
    return "\n".join(lines)
