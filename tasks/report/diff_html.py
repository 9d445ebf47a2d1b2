"""The diff report: a run against its baseline as one self-contained HTML page
(`evalpipe report RUN_ID --baseline BASELINE --out diff.html`).

At the top the gate's decision and paired CI; then the regressed and improved cases, each
with its input and reference and one output from each run side by side, with the grader's
detail (and the trajectory where the sample has one), so a reviewer sees *why*. Only the
changed cases are expanded, and at most `MAX_EXPANDED` of each kind, so a 5,000-case suite
renders as fast as a small one; new and removed cases are listed by id, unchanged ones
counted. Everything from a suite or an agent is escaped by the template (autoescape) and
clipped here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tasks.metrics.diff import CaseChange, RunDiff, metric_name
from tasks.metrics.percent import percent, signed_points
from tasks.report.diff_text import tool_changes_text
from tasks.report.gate_text import decided_by
from tasks.report.html import TEMPLATES, clip
from tasks.report.markdown import change_shown, headline
from tasks.run import RunSummary

MAX_EXPANDED = 100  # regressed cases expanded, and as many improved ones
MAX_IDS = 500
MAX_TEXT_CHARS = 8000


def expanded(diff: RunDiff) -> list[CaseChange]:
    """The cases the page expands (and whose inputs and samples it needs)."""
    return diff.labelled("regressed")[:MAX_EXPANDED] + diff.labelled("improved")[:MAX_EXPANDED]


def render_diff_report(
    diff: RunDiff,
    gate: Mapping[str, Any],
    run: RunSummary | None,
    baseline: RunSummary | None,
    details: Mapping[str, Mapping[str, Any]],
) -> str:
    """``details``: case id → {inputs, reference, before, after}, where ``before``/``after``
    is one sample {index, status, output, detail, trajectory} of that run or None; needed for
    the cases `expanded(diff)` names."""
    metric = metric_name(diff.metric)
    delta, ci = change_shown(diff, gate)
    shown = {c.case_id for c in expanded(diff)}
    sections = [
        {"id": label, "title": title, "total": len(diff.labelled(label)),
         "cases": [_case_view(c, details.get(c.case_id, {}), diff.metric)
                   for c in diff.labelled(label) if c.case_id in shown][:MAX_EXPANDED]}
        for label, title in (("regressed", "Regressed"), ("improved", "Improved"))
    ]
    return TEMPLATES.get_template("diff.html.j2").render(
        diff=diff,
        suite_name=(run or baseline).suite_name if (run or baseline) else "",
        run_agent=run.agent if run else "?",
        base_agent=baseline.agent if baseline else "?",
        metric=metric,
        gate={"decision": gate.get("decision"), "verdict": gate.get("verdict"), "reasons": gate.get("reasons", []),
              "basis": decided_by(gate)},
        before=percent(headline(baseline, diff.metric)),
        after=percent(headline(run, diff.metric)),
        delta=signed_points(delta),
        ci=f"{signed_points(ci[0])} to {signed_points(ci[1])}" if ci else "",
        level=f"{100 * diff.ci_level:g}%",
        diff_shared=diff.shared,
        counts=list(diff.counts().items()),
        dropped=diff.dropped,
        slices=[(name, s.cases, signed_points(s.delta),
                 f"{signed_points(s.ci[0])} to {signed_points(s.ci[1])}" if s.ci else "— (one case)")
                for name, s in diff.slices.items()],
        sections=sections,
        id_lists=[(title, [c.case_id for c in diff.labelled(label)[:MAX_IDS]], len(diff.labelled(label)))
                  for label, title in (("new", "New cases"), ("removed", "Removed cases"))],
    ).strip() + "\n"


def _case_view(case: CaseChange, detail: Mapping[str, Any], metric: str) -> dict[str, Any]:
    def counts(r) -> str:
        shown = "score" if metric == "score" else metric
        return "—" if r is None else f"{r.c}/{r.n}" + (f" ({shown} {r.value(metric):.2f})" if metric != "pass" else "")

    return {
        "case_id": case.case_id, "label": case.label, "change": signed_points(case.change),
        "before_counts": counts(case.before), "after_counts": counts(case.after), "slices": ", ".join(case.slices),
        "tool_calls": tool_changes_text(case.tool_changes()),
        "inputs": clip(_pretty(detail.get("inputs")), MAX_TEXT_CHARS),
        "reference": clip(_pretty(detail.get("reference")), MAX_TEXT_CHARS),
        "before": _sample_view(detail.get("before")), "after": _sample_view(detail.get("after")),
    }


def _sample_view(sample: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if sample is None:
        return None
    trajectory = sample.get("trajectory")
    return {
        "index": sample.get("index"), "status": sample.get("status"),
        "output": clip(sample.get("output") or "", MAX_TEXT_CHARS),
        "detail": clip(sample.get("detail") or "", MAX_TEXT_CHARS),
        "trajectory": clip(_pretty(trajectory), MAX_TEXT_CHARS) if trajectory else "",
    }


def _pretty(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=1, ensure_ascii=False, default=str)
