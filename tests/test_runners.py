"""Tasks mapped over a task runner (`flows.runners.Mapped`): results as the task runs finish,
and a failed mapping wound down before its runner stops, so that the runner has no task run
left to cancel (one it cancels as a worker picks it up is recorded, and logged, as crashed)."""

from __future__ import annotations

import time

import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.runners import Mapped, task_runner
from tasks.models import PlatformError

STARTED: list[int] = []


@task(name="step", cache_policy=NO_CACHE, persist_result=False)
def step(i: int, fail: int | None = None) -> int:
    STARTED.append(i)
    time.sleep(0.02)
    if i == fail:
        raise PlatformError(f"the machine failed at {i}")
    return 2 * i


class Recorded:
    """A started task runner whose submitted futures the test can look at."""

    def __init__(self, runner) -> None:
        self.runner, self.futures = runner, []

    def submit(self, task, parameters):
        future = self.runner.submit(task, parameters)
        self.futures.append(future)
        return future


@flow(persist_result=False)
def mapping(items: int) -> list[tuple[int, int]]:
    got = []
    with task_runner("threads", 2, None) as runner, Mapped(runner, step, lambda i: {"i": i}) as mapped:
        for i in range(items):
            mapped.submit(i)
        while mapped.in_flight:
            got += mapped.finished()
    return got


@flow(persist_result=False)
def failed_mapping(items: int, fail: int) -> dict[str, int]:
    STARTED.clear()
    with task_runner("threads", 2, None) as runner:
        recorded = Recorded(runner)
        with pytest.raises(PlatformError, match=f"failed at {fail}"), \
                Mapped(recorded, step, lambda i: {"i": i, "fail": fail}) as mapped:
            for i in range(items):
                mapped.submit(i)
            while mapped.in_flight:
                mapped.finished()
        # Each task run either never started (cancelled before a worker took it) or ended on
        # its own: none is left in flight for the runner's stop to cancel.
        assert all(f.wrapped_future.done() for f in recorded.futures)
        ran = [f for f in recorded.futures if not f.wrapped_future.cancelled()]
        assert len(ran) == len(STARTED) < items
        assert sorted(f.state.type.value for f in ran) == ["COMPLETED"] * (len(ran) - 1) + ["FAILED"]
        started = len(STARTED)
    assert len(STARTED) == started  # stopping the runner started nothing more
    return {"started": started}


def test_results_come_back_as_the_task_runs_finish(prefect_harness):
    assert sorted(mapping(6)) == [(i, 2 * i) for i in range(6)]


def test_a_failed_mapping_leaves_no_task_run_for_the_runner_to_cancel(prefect_harness):
    assert 3 < failed_mapping(40, 3)["started"] < 40


def test_worker_processes_get_the_callers_api_and_the_process_gets_its_settings_back(monkeypatch):
    """Process and Dask workers, and the thread forwarding their events, read the
    environment and Prefect's global settings, not the caller's context: both name the
    caller's API for the mapping, and are as they were after it."""
    import os

    import prefect.context
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.runners import _api_for_workers

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    before = prefect.context.GLOBAL_SETTINGS_CONTEXT
    api = {PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_API_AUTH_STRING: "evalpipe:secret"}
    with temporary_settings(updates=api), _api_for_workers("processes"):
        assert (os.environ["PREFECT_API_URL"], os.environ["PREFECT_API_AUTH_STRING"]) == (
            "http://127.0.0.1:9/api", "evalpipe:secret")
        assert prefect.context.GLOBAL_SETTINGS_CONTEXT.settings.api.url == "http://127.0.0.1:9/api"
    assert prefect.context.GLOBAL_SETTINGS_CONTEXT is before
    assert "PREFECT_API_URL" not in os.environ and "PREFECT_API_AUTH_STRING" not in os.environ
