"""Waiting on a condition, not for a time: a test that slept a fixed time either waited
longer than it needed, or (on a loaded machine) not long enough."""

from __future__ import annotations

import socketserver
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, *, timeout_s: float = 120.0,
               proc: subprocess.Popen | None = None, every_s: float = 0.02) -> T:
    """`condition()`'s first true value, asked every `every_s` seconds. Fails naming `what`
    once `timeout_s` have passed (a hang guard, not a speed limit), or at once if `proc`, the
    process that should bring it about, has ended (with what it wrote, if it was piped)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"{what}: the process ended first (exit {proc.returncode})\n{out or ''}{err or ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)
    return value


# How long a server's shutdown() may wait: serve_forever checks for it once per poll, by
# default every 0.5 s, which made every test's stop of a local server a half-second wait.
SHUTDOWN_POLL_S = 0.02


def serve_in_background(server: socketserver.BaseServer) -> threading.Thread:
    """Serve `server` from a daemon thread until its shutdown(), which then returns within
    SHUTDOWN_POLL_S."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S}, daemon=True)
    thread.start()
    return thread
