"""The `rescore` flow: a new run of a suite graded on a stored run's outputs, without its agent.

Wiring only, as `evaluate`: the plan is the one `evaluate` would make for the source run's
agent, n and seed; `tasks.run.rescore` takes each sample's output from the source run and
lists the cases it has none for; grading runs on the task runner as in a run
(`tasks.run.loop.draw_and_grade` with every output given, so no agent is ever called).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from prefect import flow
from pydantic import Field

from flows import steps
from flows.artifacts import publish
from storage.store import Store
from storage.suites import resolve_suite
from tasks import run
from tasks.models import EvalSuite, InputError
from tasks.run import RunConfig, RunSpec, RunStatus
from tasks.run.config import Runner
from tasks.run.loop import draw_and_grade
from tasks.run.rescore import rescore_plan
from tasks.run.summary import RunOutcome
from tasks.sandbox import allowing_unsafe, run_sandbox_mode


@flow(name="rescore", persist_result=False, log_prints=False)
def rescore(
    run_id: str,
    suite: str,
    runner: Runner = "threads",
    workers: Annotated[int | None, Field(ge=1, le=256)] = None,
    unsafe_no_sandbox: bool = False,
) -> dict[str, Any]:
    """Grade SUITE on the outputs stored by run `run_id`; cases it has no output for are
    `unscored`.

    Args:
        run_id: The run whose outputs to grade (id or unambiguous prefix).
        suite: Suite file path, git URL#PATH, or stored version.
        runner: Task runner for grading: threads, processes or dask.
        workers: Parallel workers (default: CPU count).
        unsafe_no_sandbox: Without bubblewrap, run the suite's code unprotected instead of refusing.
    """
    started = time.perf_counter()
    store = Store.default()
    source = store.find_run(run_id)
    suite_obj, suite_source = resolve_suite(suite, store)
    sandbox = run_sandbox_mode(suite_obj.grader_kinds, unsafe_no_sandbox)
    source_suite = source_suite_of(source, suite_obj, store)
    config = RunConfig(suite=suite, agent=source["agent"], runner=runner, workers=workers,
                       unsafe_no_sandbox=unsafe_no_sandbox)
    steps.snapshot_once(suite_obj, store)
    spec = RunSpec(
        suite_version=suite_obj.version, suite_name=suite_obj.name, agent=source["agent"],
        agent_fingerprint=source["agent_fingerprint"], n=source["n"], ks=list(source["ks"]),
        seed=source["seed"],
        config={"rescored_from": source["run_id"], "suite_ref": suite, "suite_source": suite_source,
                "runner": runner, "workers": config.grade_workers, "sandbox": sandbox},
    )
    plan = rescore_plan(spec.run_id, run.plan(suite_obj, spec), suite_obj, source_suite,
                        store.run_samples(source["run_id"]))
    if (origin := store.imported_from(source["run_id"])) is not None:
        store.record_imported_outputs(spec.run_id, origin)  # before any of its samples is stored
    with store.recorded_run(spec):
        store.insert_samples(plan.failed_calls)
        total = len(plan.to_grade) + plan.failed_calls.num_rows
        with allowing_unsafe(unsafe_no_sandbox), steps.prefect_stages(config) as stages:
            draw_and_grade(spec, config, suite_obj, None, plan.to_grade, total, store, stages,
                           progress=steps.ShownProgress())
        summary = steps.aggregate(spec, suite_obj, store).summary(RunOutcome(
            cases=len(suite_obj.cases) - len(plan.unscored), source_run=source["run_id"], unscored=plan.unscored,
            sandbox=sandbox, duration_s=round(time.perf_counter() - started, 3)))
        store.finish_run(spec.run_id, RunStatus.completed, summary)
    publish(summary, store)
    return summary.to_json()


def source_suite_of(source: dict[str, Any], suite: EvalSuite, store: Store) -> EvalSuite:
    """The suite the stored run `source` ran (its snapshot); bad input, before any work,
    when it is gone or shares no question (case id and inputs) with `suite`."""
    if not store.snapshot_path(source["suite_version"]).exists():
        raise InputError(f"run {source['run_id']}: the snapshot of its suite {source['suite_version'][:12]}"
                         f" is missing from {store.snapshot_dir}: cannot tell which questions it asked")
    ran = store.read_snapshot(source["suite_version"])
    asked = {(c.id, c.inputs_hash) for c in ran.cases}
    if not any((c.id, c.inputs_hash) in asked for c in suite.cases):
        raise InputError(f"run {source['run_id']} has no output for any case of suite {suite.name!r}"
                         " (no case with the same id and inputs): nothing to score")
    return ran
