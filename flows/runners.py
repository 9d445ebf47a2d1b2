"""The Prefect task runner a run's sampling tasks are mapped over, and the mapping."""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar

from prefect import Task
from prefect.futures import PrefectWrappedFuture
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

Runner = Literal["threads", "processes", "dask"]
Item = TypeVar("Item")


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


class Mapped(Generic[Item]):
    """`task` mapped over a started task runner: one task run per item, submitted whenever,
    taken as they finish (`finished`).

    Leaving the block on an exception (a task run that failed, or the caller's own) winds the
    task runs down before the runner is stopped: those not started are cancelled, so they
    never run and leave no record, and the started ones end as they would have. Left in
    flight, the runner's own stop would cancel them all, and one that a worker was just
    picking up would be recorded, and logged, as crashed: a consequence of the failure
    reported, not news of its own.
    """

    def __init__(self, runner: TaskRunner, task: Task[..., Any], params: Callable[[Item], dict[str, Any]]) -> None:
        self._runner, self._task, self._params = runner, task, params
        self._running: set[PrefectWrappedFuture] = set()
        self._finished: queue.SimpleQueue[tuple[Item, PrefectWrappedFuture]] = queue.SimpleQueue()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def submit(self, item: Item) -> None:
        future = self._runner.submit(self._task, self._params(item))
        self._running.add(future)
        future.add_done_callback(lambda f: self._finished.put((item, f)))

    def finished(self) -> list[tuple[Item, Any]]:
        """Wait for a task run to finish: the item and result of each one finished by then
        (a failed one raises its exception)."""
        ready = [self._finished.get()]
        while not self._finished.empty():
            ready.append(self._finished.get())
        self._running.difference_update(future for _, future in ready)
        return [(item, future.result()) for item, future in ready]

    def __enter__(self) -> Mapped[Item]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if exc_type is None:
            return
        # cancel() is False for a task run already started (a Dask future's is None: waiting
        # on it returns at once once it is cancelled).
        started = [f for f in self._running if not f.wrapped_future.cancel()]
        for future in started:
            future.wait()
