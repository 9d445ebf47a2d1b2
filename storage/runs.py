"""A run's references resolved before it draws anything: its suite (pinned), agent, sandbox,
prices and baseline, and the `RunSpec` recorded for it. The flow and the Python API
(`evalpipe.evaluate`) start a run the same way from here."""

from __future__ import annotations

import os
from dataclasses import dataclass

from storage.store import Store
from storage.suites import resolve_suite
from tasks.agents import Agent, load_agent
from tasks.metrics.cost import PriceTable
from tasks.metrics.rules import GateRules, check_slices
from tasks.models import EvalSuite, InputError
from tasks.report.gate_text import no_baseline_message, previous_choice
from tasks.run import RunConfig, RunSpec, check_ks
from tasks.sandbox import run_sandbox_mode

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


def prepare_run(config: RunConfig, store: Store, *, agent: Agent | None = None,
                flow_run_id: str | None = None) -> PreparedRun:
    """Everything `config` names, found and checked (bad input raises `InputError` here,
    before any agent call); `agent`: the agent itself when it is not a spec (a callable)."""
    suite, suite_source = resolve_suite(config.suite, store)
    sandbox = run_sandbox_mode(suite.grader_kinds, config.unsafe_no_sandbox)
    if agent is None:
        agent = load_agent(config.agent, config.agent_timeout_s, config.output_cap)
        if config.workspace:  # the suite file holds the references and hidden tests
            agent = agent.concealing(p for p in [suite_source] if os.path.isfile(p))
    prices = PriceTable.load(config.prices)
    if config.sequential and not config.baseline:
        raise InputError("--sequential needs --baseline: it stops when the comparison is decided")
    baseline, no_baseline = gate_baseline(config, suite, store)
    spec = RunSpec(
        suite_version=suite.version, suite_name=suite.name, agent=agent.spec,
        agent_fingerprint=agent.fingerprint, n=config.n, ks=check_ks(config.k), seed=config.seed,
        regrade=config.regrade, flow_run_id=flow_run_id,
        config=config.recorded(baseline=baseline.run_id if baseline else None, suite_source=suite_source, sandbox=sandbox,
                               prices=prices.source),
    )
    return PreparedRun(spec, suite, agent, prices, baseline, config.rules, no_baseline)


def gate_baseline(config: RunConfig, suite: EvalSuite, store: Store) -> tuple[Baseline | None, str | None]:
    """The baseline a run (or a rescore) of `suite` is gated against, its rules checked
    against the suite first; none found: what the summary says instead."""
    check_slices(config.rules.slice_min, (name for c in suite.cases for name in c.slices))
    baseline = find_baseline(config.baseline, suite, store)
    return baseline, no_baseline_message(suite.name) if config.baseline and not baseline else None


def find_baseline(baseline: str | None, suite: EvalSuite, store: Store, *, before: str | None = None
                  ) -> Baseline | None:
    """The run to gate against: `previous` is the newest completed run of the suite of the
    same name (before run `before`), whatever its version or agent, so an edited suite or a
    changed agent is gated against the last run on the cases they share (none yet: no gate,
    said); anything else, a stored run (id or prefix), found before any agent call is paid for."""
    if baseline == PREVIOUS:
        found = store.latest_completed_run_of_suite(suite.name, before=before)
        return Baseline(found, previous_choice(suite.name)) if found else None
    return Baseline(store.find_run(baseline)["run_id"]) if baseline else None
