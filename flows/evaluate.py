"""The `evaluate` flow: suite → snapshot → samples (mapped, batched) → DuckDB → aggregate.

Wiring only: planning, drawing, grading and summarizing are the plain functions of
`tasks.run`; Prefect adds the task graph, the runner, and what the UI shows. Cached work is
found with one DuckDB query before anything is mapped, so a cache hit costs a row copy,
not a Prefect task (a Prefect cache hit costs ~19 ms a task here; the work often less).
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any

import pyarrow as pa
from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Completed
from prefect.task_runners import TaskRunner
from pydantic import Field

from flows.artifacts import Progress, publish
from flows.gate import gate_runs
from flows.runners import Runner, task_runner
from flows.steps import reduce_run, sample_batch, snapshot
from storage import db, evalpipe_home
from storage.snapshots import snapshot_path
from storage.suites import resolve_suite
from tasks import run
from tasks.agents import load_agent
from tasks.models import EvalSuite
from tasks.run.sampling import PlannedSample
from tasks.sandbox import allowing_unsafe, run_sandbox_mode

# Set by the CLI to draw a progress bar: called with (samples done, samples total).
progress_hook: ContextVar[Callable[[int, int], None] | None] = ContextVar("progress_hook", default=None)

# `baseline="previous"`: gate against the newest completed run of the same suite and agent.
PREVIOUS = "previous"


def _run_name() -> str:
    p = flow_run.parameters
    return f"{Path(str(p.get('suite', 'suite'))).stem} · {p.get('agent')} · n={p.get('n', 1)}"


@flow(name="evaluate", flow_run_name=_run_name, persist_result=False, log_prints=False)
def evaluate(
    suite: str,
    agent: str,
    n: Annotated[int, Field(ge=1, le=10_000)] = 1,
    k: Annotated[list[int], Field(min_length=1)] = [1],  # noqa: B006 - Prefect parameter default
    seed: Annotated[int, Field(ge=0)] = 0,
    baseline: str | None = None,
    min_pass_at_1: Annotated[float | None, Field(ge=0, le=1)] = None,
    max_drop: Annotated[float, Field(ge=0, le=1)] = 0.0,
    runner: Runner = "threads",
    workers: Annotated[int | None, Field(ge=1, le=256)] = None,
    dask_address: str | None = None,
    batch_size: Annotated[int | None, Field(ge=1)] = None,
    regrade: Annotated[int, Field(ge=0, le=100)] = 0,
    unsafe_no_sandbox: bool = False,
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
        min_pass_at_1: Gate threshold: block when pass@1 is below this.
        max_drop: Gate threshold: block only when the drop in pass@1 against the baseline
            is surely (its whole CI) larger than this.
        runner: Task runner for sampling: threads, processes or dask.
        workers: Parallel workers (default: CPU count).
        dask_address: Address of an existing Dask scheduler (runner=dask).
        batch_size: Cases per sampling task (default: automatic, at most 64 samples a task).
        regrade: Grade each output this many extra times to count environment flakes.
        unsafe_no_sandbox: Without bubblewrap, run the suite's code (python_tests,
            repo_tests, predicate) unprotected instead of refusing. Stated in the summary.
    """
    started = time.perf_counter()
    home = evalpipe_home()
    suite_obj, suite_source = resolve_suite(suite)
    sandbox = run_sandbox_mode((c.kind for c in suite_obj.cases), unsafe_no_sandbox)
    agent_obj = load_agent(agent)
    workers = workers or os.cpu_count() or 1
    if baseline == PREVIOUS:
        baseline = db.latest_completed_run(suite_obj.version, agent_obj.fingerprint, home)
    elif baseline:
        baseline = db.find_run(baseline, home)["run_id"]  # before any agent call is paid for
    fresh = not snapshot_path(suite_obj.version, home).exists()
    snapshot.with_options(refresh_cache=fresh)(suite_obj, str(home))

    spec = run.RunSpec(
        suite_version=suite_obj.version, suite_name=suite_obj.name, agent=agent,
        agent_fingerprint=agent_obj.fingerprint, n=n, ks=run.check_ks(k), seed=seed, regrade=regrade,
        flow_run_id=str(flow_run.id) if flow_run.id else None,
        config={"runner": runner, "workers": workers, "batch_size": batch_size, "regrade": regrade,
                "baseline": baseline, "min_pass_at_1": min_pass_at_1, "max_drop": max_drop,
                "suite_ref": suite, "suite_source": suite_source, "sandbox": sandbox},
    )
    with db.recorded_run(spec, home):
        planned = run.plan(suite_obj, spec)
        reused, missing = run.pending(spec, planned, db.cached_samples([p.cache_key for p in planned], home))
        db.insert_samples(reused, home)
        with allowing_unsafe(unsafe_no_sandbox):  # in the environment: process workers see it
            _draw(spec, suite_obj, agent_obj, missing, len(planned), home,
                  per_batch=(batch_size, workers), runner=(runner, workers, dask_address))
        summary = reduce_run(spec, suite_obj, str(home))
        if baseline:
            summary.gate = gate_runs(spec.run_id, baseline, min_pass_at_1=min_pass_at_1, max_drop=max_drop,
                                     home=home, safety_failed=summary.safety_failed)
        summary.sandbox = sandbox
        summary.duration_s = round(time.perf_counter() - started, 3)
        db.finish_run(spec.run_id, "completed", summary, home)
    publish(summary, home)
    if summary.gate and summary.gate.decision == "block":
        # Still Completed (the run and its numbers are sound), but named so that the UI's
        # run list, filters and automations can tell a blocked release at a glance.
        return Completed(data=summary.to_json(), name="Blocked",
                         message="gate blocked: " + "; ".join(summary.gate.reasons))
    return summary.to_json()


