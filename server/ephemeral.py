"""Prefect's temporary ("ephemeral") server, which evalpipe starts itself rather than leaving it
to the first client call, so that it can wait long enough on a loaded machine, fail with a
message instead of a traceback, keep the server's output off the user's terminal, make
sure the server dies with the command even on kill -9, and require credentials: a random
auth string made for this process, as the managed server's (anything on the machine can
reach 127.0.0.1, and the API holds Secret blocks and Variables and can delete flow runs)."""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from server import db_template
from server.local import START_TIMEOUT_ENV, start_timeout
from server.reaper import guard
from tasks.models import PlatformError

# The credentials of the temporary server this process starts (`user:password`), made once:
# Prefect relaunches it on a port clash, and a later command in this process reuses it.
_AUTH = f"evalpipe:{secrets.token_urlsafe(32)}"


def start_temporary() -> tuple[str, bool, str | None]:
    """Start Prefect's ephemeral server (the same singleton its client would start) with our
    timeout, its output in PREFECT_HOME/evalpipe-ephemeral.log (beside its database: nothing
    is written to EVALPIPE_HOME for it), credentials, and a reaper.
    Returns (its API URL, whether this call started it, the credentials a client sends:
    None for a server this process did not start, which evalpipe cannot vouch for)."""
    import prefect.settings
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import (
        PREFECT_SERVER_API_AUTH_STRING,
        get_current_settings,
        temporary_settings,
    )

    prefect_home = get_current_settings().home
    server = SubprocessASGIServer()
    if server.running:
        return server.api_url, False, _AUTH if getattr(server, "_evalpipe_auth", False) else None
    prefect_home.mkdir(parents=True, exist_ok=True)
    log = prefect_home / "evalpipe-ephemeral.log"
    # A PREFECT_HOME's first temporary server copies the template when one was made (by a
    # managed server's start, or `make`), but builds none: on a CI runner, whose cache is as
    # new as its PREFECT_HOME, the build would cost more than the migration it replaces.
    with open(log, "ab") as out:
        seeded = db_template.seed(prefect_home, os.environ, out, build_missing=False)
    settings = {PREFECT_SERVER_API_AUTH_STRING: _AUTH}
    if seeded:  # the same settings as a managed server's first start on a seeded home
        settings |= {getattr(prefect.settings, name): value for name, value in db_template.FIRST_START.items()}
    timeout_s = start_timeout(prefect_home)
    launch = server._run_uvicorn_command

    def launch_guarded():
        # Prefect passes the current settings to the server it launches.
        with _output_to(log), temporary_settings(updates=settings):
            process = launch()
        guard(process.pid)
        return process

    # Prefect's launcher takes no stdio or pre-exec arguments; wrapping it (on this instance
    # only) is the one hook that covers its relaunch on a port clash as well.
    server._run_uvicorn_command = launch_guarded
    server._evalpipe_auth = True
    try:
        server.start(timeout=timeout_s)
    except Exception as exc:  # a timeout is a RuntimeError; a bad answer an httpx error
        process = server.server_process
        exited = process.poll() if process else None
        if process and exited is None:
            process.kill()  # a terminated server logs its interrupted startup; a killed one cannot
        server.stop()
        what = (f"exited with status {exited} while starting" if exited is not None
                else f"did not start within {timeout_s:g} s" if isinstance(exc, RuntimeError)
                else f"failed to start ({type(exc).__name__})")
        raise PlatformError(
            f"Prefect's temporary server {what} (its log: {log}): allow longer with "
            f"{START_TIMEOUT_ENV}=SECONDS, or run `evalpipe server start` once"
        ) from None
    return server.api_url, True, _AUTH


@contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Point this process's stdout and stderr at `path` while a child is spawned, so the child
    inherits the file rather than the user's terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        yield
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
