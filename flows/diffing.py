"""`evalpipe diff`: what changed between two stored runs, case by case (`tasks.metrics.diff`),
as text for a terminal, one JSON document, or the Markdown of a pull-request comment.
Mounted in `flows/cli.py`; storage and core imports are inside the commands, so
`evalpipe --help` loads neither DuckDB nor Arrow."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from flows.output import json_doc
from tasks.metrics.percent import signed_points
from tasks.models import InputError

FORMATS = ("text", "json", "markdown")
TEXT_ROWS = 30  # changed cases listed in the text form; --json lists every case

FormatOpt = Annotated[str, typer.Option("--format", help="text, json or markdown (a pull-request comment).")]
MetricOpt = Annotated[str, typer.Option("--metric", help="Compare on pass (pass@1) or score (mean score).")]


def output_format(fmt: str, as_json: bool) -> str:
    if fmt not in FORMATS:
        raise InputError(f"--format: expected {', '.join(FORMATS)}, got {fmt!r}")
    return "json" if as_json else fmt


def diff(
    run_id: Annotated[str, typer.Argument(help="The run (id or unambiguous prefix).")],
    baseline: Annotated[str, typer.Argument(help="The baseline run (id or unambiguous prefix).")],
    metric: MetricOpt = "pass",
    limit: Annotated[int, typer.Option("--limit", min=0, help="Changed cases listed in the text form.")] = TEXT_ROWS,
    fmt: FormatOpt = "text",
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON document (every case).")] = False,
) -> None:
    """Which cases regressed, improved, are new or removed between BASELINE and RUN_ID,
    paired by case as the gate pairs them; per slice, the change with its paired CI."""
    from flows.gate import pair_runs
    from tasks.report.markdown import comparison_markdown

    fmt = output_format(fmt, as_json)
    comparison = pair_runs(run_id, baseline, metric=metric)
    if fmt == "json":
        typer.echo(json_doc(comparison.diff.to_json()))
    elif fmt == "markdown":
        typer.echo(comparison_markdown(comparison.diff, None, comparison.run_summary, comparison.base_summary),
                   nl=False)
    else:
        typer.echo(diff_text(comparison.diff.to_json(), limit))


def diff_text(doc: dict[str, Any], limit: int = TEXT_ROWS) -> str:
    """The `diff --json` document for a terminal: counts, the overall change, the changed
    cases (regressions first, largest first), the slices."""
    from tasks.metrics.diff import METRIC_NAMES
    from tasks.report.html import clip

    metric = METRIC_NAMES[doc["metric"]]
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
    if len(changed) > limit:
        lines.append(f"  ... and {len(changed) - limit} more changed case(s) (--json lists every case)")
    if doc["slices"]:
        lines.append("slices:")
        for name, s in doc["slices"].items():
            ci = s["delta_ci"]
            shown = f"[{signed_points(ci[0])}, {signed_points(ci[1])}]" if ci else "(no CI: one case)"
            lines.append(f"  {clip(_plain(name), 30):<16} {s['cases']:>5} shared  Δ {signed_points(s['delta'])}  {shown}")
    return "\n".join(lines)


def _side(side: dict[str, Any] | None, metric: str) -> str:
    if side is None:
        return "-"
    counts = f"{side['passes']}/{side['samples']}"
    return counts if metric == "pass" else f"score {side['score']:.2f} ({counts})"


def _plain(text: str) -> str:
    """Suite text for a terminal: a control character (an escape sequence, a newline) shows
    as U+FFFD instead of acting."""
    return "".join(ch if ch.isprintable() else "\ufffd" for ch in text)
