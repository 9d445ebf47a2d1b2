"""The `plan --json` document (`tasks.metrics.power`) as text for a terminal (`evalpipe plan`)."""

from __future__ import annotations

from typing import Any


def plan_text(doc: dict[str, Any]) -> str:
    """The `plan --json` document for a terminal: the variances it rests on, what the suite
    needs, the trade-off table, the assumptions."""
    source = (f"from {doc['measured_cases']} baseline cases" if doc["measured_cases"] else "from a prior")
    lines = [
        f"to detect a paired drop of {100 * doc['detect']:g} points with power {doc['power']:g}"
        f" (two-sided alpha {doc['alpha']:g}):",
        f"  variances {source}: between cases {doc['between_case_variance']:.4f},"
        f" within a case {doc['within_case_variance']:.4f} (mean pass rate {100 * doc['mean_pass_rate']:.1f}%)",
    ]
    if doc["suite_cases"] is not None:
        if doc["reachable"]:
            lines.append(f"  on the suite's {doc['suite_cases']} cases: {doc['samples_per_case']} samples per case"
                         f" ({doc['total_samples']} samples a run)")
        else:
            lines.append(f"  the suite's {doc['suite_cases']} cases cannot reach it at up to {doc['max_samples']}"
                         f" samples per case: smallest detectable drop {100 * doc['smallest_detectable']:.1f} points")
    lines.append("  samples/case   cases needed   samples a run" + ("   fits the suite" if doc["suite_cases"] else ""))
    for row in doc["table"]:
        fits = "" if row["fits"] is None else ("   yes" if row["fits"] else "   no")
        lines.append(f"  {row['samples']:>12}   {row['cases']:>12}   {row['total_samples']:>13}{fits}")
    lines.extend(f"  assumed: {a}" for a in doc["assumptions"])
    return "\n".join(lines)
