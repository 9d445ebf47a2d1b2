"""The `evaluate` flow: suite → snapshot → samples (mapped, batched) → DuckDB → aggregate.

The flow is thin: planning, drawing, grading and aggregating are plain functions in
`tasks/`; Prefect adds the task graph, the runner, and what the UI shows. Cached work is
found with one DuckDB query before anything is mapped, so a cache hit costs a row copy,
not a Prefect task (a Prefect cache hit costs ~19 ms a task here; the work often less).
"""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner
from pydantic import Field

from storage import db, evalpipe_home
from storage.calibrations import run_calibrations
from storage.snapshots import snapshot_path, write_snapshot
from tasks.agents import load_agent
from tasks.aggregate import aggregate
from tasks.dataset import resolve_suite
from tasks.models import EvalSuite, InputError
from tasks.report import slices_table, summary_markdown
from tasks.sampling import PlannedSample, plan_samples, run_batch

Runner = Literal["threads", "processes", "dask"]

# Set by the CLI to draw a progress bar: called with (samples done, samples total).
progress_hook: ContextVar[Callable[[int, int], None] | None] = ContextVar("progress_hook", default=None)

# What a kill can throw away is bounded by count and by time, whatever the suite's size: a
# sampling task draws at most MAX_BATCH samples and starts no new one after BATCH_BUDGET_S
# (the rest is submitted again). Within that, aim for TASKS_PER_WORKER tasks per worker:
# enough to balance uneven cases and move the progress bar, few enough that Prefect's
# ~10 ms per task stays small.
MAX_BATCH = 64
BATCH_BUDGET_S = 2.0
TASKS_PER_WORKER = 16

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
def sample_batch(agent: Any, cases: list, planned: list[PlannedSample], n: int, regrade: int,
                 budget_s: float, label: str):
    return run_batch(agent, cases, planned, n, regrade, budget_s)


@task(name="aggregate", cache_policy=NO_CACHE, persist_result=False)
def reduce_run(run: dict[str, Any], suite: EvalSuite, ks: list[int], home: str) -> dict[str, Any]:
    """The one reduction: read the run's samples back, aggregate, store, publish."""
    samples = db.run_samples(run["run_id"], Path(home))
    agg = aggregate(samples, {c.id: c.slices for c in suite.cases}, ks, seed=run["seed"])
    db.write_aggregates(run["run_id"], agg.rows(), Path(home))
    cached = pc.sum(samples["cached"]).as_py() or 0
    summary = {
        "run_id": run["run_id"],
        "suite_version": suite.version,
        "suite_name": suite.name,
        "agent": run["agent"],
        "n": run["n"],
        "cases": len(suite.cases),
        "samples": samples.num_rows,
        "cached_samples": cached,
        **agg.to_json(),
    }
    if run.get("regrade"):
        summary["env_flaky_samples"] = _env_flakes(samples)
    return summary


def _env_flakes(samples: pa.Table) -> int:
    return sum(bool(json.loads(t).get("env_flaky")) for t in samples["trace"].to_pylist())


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


def samples_per_task(missing: int, workers: int) -> int:
    return max(1, min(MAX_BATCH, math.ceil(missing / (workers * TASKS_PER_WORKER))))


def batches(planned: Sequence[PlannedSample], per_batch: int) -> list[list[PlannedSample]]:
    return [list(planned[i : i + per_batch]) for i in range(0, len(planned), per_batch)]


