"""How a command ends when it is stopped: Ctrl-C (SIGINT) and SIGTERM alike, exit 130 within
STOP_LIMIT_S whatever the runner (docs/storage.md, "Run status").

A signal raises `KeyboardInterrupt` (during a flow run Prefect's own SIGTERM handler raises
its `TerminationSignal` instead); the run loop then starts no new agent call, waits a
bounded time for the calls in flight and stores what they returned, and the run is recorded
`interrupted`. What can still hang after that (a thread inside a hung agent, which Python
joins at exit, a Dask cluster closing around a hung task) is cut short by `os._exit`:
everything bought is stored by then, or logged (storage/outputs.py), so nothing is lost.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

INTERRUPTED = 130  # a shell's status for a command stopped by Ctrl-C
INTERRUPTED_LINE = "evalpipe: interrupted; run the same command again to resume (finished samples are kept)"
STOP_LIMIT_S = 5.0
# Left for the way out once the loop has stored what it could (the flow's end, the runners'
# shutdown): past it, the process ends as it is.
EXIT_GRACE_S = 1.0

_lock = threading.RLock()  # a signal handler may call in while the main thread holds it
_timer: threading.Timer | None = None
_deadline = float("inf")


def stop_on_signals() -> Callable[[], None]:
    """SIGINT and SIGTERM raise `KeyboardInterrupt` and bound the time left to the process.
    Returns what puts back the handlers it found: a process that runs a command in-process
    (`make demo`, a test, a script calling `flows.cli.main`) keeps its own Ctrl-C after it."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set handlers (`main` called from a test's thread)
    found = {signum: signal.signal(signum, _stopped) for signum in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for signum, handler in found.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(signum, handler)

    return restore


def _stopped(signum, frame) -> None:
    ends_within(STOP_LIMIT_S - 1.0)  # the rest is for the exit itself on a loaded machine
    raise KeyboardInterrupt


@contextmanager
def bounded_under_prefect() -> Iterator[None]:
    """Inside a flow run, where Prefect's SIGTERM handler (raising its `TerminationSignal`)
    has replaced ours: a SIGTERM bounds the time left as ours does, then goes to Prefect's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prefects = signal.getsignal(signal.SIGTERM)
    if not callable(prefects) or prefects is _stopped:
        yield
        return

    def bounded(signum, frame) -> None:
        ends_within(STOP_LIMIT_S - 1.0)
        prefects(signum, frame)

    signal.signal(signal.SIGTERM, bounded)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is bounded:
            signal.signal(signal.SIGTERM, prefects)


def stop_requested() -> bool:
    """Whether this process was asked to stop (a signal bounded the time left to it)."""
    with _lock:
        return _deadline != float("inf")


def ends_within(seconds: float) -> None:
    """End the process (exit 130, the one line) `seconds` from now unless it ends first, or
    sooner if an earlier call said sooner."""
    global _timer, _deadline
    with _lock:
        deadline = time.monotonic() + seconds
        if deadline >= _deadline:
            return
        if _timer is not None:
            _timer.cancel()
        _deadline, _timer = deadline, threading.Timer(seconds, _exit)
        _timer.daemon = True
        _timer.start()


def _exit() -> None:
    try:
        sys.stderr.write(INTERRUPTED_LINE + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(INTERRUPTED)
