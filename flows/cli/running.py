"""`evalpipe run` and `evalpipe rescore`: a run of the `evaluate` (or `rescore`) flow, with its
progress beside it, its summary printed and its exit status read off the summary."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.common import (
    METRIC_HELP,
    JsonFlag,
    MaxDropOpt,
    MaxIncreaseOpt,
    MaxNewFailuresOpt,
    MinPassOpt,
    MinSliceOpt,
    RunArg,
    SuiteArg,
    UnsafeFlag,
    bad_input,
    run_summary_text,
)
from flows.output import json_doc
from tasks.models import MAX_N, MAX_REGRADE, MAX_ROUNDS, MAX_WORKERS

if TYPE_CHECKING:
    from storage.store import Store

def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        bad_input(f"-k: expected comma-separated integers like 1,5,10, got {text!r}")
    if not ks or any(k < 1 for k in ks):
        bad_input(f"-k: every k must be a positive integer, got {text!r}")
    return ks



def run(
    suite: SuiteArg,
    agent: Annotated[str, typer.Option("--agent", help="Agent spec (python:, cmd:, replay:, reference, openai:).")],
    n: Annotated[int, typer.Option("-n", min=1, max=MAX_N, help="Samples per case.")] = 1,
    k: Annotated[str, typer.Option("-k", help="Comma-separated k values for pass@k.")] = "1",
    seed: Annotated[int, typer.Option(
        "--seed", min=0, help="Run seed; with a deterministic agent, the same seed gives the same run.")] = 0,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, max=MAX_WORKERS, help="Parallel graders (default: CPU count).")] = None,
    agent_concurrency: Annotated[int | None, typer.Option(
        "--agent-concurrency", min=1, max=MAX_WORKERS,
        help="Agent calls in flight (default 16): they wait on an API, not on a core.")] = None,
    runner: Annotated[str, typer.Option("--runner", help="threads, processes or dask.")] = "threads",
    dask_address: Annotated[str | None, typer.Option(
        "--dask-address", help="With --runner dask: an existing Dask scheduler (tls://HOST:PORT).")] = None,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", min=1, help="Cases per task (default: as many as fit about 2 s).")] = None,
    regrade: Annotated[int, typer.Option("--regrade", min=0, max=MAX_REGRADE, help="Re-grade each output R times.")] = 0,
    baseline: Annotated[str | None, typer.Option(
        "--baseline", help="Gate against this run (id, unambiguous prefix, or 'previous').")] = None,
    min_pass_at_1: MinPassOpt = None,
    max_drop: Annotated[float, typer.Option(
        "--max-drop", min=0.0, max=1.0,
        help="Block only when the drop in pass@1 vs the baseline is surely larger than this (CI wholly below -D).")] = 0.0,
    max_new_failures: Annotated[int | None, typer.Option(
        "--max-new-failures", min=0, help="Gate rule: block when more than N always-passing cases now fail.")] = None,
    min_slice: Annotated[list[str] | None, typer.Option(
        "--min-slice", metavar="SLICE=X", help="Gate rule: block when the slice is below X; repeatable.")] = None,
    max_increase: MaxIncreaseOpt = None,
    metric: Annotated[str, typer.Option("--metric", help=METRIC_HELP)] = "pass",
    max_agent_errors: Annotated[float, typer.Option(
        "--max-agent-errors", min=0.0, max=1.0, metavar="FRACTION",
        help="Exit 4 when more than this share of samples are agent_error: the agent is broken,"
             " so the numbers say nothing about the model.")] = 0.1,
    max_grader_errors: Annotated[float, typer.Option(
        "--max-grader-errors", min=0.0, max=1.0, metavar="FRACTION",
        help="Exit 5 when more than this share of samples are error: the grader could not run,"
             " so the numbers measure nothing.")] = 0.1,
    unsafe_no_sandbox: UnsafeFlag = False,
    max_output_bytes: Annotated[int | None, typer.Option(
        "--max-output-bytes", min=1, help="Cap on each agent output (default 4 MB; $EVALPIPE_MAX_OUTPUT_BYTES).")] = None,
    cmd_timeout: Annotated[float | None, typer.Option(
        "--cmd-timeout", metavar="SECONDS",
        help="Seconds a cmd: agent may take per sample (default 300; $EVALPIPE_AGENT_TIMEOUT_S).")] = None,
    openai_timeout: Annotated[float | None, typer.Option(
        "--openai-timeout", metavar="SECONDS",
        help="Seconds per request of an openai: agent (default 60; $EVALPIPE_OPENAI_TIMEOUT_S).")] = None,
    openai_max_attempts: Annotated[int | None, typer.Option(
        "--openai-max-attempts", min=1, metavar="N",
        help="Requests an openai: agent makes per sample, retries included (default 5;"
             " $EVALPIPE_OPENAI_MAX_ATTEMPTS).")] = None,
    workspace: Annotated[bool, typer.Option(
        "--workspace", help="Run a cmd:/python: coding agent per sample in a fresh checkout of the case's"
                            " base commit, sandboxed; its output is the change it leaves there.")] = False,
    agent_timeout: Annotated[float | None, typer.Option(
        "--agent-timeout", metavar="SECONDS",
        help="With --workspace: seconds per agent run (default 1800).")] = None,
    agent_memory_mb: Annotated[int | None, typer.Option(
        "--agent-memory-mb", min=1, metavar="MB",
        help="With --workspace: the agent's address-space cap (default 8192; $EVALPIPE_AGENT_MEMORY_MB).")] = None,
    workspace_tree_mb: Annotated[int | None, typer.Option(
        "--workspace-tree-mb", min=1, metavar="MB",
        help="With --workspace: cap on the files the agent leaves (default 4096; $EVALPIPE_WORKSPACE_TREE_MB).")] = None,
    workspace_change_bytes: Annotated[int | None, typer.Option(
        "--workspace-change-bytes", min=1, metavar="N",
        help="With --workspace: cap on the agent's change (default 4 MB; $EVALPIPE_WORKSPACE_CHANGE_BYTES).")] = None,
    max_model_calls: Annotated[int | None, typer.Option(
        "--max-model-calls", min=1, metavar="N",
        help="Model calls one sample may make (the openai: tool loop's turns, a workspace agent's calls through the"
             " gateway); the call past it is refused and the sample is agent_error naming the cap.")] = None,
    max_trajectory_bytes: Annotated[int | None, typer.Option(
        "--max-trajectory-bytes", min=1, metavar="N",
        help="With --workspace: cap on the trajectory kept (default 1 MB; $EVALPIPE_MAX_TRAJECTORY_BYTES).")] = None,
    max_cost: Annotated[float | None, typer.Option(
        "--max-cost", metavar="USD",
        help="Start no new agent call once the drawn samples cost this much; the run ends partial (exit 6)."
             " The same command with a larger budget draws the rest.")] = None,
    max_samples: Annotated[int | None, typer.Option(
        "--max-samples", min=1, metavar="N",
        help="Draw at most N samples from the agent (cached outputs are free); the run ends partial (exit 6)"
             " if more were needed.")] = None,
    prices: Annotated[Path | None, typer.Option(
        "--prices", help="Price file (YAML/JSON: model -> input_per_mtok, output_per_mtok) over genai-prices'"
                         " table (default: $EVALPIPE_PRICES).")] = None,
    sequential: Annotated[bool, typer.Option(
        "--sequential", help="With --baseline: draw cases in a seeded random order, in rounds, and stop as soon"
                             " as the gate's decision cannot change (anytime-valid).")] = False,
    rounds: Annotated[int, typer.Option("--rounds", min=1, max=MAX_ROUNDS, help="Rounds (looks) of --sequential.")] = 10,
    as_json: JsonFlag = False,
) -> None:
    """Sample, grade, store and aggregate a run of AGENT on SUITE.

    Exit 1 when the gate (--baseline) blocks, 4 when too many samples are agent_error,
    5 when too many are error (the grader could not run), 6 when a budget (--max-cost,
    --max-samples) left samples undrawn."""
    from storage.store import Store
    from tasks.metrics.rules import parse_increases, parse_slice_thresholds
    from tasks.run import RunConfig
    from tasks.run.prepare import pinned, prepare_run

    config = RunConfig.build(
        "run", lambda field: "--" + {"sequential_rounds": "rounds"}.get(field, field).replace("_", "-"),
        suite=suite, agent=agent, n=n, k=parse_ks(k), seed=seed, baseline=baseline, min_pass_at_1=min_pass_at_1,
        max_drop=max_drop, max_new_failures=max_new_failures, min_slice=parse_slice_thresholds(min_slice or ()) or None,
        max_increase=parse_increases(max_increase or ()) or None, metric=metric, runner=runner, workers=workers, agent_concurrency=agent_concurrency, dask_address=dask_address,
        batch_size=batch_size, regrade=regrade, unsafe_no_sandbox=unsafe_no_sandbox,
        max_output_bytes=max_output_bytes, cmd_timeout=cmd_timeout, openai_timeout=openai_timeout,
        openai_max_attempts=openai_max_attempts, workspace=workspace, agent_timeout=agent_timeout,
        agent_memory_mb=agent_memory_mb, workspace_tree_mb=workspace_tree_mb,
        workspace_change_bytes=workspace_change_bytes, max_trajectory_bytes=max_trajectory_bytes, max_model_calls=max_model_calls, max_cost=max_cost,
        max_samples=max_samples, prices=str(prices) if prices else None, sequential=sequential,
        sequential_rounds=rounds)
    # Every check of the input, once, before Prefect starts: a one-line message, not a failed
    # flow run. The flow is handed what was prepared (`prepared`), and its parameters name
    # the suite pinned (a git branch as the commit read here) and the price file found.
    store = Store.default()
    store.check()  # a damaged or locked database is reported before Prefect starts, too
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
    detail, _ = store.commonest_detail(summary["run_id"], status) or ("", 0)
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
    suite: SuiteArg,
    workers: Annotated[int | None, typer.Option("--workers", min=1, max=MAX_WORKERS)] = None,
    unsafe_no_sandbox: UnsafeFlag = False,
    baseline: Annotated[str | None, typer.Option(
        "--baseline", help="Gate the rescored run against this run (id, unambiguous prefix, or 'previous').")] = None,
    min_pass_at_1: MinPassOpt = None,
    max_drop: MaxDropOpt = None,
    max_new_failures: MaxNewFailuresOpt = None,
    min_slice: MinSliceOpt = None,
    max_increase: MaxIncreaseOpt = None,
    metric: Annotated[str, typer.Option("--metric", help=METRIC_HELP)] = "pass",
    as_json: JsonFlag = False,
) -> None:
    """A new run of SUITE graded on RUN_ID's stored outputs, without calling its agent.

    Cases whose id and inputs match RUN_ID's are graded; the others are reported `unscored`
    (never drawn, never counted as failures). With --baseline it is gated by the same rules
    as `run`: exit 1 when blocked."""
    from storage.store import Store
    from tasks.metrics.rules import parse_increases, parse_slice_thresholds
    from tasks.run.rescore import prepare_rescore

    store = Store.default()
    store.check()
    options = {"suite": suite, "runner": "threads", "workers": workers, "unsafe_no_sandbox": unsafe_no_sandbox,
               "baseline": baseline, "min_pass_at_1": min_pass_at_1, "max_drop": max_drop or 0.0,
               "max_new_failures": max_new_failures, "min_slice": parse_slice_thresholds(min_slice or ()) or None,
               "max_increase": parse_increases(max_increase or ()) or None, "metric": metric}
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