def new_run_id() -> str:
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


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
    """
    started = time.perf_counter()
    if any(x < 1 for x in k):
        raise InputError(f"k: every k must be at least 1, got {k}")
    home = evalpipe_home()
    suite_obj, suite_source = resolve_suite(suite)
    agent_obj = load_agent(agent)
    workers = workers or os.cpu_count() or 1

    if baseline == PREVIOUS:
        baseline = db.latest_completed_run(suite_obj.version, agent_obj.fingerprint, home)
    elif baseline:
        baseline = db.find_run(baseline, home)["run_id"]  # before any agent call is paid for

    fresh = not snapshot_path(suite_obj.version, home).exists()
    snapshot.with_options(refresh_cache=fresh)(suite_obj, str(home))

    run = {
        "run_id": new_run_id(),
        "suite_version": suite_obj.version,
        "suite_name": suite_obj.name,
        "agent": agent,
        "agent_fingerprint": agent_obj.fingerprint,
        "n": n,
        "ks": list(k),
        "seed": seed,
        "regrade": regrade,
        "flow_run_id": str(flow_run.id) if flow_run.id else None,
        "config": {"runner": runner, "workers": workers, "batch_size": batch_size, "regrade": regrade,
                   "baseline": baseline, "min_pass_at_1": min_pass_at_1, "max_drop": max_drop,
                   "suite_ref": suite, "suite_source": suite_source},
    }
    db.start_run(run, home)
    try:
        planned = plan_samples(suite_obj, agent_obj.fingerprint, n, seed)
        missing = _with_stored_outputs(planned, home) if regrade else _reuse_cached(run["run_id"], planned, home)
        _draw(run, suite_obj, agent_obj, missing, len(planned), batch_size, runner, workers, dask_address, home)
        summary = reduce_run(run, suite_obj, list(k), str(home))
        if baseline:
            from flows.gate import gate_runs

            summary["gate"] = gate_runs(run["run_id"], baseline, min_pass_at_1=min_pass_at_1,
                                        max_drop=max_drop, home=home, summary=summary)
        summary["flow_run_id"] = run["flow_run_id"]
        summary["duration_s"] = round(time.perf_counter() - started, 3)
        db.finish_run(run["run_id"], "completed", summary, home)
    except BaseException:
        db.finish_run(run["run_id"], "failed", None, home)
        raise
    _publish(summary, home)
    gate = summary.get("gate")
    if gate and gate["decision"] == "block":
        # Still Completed (the run and its numbers are sound), but named so that the UI's
        # run list, filters and automations can tell a blocked release at a glance.
        return Completed(data=summary, name="Blocked", message="gate blocked: " + "; ".join(gate["reasons"]))
    return summary


def _reuse_cached(run_id: str, planned: list[PlannedSample], home: Path) -> list[PlannedSample]:
    """Copy every finished sample found by cache key into this run; return what is left."""
    hits = db.cached_samples([p.cache_key for p in planned], home)
    if hits.num_rows:
        hits = hits.set_column(hits.schema.get_field_index("run_id"), "run_id",
                               pa.array([run_id] * hits.num_rows, pa.string()))
        hits = hits.set_column(hits.schema.get_field_index("cached"), "cached",
                               pa.array([True] * hits.num_rows, pa.bool_()))
        db.insert_samples(hits, home)
    found = set(hits["cache_key"].to_pylist())
    return [p for p in planned if p.cache_key not in found]


def _with_stored_outputs(planned: list[PlannedSample], home: Path) -> list[PlannedSample]:
    """`--regrade`: the stored output of every finished sample is graded again rather than
    drawn again, so the agent is not asked twice (nor paid twice) for the same output."""
    hits = db.cached_samples([p.cache_key for p in planned], home)
    outputs = dict(zip(hits["cache_key"].to_pylist(), hits["output"].to_pylist(), strict=True))
    return [replace(p, output=outputs.get(p.cache_key)) for p in planned]


def _draw(run, suite: EvalSuite, agent, missing, total, batch_size, runner, workers, dask_address, home):
    """Map the missing samples over the task runner; store the drawn ones as they finish."""
    hook = progress_hook.get()
    done = total - len(missing)
    if hook:
        hook(done, total)
    if not missing:
        return
    n = run["n"]
    per_batch = batch_size * n if batch_size else samples_per_task(len(missing), workers)
    cases = {c.id: c for c in suite.cases}

    def params(chunk: list[PlannedSample]) -> dict[str, Any]:
        ids = sorted({p.case_id for p in chunk})
        label = ids[0] if len(ids) == 1 else f"{ids[0]}…{ids[-1]} ({len(chunk)})"
        return {"agent": agent, "cases": [cases[c] for c in ids], "planned": chunk, "n": n,
                "regrade": run["regrade"], "budget_s": BATCH_BUDGET_S, "label": label}

    progress = create_progress_artifact(progress=100 * done / total, description="samples graded")
    last_update = time.monotonic()
    with _api_for_workers(runner), _task_runner(runner, workers, dask_address) as task_runner:
        for drawn, planned in _sampled(task_runner, params, batches(missing, per_batch)):
            db.insert_samples(db.samples_table(run["run_id"], drawn, planned), home)
            done += len(drawn)
            if hook:
                hook(done, total)
            if time.monotonic() - last_update > 1.0 or done == total:
                update_progress_artifact(progress, 100 * done / total)
                last_update = time.monotonic()


def _sampled(task_runner: TaskRunner, params, work: list[list[PlannedSample]]) -> Iterator[tuple[list, list]]:
    """Submit a sampling task per chunk; yield (drawn samples, their planned samples) as
    tasks finish. A task that stopped at its time budget has the rest of its chunk
    submitted again. Everything that finished meanwhile comes out together, as one
    database write: opening the DuckDB file costs more than a small batch's rows."""
    finished: queue.SimpleQueue = queue.SimpleQueue()

    def submit(chunk: list[PlannedSample]) -> None:
        future = task_runner.submit(sample_batch, params(chunk))
        future.add_done_callback(lambda f: finished.put((f, chunk)))

    for chunk in work:
        submit(chunk)
    in_flight = len(work)
    while in_flight:
        ready = [finished.get()]
        while not finished.empty():
            ready.append(finished.get())
        in_flight -= len(ready)
        drawn, planned = [], []
        for future, chunk in ready:
            samples = future.result()
            drawn += samples
            planned += chunk[: len(samples)]
            if len(samples) < len(chunk):
                submit(chunk[len(samples):])
                in_flight += 1
        yield drawn, planned


def _publish(summary: dict[str, Any], home: Path) -> None:
    """The run's summary and per-slice table as artifacts on the flow run page."""
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
