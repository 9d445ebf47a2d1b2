"""Which Prefect API a flow-running command talks to, and Prefect's failures as one line.

In order of preference:
1. `PREFECT_API_URL`, when configured: checked reachable before any work starts.
2. The server evalpipe manages for this EVALPIPE_HOME (server/managed.py): started in the
   background by the first command that needs it, announced in one line, reused by every
   later one (a run then starts in ~4 s instead of ~12 s), stopped when idle. With
   EVALPIPE_SERVER=temporary, or where `CI` is set, it is used only when already up.
3. Prefect's temporary server (server/ephemeral.py), started for this command alone.
A platform failure is a `PlatformError` (exit 3).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from server import local, managed
from server.ephemeral import start_temporary
from tasks.models import PlatformError

FASTER = "a local server kept up (`evalpipe server start`) makes runs start about 3x faster"
RESUME = "run the command again (a run resumes from the samples it had stored)"


# Loading Prefect, pydantic and the stages makes about a million objects that live as long as
# the command; the collector's default pace (a pass every 700 allocations, each older pass
# walking all of them) spends ~0.2 s of a command's start on them. A command starts at a slow
# pace (`loading_heap`) and, once Prefect is loaded, freezes what it made and goes back to the
# default pace (`settled_heap`) for the run's own garbage, but for the full passes: a run's
# plan (tens of thousands of samples) lives as long as it does, and a full pass every 10th
# older one walked it 3-4 times on 20,000 samples (~0.15 s, 8 us a sample); every 100th.
_DEFAULT_GC = gc.get_threshold()
_LOADING_GC = 100_000
_RUN_FULL_PASS = 100


def loading_heap() -> None:
    gc.set_threshold(_LOADING_GC, *_DEFAULT_GC[1:])


def settled_heap() -> None:
    gc.freeze()
    gc.set_threshold(*_DEFAULT_GC[:2], max(_DEFAULT_GC[2], _RUN_FULL_PASS))


def quiet_prefect() -> None:
    # Prefect logs every task run at INFO; on a terminal the progress bar says it better, so
    # the console shows warnings only. The flow run's own log (its start, progress, headline
    # figures and gate decision) still reaches the API at INFO: the UI's Logs tab shows it.
    # Without network, the telemetry of a server started from here would log errors.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")


@contextmanager
def prefect_api(json_mode: bool = False) -> Iterator[Callable[[Any], Any]]:
    """Connect this process to a Prefect API for the block's flow runs. Yields `watch`:
    `watch(flow)` is the flow, made to print its run's UI URL on stderr when a UI serves it
    (not in JSON mode, whose stdout is one document and stderr stays quiet)."""
    # Bad settings are bad input, refused before Prefect is imported.
    local.start_timeout()
    server_mode, idle_s = managed.mode(), managed.idle_timeout()
    quiet_prefect()
    logging.disable(logging.NOTSET)  # undo a previous command's exit silence (flows.demo runs several)
    # Importing Prefect takes ~2 s, and a server ~6 s to start: when nothing can name an API
    # but the managed server is to be used, the import runs beside its start.
    importing = (_in_background(_configured_api)
                 if server_mode == "managed" and not _may_name_an_api() else None)
    api_url = None if importing else _configured_api()
    use = nullcontext(None) if api_url else managed.used(start=server_mode == "managed", idle_s=idle_s)
    with use as found:
        if importing is not None:
            api_url = importing()  # a setting it could not see before the import still wins
        server = found.server if found and not api_url else None
        temporary_auth = None
        if server is not None:
            api_url = server.api_url
            if found.started:
                print(f"evalpipe: {_started_line(server)}", file=sys.stderr, flush=True)
        elif api_url:
            _check_reachable(api_url)
        else:
            api_url, started, temporary_auth = start_temporary()
            if started and not json_mode:  # after the start, so that a failure to start stays one line
                hint = (f"the evalpipe server at {found.hung.url} (pid {found.hung.pid}) is not answering, so this"
                        " command started a temporary one; `evalpipe server stop` then `start` renews it"
                        if found.hung else f"this command started a temporary Prefect server; {FASTER}")
                print(f"evalpipe: {hint}", file=sys.stderr, flush=True)
        with _connected(api_url, server, json_mode, temporary_auth) as watch:
            settled_heap()
            yield watch


def _may_name_an_api() -> bool:
    """Whether Prefect's settings might name an API, told without importing Prefect: its
    environment variables, the profiles file, a prefect.toml, a .env or a pyproject.toml
    that mention it. It errs on yes (then the import comes first, as before)."""
    if any(name in os.environ for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH")):
        return True
    prefect_home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")
    for path, mark in ((prefect_home / "profiles.toml", "PREFECT_API_URL"), (Path("prefect.toml"), ""),
                       (Path(".env"), "PREFECT_"), (Path("pyproject.toml"), "tool.prefect")):
        try:
            if mark in path.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def _in_background(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Start `fn` in a thread; the returned call waits for its result (or raises its error)."""
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the waiting caller
            outcome["error"] = exc

    thread = threading.Thread(target=work, name="evalpipe-import-prefect", daemon=True)
    thread.start()

    def result() -> Any:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return result


def _started_line(server: managed.Managed) -> str:
    s = server.idle_s
    idle = (f"it stops after {s / 60:g} min unused" if s and s >= 120 else f"it stops after {s:g} s unused" if s
            else "it runs until stopped")
    return (f"started a local Prefect server for this EVALPIPE_HOME, UI {server.ui_url} (login: "
            f"{managed.credentials_path(server.directory)}); later commands reuse it, {idle}, "
            "`evalpipe server stop` stops it now")


@contextmanager
def _connected(api_url: str, server: managed.Managed | None, json_mode: bool,
               temporary_auth: str | None = None) -> Iterator[Callable[[Any], Any]]:
    """Point this process's Prefect client at `api_url` (with the managed server's
    credentials, or the temporary server's) and turn Prefect's platform failures into one line."""
    if server is not None:
        # Worker processes (runner=processes, dask) read the environment.
        os.environ["PREFECT_API_URL"] = api_url
        os.environ["PREFECT_API_AUTH_STRING"] = server.auth
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_UI_URL,
        temporary_settings,
    )

    # No flow run heartbeats from a command: the engine joins their thread, which sleeps in
    # 1 s steps, at the end of every flow run (0.5 s a run on average), and a run whose
    # process dies is found `interrupted` by evalpipe itself. Workers keep Prefect's default.
    updates: dict[Any, Any] = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    if server is not None:  # its flow run links go to the UI whose login page shows no errors
        updates |= {PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: server.auth, PREFECT_UI_URL: server.ui_url}
    elif temporary_auth is not None:  # its URL stays unset: Prefect's client knows the temporary server
        updates |= {PREFECT_API_AUTH_STRING: temporary_auth}
    try:
        with temporary_settings(updates=updates):
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
        if server is not None:
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
