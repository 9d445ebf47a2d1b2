"""`evalpipe diff`: what changed between two stored runs, case by case (`tasks.metrics.diff`),
as text for a terminal, one JSON document, or the Markdown of a pull-request comment.
Mounted in `flows/cli/__init__.py`; storage and core imports are inside the commands, so
`evalpipe --help` loads neither DuckDB nor Arrow."""

from __future__ import annotations

from typing import Annotated

import typer

from flows.output import json_doc
from tasks.models import InputError

FORMATS = ("text", "json", "markdown")
TEXT_ROWS = 30  # changed cases listed in the text form; --json lists every case

FormatOpt = Annotated[str, typer.Option("--format", help="text, json or markdown (a pull-request comment).")]
MetricOpt = Annotated[str, typer.Option("--metric", help="What the paired CI compares: pass (pass@1), score (mean"
                                                            " score), or a registered per-case metric by name.")]


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
    from service.gate import pair_runs
    from storage.store import Store
    from tasks.report.diff_text import diff_text

    fmt = output_format(fmt, as_json)
    comparison = pair_runs(run_id, baseline, metric=metric, store=Store.default())
    if fmt == "json":
        typer.echo(json_doc(comparison.diff.to_json()))
    elif fmt == "markdown":
        typer.echo(comparison.markdown(), nl=False)
    else:
        typer.echo(diff_text(comparison.diff.to_json(), limit))
