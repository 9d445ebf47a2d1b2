"""The `rescore` flow: a new run of a suite graded on a stored run's outputs, without its agent.

Wiring only, as `evaluate`: the plan is the one `evaluate` would make for the source run's
agent, n and seed; `tasks.run.rescore` takes each sample's output from the source run and
lists the cases it has none for; the run loop grades them on the task runner as in a run
(`tasks.run.loop.run_loop`'s rescoring mode: every output given, so no agent is ever called),
then reduces and gates by the same rules as a run.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from prefect import flow, get_run_logger
from pydantic import Field

from flows import steps
from flows.artifacts import publish
from flows.gate import run_gate
from flows.interrupt import stop_requested
from storage.store import Store
from storage.suites import resolve_suite
from tasks import run
from tasks.metrics.cost import PriceTable
from tasks.metrics.diff import Metric
from tasks.models import MAX_WORKERS, EvalSuite, InputError
from tasks.run import RunConfig, RunSpec
from tasks.run.config import Runner
from tasks.run.loop import run_loop
from tasks.run.prepare import PreparedRun, gate_baseline
from tasks.run.rescore import rescore_plan
from tasks.sandbox import allowing_unsafe, run_sandbox_mode


@flow(name="rescore", persist_result=False, log_prints=False)
def rescore(
    run_id: str,
    suite: str,
    runner: Runner = "threads",
    workers: Annotated[int | None, Field(ge=1, le=MAX_WORKERS)] = None,
    unsafe_no_sandbox: bool = False,
    baseline: str | None = None,
    min_pass_at_1: Annotated[float | None, Field(ge=0, le=1)] = None,
    max_drop: Annotated[float, Field(ge=0, le=1)] = 0.0,
    max_new_failures: Annotated[int | None, Field(ge=0)] = None,
    min_slice: dict[str, Annotated[float, Field(ge=0, le=1)]] | None = None,
    metric: Metric = "pass",
) -> dict[str, Any]:
    """Grade SUITE on the outputs stored by run `run_id`; cases it has no output for are
    `unscored`. With a baseline, gated by the same rules as a run.

    Args:
        run_id: The run whose outputs to grade (id or unambiguous prefix).
        suite: Suite file path, git URL#PATH, or stored version.
        runner: Task runner for grading: threads, processes or dask.
        workers: Parallel workers (default: CPU count).
        unsafe_no_sandbox: Without bubblewrap, run the suite's code unprotected instead of refusing.
        baseline: A run id to gate against, or 'previous' (as for evaluate).
        min_pass_at_1: Gate threshold: block when pass@1 is below this.
        max_drop: Gate threshold: block only when the drop is surely larger than this.
        max_new_failures: Gate rule: block when more than this many always-passing cases now fail.
        min_slice: Gate rule: slice name -> the lowest pass@1 (or mean score) it may have.
        metric: What the gate's paired CI compares: pass (pass@1), score (mean score), or a
            registered per-case metric by name.
    """
    started = time.perf_counter()
    store = Store.default()
    source = store.find_run(run_id)
    suite_obj, suite_source = resolve_suite(suite, store)
    sandbox = run_sandbox_mode(suite_obj.grader_kinds, unsafe_no_sandbox)
    source_suite = source_suite_of(source, suite_obj, store)
    config = RunConfig(suite=suite, agent=source["agent"], runner=runner, workers=workers,
                       unsafe_no_sandbox=unsafe_no_sandbox, baseline=baseline, min_pass_at_1=min_pass_at_1,
                       max_drop=max_drop, max_new_failures=max_new_failures, min_slice=min_slice, metric=metric)
    found, no_baseline = gate_baseline(config, suite_obj, store)
    steps.snapshot_once(suite_obj, store)
    spec = RunSpec(
        suite_version=suite_obj.version, suite_name=suite_obj.name, agent=source["agent"],
        agent_fingerprint=source["agent_fingerprint"], n=source["n"], ks=list(source["ks"]),
        seed=source["seed"],
        config={"rescored_from": source["run_id"], "suite_ref": suite, "suite_source": suite_source,
                "runner": runner, "workers": config.grade_workers, "sandbox": sandbox,
                "baseline": found.run_id if found else None},
    )
    plan = rescore_plan(spec.run_id, run.plan(suite_obj, spec), suite_obj, source_suite, source["run_id"],
                        store.run_samples(source["run_id"], whole_outputs=False), store)
    if (origin := store.imported_from(source["run_id"])) is not None:
        store.record_imported_outputs(spec.run_id, origin)  # before any of its samples is stored
    prepared = PreparedRun(spec, suite_obj, None, PriceTable(), found, config.rules, no_baseline)
    with allowing_unsafe(unsafe_no_sandbox), steps.prefect_stages(config) as stages:
        summary = run_loop(spec, config, suite_obj, None, store, stages, progress=steps.ShownProgress(),
                           gate=run_gate(prepared, config, store), no_baseline=no_baseline,
                           log=get_run_logger(), reduce=steps.reduce_in_task, started=started, rescoring=plan,
                           stopping=stop_requested)
    publish(summary, store)
    steps.log_headline(summary)
    return steps.final_state(summary)


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
