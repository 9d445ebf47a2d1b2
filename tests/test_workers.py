"""The processes runner's workers (`tasks.run.workers`): forked from a warm server, they run a
stage's plain work in the run's environment, and a killed one fails the tasks waiting on it
and leaves no process behind."""

from __future__ import annotations

import os
import signal
from concurrent.futures.process import BrokenProcessPool

import pytest

from tasks.run.workers import run_in, worker_processes


def _environ_and_pid() -> tuple[str | None, int]:
    return os.environ.get("EVALPIPE_TEST_MARK"), os.getpid()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_each_pool_s_workers_take_the_environment_of_the_run_that_made_it(monkeypatch):
    """The forkserver is started once per process, with the environment of its first run;
    a later run's workers must see the later run's (its EVALPIPE_HOME, its sandbox's settings)."""
    monkeypatch.setenv("EVALPIPE_TEST_MARK", "first")
    with worker_processes(1) as pool:
        first, worker = run_in(pool, _environ_and_pid)
    monkeypatch.setenv("EVALPIPE_TEST_MARK", "second")
    with worker_processes(2) as pool:
        second, other = run_in(pool, _environ_and_pid)
    assert (first, second) == ("first", "second")
    assert os.getpid() not in (worker, other) and not _alive(worker) and not _alive(other)
    assert run_in(None, _environ_and_pid) == ("second", os.getpid())  # no pool: here


def test_a_killed_worker_fails_what_waits_on_it_and_leaves_no_worker_behind():
    with pytest.raises(BrokenProcessPool):  # noqa: PT012 - the pool's end is part of it
        with worker_processes(2) as pool:
            _, survivor = run_in(pool, _environ_and_pid)
            run_in(pool, _die)
    assert not _alive(survivor)
