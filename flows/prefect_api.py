"""Which Prefect API a flow-running command talks to, and Prefect's failures as one line.

In order of preference:
1. `PREFECT_API_URL`, when configured: checked reachable before any work starts.
2. The server evalpipe manages for this EVALPIPE_HOME (`evalpipe server start`), when up:
   a run then starts in ~4 s instead of ~12 s, and its flow run URL is printed.
3. Prefect's ephemeral server, which this module starts itself rather than leaving it to
   the first client call, so that it can wait long enough on a loaded machine, fail with a
   message instead of a traceback, keep the server's output off the user's terminal, and
   make sure the server dies with this process even on kill -9.
A platform failure is a `PlatformError` (exit 3).
"""

from __future__ import annotations

import logging
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from flows import server as local
from flows.reaper import guard
from tasks.models import PlatformError

FASTER = "`evalpipe server start` keeps a local server up and makes runs start about 3x faster"
RESUME = "run the command again (a run resumes from the samples it had stored)"


def quiet_prefect() -> None:
    # Prefect logs every task run at INFO; on a terminal the progress bar says it better.
    # Without network, the telemetry of a server started from here would log errors.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")


@contextmanager
def prefect_api(json_mode: bool = False) -> Iterator[Callable[[Any], Any]]:
    """Connect this process to a Prefect API for the block's flow runs. Yields `watch`:
    `watch(flow)` is the flow, made to print its run's UI URL on stderr when a UI serves it
    (not in JSON mode, whose stdout is one document and stderr stays quiet)."""
    local.start_timeout()  # a bad value is bad input, refused before Prefect is imported
    quiet_prefect()
    logging.disable(logging.NOTSET)  # undo a previous command's exit silence (flows.demo runs several)
    api_url = _configured_api()
    managed = None if api_url else local.running()
    hint = f"this command started a temporary Prefect server; {FASTER}"
    if managed is not None and not local.healthy(managed.api_url):
        hint = (f"the evalpipe server at {managed.url} (pid {managed.pid}) is not answering, so this "
                "command started a temporary one; `evalpipe server stop` then `start` renews it")
        managed = None
    if managed is not None:
        api_url = managed.api_url
        # Worker processes (runner=processes, dask) read the environment.
        os.environ["PREFECT_API_URL"] = api_url
        os.environ["PREFECT_API_AUTH_STRING"] = managed.auth
    elif api_url:
        _check_reachable(api_url)
    else:
        api_url, started = _start_ephemeral()
        if started and not json_mode:  # after the start, so that a failure to start stays one line
            print(f"evalpipe: {hint}", file=sys.stderr, flush=True)

    import httpx
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    settings = (temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: managed.auth})
                if managed else nullcontext())
    try:
        with settings:
            yield (lambda flow: flow) if json_mode else _announcing
    except httpx.TransportError as exc:
        if local.healthy(api_url):
            raise  # not Prefect's API: let the caller's own error handling see it
        raise PlatformError(f"lost the Prefect API at {api_url} ({type(exc).__name__}): {RESUME}") from None
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code < 500:
            raise
        # Prefect's client has already retried; a 503 is its SQLite database busy past the wait.
        raise PlatformError(f"the Prefect API at {api_url} kept failing (HTTP {exc.response.status_code}):"
                            f" {RESUME}") from None
    finally:
        if managed is not None:
            os.environ.pop("PREFECT_API_URL", None)
            os.environ.pop("PREFECT_API_AUTH_STRING", None)
        # Work done: what Prefect's background services log while they drain at interpreter
        # exit (events flushed to a server that is stopping) is not the user's business.
        logging.disable(logging.CRITICAL)


def _configured_api() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def _check_reachable(api_url: str) -> None:
    """Any HTTP answer is enough (Prefect Cloud answers /health differently); no answer is not."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=10):
            return
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PlatformError(
            f"the Prefect API at {api_url} (PREFECT_API_URL) is unreachable ({reason}): start that "
            "server, or unset PREFECT_API_URL to use a local one"
        ) from None


def _announcing(flow: Any) -> Any:
    def announce(flow, flow_run, state) -> None:
        from prefect.utilities.urls import url_for

        if url := url_for(flow_run):
            print(f"evalpipe: flow run {url}", file=sys.stderr, flush=True)

    return flow.with_options(on_running=[*flow.on_running_hooks, announce])


def _start_ephemeral() -> tuple[str, bool]:
    """Start Prefect's ephemeral server (the same singleton its client would start) with our
    timeout, its output in PREFECT_HOME/evalpipe-ephemeral.log (beside its database: nothing
    is written to EVALPIPE_HOME for it), and a reaper.
    Returns (its API URL, whether this call started it)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    prefect_home = get_current_settings().home
    timeout_s = local.start_timeout(prefect_home)
    server = SubprocessASGIServer()
    if server.running:
        return server.api_url, False
    prefect_home.mkdir(parents=True, exist_ok=True)
    log = prefect_home / "evalpipe-ephemeral.log"
    launch = server._run_uvicorn_command

    def launch_guarded():
        with _output_to(log):
            process = launch()
        guard(process.pid)
        return process

    # Prefect's launcher takes no stdio or pre-exec arguments; wrapping it (on this instance
    # only) is the one hook that covers its relaunch on a port clash as well.
    server._run_uvicorn_command = launch_guarded
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
            f"{local.START_TIMEOUT_ENV}=SECONDS, or run `evalpipe server start` once"
        ) from None
    return server.api_url, True


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
