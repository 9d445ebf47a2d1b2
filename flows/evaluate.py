"""The `evaluate` flow: suite → snapshot → samples (mapped, batched) → DuckDB → aggregate.

Wiring only: planning, drawing, grading and summarizing are the plain functions of
`tasks.run`; Prefect adds the task graph, the runner, and what the UI shows. Cached work is
found with one DuckDB query before anything is mapped, so a cache hit costs a row copy,
not a Prefect task (a Prefect cache hit costs ~19 ms a task here; the work often less).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from prefect import flow, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.states import Completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner
from pydantic import Field

from flows.gate import gate_runs
from storage import db, evalpipe_home
from storage.calibrations import run_calibrations
from storage.snapshots import snapshot_path, write_snapshot
from tasks.agents import load_agent
from tasks.dataset import resolve_suite
from tasks.models import EvalSuite
from tasks.report import slices_table, summary_markdown
from tasks.run import (
    RunSpec,
    RunSummary,
    batch_label,
    batches,
    check_ks,
    draw_batch,
    plan,
    reuse_cached,
    summarize,
    with_stored_outputs,
)
from tasks.sampling import PlannedSample

Runner = Literal["threads", "processes", "dask"]

# Set by the CLI to draw a progress bar: called with (samples done, samples total).
progress_hook: ContextVar[Callable[[int, int], None] | None] = ContextVar("progress_hook", default=None)

# `baseline="previous"`: gate against the newest completed run of the same suite and agent.
PREVIOUS = "previous"


def _run_name() -> str:
    p = flow_run.parameters
    return f"{Path(str(p.get('suite', 'suite'))).stem} · {p.get('agent')} · n={p.get('n', 1)}"


def _snapshot_key(context, parameters) -> str:
    return f"evalpipe-snapshot-{parameters['home']}-{parameters['suite'].version}"


@task(name="snapshot", cache_key_fn=_snapshot_key, task_run_name="snapshot {suite.name}")
def snapshot(suite: EvalSuite, home: str) -> str:
    """Write the suite's snapshot (once per version) and record the suite in DuckDB."""
    path = write_snapshot(suite, Path(home))
    db.record_suite(suite, path, Path(home))
    return str(path)


@task(name="sample", cache_policy=NO_CACHE, persist_result=False, task_run_name="sample {label}")
def sample_batch(agent: Any, cases: list, planned: list[PlannedSample], spec: RunSpec, label: str):
    return draw_batch(agent, cases, planned, spec)


@task(name="aggregate", cache_policy=NO_CACHE, persist_result=False)
def reduce_run(spec: RunSpec, suite: EvalSuite, home: str) -> RunSummary:
    """The one reduction: read the run's samples back, summarize, store the aggregates."""
    summary, rows = summarize(spec, suite, db.run_samples(spec.run_id, Path(home)))
    db.write_aggregates(spec.run_id, rows, Path(home))
    return summary


def _task_runner(runner: Runner, workers: int, dask_address: str | None) -> TaskRunner:
    if runner == "threads":
        return ThreadPoolTaskRunner(max_workers=workers)
    if runner == "processes":
        return ProcessPoolTaskRunner(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    return DaskTaskRunner(
        cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "dashboard_address": None}
    )


@contextmanager
def _api_for_workers(runner: Runner) -> Iterator[None]:
    """Worker processes of an ephemeral-mode run must talk to this process's temporary
    server; without a URL each would boot a server of its own."""
    from prefect.settings import get_current_settings

    if runner == "threads" or get_current_settings().api.url:
        yield
        return
    from prefect.server.api.server import SubprocessASGIServer

    os.environ["PREFECT_API_URL"] = SubprocessASGIServer().api_url
    try:
        yield
    finally:
        os.environ.pop("PREFECT_API_URL", None)