def _draw(spec: run.RunSpec, suite: EvalSuite, agent: Any, missing: list[PlannedSample], total: int, home: Path, *,
          per_batch: tuple[int | None, int], runner: tuple[Runner, int, str | None]) -> None:
    """Map the missing samples over the task runner; store the drawn ones as they finish."""
    hook = progress_hook.get()
    done = total - len(missing)
    if hook:
        hook(done, total)
    if not missing:
        return
    cases = {c.id: c for c in suite.cases}

    def params(chunk: list[PlannedSample]) -> dict[str, Any]:
        return {"agent": agent, "cases": [cases[c] for c in sorted({p.case_id for p in chunk})],
                "planned": chunk, "spec": spec, "label": run.batch_label(chunk)}

    progress = Progress(done, total, hook)
    with task_runner(*runner) as runner_:
        for rows in _sampled(runner_, params, run.batches(missing, spec.n, *per_batch)):
            db.insert_samples(rows, home)
            progress.advance(rows.num_rows)


def _sampled(runner: TaskRunner, params: Callable[[list[PlannedSample]], dict[str, Any]],
             work: list[list[PlannedSample]]) -> Iterator[pa.Table]:
    """Submit a sampling task per chunk and yield the drawn rows as tasks finish. A task
    stopped by its time budget drew a prefix of its chunk: the rest is submitted again.
    Whatever finished meanwhile comes out together, as one database write: opening the
    DuckDB file costs more than a small batch's rows."""
    finished: queue.SimpleQueue = queue.SimpleQueue()

    def submit(chunk: list[PlannedSample]) -> None:
        future = runner.submit(sample_batch, params(chunk))
        future.add_done_callback(lambda f: finished.put((f, chunk)))

    for chunk in work:
        submit(chunk)
    in_flight = len(work)
    while in_flight:
        ready = [finished.get()]
        while not finished.empty():
            ready.append(finished.get())
        in_flight -= len(ready)
        tables = []
        for future, chunk in ready:
            rows = future.result()
            tables.append(rows)
            if rows.num_rows < len(chunk):
                submit(chunk[rows.num_rows:])
                in_flight += 1
        yield pa.concat_tables(tables)
