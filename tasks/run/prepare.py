"""Preparing a run: everything a `RunConfig` names resolved and checked, once, before anything
is drawn: its suite (pinned), agent, sandbox, prices, baseline and rules, and the `RunSpec`
recorded for it. The CLI, the flows (`evaluate`, `rescore`) and the Python API
(`evalpipe.evaluate`) all start a run here; `tasks.run.loop.run_loop` runs it. Where the
suites and the stored runs are read is the caller's (`RunSources`: `storage.store.Store`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tasks.agents import Agent, load_agent
from tasks.agents.workspace_runner import check_workspace_repos
from tasks.metrics.cost import PriceTable
from tasks.metrics.rules import GateRules, check_slices
from tasks.models import EvalSuite
from tasks.run.config import RunConfig
from tasks.run.spec import RunSpec, check_ks
from tasks.sandbox import run_sandbox_mode


class RunFinder(Protocol):
    """The stored runs a baseline is found among (`storage.runs.Runs`)."""

    def find(self, ref: str) -> dict[str, Any]: ...
    def latest_completed_of_suite(self, suite_name: str, *, before: str | None = None) -> str | None: ...


class RunSources(Protocol):
    """Where a run's suite and baseline are found (`storage.store.Store`)."""

    def resolve_suite(self, ref: str) -> tuple[EvalSuite, str]: ...
    @property
    def runs(self) -> RunFinder: ...


# `baseline="previous"`: gate against the newest completed run of the same suite, any agent.
PREVIOUS = "previous"


@dataclass(frozen=True)
class Baseline:
    """The run a run is gated against, and how it was chosen (`previous`: said in every output)."""

    run_id: str
    choice: str | None = None


@dataclass(frozen=True)
class PreparedRun:
    spec: RunSpec
    suite: EvalSuite
    agent: Agent | None  # None: a rescore, which never calls one
    prices: PriceTable
    baseline: Baseline | None  # the run to gate against, when there is one
    rules: GateRules
    no_baseline: str | None  # a baseline was asked for and none exists: what the summary says


def prepare_run(config: RunConfig, store: RunSources, *, agent: Agent | None = None,
                flow_run_id: str | None = None) -> PreparedRun:
    """Everything `config` names, found and checked (bad input raises `InputError` here,
    before any agent call); `agent`: the agent itself when it is not a spec (a callable)."""
    suite, suite_source = store.resolve_suite(config.suite)
    sandbox = run_sandbox_mode(suite.grader_kinds, config.unsafe_no_sandbox)
    if agent is None:
        agent = load_agent(config.agent, config.agent_timeout_s, config.agent_settings)
        if config.workspace:  # the suite file holds the references and hidden tests
            agent = agent.concealing(p for p in [suite_source] if os.path.isfile(p))
    if config.workspace:  # a repository that is not there is bad input, not an agent_error per sample
        check_workspace_repos(suite.cases)
    prices = PriceTable.load(config.prices)
    baseline, no_baseline = gate_baseline(config, suite, store)
    spec = RunSpec(
        suite_version=suite.version, suite_name=suite.name, agent=agent.spec,
        agent_fingerprint=agent.fingerprint, n=config.n, ks=check_ks(config.k), seed=config.seed,
        regrade=config.regrade, flow_run_id=flow_run_id,
        config=config.recorded(baseline=baseline.run_id if baseline else None, suite_source=suite_source, sandbox=sandbox,
                               prices=prices.source),
    )
    return PreparedRun(spec, suite, agent, prices, baseline, config.rules, no_baseline)


def pinned(config: RunConfig, run: PreparedRun) -> tuple[RunConfig, PreparedRun]:
    """`config` naming what preparing it resolved (the suite pinned: a git branch as the
    commit read; the price file found), and `run` recording that: what a flow run is handed,
    so that it runs exactly the suite that was checked, even if the branch moves meanwhile."""
    config = config.model_copy(update={"suite": run.spec.config["suite_source"], "prices": run.prices.source})
    spec = run.spec.model_copy(update={"config": {**run.spec.config, "suite_ref": config.suite}})
    return config, replace(run, spec=spec)


def gate_baseline(config: RunConfig, suite: EvalSuite, store: RunSources) -> tuple[Baseline | None, str | None]:
    """The baseline a run (or a rescore) of `suite` is gated against, its rules checked
    against the suite first; none found: what the summary says instead."""
    check_slices(config.rules.slice_min, (name for c in suite.cases for name in c.slices))
    baseline = find_baseline(config.baseline, suite.name, store)
    return baseline, no_baseline_message(suite.name) if config.baseline and not baseline else None


def find_baseline(baseline: str | None, suite_name: str, store: RunSources, *, before: str | None = None
                  ) -> Baseline | None:
    """The run to gate against: `previous` is the newest completed run of the suite of the
    same name (before run `before`), whatever its version or agent, so an edited suite or a
    changed agent is gated against the last run on the cases they share (none yet: no gate,
    said); anything else, a stored run (id or prefix), found before any agent call is paid for."""
    if baseline == PREVIOUS:
        found = store.runs.latest_completed_of_suite(suite_name, before=before)
        return Baseline(found, previous_choice(suite_name)) if found else None
    return Baseline(store.runs.find(baseline)["run_id"]) if baseline else None


def no_baseline_message(suite_name: str, before: str | None = None) -> str:
    """`--baseline previous` with no completed run of the suite (before run `before`)."""
    return (f"no baseline: no completed run of suite {suite_name!r}" + (f" before {before}" if before else " yet")
            + "; nothing was compared")


def previous_choice(suite_name: str) -> str:
    """How `--baseline previous` chose, as every output of the decision says."""
    return f"previous: the latest completed run of suite {suite_name!r}"
