"""`evalpipe runs`: stored runs listed, shown (a case's samples too), exported and imported."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import JsonFlag, RunArg, emit, run_summary_text, size_text
from flows.output import json_doc
from tasks.metrics.percent import figure

runs_app = typer.Typer(no_args_is_help=True, help="Stored runs.")


@runs_app.command("list")
def runs_list(as_json: JsonFlag = False, limit: Annotated[int, typer.Option("--limit", min=1)] = 50) -> None:
    """The newest runs in this EVALPIPE_HOME."""
    from storage.store import Store

    store = Store.default()
    runs = store.runs.list(limit=limit)
    keys = ("run_id", "suite_name", "suite_version", "agent", "n", "status", "started_at")
    brief = [{key: r[key] for key in keys} | {"pass_at_1": ((r.get("summary") or {}).get("pass_at_k") or {}).get("1")}
             for r in runs]
    if as_json:
        typer.echo(json_doc(brief))
        return
    if store.home.parent != Path.cwd():  # found above the working directory, or set elsewhere
        typer.echo(f"evalpipe: reading {store.home}", err=True)
    for r in brief:
        typer.echo(f"{r['run_id']}  {r['status']:<9}  {r['suite_name']:<14} {r['suite_version'][:12]}"
                   f"  n={r['n']:<3} pass@1 {figure(r['pass_at_1'])}  {r['agent']}")


@runs_app.command("show")
def runs_show(
    run_id: RunArg,
    case: Annotated[str | None, typer.Option("--case", help="Show this case's samples: output, verdict, timing.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """One run's summary (the same document `run --json` printed), or with --case what the
    agent answered on one case and how each answer was graded."""
    from storage.store import Store

    store = Store.default()
    row = store.runs.find(run_id)
    if case is not None:
        from tasks.report.case_view import case_doc, case_text

        doc = case_doc(row["run_id"], case, store.samples.of_case(row["run_id"], case))
        typer.echo(json_doc(doc) if as_json else case_text(doc))
        return
    if as_json:
        typer.echo(json_doc(row.get("summary") or row))
    elif row.get("summary"):
        typer.echo(run_summary_text(row["summary"]))
    else:
        typer.echo(f"run {row['run_id']}: status {row['status']}, started {row['started_at']}, no summary")



@runs_app.command("export")
def runs_export(run_id: RunArg, out: Annotated[Path, typer.Option("--out", help="The file to write.")],
                as_json: JsonFlag = False) -> None:
    """Write a finished run (its row, summary, samples and suite snapshot) to one file, a
    baseline another EVALPIPE_HOME can import (a CI job's artifact)."""
    from storage.store import Store

    doc = Store.default().exports.export_run(run_id, out)
    emit(doc, as_json, f"exported run {doc['run_id']} ({doc['samples']} samples, {size_text(doc['bytes'])}) to {out}")


@runs_app.command("import")
def runs_import(path: Annotated[Path, typer.Argument(help="A file written by `evalpipe runs export`.")],
                as_json: JsonFlag = False) -> None:
    """Bring an exported run into this EVALPIPE_HOME (again: nothing changes); then gate,
    diff and --baseline work against it."""
    from storage.store import Store

    doc = Store.default().exports.import_run(path)
    verb = "imported" if doc["imported"] else "already here:"
    emit(doc, as_json, f"{verb} run {doc['run_id']} ({doc['samples']} samples, suite {doc['suite_version'][:12]})")
