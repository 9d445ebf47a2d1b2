"""The Prefect task runners a run's stages run on, their workers pointed at the flow run's API."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

from tasks.run.config import Runner


@contextmanager
def task_runner(runner: Runner, workers: int, dask_address: str | None) -> Iterator[TaskRunner]:
    """The started task runner, its worker processes pointed at this process's API."""
    with _api_for_workers(runner), _make(runner, workers, dask_address) as started:
        yield started


def _make(runner: Runner, workers: int, dask_address: str | None) -> TaskRunner:
    if runner == "threads":
        return ThreadPoolTaskRunner(max_workers=workers)
    if runner == "processes":
        return _ProcessPool(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    # TLS with credentials made for this cluster alone (`security=True`: a CA and a
    # certificate, in memory): the scheduler listens on 127.0.0.1, where any local process,
    # a sandboxed agent's included, could otherwise connect and run code on the workers.
    return DaskTaskRunner(
        cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "dashboard_address": None, "security": True}
    )


class _ProcessPool(ProcessPoolTaskRunner):
    """Prefect's process pool, whose shutdown cannot hang once a worker died.

    A dead worker breaks CPython's pool (3.11): its manager thread terminates the other
    workers, then joins them. A task submitted at that moment (Prefect submits from threads of
    its own) may pass the pool's check before it is marked broken and start a worker after the
    terminations: that one is never terminated nor told to stop, and the join waits on it
    forever (2 runs in 20 that lost a worker hung). So the shutdown of a broken pool first
    lets the submissions in flight end, then kills every worker left. (The attributes read are
    Prefect's and CPython's own: where a version lacks them, the shutdown is theirs as it was.)"""

    def __exit__(self, *exc_info: object) -> None:
        pool, submitting = getattr(self, "_executor", None), getattr(self, "_resolver_executor", None)
        if pool is not None and getattr(pool, "_broken", False):
            if submitting is not None:
                submitting.shutdown(wait=True, cancel_futures=True)
            for worker in list((getattr(pool, "_processes", None) or {}).values()):
                worker.kill()
        super().__exit__(*exc_info)


@contextmanager
def _api_for_workers(runner: Runner) -> Iterator[None]:
    """Worker processes, and the thread that forwards their events to the server, talk to
    the server holding the flow run. The processes read the environment (without a URL, each
    would boot a server of its own); the forwarding thread reads Prefect's global settings,
    not the caller's context, and without this it recorded the task runs on another
    database (thousands of `FOREIGN KEY constraint failed` tracebacks, task runs missing)."""
    import prefect.context
    from prefect.settings import get_current_settings

    if runner == "threads":
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
