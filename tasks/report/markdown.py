"""A run against its baseline as a compact Markdown summary: the pull-request comment
(`gate --format markdown`, `diff --format markdown`) and the Prefect artifact of a gated run.

It must fit a GitHub comment (65,536 characters) whatever the suite's size, so every part
is bounded: the worst regressions and the best improvements as short tables, the slices
that changed most, each cell clipped; the counts above them stay exact. Text that came
from a suite or a stored run (case ids, slice names, reasons and the rules' line naming
them, grader details) is inert: in code spans or fenced code blocks, where no mention, link,
issue reference, emphasis, strike, math or HTML renders (GitHub acts on text outside code).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tasks.metrics.diff import CaseChange, RunDiff, metric_name
from tasks.metrics.percent import percent, signed_points
from tasks.metrics.rules import newly_failing
from tasks.report.gate_text import decided_by
from tasks.report.html import clip
from tasks.report.inert import code_span, longest_backticks
from tasks.run import RunSummary

GITHUB_COMMENT_LIMIT = 65_536
MAX_REGRESSIONS = 25
MAX_IMPROVEMENTS = 10
MAX_SLICES = 20
MAX_REASONS = 12
MAX_CELL = 80
MAX_REASON = 400
MAX_FAILING = 10  # newly failing cases whose failing grader and detail are shown
MAX_DETAIL = 600
MAX_DETAIL_LINES = 12


def comparison_markdown(
    diff: RunDiff,
    gate: Mapping[str, Any] | None = None,
    run: RunSummary | None = None,
    baseline: RunSummary | None = None,
    failing: Mapping[str, Mapping[str, Any]] | None = None,
    failing_graders: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
) -> str:
    """The decision (when gated), the metric before → after with the paired CI, the counts of
    each label, the worst regressions and best improvements, why each newly failing case
    fails (`failing`: case id → its first failing sample's `sample_index`, `status`, `detail`
    and the case's grader `kind`), each extra grader newly failing a case (`failing_graders`:
    (grader name, case id) → its first failing sample's `sample_index` and `detail`), and the
    slices that moved."""
    metric = metric_name(diff.metric)
    level = f"{100 * diff.ci_level:g}%"
    lines = []
    if gate:
        lines.append(f"## evalpipe gate: **{str(gate['decision']).upper()}** ({code_span(gate['verdict'])})")
    else:
        lines.append("## evalpipe diff")
    lines += ["", f"run {code_span(diff.run_id)} against baseline {code_span(diff.baseline)}", ""]
    before, after = headline(baseline, diff.metric), headline(run, diff.metric)
    delta, ci = change_shown(diff, gate)
    shift = (f"Δ {signed_points(delta)}" + (f", {level} CI {signed_points(ci[0])} to {signed_points(ci[1])}" if ci else "")
             if delta is not None else "no shared cases")
    lines.append(f"**{metric}** {percent(before)} → {percent(after)} ({shift}) over {diff.shared} shared cases")
    basis = decided_by(gate) if gate else None
    if basis:
        lines += ["", code_span(clip(basis, MAX_REASON))]
    counts = diff.counts()
    lines += ["", " · ".join(f"{label} **{count}**" for label, count in counts.items())]
    if diff.dropped:
        lines.append(f"\n{diff.dropped} case(s) measured by one run only (new or removed) are left out of"
                     " every paired figure.")
    if gate and gate.get("reasons"):
        reasons = list(gate["reasons"])
        lines += [""] + [f"- {code_span(clip(r, MAX_REASON))}" for r in reasons[:MAX_REASONS]]
        if len(reasons) > MAX_REASONS:
            lines.append(f"- … and {len(reasons) - MAX_REASONS} more")
    lines += _cases_table("Worst regressions", diff.labelled("regressed"), MAX_REGRESSIONS, diff.metric)
    lines += _cases_table("Best improvements", diff.labelled("improved"), MAX_IMPROVEMENTS, diff.metric)
    lines += _failing_section(diff, failing or {})
    lines += _failing_graders_section(failing_graders or {})
    lines += _slices_table(diff, level)
    text = "\n".join(lines) + "\n"
    # The bounds above keep it far below the limit; this is the guarantee, whatever the input.
    if len(text) >= GITHUB_COMMENT_LIMIT:
        # At a line's end: every code span closes on its line (a fence left open runs to the end, still code).
        text = text[: GITHUB_COMMENT_LIMIT - 100].rpartition("\n")[0] + "\n\n… (cut to fit a GitHub comment)\n"
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
        lines.append(f"| {code_span(clip(c.case_id, MAX_CELL), cell=True)} | {_side(c.before, metric)} | {_side(c.after, metric)}"
                     f" | {signed_points(c.change)} |")
    return lines


def _failing_section(diff: RunDiff, failing: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each newly failing case (passed every sample in the baseline, fails one now) with the
    grader that failed it and its detail, shortened and fenced: the detail quotes the output."""
    cases = {c.case_id: c for c in diff.cases}
    ids = [cid for cid in newly_failing(diff) if cid in failing][:MAX_FAILING]
    if not ids:
        return []
    total = len(newly_failing(diff))
    shown = f"{len(ids)} of {total}" if total > len(ids) else str(total)
    lines = ["", f"### Newly failing ({shown})"]
    for cid in ids:
        sample, after, before = failing[cid], cases[cid].after, cases[cid].before
        grader = f"grader {code_span(sample['kind'])}" if sample.get("kind") else "its grader"
        lines += ["", f"**{code_span(clip(cid, MAX_CELL))}** ({before.c}/{before.n} → {after.c}/{after.n}):"
                      f" {grader} gave {code_span(sample['status'])} on sample {sample['sample_index']}",
                  *_fenced(_shortened(sample["detail"]))]
    return lines


def _failing_graders_section(failing: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[str]:
    """Each extra grader that passed a case in every baseline sample and fails it now, with its
    detail (`called forbidden tool delete_account(...)`), shortened and fenced."""
    if not failing:
        return []
    shown = list(failing.items())[:MAX_FAILING]
    lines = ["", f"### Newly failing graders ({len(shown)} of {len(failing)})" if len(failing) > len(shown)
             else f"### Newly failing graders ({len(failing)})"]
    for (name, cid), sample in shown:
        lines += ["", f"**{code_span(clip(cid, MAX_CELL))}**: grader {code_span(clip(name, MAX_CELL))} failed on"
                      f" sample {sample['sample_index']}", *_fenced(_shortened(sample["detail"]))]
    return lines


def _shortened(text: str) -> str:
    """A detail cut to MAX_DETAIL_LINES lines of at most MAX_DETAIL characters in all."""
    lines = str(text).splitlines() or [""]
    kept = "\n".join(lines[:MAX_DETAIL_LINES])
    cut = clip(kept, MAX_DETAIL)
    return cut + ("\n…" if len(lines) > MAX_DETAIL_LINES and cut == kept else "")


def _fenced(text: str) -> list[str]:
    """`text` as a fenced code block, literal whatever it holds: the fence is longer than any
    run of backticks in it, so no line of the text can close it."""
    fence = "`" * max(3, longest_backticks(text) + 1)
    return [fence + "text", *text.splitlines(), fence]


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
        lines.append(f"| {code_span(clip(name, MAX_CELL), cell=True)} | {s.cases} | {signed_points(s.delta)} | {ci} |")
    return lines
