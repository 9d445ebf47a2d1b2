"""Worker processes for the grading stage (`--runner processes`): each grading task's work
(`tasks.run.loop.GradeTask`) runs in a process of its own, so graders that spend CPU in
Python (a judge's parsing, a custom grader, the hand-off of each program to its sandbox)
take neither the run's process's CPU nor its GIL.

The workers are forked from a server process that imported the stages once (multiprocessing's
`forkserver`, its preload): a worker starts in milliseconds and costs no import, where a
fresh interpreter per worker imports Prefect and the stages (~1.4 s of CPU each). A worker
runs the plain task, never Prefect: the task run stays on a thread of the run's process,
which waits for its worker, so the UI and the loop see the same task runs as with threads.

The forkserver outlives a run (one per process), so each pool hands its workers the
environment of the process that made it (for the programs they start: PATH, the endpoints'
keys), never the one the server was started with. The run's settings are not taken from it:
each task carries them (`tasks.settings.MachineSettings`, the agent's and judges' settings). A worker that dies (killed, out of memory) breaks the pool:
the task's wait raises `BrokenProcessPool`, the run fails (exit 3) with every output it
drew stored, and the pool's end kills every worker left, one CPython started as it broke
included (a submit racing the breakage starts one that nothing would stop, and the pool's
own thread then waits on it forever: a run that lost a worker hung in about 1 of 15).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

# What a worker needs, imported once in the forkserver: the stages and the graders.
_PRELOAD = ["tasks.run.loop", "tasks.graders"]


@contextmanager
def worker_processes(workers: int) -> Iterator[Executor]:
    """A pool of `workers` processes for stage tasks, ended (its workers gone) on exit."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_adopt, initargs=(dict(os.environ),))
    ended = False
    try:
        yield pool
        ended = True
    finally:
        # Stopped or failed, the run does not wait for its graders (a program may have 600 s
        # left), and kills them. The dict is the pool's own: a worker started by a submit
        # that raced the breakage joins it, and `shutdown` returns only once no submit is
        # under way (it takes their lock), so none is missed.
        workers_left = getattr(pool, "_processes", None) or {}
        cut = not ended or bool(getattr(pool, "_broken", False))
        pool.shutdown(wait=not cut, cancel_futures=True)
        if cut:
            for worker in list(workers_left.values()):
                worker.kill()
                worker.join()


def run_in(pool: Executor | None, work: Callable[[], Any]) -> Any:
    """`work()` in a worker of `pool` (or here, without one), waiting for its result."""
    return work() if pool is None else pool.submit(work).result()


def _adopt(environ: Mapping[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
