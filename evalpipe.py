"""evalpipe's Python API: `from evalpipe import evaluate, rescore` (docs/python-api.md).

`evaluate(suite, agent, **options)` makes the run `evalpipe run` makes, with the same options
(`RunConfig`), stored the same way in EVALPIPE_HOME, and returns its typed summary. This machine's settings
(`tasks.settings.MachineSettings`: the sandbox, EVALPIPE_HOME, ...) are read from the
environment once a call, and carried by that run alone. It runs
the one run service (`service.run.execute`) on thread pools of the calling process, without a
Prefect server: a notebook pays neither the server nor Prefect's import, and a Python
callable can be the agent. The run has no flow run (`flow_run_id` is null) and so no
artifacts in the UI; everything else (samples, cache keys, aggregates, the gate) is the CLI's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage.store import Store
    from tasks.settings import MachineSettings

__all__ = ["evaluate", "rescore"]

SuiteLike = str | os.PathLike | Sequence[Any]
AgentLike = str | Callable[..., Any]


def evaluate(suite: SuiteLike, agent: AgentLike, *, name: str = "suite",
             progress: Callable[[int, int], None] | None = None, home: str | os.PathLike | None = None,
             **options: Any):
    """Run `agent` on `suite`, grade, store and summarize: the `RunSummary` (`.run_id`,
    `.pass_at_k`, `.pass_at_1_ci`, `.gate`, ...; `.to_json()` is the `run --json` document).

    suite: a suite file's path, a git `URL#PATH`, a stored suite version, or the cases
        themselves (`EvalCase`s or dicts as a suite file holds them; snapshotted as any
        suite, under `name`).
    agent: an agent spec (`python:MOD:FUNC`, `cmd:...`, `replay:FILE`, `openai:MODEL`,
        `reference`), or a callable `func(inputs, ctx) -> str`, called as a `python:` agent is.
    progress: called with (samples done, samples total) as samples are stored.
    home: the evalpipe home to keep the run in (default: `EVALPIPE_HOME`, as the CLI's).
    options: `evalpipe run`'s options as keywords (`n`, `k`, `seed`, `baseline`, `workers`,
        `agent_concurrency`, `max_cost`, ...: the fields of `tasks.run.RunConfig`).

    Bad input raises `InputError` (one line naming what is wrong) before any agent call. A
    blocked gate is in the summary (`summary.gate.decision`), not raised.
    """
    from service.run import Shell, execute
    from tasks.agents.python import CallableAgent
    from tasks.models import InputError
    from tasks.run import RunConfig, RunSummary
    from tasks.run.prepare import prepare_run

    started = time.perf_counter()
    with _machine() as machine:
        store = _store(home)
        ref = _suite_ref(suite, name, store)
        own = None if isinstance(agent, str) else CallableAgent.of(agent)
        config = RunConfig.build("evaluate", suite=ref, agent=agent if own is None else own.spec,
                                 environ=os.environ, **options)
        if own is not None and config.workspace:
            raise InputError("evaluate: workspace runs take a cmd: or python: agent spec, not a callable")
        _threads_only("evaluate", config)
        summary = execute(prepare_run(config, store, agent=own), config, store, Shell(progress=progress),
                          machine=machine, started=started)
    return RunSummary.read(summary.to_json())


def rescore(run_id: str, suite: SuiteLike, *, name: str = "suite",
            progress: Callable[[int, int], None] | None = None, home: str | os.PathLike | None = None,
            **options: Any):
    """`evalpipe rescore`: a new run of `suite` graded on the outputs stored by run `run_id`
    (id or unambiguous prefix), without calling its agent; cases it has no output for are
    `unscored`. `suite`, `name`, `progress` and `home` as for `evaluate`; `options`: the
    rescore's options (`workers`, `unsafe_no_sandbox`, `baseline` and the gate's rules:
    `min_pass_at_1`, `max_drop`, `max_new_failures`, `min_slice`, `metric`). Returns the
    `RunSummary`; a blocked gate is in `summary.gate`, not raised."""
    from service.run import Shell, execute
    from tasks.run import RunSummary
    from tasks.run.rescore import prepare_rescore

    started = time.perf_counter()
    with _machine() as machine:
        store = _store(home)
        prepared = prepare_rescore(run_id, store, **{"suite": _suite_ref(suite, name, store), **options})
        _threads_only("rescore", prepared.config)
        summary = execute(prepared.run, prepared.config, store, Shell(progress=progress), machine=machine,
                          started=started, rescoring=prepared.plan)
    return RunSummary.read(summary.to_json())


@contextmanager
def _machine() -> Iterator[MachineSettings]:
    """This machine's settings, read from the environment here, once a call, and entered for
    the call (its preparation included); the run carries them on (`service.run.execute`)."""
    from tasks.settings import MachineSettings, using

    machine = MachineSettings.from_environ(os.environ)
    with using(machine):
        yield machine


def _threads_only(command: str, config: Any) -> None:
    """`InputError` for a runner the API does not have (accepted and ignored, a Dask address
    would look used): it grades on this process's threads."""
    from tasks.models import InputError

    if config.runner != "threads" or config.dask_address:
        raise InputError(f"{command}: runner={config.runner!r}"
                         + (f", dask_address={config.dask_address!r}" if config.dask_address else "")
                         + ": the Python API grades on this process's threads; other runners are"
                           " `evalpipe run --runner`'s")


def _store(home: str | os.PathLike | None) -> Store:
    """The home's store (default: EVALPIPE_HOME's), checked before any work."""
    from storage.store import Store
    from tasks.home import hide_home

    store = Store.default()
    if home is not None:
        store = Store(home)
        hide_home(store.home)  # as EVALPIPE_HOME is: from the code graded in the sandbox
    store.db.check()
    return store


def _suite_ref(suite: SuiteLike, name: str, store: Store) -> str:
    """A reference `resolve_suite` takes: as given, or an in-memory suite's stored version."""
    if isinstance(suite, str | os.PathLike):
        return os.fspath(suite)
    from tasks.models import EvalCase, EvalSuite, InputError
    from tasks.suites.dataset import build_suite

    if isinstance(suite, EvalSuite):
        built = suite
    elif isinstance(suite, Sequence) and all(isinstance(c, EvalCase) for c in suite) and suite:
        built = EvalSuite(name=name, cases=tuple(suite))
    elif isinstance(suite, Sequence) and all(isinstance(c, Mapping) for c in suite):
        built = build_suite(name, [(f"case {i + 1}", dict(c)) for i, c in enumerate(suite)], {},
                            source=f"evaluate({name})")
    else:
        raise InputError("evaluate: suite must be a path, a git URL#PATH, a stored version, or a list of"
                         " EvalCase or dicts")
    if not store.snapshots.has(built):
        store.snapshots.save(built)
    return built.version

