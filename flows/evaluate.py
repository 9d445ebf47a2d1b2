"""The `evaluate` flow: Prefect wiring around the run loop (`tasks.run.loop`).

The flow's parameters (the deployment's form) are the fields of `RunConfig`, built at its
top; the loop runs on Prefect's task runners (`flows.steps.prefect_stages`: drawing and
grading as tasks of their own), keeps its samples in the `Store`, and the flow publishes
the summary as artifacts. Cached work is found with one DuckDB query before anything is
mapped, so a cache hit costs a row copy, not a Prefect task.
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from dataclasses import replace
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from flows import steps
from flows.artifacts import name_flow_run, publish
from service.run import execute
from storage.store import Store
from tasks.metrics.sequential import DEFAULT_ROUNDS
from tasks.models import MAX_N, MAX_REGRADE, MAX_ROUNDS, MAX_WORKERS
from tasks.report.sample_table import flow_run_name
from tasks.run import RunConfig, RunSummary, run_title
from tasks.run.config import Runner
from tasks.run.prepare import PreparedRun, prepare_run
from tasks.settings import MachineSettings, using


def _run_name() -> str:
    p = flow_run.parameters
    return run_title(str(p.get("suite", "suite")), p.get("agent"), p.get("n", 1))


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
    max_increase: dict[str, Annotated[float, Field(ge=0)]] | None = None,
    metric: str = "pass",
    runner: Runner = "threads",
    workers: Annotated[int | None, Field(ge=1, le=MAX_WORKERS)] = None,
    agent_concurrency: Annotated[int | None, Field(ge=1, le=MAX_WORKERS)] = None,
    dask_address: str | None = None,
    batch_size: Annotated[int | None, Field(ge=1)] = None,
    regrade: Annotated[int, Field(ge=0, le=MAX_REGRADE)] = 0,
    unsafe_no_sandbox: bool = False,
    max_output_bytes: Annotated[int | None, Field(ge=1)] = None,
    cmd_timeout: Annotated[float | None, Field(gt=0)] = None,
    openai_timeout: Annotated[float | None, Field(gt=0)] = None,
    openai_max_attempts: Annotated[int | None, Field(ge=1)] = None,
    workspace: bool = False,
    agent_timeout: Annotated[float | None, Field(gt=0)] = None,
    agent_memory_mb: Annotated[int | None, Field(ge=1)] = None,
    workspace_tree_mb: Annotated[int | None, Field(ge=1)] = None,
    workspace_change_bytes: Annotated[int | None, Field(ge=1)] = None,
    max_trajectory_bytes: Annotated[int | None, Field(ge=1)] = None,
    max_model_calls: Annotated[int | None, Field(ge=1)] = None,
    max_sample_cost: Annotated[float | None, Field(gt=0)] = None,
    model_concurrency: Annotated[int | None, Field(ge=1)] = None,
    replay_model_calls: bool = False,
    fresh: bool = False,
    max_cost: Annotated[float | None, Field(gt=0)] = None,
    max_samples: Annotated[int | None, Field(ge=1)] = None,
    prices: str | None = None,
    sequential: bool = False,
    sequential_rounds: Annotated[int, Field(ge=1, le=MAX_ROUNDS)] = DEFAULT_ROUNDS,
) -> dict[str, Any]:
    """Sample `n` outputs per case from `agent`, grade them, store and aggregate the run.

    Prefect's parameter form takes its field descriptions from this section.

    Args:
        suite: Suite file, git URL#PATH (URL@REF#PATH), or stored version.
        agent: Agent spec (python:, cmd:, replay:, reference, openai:).
        n: Samples per case.
        k: Comma-separated k values for pass@k.
        seed: Run seed; with a deterministic agent, the same seed gives the same run.
        baseline: Gate against this run (id, unambiguous prefix, or 'previous').
        min_pass_at_1: Block when the run's pass@1 is below this.
        max_drop: Block only when the drop in pass@1 vs the baseline is surely larger than this (CI
            wholly below -D).
        max_new_failures: Gate rule: block when more than N always-passing cases now fail.
        min_slice: Gate rule: block when the slice is below X; repeatable.
        max_increase: Block when a figure per sample (turns, tool_calls, tokens, cost) grew by more
            than FRACTION (0.2: 20 %) over the baseline, the whole paired CI above it; repeatable.
        metric: What the paired CI compares: pass (pass@1), score (mean score), or a registered
            per-case metric by name (pass@1, mean_score, a plugin's).
        runner: threads, processes or dask.
        workers: Parallel graders (default: CPU count).
        agent_concurrency: Agent calls in flight (default 16): they wait on an API, not on a core.
        dask_address: With --runner dask: an existing Dask scheduler (tls://HOST:PORT).
        batch_size: Cases per task (default: as many as fit about 2 s).
        regrade: Re-grade each output R times.
        unsafe_no_sandbox: Without bubblewrap, run the suite's code unprotected instead of refusing.
        max_output_bytes: Cap on each agent output (default 4 MB; $EVALPIPE_MAX_OUTPUT_BYTES).
        cmd_timeout: Seconds a cmd: agent may take per sample (default 300;
            $EVALPIPE_AGENT_TIMEOUT_S).
        openai_timeout: Seconds per request of an openai: agent (default 60;
            $EVALPIPE_OPENAI_TIMEOUT_S).
        openai_max_attempts: Requests an openai: agent makes per sample, retries included (default
            5; $EVALPIPE_OPENAI_MAX_ATTEMPTS).
        workspace: Run a cmd:/python: coding agent per sample in a fresh checkout of the case's base
            commit, sandboxed; its output is the change it leaves there.
        agent_timeout: With --workspace: seconds per agent run (default 1800).
        agent_memory_mb: With --workspace: the agent's address-space cap (default 8192;
            $EVALPIPE_AGENT_MEMORY_MB).
        workspace_tree_mb: With --workspace: cap on the files the agent leaves (default 4096;
            $EVALPIPE_WORKSPACE_TREE_MB).
        workspace_change_bytes: With --workspace: cap on the agent's change (default 4 MB;
            $EVALPIPE_WORKSPACE_CHANGE_BYTES).
        max_trajectory_bytes: With --workspace: cap on the trajectory kept (default 1 MB;
            $EVALPIPE_MAX_TRAJECTORY_BYTES).
        max_model_calls: Model calls one sample may make (the openai: tool loop's turns, a workspace
            agent's calls through the gateway); the call past it is refused and the sample is
            agent_error naming the cap.
        max_sample_cost: USD one sample's model calls through the gateway may cost, priced as the
            run's usage: the call that would pass it (at the dearest call so far) is refused and the
            sample is agent_error naming the cap.
        model_concurrency: Model calls in flight at once across the run (default: no cap beyond
            --agent-concurrency), through the gateway and an in-process agent's OpenAI SDK.
        replay_model_calls: Keep each model call made through the gateway or an in-process agent's
            OpenAI SDK, and answer a call identical to one an earlier run of this agent spec kept for
            the same case, sample index and seed (same request body, same ordinal among identical
            requests) from it, with no upstream call.
        fresh: Draw every sample from the agent again, taking no output nor verdict from the cache
            (what the cache cannot see changed: a venv's packages, a model behind the same
            endpoint); the outputs drawn are kept, and later runs reuse them.
        max_cost: Start no new agent call once the drawn samples cost this much; the run ends
            partial (exit 6). The same command with a larger budget draws the rest.
        max_samples: Draw at most N samples from the agent (cached outputs are free); the run ends
            partial (exit 6) if more were needed.
        prices: Price file (YAML/JSON: model -> input_per_mtok, output_per_mtok) over genai-prices'
            table (default: $EVALPIPE_PRICES).
        sequential: With --baseline: draw cases in a seeded random order, in rounds, and stop as
            soon as the gate's decision cannot change (anytime-valid).
        sequential_rounds: Rounds (looks) of --sequential.
    """
    started = time.perf_counter()
    # The parameters, as the form shows them, are the fields of the run's configuration; those
    # not given take this machine's documented overrides (a deployment's worker), read here
    # with its settings (`MachineSettings`), which the run carries on.
    config = RunConfig.build("evaluate", environ=os.environ, **{name: value for name, value in locals().items()
                                                                if name in RunConfig.model_fields})
    machine = MachineSettings.from_environ(os.environ)
    with using(machine):
        return steps.final_state(run(config, machine, started))


# The run as `evalpipe run` prepared it in this process, with its configuration: the flow
# takes it rather than resolving and checking everything again (a deployment's run prepares).
prepared_here: ContextVar[tuple[RunConfig, PreparedRun | None] | None] = ContextVar("prepared_here", default=None)


def run(config: RunConfig, machine: MachineSettings, started: float) -> RunSummary:
    """The run `config` describes on a machine of settings `machine`, inside the flow:
    prepared, then looped over Prefect's task runners, its summary published."""
    steps.check_deployment_allows(config.agent, config.unsafe_no_sandbox, config.dask_address, config.suite)
    store = Store.default()
    flow_run_id = str(flow_run.id) if flow_run.id else None
    handed = prepared_here.get()
    if handed is not None and handed[0] == config and handed[1] is not None:
        run = replace(handed[1], spec=handed[1].spec.model_copy(update={"flow_run_id": flow_run_id}))
    else:
        run = prepare_run(config, store, flow_run_id=flow_run_id)
    name_flow_run(flow_run_id, flow_run_name(run.suite.name, run.spec.agent, run.spec.n, run.spec.run_id))
    get_run_logger().info("run %s: suite %s (%s, %d cases), agent %s, n=%d%s", run.spec.run_id, run.suite.name,
                          run.suite.version[:12], len(run.suite.cases), run.spec.agent, run.spec.n,
                          f", gated against {run.baseline.run_id}" if run.baseline else "")
    summary = execute(run, config, store, steps.prefect_shell(), machine=machine, started=started)
    publish(summary, store, {case.id: case.kind for case in run.suite.cases})
    steps.log_headline(summary)
    return summary
