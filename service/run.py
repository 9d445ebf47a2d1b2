"""One run, from its prepared configuration to its stored decision: the one recipe every shell
follows (`evalpipe run` and `rescore` through their flows, the flows of deployments,
`evalpipe.evaluate` and `rescore`), so a rule, a budget or a setting holds in every one."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from service.gate import run_gate
from storage.store import Store
from tasks.models import EvalSuite
from tasks.run import RunConfig, RunSummary
from tasks.run.loop import Progress, SampleStore, Stages, local_stages, reduce_run, run_loop
from tasks.run.prepare import PreparedRun
from tasks.run.rescore import RescorePlan
from tasks.run.spec import RunSpec
from tasks.run.summary import Measured
from tasks.sandbox import allowing_unsafe
from tasks.settings import MachineSettings, using


def snapshot_if_missing(suite: EvalSuite, store: Store) -> None:
    """The suite's snapshot, written once per version."""
    if not store.snapshots.has(suite):
        store.snapshots.save(suite)


@dataclass(frozen=True)
class Shell:
    """What the caller runs a run on: where its stages run (Prefect's task runners in a flow,
    thread pools without Prefect), how the suite is snapshotted and the figures reduced (a flow
    makes each a task of its own), and where progress, the log and a stop request come from."""

    stages: Callable[[RunConfig], AbstractContextManager[Stages]] = local_stages
    snapshot: Callable[[EvalSuite, Store], None] = snapshot_if_missing
    reduce: Callable[[RunSpec, EvalSuite, SampleStore], Measured] = reduce_run
    progress: Progress | None = None
    log: logging.Logger | logging.LoggerAdapter | None = None
    stopping: Callable[[], bool] | None = None


def execute(run: PreparedRun, config: RunConfig, store: Store, shell: Shell = Shell(), *,
            machine: MachineSettings, started: float | None = None,
            rescoring: RescorePlan | None = None) -> RunSummary:
    """Run `run` as `config` says, kept in `store`: the suite snapshotted, the stages entered
    with the run's sandbox setting and `machine`, the settings the caller's edge read (each
    stage task carries them where it runs), the loop (plain, sequential, or `rescoring` another run's
    stored outputs, with no agent called), the reduction and the gate, then the stored summary.
    `started`: when the caller began (`time.perf_counter()`), for the summary's duration."""
    started = time.perf_counter() if started is None else started
    with using(machine):
        shell.snapshot(run.suite, store)
        if rescoring is not None and (origin := store.exports.imported_from(rescoring.source_run)) is not None:
            store.exports.record_imported_outputs(run.spec.run_id, origin)  # before any of its samples is stored
        with allowing_unsafe(config.unsafe_no_sandbox), shell.stages(config) as stages:
            return run_loop(run.spec, config, run.suite, run.agent, store, stages,
                            prices=run.prices, progress=shell.progress, gate=run_gate(run, config, store),
                            no_baseline=run.no_baseline, log=shell.log, reduce=shell.reduce, started=started,
                            rescoring=rescoring, stopping=shell.stopping)
