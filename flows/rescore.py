"""The `rescore` flow: a new run of a suite graded on a stored run's outputs, without its agent.

Wiring only, as `evaluate`: the plan is the one `evaluate` would make for the source run's
agent, n and seed; `tasks.run.rescore` takes each sample's output from the source run and
lists the cases it has none for; the run loop grades them on the task runner as in a run
(`tasks.run.loop.run_loop`'s rescoring mode: every output given, so no agent is ever called),
then reduces and gates by the same rules as a run.
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from dataclasses import replace
from typing import Annotated, Any

from prefect import flow
from prefect.runtime import flow_run
from pydantic import Field

from flows import steps
from flows.artifacts import name_flow_run, publish
from service.run import execute
from storage.store import Store
from tasks.metrics.diff import Metric
from tasks.models import MAX_WORKERS
from tasks.report.sample_table import rescore_run_name
from tasks.run import RunConfig
from tasks.run.config import Runner
from tasks.run.rescore import PreparedRescore, prepare_rescore
from tasks.settings import MachineSettings, using


def _run_name() -> str:
    p = flow_run.parameters
    return rescore_run_name(str(p.get("suite", "suite")), str(p.get("run_id", "")))


@flow(name="rescore", flow_run_name=_run_name, persist_result=False, log_prints=False)
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
    max_increase: dict[str, Annotated[float, Field(ge=0)]] | None = None,
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
        max_increase: Gate rule: figure (turns, tool_calls, tokens, cost) -> the largest growth
            of its mean per sample over the baseline (0.2: 20 %), the whole paired CI above it.
        metric: What the gate's paired CI compares: pass (pass@1), score (mean score), or a
            registered per-case metric by name.
    """
    started = time.perf_counter()
    machine = MachineSettings.from_environ(os.environ)  # this machine's (a deployment's worker), carried on
    with using(machine):
        return _rescored(run_id, suite, machine, started, {name: value for name, value in locals().items()
                                                              if name in RunConfig.model_fields})


def _rescored(run_id: str, suite: str, machine: MachineSettings, started: float,
              options: dict[str, Any]) -> dict[str, Any]:
    steps.check_deployment_allows(None, options["unsafe_no_sandbox"], suite=suite)
    store = Store.default()
    handed = prepared_here.get()
    if handed is not None and handed[0] == (run_id, options):
        rescoring = handed[1]
    else:
        rescoring = prepare_rescore(run_id, store, **options)
    flow_run_id = str(flow_run.id) if flow_run.id else None
    config, prepared = rescoring.config, rescoring.run
    spec = prepared.spec.model_copy(update={"flow_run_id": flow_run_id})  # its summary links this flow run
    name_flow_run(flow_run_id, rescore_run_name(prepared.suite.name, rescoring.plan.source_run, spec.run_id))
    summary = execute(replace(prepared, spec=spec), config, store, steps.prefect_shell(), machine=machine,
                      started=started, rescoring=rescoring.plan)
    publish(summary, store, {case.id: case.kind for case in prepared.suite.cases})
    steps.log_headline(summary)
    return steps.final_state(summary)


# The rescore as `evalpipe rescore` prepared it in this process, keyed by the flow's
# parameters: the flow takes it rather than checking everything again (as `evaluate` does).
prepared_here: ContextVar[tuple[tuple[str, dict[str, Any]], PreparedRescore] | None] = ContextVar(
    "rescore_prepared_here", default=None)
