"""The Prefect side of an evaluate run: the two stages (`tasks.run.loop`) as Prefect tasks
on their task runners, the snapshot and aggregate tasks, progress on the flow run's page,
and the flow's final state."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State
from prefect.task_runners import TaskRunner
from prefect.utilities.annotations import quote

from flows.artifacts import Progress, progress_hook
from flows.interrupt import EXIT_GRACE_S, bounded_under_prefect, ends_within, stop_requested
from flows.runners import task_runner
from service.run import Shell
from storage.store import Store
from tasks.agents.trust import ALLOW_ENV, deployment_refusal
from tasks.metrics.percent import headline_ci, percent
from tasks.models import EvalSuite, InputError
from tasks.run import RunConfig, RunSpec, RunSummary
from tasks.run.loop import DrawTask, GradeTask, SampleStore, reduce_run
from tasks.run.summary import Measured
from tasks.run.workers import run_in, worker_processes


def _snapshot_key(context, parameters) -> str:
    return f"evalpipe-snapshot-{parameters['store'].home}-{parameters['suite'].version}"


@task(name="snapshot", cache_key_fn=_snapshot_key, task_run_name="snapshot {suite.name}")
def snapshot(suite: EvalSuite, store: Store) -> str:
    """Write the suite's snapshot (once per version) and record the suite in DuckDB."""
    return str(store.snapshots.save(suite))


class Sealed:
    """A stage's task as its Prefect task takes it: an object Prefect does not look into.
    Otherwise it walks every sample of the task (and every field of each) looking for
    futures, twice a task; `quote` would spare that too, but Dask takes it apart (a tuple)."""

    __slots__ = ("work", "pool")

    def __init__(self, work: DrawTask | GradeTask, pool: Executor | None = None) -> None:
        self.work, self.pool = work, pool  # pool: the worker processes its work runs in

    def __getstate__(self) -> DrawTask | GradeTask:
        return self.work

    def __setstate__(self, work: DrawTask | GradeTask) -> None:
        self.work, self.pool = work, None


@task(name="sample", cache_policy=NO_CACHE, persist_result=False, task_run_name="sample {label}")
def draw(sealed: Sealed, label: str) -> Any:
    return sealed.work()


@task(name="grade", cache_policy=NO_CACHE, persist_result=False, task_run_name="grade {label}")
def grade(sealed: Sealed, label: str) -> Any:
    return run_in(sealed.pool, sealed.work)


@task(name="aggregate", cache_policy=NO_CACHE, persist_result=False)
def aggregate(spec: RunSpec, suite: EvalSuite, store: SampleStore) -> Measured:
    return reduce_run(spec, suite, store)


@dataclass
class PrefectStages:
    """The loop's stages as Prefect tasks, each on its task runner (`prefect_stages`)."""

    draws: TaskRunner
    grades: TaskRunner
    grading_processes: Executor | None = None  # --runner processes: where grading work runs

    def draw(self, work: DrawTask) -> Any:
        return self.draws.submit(draw, {"sealed": Sealed(work), "label": work.label})

    def grade(self, work: GradeTask) -> Any:
        return self.grades.submit(grade, {"sealed": Sealed(work, self.grading_processes), "label": work.label})


@contextmanager
def prefect_stages(config: RunConfig) -> Iterator[PrefectStages]:
    """Grading on the run's task runner; drawing on threads of this process, or on the Dask
    cluster too (a run that outgrows one machine draws there, the agent sent as its spec)."""
    with task_runner(config.runner, config.grade_workers, config.dask_address) as grades:
        if config.runner == "dask":
            with _bounded_exit():
                yield PrefectStages(grades, grades)
            return
        pool = worker_processes(config.grade_workers) if config.runner == "processes" else nullcontext()
        with task_runner("threads", config.draw_slots, None) as draws, pool as workers, _bounded_exit():
            yield PrefectStages(draws, grades, workers)


