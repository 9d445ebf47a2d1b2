"""The Prefect task runners a run's stages run on, their workers pointed at the flow run's API."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from tasks.run.config import Runner


@contextmanager
def task_runner(runner: Runner, workers: int, dask_address: str | None) -> Iterator[TaskRunner]:
    """The started task runner, its worker processes pointed at this process's API."""
    with _api_for_workers(runner), _make(runner, workers, dask_address) as started:
        yield started


def _make(runner: Runner, workers: int, dask_address: str | None) -> TaskRunner:
    if runner != "dask":  # processes: the task runs on a thread, its work in a worker (tasks.run.workers)
        return ThreadPoolTaskRunner(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    # TLS with credentials made for this cluster alone (`security=True`: a CA and a
    # certificate, in memory): the scheduler listens on 127.0.0.1, where any local process,
    # a sandboxed agent's included, could otherwise connect and run code on the workers.
    # Its scheduler serves HTTP (health, metrics) even with no dashboard: on a free port, not
    # Dask's 8787, which a second run at once found taken (a warning on its output).
    return DaskTaskRunner(cluster_kwargs={
        "n_workers": workers, "threads_per_worker": 1, "security": True,
        "dashboard_address": "127.0.0.1:0", "scheduler_kwargs": {"dashboard": False},
    })


@contextmanager
def _api_for_workers(runner: Runner) -> Iterator[None]:
    """A Dask cluster's workers run Prefect's task engine and talk to the server holding the
    flow run. Worker processes read the environment (without a URL, each would boot a
    server of its own), and Prefect's threads read its global settings, not the caller's
    context: without this, task runs were recorded on another database (thousands of
    `FOREIGN KEY constraint failed` tracebacks, task runs missing). Threads and the
    processes runner's workers (`tasks.run.workers`, no Prefect) need neither."""
    import prefect.context
    from prefect.settings import get_current_settings

    if runner != "dask":
        yield
        return
    api = get_current_settings().api
    if api.url:
        url = api.url
    else:  # ephemeral mode: the temporary server this process started
        from prefect.server.api.server import SubprocessASGIServer

        url = SubprocessASGIServer().api_url
    wanted = {"PREFECT_API_URL": url,
              "PREFECT_API_AUTH_STRING": api.auth_string.get_secret_value() if api.auth_string else None}
    saved = {name: os.environ.get(name) for name in wanted}, prefect.context.GLOBAL_SETTINGS_CONTEXT
    _set_environ(wanted)
    prefect.context.refresh_global_settings_context()
    try:
        yield
    finally:  # as it was: a later command in this process chooses its API afresh
        _set_environ(saved[0])
        prefect.context.GLOBAL_SETTINGS_CONTEXT = saved[1]


def _set_environ(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
