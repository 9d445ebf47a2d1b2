"""The Prefect task runner a run's sampling tasks are mapped over."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

Runner = Literal["threads", "processes", "dask"]


@contextmanager
def task_runner(runner: Runner, workers: int, dask_address: str | None) -> Iterator[TaskRunner]:
    """The started task runner, its worker processes pointed at this process's API."""
    with _api_for_workers(runner), _make(runner, workers, dask_address) as started:
        yield started


def _make(runner: Runner, workers: int, dask_address: str | None) -> TaskRunner:
    if runner == "threads":
        return ThreadPoolTaskRunner(max_workers=workers)
    if runner == "processes":
        return ProcessPoolTaskRunner(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    return DaskTaskRunner(
        cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "dashboard_address": None}
    )


@contextmanager
def _api_for_workers(runner: Runner) -> Iterator[None]:
    """Worker processes of an ephemeral-mode run must talk to this process's temporary
    server; without a URL each would boot a server of its own."""
    from prefect.settings import get_current_settings

    if runner == "threads" or get_current_settings().api.url:
        yield
        return
    from prefect.server.api.server import SubprocessASGIServer

    os.environ["PREFECT_API_URL"] = SubprocessASGIServer().api_url
    try:
        yield
    finally:
        os.environ.pop("PREFECT_API_URL", None)
