"""The steps of an evaluate run: its Prefect tasks (snapshot, sample mapped over the task
runner, aggregate) and the storage each step reads or writes around them."""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State

from flows.artifacts import Progress, progress_hook
from flows.runners import Mapped, Runner, task_runner
from storage import db
from storage.snapshots import snapshot_path, write_snapshot
from tasks import run
from tasks.agents.trust import ALLOW_ENV, deployment_refusal
from tasks.metrics.cost import PriceTable
from tasks.metrics.percent import percent
from tasks.models import EvalSuite, InputError
from tasks.run import RunSpec, RunSummary, draw_batch, summarize
from tasks.run.budget import Budget, Meter
from tasks.run.sampling import PlannedSample

# `baseline="previous"`: gate against the newest completed run of the same suite, any agent.
PREVIOUS = "previous"


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
    summary, rows = summarize(spec, suite, db.run_samples(spec.run_id, Path(home), run.summary_columns(spec)))
    db.write_aggregates(spec.run_id, rows, Path(home))
    return summary


@dataclass
class Drawn:
    """How drawing went: the meter of what was drawn and spent, and how many samples were
    left undrawn because the budget was spent."""

    meter: Meter
    undrawn: int = 0


def check_deployment_allows(agent: str, unsafe_no_sandbox: bool) -> None:
    """A flow run of a deployment runs code agents and the unsafe flag only as its own
    configuration allows (tasks.agents.trust); a run from the CLI or a notebook is the user's."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment

    if deployment.id is None:
        return
    # Its own parameters, as deployed (`prefect.runtime.deployment.parameters` are the run's).
    with get_client(sync_client=True) as client:
        configured = client.read_deployment(deployment.id).parameters or {}
    refusal = deployment_refusal(agent, unsafe_no_sandbox, configured, os.environ.get(ALLOW_ENV, ""))
    if refusal:
        raise InputError(refusal)


def find_baseline(baseline: str | None, suite: EvalSuite, home: Path) -> str | None:
    """The run id to gate against: `previous` is the newest completed run of the same suite
    version, whatever its agent, so a changed agent is gated against the last one (none yet:
    no gate, said in the summary); anything else, a stored run (id or prefix), found before
    any agent call is paid for."""
    if baseline == PREVIOUS:
        return db.latest_completed_run_of_suite(suite.version, home)
    return db.find_run(baseline, home)["run_id"] if baseline else None


def no_baseline_note(suite: EvalSuite) -> str:
    return (f"no baseline: no completed run of suite {suite.name} ({suite.version[:12]}) yet;"
            " this run was not gated")


def log_headline(summary: RunSummary) -> None:
    """The headline figures and the gate's decision in the flow run's log (the UI's Logs tab)."""
    logger = get_run_logger()
    pass_at_1, ci = summary.pass_at_k.get("1"), summary.pass_at_1_ci
    logger.info("%s: pass@1 %s (CI %s to %s) over %d cases x n=%d; %d flaky; safety %s", summary.suite_name,
                percent(pass_at_1), percent(ci[0]), percent(ci[1]), summary.cases, summary.n, summary.flaky_cases,
                "FAILED" if summary.safety_failed else "clean")
    hats = ", ".join(f"pass^{k} {percent(v)}" for k, v in (summary.pass_hat_k or {}).items() if k != "1")
    if hats:
        logger.info("reliability: %s", hats)
    if summary.gate:
        logger.info("gate vs %s: %s (%s): %s", summary.gate.baseline, summary.gate.decision.upper(),
                    summary.gate.verdict, "; ".join(summary.gate.reasons))
    elif summary.no_baseline:
        logger.warning("%s", summary.no_baseline)


def snapshot_once(suite: EvalSuite, home: Path) -> None:
    """The `snapshot` task, cached per suite version, run again when its file is gone."""
    fresh = not snapshot_path(suite.version, home).exists()
    snapshot.with_options(refresh_cache=fresh)(suite, str(home))


def reuse_cached(spec: RunSpec, planned: list[PlannedSample], home: Path) -> list[PlannedSample]:
    """Store the samples found in the cache as this run's; the planned samples left to draw."""
    stored = db.cached_samples([(p.output_key, p.cache_key) for p in planned], home)
    reused, missing = run.pending(spec, planned, stored)
    db.insert_samples(reused, home)
    return missing


def draw_missing(spec: RunSpec, suite: EvalSuite, agent: Any, missing: list[PlannedSample], total: int,
                 home: Path, *, batch_size: int | None, runner: Runner, workers: int,
                 dask_address: str | None, budget: Budget | None = None,
                 prices: PriceTable | None = None) -> Drawn:
    """Map the missing samples over the task runner, `sample_batch` a batch; store the drawn
    ones as they finish. A batch stopped by its time budget drew a prefix: the rest is
    submitted again. Whatever finished meanwhile is stored together, as one database
    write: opening the DuckDB file costs more than a small batch's rows.

    Stored outputs to grade anew are all submitted at once; the samples to draw too, unless
    the run has a cost budget: then one sample a task, no more than `workers` in flight,
    and none started once the budget is spent (`tasks.run.budget`)."""
    hook = progress_hook.get()
    if hook:
        hook(total - len(missing), total)
    budget, prices = budget or Budget(), prices or PriceTable()
    to_grade = [p for p in missing if p.output is not None]
    to_draw, cut = budget.order([p for p in missing if p.output is None])
    meter = Meter(budget)
    drawn = Drawn(meter, len(cut))
    if not to_grade and not to_draw:
        return drawn
    cases = {c.id: c for c in suite.cases}
    progress = Progress(total - len(missing), total, hook)
    paced = budget.max_cost_usd is not None
    waiting = deque([[p] for p in to_draw] if paced else run.batches(to_draw, spec.n, batch_size, workers))

    def params(chunk: list[PlannedSample]) -> dict[str, Any]:
        return {"agent": agent, "cases": run.batch_cases(cases, chunk), "planned": chunk, "spec": spec,
                "label": run.batch_label(chunk)}

    def top_up() -> None:
        while waiting and meter.may_draw and (not paced or mapped.in_flight < workers):
            mapped.submit(waiting.popleft())

    with task_runner(runner, workers, dask_address) as started, Mapped(started, sample_batch, params) as mapped:
        for chunk in run.batches(to_grade, spec.n, batch_size, workers) if to_grade else []:
            mapped.submit(chunk)
        top_up()
        while mapped.in_flight:
            finished = mapped.finished()
            rows = run.priced(pa.concat_tables([rows for _, rows in finished]), prices)
            meter.add(rows)
            for chunk, done in finished:  # the workers get more before this process writes
                if rest := run.undrawn(chunk, done):
                    if rest[0].output is not None or meter.may_draw:
                        mapped.submit(rest)
                    else:
                        drawn.undrawn += len(rest)
            top_up()
            db.insert_samples(rows, home)
            progress.advance(rows.num_rows)
    drawn.undrawn += sum(len(chunk) for chunk in waiting)
    return drawn


class GateBlocked(Exception):
    """What calling `evaluate` raises when its gate blocked: the run and its numbers are
    sound and stored (`summary`, the `run --json` document); the release is not."""

    def __init__(self, summary: dict[str, Any]) -> None:
        super().__init__("gate blocked: " + "; ".join(summary["gate"]["reasons"]))
        self.summary = summary


def flow_result(state: State) -> dict[str, Any]:
    """The `run --json` document from the flow run's final state, a Blocked run's included
    (its Failed state carries it); any other failure is raised as it is."""
    if state.is_failed() and state.name == "Blocked":
        return state.result(raise_on_failure=False).summary
    return state.result()


def final_state(summary: RunSummary) -> dict[str, Any] | State:
    """The flow's return: the `run --json` document. When the gate blocked, a Failed state
    named Blocked (red in the UI, so automations and notifications fire) that still carries
    the document: the run and its numbers are sound and stored; the release is not. A run
    its budget stopped is Completed, named `Partial`."""
    if summary.partial:
        return Completed(data=summary.to_json(), name="Partial",
                         message=f"budget spent: {summary.undrawn_samples} samples undrawn")
    if summary.gate and summary.gate.decision == "block":
        blocked = GateBlocked(summary.to_json())
        return Failed(data=blocked, name="Blocked", message=str(blocked))
    return summary.to_json()
