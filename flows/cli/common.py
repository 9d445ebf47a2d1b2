"""What the command groups share: the arguments and options several commands take, and
the ways they print (one JSON document, or a human line)."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn

import typer

from flows.output import json_doc
from tasks.models import InputError

JsonFlag = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document.")]
METRIC_HELP = ("What the paired CI compares: pass (pass@1), score (mean score), or a registered per-case metric"
               " by name (pass@1, mean_score, a plugin's).")
UnsafeFlag = Annotated[bool, typer.Option(
    "--unsafe-no-sandbox", help="Without bubblewrap, run the suite's code unprotected instead of refusing.")]
SuiteArg = Annotated[str, typer.Argument(help="Suite file, git URL#PATH (URL@REF#PATH), or stored version.")]
RunArg = Annotated[str, typer.Argument(help="A run id, or an unambiguous prefix of one.")]


def emit(doc: dict[str, Any], as_json: bool, human: str) -> None:
    typer.echo(json_doc(doc) if as_json else human)


def bad_input(message: str) -> NoReturn:
    raise InputError(message)


def size_text(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def run_summary_text(summary: dict[str, Any]) -> str:
    """The text summary, with each judge that graded the run and its calibration (or none)."""
    from storage.store import Store
    from tasks.report.text import summary_text  # the core's imports (Arrow) only to print a summary

    return summary_text(summary, Store.default().calibrations.of_run(summary["run_id"]))