@contextmanager
def _bounded_exit() -> Iterator[None]:
    """Stopped (Ctrl-C, SIGTERM), the loop has stored what it could; the runners' shutdown
    then waits on whatever is still out (a hung agent), so the process gets a bounded time."""
    try:
        with bounded_under_prefect():
            yield
    except BaseException as exc:
        if not isinstance(exc, Exception):
            ends_within(EXIT_GRACE_S)
        raise


class ShownProgress:
    """Samples graded so far: the CLI's progress hook, once there is work the flow run's
    progress artifact, and a line in the flow run's log at every tenth of the work."""

    def __init__(self) -> None:
        self.hook = progress_hook.get()
        self.shown: Progress | None = None
        self.logged = 0  # tenths of the work logged so far

    def __call__(self, done: int, total: int) -> None:
        tenths = 10 * done // total if total else 0
        if tenths > self.logged:
            self.logged = tenths
            get_run_logger().info("progress: %d of %d samples (%d%%)", done, total, 100 * done // total)
        if self.shown is None:
            if self.hook:
                self.hook(done, total)
            if done < total:
                self.shown = Progress(done, total, self.hook)
            return
        self.shown.advance(done - self.shown.done)


def check_deployment_allows(agent: str | None, unsafe_no_sandbox: bool, dask_address: str | None = None,
                            suite: str | None = None) -> None:
    """A flow run of a deployment runs code agents, suites and the unsafe flag, and sends tasks
    to a Dask scheduler, only as its own configuration allows (tasks.agents.trust); a run from
    the CLI or a notebook is the user's."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment

    if deployment.id is None:
        return
    # Its own parameters, as deployed (`prefect.runtime.deployment.parameters` are the run's).
    with get_client(sync_client=True) as client:
        configured = client.read_deployment(deployment.id).parameters or {}
    refusal = deployment_refusal(agent, unsafe_no_sandbox, configured, os.environ.get(ALLOW_ENV, ""), dask_address,
                                 suite)
    if refusal:
        raise InputError(refusal)


def log_headline(summary: RunSummary) -> None:
    """The headline figures and the gate's decision in the flow run's log (the UI's Logs tab)."""
    logger = get_run_logger()
    logger.info("%s: pass@1 %s (%s) over %d cases x n=%d; %d flaky; safety %s", summary.suite_name,
                percent(summary.pass_at_k.get("1")), headline_ci(summary.pass_at_1_ci, summary.cases, summary.ci_level),
                summary.cases, summary.n, summary.flaky_cases,
                "FAILED" if summary.safety_failed else "clean")
    hats = ", ".join(f"pass^{k} {percent(v)}" for k, v in (summary.pass_hat_k or {}).items() if k != "1")
    if hats:
        logger.info("reliability: %s", hats)
    if summary.no_baseline:
        logger.warning("%s", summary.no_baseline)
    if summary.gate:  # without a baseline, by the rules that need none
        logger.info("gate%s: %s (%s): %s", f" vs {summary.gate.baseline}" if summary.gate.baseline else "",
                    summary.gate.decision.upper(), summary.gate.verdict, "; ".join(summary.gate.reasons))


# The suite goes to a task `quote`d: Prefect would otherwise walk every field of every case
# looking for futures, twice per task (~0.5 s a task at 2,000 cases).


def snapshot_once(suite: EvalSuite, store: Store) -> None:
    """The `snapshot` task, cached per suite version, run again when its file is gone."""
    snapshot.with_options(refresh_cache=not store.snapshots.has(suite))(quote(suite), store)


def reduce_in_task(spec: RunSpec, suite: EvalSuite, store: SampleStore) -> Measured:
    """The loop's reduce as the `aggregate` task."""
    return aggregate(spec, quote(suite), store)


def prefect_shell() -> Shell:
    """The run service's shell inside a flow run: Prefect's task runners, the snapshot and the
    reduction as tasks, progress shown and logged, a stop request (a signal) heeded."""
    return Shell(stages=prefect_stages, snapshot=snapshot_once, reduce=reduce_in_task, progress=ShownProgress(),
                 log=get_run_logger(), stopping=stop_requested)


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
