"""`evalpipe run` and `evalpipe rescore`: a run of the `evaluate` (or `rescore`) flow, with its
progress beside it, its summary printed and its exit status read off the summary."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.common import JsonFlag, RunArg, run_summary_text
from flows.cli.run_options import Fields, option_name
from flows.output import json_doc

if TYPE_CHECKING:
    from storage.store import Store


# The exit-4 and exit-5 thresholds sit between the run's fields, after the gate's options,
# where --help has always listed them.
RunFields = Annotated[dict[str, Any], Fields(stop="unsafe_no_sandbox")]
MoreRunFields = Annotated[dict[str, Any], Fields(start="unsafe_no_sandbox")]
RESCORE_FIELDS = ("suite", "workers", "unsafe_no_sandbox", "baseline", "min_pass_at_1", "max_drop",
                  "max_new_failures", "min_slice", "max_increase", "metric")  # the runner is threads


def run(
    fields: RunFields,
    *,
    max_agent_errors: Annotated[float, typer.Option(
        "--max-agent-errors", min=0.0, max=1.0, metavar="FRACTION",
        help="Exit 4 when more than this share of samples are agent_error: the agent is broken,"
             " so the numbers say nothing about the model.")] = 0.1,
    max_grader_errors: Annotated[float, typer.Option(
        "--max-grader-errors", min=0.0, max=1.0, metavar="FRACTION",
        help="Exit 5 when more than this share of samples are error: the grader could not run,"
             " so the numbers measure nothing.")] = 0.1,
    more_fields: MoreRunFields,
    as_json: JsonFlag = False,
) -> None:
    """Sample, grade, store and aggregate a run of AGENT on SUITE.

    Exit 1 when the gate (--baseline) blocks, 4 when too many samples are agent_error,
    5 when too many are error (the grader could not run), 6 when a budget (--max-cost,
    --max-samples) left samples undrawn."""
    from storage.store import Store
    from tasks.run import RunConfig
    from tasks.run.prepare import pinned, prepare_run

    config = RunConfig.build("run", option_name, environ=os.environ, **fields, **more_fields)
    # Every check of the input, once, before Prefect starts: a one-line message, not a failed
    # flow run. The flow is handed what was prepared (`prepared`), and its parameters name
    # the suite pinned (a git branch as the commit read here) and the price file found.
    store = Store.default()
    store.db.check()  # a damaged or locked database is reported before Prefect starts, too
    config, prepared = pinned(config, prepare_run(config, store))
    suite_obj = prepared.suite
    summary = run_flow(config, as_json, suite_obj.name, prepared)
    typer.echo(json_doc(summary) if as_json else run_summary_text(summary))
    broken = _broken(summary, "agent_error", max_agent_errors, store)
    if broken:
        # Exit 4 wins over a blocked gate: the numbers of a broken agent say nothing about the model.
        typer.echo(f"evalpipe: warning: {broken}", err=True)
        raise typer.Exit(4)
    broken = _broken(summary, "error", max_grader_errors, store)
    if broken:
        typer.echo(f"evalpipe: error: {broken}", err=True)
        raise typer.Exit(5)
    if summary.get("partial"):
        # Exit 6 wins over a blocked gate: numbers over part of the samples decide no release.
        typer.echo(f"evalpipe: partial run: {summary['undrawn_samples']} samples undrawn"
                   f" ({summary['budget']['stopped']}); run again with a larger budget to draw them", err=True)
        raise typer.Exit(PARTIAL_EXIT)
    if summary.get("gate", {}).get("decision") == "block":
        raise typer.Exit(1)


PARTIAL_EXIT = 6  # a budget left samples undrawn (docs/contract.md §10)


def run_flow(config: Any, as_json: bool, title: str, prepared: Any = None) -> dict[str, Any]:
    """The `evaluate` flow run of `config` (a `RunConfig`) on the Prefect API the CLI picks,
    a progress bar beside it: the `run --json` document. `prepared`: the run as this process
    prepared (and checked) it, which the flow takes instead of preparing it again."""
    from flows.prefect_api import prefect_api

    with prefect_api(as_json) as watch, progress(title, as_json) as hook:
        from flows.artifacts import progress_hook
        from flows.evaluate import evaluate, prepared_here
        from flows.steps import flow_result

        token, handed = progress_hook.set(hook), prepared_here.set((config, prepared))
        try:
            return flow_result(watch(evaluate)(**config.model_dump(), return_state=True))
        finally:
            progress_hook.reset(token)
            prepared_here.reset(handed)


def _broken(summary: dict[str, Any], status: str, max_share: float, store: Store) -> str | None:
    """The exit-4 (`agent_error`) or exit-5 (`error`) line, quoting the commonest detail."""
    from tasks.run.health import broken_agent, broken_grader, error_share

    if error_share(summary, status, max_share) is None:
        return None  # the commonest detail is read only when it will be shown
    detail, _ = store.samples.commonest_detail(summary["run_id"], status) or ("", 0)
    return (broken_agent if status == "agent_error" else broken_grader)(summary, max_share, detail or "")


@contextmanager
def progress(label: str, as_json: bool):
    """A progress bar on a terminal; elsewhere (CI logs, pipes) a plain line on stderr every
    PROGRESS_EVERY_S or PROGRESS_EVERY_PCT. Neither in --json mode, which stays quiet."""
    if as_json:
        yield None
        return
    if not sys.stderr.isatty():
        yield progress_lines(label, lambda line: typer.echo(line, err=True))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"{label}: samples graded"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True, console=_stderr_console()) as bar:
        task_id = bar.add_task("samples", total=None)
        yield lambda done, total: bar.update(task_id, completed=done, total=total)


PROGRESS_EVERY_S = 10.0
PROGRESS_EVERY_PCT = 10.0


def progress_lines(label: str, echo, clock=time.monotonic):
    """A progress hook printing "LABEL: D/T samples graded (P%) after Ss" at the start, at the
    end, and whenever PROGRESS_EVERY_S or PROGRESS_EVERY_PCT has passed since the last line."""
    start = clock()
    last: list[float] = []  # (time, percent) of the last line, once there is one

    def hook(done: int, total: int) -> None:
        now, pct = clock(), 100.0 * done / total if total else 100.0
        if last and done < total and now - last[0] < PROGRESS_EVERY_S and pct - last[1] < PROGRESS_EVERY_PCT:
            return
        last[:] = [now, pct]
        echo(f"{label}: {done}/{total} samples graded ({pct:.0f}%) after {now - start:.0f}s")

    return hook


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def rescore_cmd(
    run_id: RunArg,
    fields: Annotated[dict[str, Any], Fields(RESCORE_FIELDS)],
    as_json: JsonFlag = False,
) -> None:
    """A new run of SUITE graded on RUN_ID's stored outputs, without calling its agent.

    Cases whose id and inputs match RUN_ID's are graded; the others are reported `unscored`
    (never drawn, never counted as failures). With --baseline it is gated by the same rules
    as `run`: exit 1 when blocked."""
    from storage.store import Store
    from tasks.run.rescore import prepare_rescore

    store = Store.default()
    store.db.check()
    options = {"runner": "threads", **fields}
    # Every check of the input, once, before Prefect starts; the flow is handed what was prepared.
    prepared = prepare_rescore(run_id, store, **options)
    summary = rescore_flow(prepared, options, as_json)
    typer.echo(json_doc(summary) if as_json else run_summary_text(summary))
    if summary.get("gate", {}).get("decision") == "block":
        raise typer.Exit(1)


def rescore_flow(prepared: Any, options: dict[str, Any], as_json: bool) -> dict[str, Any]:
    """The `rescore` flow run that `prepared` (a `PreparedRescore` of `options`) describes,
    handed to the flow so that it checks nothing again, a progress bar beside it."""
    from flows.prefect_api import prefect_api

    source_run, options = prepared.plan.source_run, options | {"suite": prepared.config.suite}
    with prefect_api(as_json) as watch, progress(prepared.run.suite.name, as_json) as hook:
        from flows.artifacts import progress_hook
        from flows.rescore import prepared_here, rescore
        from flows.steps import flow_result

        token, handed = progress_hook.set(hook), prepared_here.set(((source_run, options), prepared))
        try:
            return flow_result(watch(rescore)(run_id=source_run, **options, return_state=True))
        finally:
            progress_hook.reset(token)
            prepared_here.reset(handed)
