"""The `evaluate` flow: suite → snapshot → samples (mapped, batched) → DuckDB → aggregate.

Wiring only: planning, drawing, grading and summarizing are the plain functions of
`tasks.run`; the steps around them (`flows.steps`) add the Prefect tasks, the task runner
and what the UI shows. Cached work is found with one DuckDB query before anything is mapped,
so a cache hit costs a row copy, not a Prefect task (a Prefect cache hit costs ~19 ms a task
here; the work often less).
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Any, Literal

from prefect import flow
from prefect.runtime import flow_run
from pydantic import Field

from flows import steps
from flows.artifacts import publish
from flows.gate import gate_runs
from flows.runners import Runner
from flows.sequential import apply_stop, draw_sequentially
from storage import db, evalpipe_home
from storage.suites import resolve_suite
from tasks import run
from tasks.agents import DEFAULT_AGENT_TIMEOUT_S, load_agent
from tasks.metrics.cost import PriceTable
from tasks.metrics.rules import GateRules, check_slices
from tasks.metrics.sequential import DEFAULT_ROUNDS
from tasks.metrics.stats import DEFAULT_LEVEL
from tasks.models import MAX_N, MAX_REGRADE, MAX_ROUNDS, MAX_WORKERS, InputError
from tasks.run.budget import Budget, budget_summary
from tasks.sandbox import allowing_unsafe, run_sandbox_mode


def _run_name() -> str:
    p = flow_run.parameters
    return run.run_title(str(p.get("suite", "suite")), p.get("agent"), p.get("n", 1))


@flow(name="evaluate", flow_run_name=_run_name, persist_result=False, log_prints=False)
def evaluate(
    suite: str,
    agent: str,
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1,
    k: Annotated[list[int], Field(min_length=1)] = [1],  # noqa: B006 - Prefect parameter default
    seed: Annotated[int, Field(ge=0)] = 0,
    baseline: str | None = None,
    min_pass_at_1: Annotated[float | None, Field(ge=0, le=1)] = None,
    max_drop: Annotated[float, Field(ge=0, le=1)] = 0.0,
    max_new_failures: Annotated[int | None, Field(ge=0)] = None,
    min_slice: dict[str, Annotated[float, Field(ge=0, le=1)]] | None = None,
    metric: Literal["pass", "score"] = "pass",
    runner: Runner = "threads",
    workers: Annotated[int | None, Field(ge=1, le=MAX_WORKERS)] = None,
    dask_address: str | None = None,
    batch_size: Annotated[int | None, Field(ge=1)] = None,
    regrade: Annotated[int, Field(ge=0, le=MAX_REGRADE)] = 0,
    unsafe_no_sandbox: bool = False,
    workspace: bool = False,
    agent_timeout: Annotated[float, Field(gt=0)] = DEFAULT_AGENT_TIMEOUT_S,
    max_cost: Annotated[float | None, Field(gt=0)] = None,
    max_samples: Annotated[int | None, Field(ge=1)] = None,
    prices: str | None = None,
    sequential: bool = False,
    sequential_rounds: Annotated[int, Field(ge=1, le=MAX_ROUNDS)] = DEFAULT_ROUNDS,
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
            run of the same suite version, whatever its agent (none yet: no gate, and the
            summary says so).
        min_pass_at_1: Gate threshold: block when pass@1 is below this.
        max_drop: Gate threshold: block only when the drop in pass@1 against the baseline
            is surely (its whole CI) larger than this.
        max_new_failures: Gate rule: block when more than this many cases that always
            passed in the baseline fail in some sample now.
        min_slice: Gate rule: slice name -> the lowest pass@1 (or mean score) it may have.
        metric: What the gate's paired CI compares: pass (pass@1) or score (mean score).
        runner: Task runner for sampling: threads, processes or dask.
        workers: Parallel workers (default: CPU count).
        dask_address: Address of an existing Dask scheduler (runner=dask).
        batch_size: Cases per sampling task (default: automatic, at most 64 samples a task).
        regrade: Grade each output this many extra times to count environment flakes.
        unsafe_no_sandbox: Without bubblewrap, run the suite's code (python_tests,
            repo_tests, predicate) unprotected instead of refusing. Stated in the summary.
        workspace: Run a cmd: or python: coding agent per sample in a fresh checkout of the
            case's base commit, in the sandbox; its output is the change it leaves there.
        agent_timeout: With workspace: seconds each agent run may take.
        max_cost: Budget in USD: no new agent call starts once the drawn samples cost this
            much; the run ends partial, and the same run with a larger budget draws the rest.
        max_samples: Budget in agent calls: draw at most this many samples (cached ones are free).
        prices: A price file (YAML/JSON: model -> input_per_mtok, output_per_mtok) over
            genai-prices' table; default: the file EVALPIPE_PRICES names, if any.
        sequential: With a baseline: draw the cases in a seeded random order, in rounds, and
            stop as soon as the gate's decision cannot change (an anytime-valid confidence
            sequence); the stop is recorded under `sequential` in the summary.
        sequential_rounds: The number of rounds (looks) of a sequential run.
    """
    started = time.perf_counter()
    steps.check_deployment_allows(agent, unsafe_no_sandbox)
    home = evalpipe_home()
    suite_obj, suite_source = resolve_suite(suite)
    sandbox = run_sandbox_mode((c.kind for c in suite_obj.cases), unsafe_no_sandbox)
    agent_obj = load_agent(agent, agent_timeout if workspace else None)
    if workspace:  # the suite file holds the references and hidden tests
        agent_obj = agent_obj.concealing(p for p in [suite_source] if os.path.isfile(p))
    budget, price_table = Budget(max_cost_usd=max_cost, max_samples=max_samples), PriceTable.load(prices)
    workers = workers or os.cpu_count() or 1
    asked_baseline = baseline
    if sequential and not baseline:
        raise InputError("--sequential needs --baseline: it stops when the comparison is decided")
    baseline = steps.find_baseline(baseline, suite_obj, home)
    rules = GateRules(max_new_failures=max_new_failures, slice_min=min_slice or {})
    check_slices(rules.slice_min, (name for c in suite_obj.cases for name in c.slices))
    steps.snapshot_once(suite_obj, home)

    spec = run.RunSpec(
        suite_version=suite_obj.version, suite_name=suite_obj.name, agent=agent,
        agent_fingerprint=agent_obj.fingerprint, n=n, ks=run.check_ks(k), seed=seed, regrade=regrade,
        flow_run_id=str(flow_run.id) if flow_run.id else None,
        config={"runner": runner, "workers": workers, "batch_size": batch_size, "regrade": regrade,
                "baseline": baseline, "min_pass_at_1": min_pass_at_1, "max_drop": max_drop,
                "max_new_failures": max_new_failures, "min_slice": min_slice, "metric": metric,
                "suite_ref": suite, "suite_source": suite_source, "sandbox": sandbox,
                "workspace": workspace, "agent_timeout_s": agent_timeout if workspace else None,
                "max_cost": max_cost, "max_samples": max_samples, "prices": price_table.source},
    )
    with db.recorded_run(spec, home):
        planned = run.plan(suite_obj, spec)
        record = None
        if sequential and baseline:  # rounds until the gate's decision cannot change
            with allowing_unsafe(unsafe_no_sandbox):
                record, planned = draw_sequentially(
                    spec, suite_obj, agent_obj, planned, home, baseline=baseline, max_drop=max_drop,
                    metric=metric, alpha=1 - DEFAULT_LEVEL, rounds=sequential_rounds,
                    can_pass_early=not (min_pass_at_1 is not None or max_new_failures is not None or min_slice
                                        or any(c.must_pass for c in suite_obj.cases)),
                    batch_size=batch_size, runner=runner, workers=workers, dask_address=dask_address)
        missing = steps.reuse_cached(spec, planned, home) if record is None else []
        with allowing_unsafe(unsafe_no_sandbox):  # in the environment: process workers see it
            drawn = steps.draw_missing(spec, suite_obj, agent_obj, missing, len(planned), home,
                                       batch_size=batch_size, runner=runner, workers=workers,
                                       dask_address=dask_address, budget=budget, prices=price_table)
        summary = steps.reduce_run(spec, suite_obj, str(home))
        if budget.limited:
            summary.budget = budget_summary(budget, drawn.meter, drawn.undrawn)
        if drawn.undrawn:
            summary.partial, summary.undrawn_samples = True, drawn.undrawn
        if baseline:
            summary.gate = gate_runs(spec.run_id, baseline, min_pass_at_1=min_pass_at_1, max_drop=max_drop,
                                     home=home, safety_failed=summary.safety_failed, rules=rules,
                                     metric=metric, summary=summary)
        elif asked_baseline:
            summary.no_baseline = steps.no_baseline_note(suite_obj)
        if record is not None:
            apply_stop(summary, record)
        summary.sandbox = sandbox
        summary.duration_s = round(time.perf_counter() - started, 3)
        db.finish_run(spec.run_id, "partial" if summary.partial else "completed", summary, home)
    publish(summary, home)
    steps.log_headline(summary)
    return steps.final_state(summary)
