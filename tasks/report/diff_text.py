"""The `diff --json` document as text for a terminal (`evalpipe diff`)."""

from __future__ import annotations

from typing import Any

from tasks.metrics.diff import metric_name
from tasks.metrics.percent import signed_points
from tasks.report.html import clip


def diff_text(doc: dict[str, Any], limit: int) -> str:
    """The `diff --json` document for a terminal: counts, the overall change, the changed
    cases (regressions first, largest first; the first `limit`), the slices."""
    metric = metric_name(doc["metric"])
    level = f"{100 * doc['ci_level']:g}%"
    lines = [f"diff {doc['run_id']} against {doc['baseline']}: {metric} on {doc['shared_cases']} shared cases"
             + (f" ({doc['dropped_cases']} measured by one run only: new or removed)" if doc["dropped_cases"] else "")]
    lines.append("  ".join(f"{label} {count}" for label, count in doc["counts"].items()))
    if doc["delta"] is not None:
        ci = doc["delta_ci"]
        lines.append(f"Δ {metric} {signed_points(doc['delta'])}"
                     + (f" ({level} CI {signed_points(ci[0])} to {signed_points(ci[1])})" if ci else " (no CI: one case)"))
    changed = [c for c in doc["cases"] if c["label"] != "unchanged"]
    width = min(max((len(_plain(c["case_id"])) for c in changed[:limit]), default=4), 40)
    for c in changed[:limit]:
        lines.append(f"  {c['label']:<9}  {clip(_plain(c['case_id']), 40):<{width}}"
                     f"  {_side(c['before'], doc['metric'])} -> {_side(c['after'], doc['metric'])}"
                     + (f"  {signed_points(c['change'])}" if c["change"] is not None else ""))
        if c.get("tool_calls"):
            lines.append(f"  {'':<9}  tool calls per sample: {tool_changes_text(c['tool_calls'])}")
    if len(changed) > limit:
        lines.append(f"  ... and {len(changed) - limit} more changed case(s) (--json lists every case)")
    if doc["slices"]:
        lines.append("slices:")
        for name, s in doc["slices"].items():
            ci = s["delta_ci"]
            shown = f"[{signed_points(ci[0])}, {signed_points(ci[1])}]" if ci else "(no CI: one case)"
            lines.append(f"  {clip(_plain(name), 30):<16} {s['cases']:>5} shared  Δ {signed_points(s['delta'])}  {shown}")
    return "\n".join(lines)


def tool_changes_text(changes: dict[str, list[float]]) -> str:
    """`+get_order 0 -> 1, -search_kb 1 -> 0, search 1 -> 2`: calls that appeared, disappeared
    or changed, per sample."""
    def one(name: str, before: float, after: float) -> str:
        sign = "+" if not before else "-" if not after else ""
        return f"{sign}{_plain(name)} {before:g} -> {after:g}"

    return ", ".join(one(name, *pair) for name, pair in changes.items())


def _side(side: dict[str, Any] | None, metric: str) -> str:
    if side is None:
        return "-"
    counts = f"{side['passes']}/{side['samples']}"
    return counts if metric == "pass" else f"{'score' if metric == 'score' else metric} {side['value']:.2f} ({counts})"


def _plain(text: str) -> str:
    """Suite text for a terminal: a control character (an escape sequence, a newline) shows
    as U+FFFD instead of acting."""
    return "".join(ch if ch.isprintable() else "\ufffd" for ch in text)
