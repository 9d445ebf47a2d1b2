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
MinPassOpt = Annotated[float | None, typer.Option(
    "--min-pass-at-1", min=0.0, max=1.0, help="Block when the run's pass@1 is below this.")]
MaxDropOpt = Annotated[float | None, typer.Option(
    "--max-drop", min=0.0, max=1.0,
    help="Block only when the drop in pass@1 vs the baseline is surely larger than this (CI wholly below -D).")]
MaxNewFailuresOpt = Annotated[int | None, typer.Option(
    "--max-new-failures", min=0, help="Block when more than N cases that always passed in the baseline now fail.")]
MinSliceOpt = Annotated[list[str] | None, typer.Option(
    "--min-slice", metavar="SLICE=X", help="Block when the slice's pass@1 (or mean score) is below X; repeatable.")]
MaxIncreaseOpt = Annotated[list[str] | None, typer.Option(
    "--max-increase", metavar="FIGURE=FRACTION",
    help="Block when a figure per sample (turns, tool_calls, tokens, cost) grew by more than FRACTION"
         " (0.2: 20 %) over the baseline, the whole paired CI above it; repeatable.")]


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

    return summary_text(summary, Store.default().run_calibrations(summary["run_id"]))