@flow(name="evaluate", flow_run_name=_run_name, persist_result=False, log_prints=False)
def evaluate(
    suite: str,
    agent: str,
    n: Annotated[int, Field(ge=1, le=10_000)] = 1,
    k: Annotated[list[int], Field(min_length=1)] = [1],  # noqa: B006 - Prefect parameter default
    seed: Annotated[int, Field(ge=0)] = 0,
    baseline: str | None = None,
    runner: Runner = "threads",
    workers: Annotated[int | None, Field(ge=1, le=256)] = None,
    dask_address: str | None = None,
    batch_size: Annotated[int | None, Field(ge=1)] = None,
    regrade: Annotated[int, Field(ge=0, le=100)] = 0,
) -> dict[str, Any]:
    """Sample `n` outputs per case from `agent`, grade them, store and aggregate the run.

    Prefect's parameter form takes its field descriptions from this section.

    Args:
        suite: Suite file path; a suite in git as URL#PATH or URL@REF#PATH; or a stored
            suite version (full or an unambiguous prefix).
        agent: Agent spec: python:MOD:FUNC, cmd:..., replay:FILE, reference, openai:MODEL.
        n: Samples per case.
        k: The k of each pass@k to report.
        seed: Run seed; with a deterministic agent, the same seed gives the same run.
        baseline: A run id to gate against at the end, or 'previous': the latest completed
            run of the same suite version and agent (none yet: no gate).
        runner: Task runner for sampling: threads, processes or dask.
        workers: Parallel workers (default: CPU count).
        dask_address: Address of an existing Dask scheduler (runner=dask).
        batch_size: Cases per sampling task (default: automatic).
        regrade: Grade each output this many extra times to count environment flakes.
    """
    started = time.perf_counter()
    home = evalpipe_home()
    suite_obj, suite_source = resolve_suite(suite)
    agent_obj = load_agent(agent)
    workers = workers or os.cpu_count() or 1
    if baseline == PREVIOUS:
        baseline = db.latest_completed_run(suite_obj.version, agent_obj.fingerprint, home)
    fresh = not snapshot_path(suite_obj.version, home).exists()
    snapshot.with_options(refresh_cache=fresh)(suite_obj, str(home))

    spec = RunSpec(
        suite_version=suite_obj.version, suite_name=suite_obj.name, agent=agent,
        agent_fingerprint=agent_obj.fingerprint, n=n, ks=check_ks(k), seed=seed, regrade=regrade,
        flow_run_id=str(flow_run.id) if flow_run.id else None,
        config={"runner": runner, "workers": workers, "batch_size": batch_size, "regrade": regrade,
                "baseline": baseline, "suite_ref": suite, "suite_source": suite_source},
    )
    with db.recorded_run(spec, home):
        planned = plan(suite_obj, spec)
        hits = db.cached_samples([p.cache_key for p in planned], home)
        if regrade:
            missing = with_stored_outputs(planned, hits)
        else:
            reused, missing = reuse_cached(spec.run_id, planned, hits)
            db.insert_samples(reused, home)
        _draw(spec, suite_obj, agent_obj, missing, len(planned), home,
              per_batch=(batch_size, workers), runner=(runner, workers, dask_address))
        summary = reduce_run(spec, suite_obj, str(home))
        if baseline:
            summary.gate = gate_runs(spec.run_id, baseline, home=home, safety_failed=summary.safety_failed)
        summary.duration_s = round(time.perf_counter() - started, 3)
        db.finish_run(spec.run_id, "completed", summary, home)
    _publish(summary, home)
    if summary.gate and summary.gate.decision == "block":
        # Still Completed (the run and its numbers are sound), but named so that the UI's
        # run list, filters and automations can tell a blocked release at a glance.
        return Completed(data=summary.to_json(), name="Blocked",
                         message="gate blocked: " + "; ".join(summary.gate.reasons))
    return summary.to_json()


def _draw(spec: RunSpec, suite: EvalSuite, agent: Any, missing: list[PlannedSample], total: int, home: Path, *,
          per_batch: tuple[int | None, int], runner: tuple[Runner, int, str | None]) -> None:
    """Map the missing samples over the task runner; store each batch as it finishes."""
    hook = progress_hook.get()
    done = total - len(missing)
    if hook:
        hook(done, total)
    if not missing:
        return
    work = batches(missing, spec.n, *per_batch)
    cases = {c.id: c for c in suite.cases}
    progress = create_progress_artifact(progress=100 * done / total, description="samples graded")
    last_update = time.monotonic()
    with _api_for_workers(runner[0]), _task_runner(*runner) as task_runner:
        futures = {}
        for i, chunk in enumerate(work):
            params = {"agent": agent, "cases": [cases[c] for c in sorted({p.case_id for p in chunk})],
                      "planned": chunk, "spec": spec, "label": batch_label(chunk)}
            futures[task_runner.submit(sample_batch, params)] = i
        for future in as_completed(list(futures)):
            db.insert_samples(future.result(), home)
            done += len(work[futures[future]])
            if hook:
                hook(done, total)
            if time.monotonic() - last_update > 1.0 or done == total:
                update_progress_artifact(progress, 100 * done / total)
                last_update = time.monotonic()


def _publish(run: RunSummary, home: Path) -> None:
    """The run's summary and per-slice table as artifacts on the flow run page."""
    summary = run.to_json()
    slug = "".join(ch if ch.isalnum() else "-" for ch in summary["suite_name"].lower()).strip("-")
    judges = run_calibrations(summary["run_id"], home)
    create_markdown_artifact(
        key=f"evalpipe-{slug}-summary", markdown=summary_markdown(summary, summary.get("gate"), judges),
        description=f"evalpipe run {summary['run_id']}",
    )
    rows = slices_table(summary)
    if rows:
        create_table_artifact(key=f"evalpipe-{slug}-slices", table=rows,
                              description=f"per-slice pass@1, run {summary['run_id']}")
