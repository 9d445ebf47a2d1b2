"""A run against its baseline as a compact Markdown summary: the pull-request comment
(`gate --format markdown`, `diff --format markdown`) and the Prefect artifact of a gated run.

It must fit a GitHub comment (65,536 characters) whatever the suite's size, so every part
is bounded: the worst regressions and the best improvements as short tables, the slices
that changed most, each cell clipped; the counts above them stay exact. Text that came
from a suite (case ids, slice names, reasons naming them) is escaped for Markdown and HTML.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tasks.metrics.diff import CaseChange, RunDiff, metric_name
from tasks.metrics.percent import percent, signed_points
from tasks.report.gate_text import decided_by
from tasks.report.html import clip
from tasks.run import RunSummary

GITHUB_COMMENT_LIMIT = 65_536
MAX_REGRESSIONS = 25
MAX_IMPROVEMENTS = 10
MAX_SLICES = 20
MAX_REASONS = 12
MAX_CELL = 80
MAX_REASON = 400


def comparison_markdown(
    diff: RunDiff,
    gate: Mapping[str, Any] | None = None,
    run: RunSummary | None = None,
    baseline: RunSummary | None = None,
) -> str:
    """The decision (when gated), the metric before → after with the paired CI, the counts of
    each label, the worst regressions and best improvements, and the slices that moved."""
    metric = metric_name(diff.metric)
    level = f"{100 * diff.ci_level:g}%"
    lines = []
    if gate:
        lines.append(f"## evalpipe gate: **{str(gate['decision']).upper()}** ({_text(gate['verdict'])})")
    else:
        lines.append("## evalpipe diff")
    lines += ["", f"run `{_code(diff.run_id)}` against baseline `{_code(diff.baseline)}`", ""]
    before, after = headline(baseline, diff.metric), headline(run, diff.metric)
    delta, ci = change_shown(diff, gate)
    shift = (f"Δ {signed_points(delta)}" + (f", {level} CI {signed_points(ci[0])} to {signed_points(ci[1])}" if ci else "")
             if delta is not None else "no shared cases")
    lines.append(f"**{metric}** {percent(before)} → {percent(after)} ({shift}) over {diff.shared} shared cases")
    basis = decided_by(gate) if gate else None
    if basis:
        lines += ["", _text(clip(basis, MAX_REASON))]
    counts = diff.counts()
    lines += ["", " · ".join(f"{label} **{count}**" for label, count in counts.items())]
    if diff.dropped:
        lines.append(f"\n{diff.dropped} case(s) measured by one run only (new or removed) are left out of"
                     " every paired figure.")
    if gate and gate.get("reasons"):
        reasons = list(gate["reasons"])
        lines += [""] + [f"- {_text(clip(r, MAX_REASON))}" for r in reasons[:MAX_REASONS]]
        if len(reasons) > MAX_REASONS:
            lines.append(f"- … and {len(reasons) - MAX_REASONS} more")
    lines += _cases_table("Worst regressions", diff.labelled("regressed"), MAX_REGRESSIONS, diff.metric)
    lines += _cases_table("Best improvements", diff.labelled("improved"), MAX_IMPROVEMENTS, diff.metric)
    lines += _slices_table(diff, level)
    text = "\n".join(lines) + "\n"
    # The bounds above keep it far below the limit; this is the guarantee, whatever the input.
    if len(text) >= GITHUB_COMMENT_LIMIT:
        text = text[: GITHUB_COMMENT_LIMIT - 100] + "\n\n… (cut to fit a GitHub comment)\n"
    return text


def change_shown(diff: RunDiff, gate: Mapping[str, Any] | None) -> tuple[float | None, list[float] | None]:
    """The change and its CI a page heads with: the decision's own when it is gated (a
    sequential stop's bounds included), so the header and the reasons show one CI; else the
    diff's paired change (None for a single case)."""
    if gate:
        return gate.get("delta_pass_at_1"), gate.get("delta_ci")
    overall = diff.overall
    return (overall.delta, list(overall.ci) if overall.ci else None) if overall else (None, None)


def headline(summary: RunSummary | None, metric: str) -> float | None:
    """A run's overall value of the compared metric: pass@1, the mean score, or a registered
    metric's (`run --json`'s `metrics`)."""
    if summary is None:
        return None
    if metric in ("pass", "score"):
        return summary.mean_score if metric == "score" else summary.pass_at_k.get("1")
    figure = (summary.metrics or {}).get(metric)
    return figure.value if figure is not None else None


def _cases_table(title: str, cases: Sequence[CaseChange], limit: int, metric: str) -> list[str]:
    if not cases:
        return []
    shown = f"the {limit} largest of {len(cases)}" if len(cases) > limit else str(len(cases))
    lines = ["", f"### {title} ({shown})", "", "| case | before | after | change |", "|---|---|---|---|"]
    for c in cases[:limit]:
        lines.append(f"| {_text(clip(c.case_id, MAX_CELL))} | {_side(c.before, metric)} | {_side(c.after, metric)}"
                     f" | {signed_points(c.change)} |")
    return lines


def _side(result, metric: str) -> str:
    if result is None:
        return "—"
    if metric == "pass":
        return f"{result.c}/{result.n}"
    return f"{result.value(metric):.2f} ({result.c}/{result.n})"


def _slices_table(diff: RunDiff, level: str) -> list[str]:
    moved = sorted(diff.slices.items(), key=lambda item: (item[1].delta, item[0]))
    if not moved:
        return []
    shown = f"the {MAX_SLICES} that moved most of {len(moved)}" if len(moved) > MAX_SLICES else str(len(moved))
    lines = ["", f"### Slices ({shown})", "", f"| slice | shared cases | Δ | {level} CI |", "|---|---|---|---|"]
    chosen = sorted(moved, key=lambda item: -abs(item[1].delta))[:MAX_SLICES]
    for name, s in sorted(chosen, key=lambda item: (item[1].delta, item[0])):
        ci = f"{signed_points(s.ci[0])} to {signed_points(s.ci[1])}" if s.ci else "— (one case)"
        lines.append(f"| {_text(clip(name, MAX_CELL))} | {s.cases} | {signed_points(s.delta)} | {ci} |")
    return lines


_MARKDOWN_SPECIALS = str.maketrans({ch: "\\" + ch for ch in "\\`*_[]|"})


def _text(text: str) -> str:
    """Suite text as inert Markdown: no table breaks, no HTML, no emphasis or links, one line."""
    text = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.translate(_MARKDOWN_SPECIALS).replace("\r", " ").replace("\n", " ")


def _code(text: str) -> str:
    """Text inside an inline code span: a backtick would end it, a pipe would end the cell."""
    return str(text).replace("`", "'").replace("|", "/").replace("\r", " ").replace("\n", " ")
