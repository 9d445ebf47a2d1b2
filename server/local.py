"""A Prefect server with its UI on 127.0.0.1: starting one, and `evalpipe server` in the
foreground (`make server`).

`start_server` launches `prefect server start` (server/busy_retry.py: a request that met its
SQLite database busy is retried in the server) on 127.0.0.1 in its own session and returns
once the API's health endpoint answers (never a fixed sleep).

The UI asks the API at `PREFECT_UI_API_URL`, which must name the chosen port whenever it
is not Prefect's default 4200, so it is always set in the server's environment.
"""

from __future__ import annotations

import base64
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from server import db_template
from server.reaper import guard
from tasks.models import InputError, PlatformError

HOST = "127.0.0.1"
DEFAULT_PORT = 4200
START_TIMEOUT_ENV = "EVALPIPE_SERVER_START_TIMEOUT"
# A Prefect server boots in 10-25 s on a loaded 2-core machine; Prefect's own default (20 s)
# is too short there. Its first start also creates its database, measured at 60-125 s there.
DEFAULT_START_TIMEOUT_S = 90.0
FIRST_START_FACTOR = 3
STOP_TIMEOUT_S = 20.0


def start_timeout(prefect_home: Path | None = None) -> float:
    """Seconds to wait for a Prefect server to answer: EVALPIPE_SERVER_START_TIMEOUT or 90;
    three times that for a server whose PREFECT_HOME has no database yet."""
    raw = os.environ.get(START_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_START_TIMEOUT_S
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise InputError(f"{START_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    first = prefect_home is not None and not (prefect_home / "prefect.db").exists()
    return value * FIRST_START_FACTOR if first else value


@dataclass(frozen=True)
class Server:
    process: subprocess.Popen
    url: str  # the UI; the API is under url + "/api"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_env(port: int, prefect_home: Path | None = None, base: dict[str, str] | None = None,
               auth: str | None = None) -> dict[str, str]:
    """The server's environment: its API and UI on `port`, no telemetry, no stray client URL,
    CORS for the UI's own origin only; with `auth` ("user:password"), credentials required."""
    env = dict(os.environ if base is None else base)
    # The server must not try to be a client of another one, nor take a client's credentials.
    for name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING"):
        env.pop(name, None)
    env |= {
        "PREFECT_SERVER_API_HOST": HOST,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_API_URL": f"http://{HOST}:{port}/api",
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": f"http://{HOST}:{port}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    }
    if auth is not None:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth
    if prefect_home is not None:
        env["PREFECT_HOME"] = str(prefect_home)
    return env


def healthy(api_url: str, auth: str | None = None) -> bool:
    """Whether the server at `api_url` answers; with `auth`, whether it takes those
    credentials too (another home's server on the same port answers its health check)."""
    url, headers = f"{api_url}/health", {}
    if auth is not None:
        url, headers = f"{api_url}/admin/version", {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(api_url: str, process: subprocess.Popen, timeout_s: float, auth: str | None = None) -> None:
    """Poll the server until it answers (with `auth`: to those credentials, so that a server
    another command started on the same port meanwhile is not taken for this one); fail
    early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    while not healthy(api_url, auth):
        if process.poll() is not None:
            raise PlatformError(f"the Prefect server exited with status {process.returncode} while starting")
        if time.monotonic() > deadline:
            raise PlatformError(
                f"the Prefect server at {api_url} did not answer within {timeout_s:g} s (allow longer with "
                f"{START_TIMEOUT_ENV}=SECONDS)"
            )
        time.sleep(0.2)


# `prefect server start`, run by the module that retries what met SQLite busy.
LAUNCHER = "server.busy_retry"


def start_server(
    port: int | None = None,
    *,
    prefect_home: Path | None = None,
    log: IO | None = None,
    timeout_s: float | None = None,
    auth: str | None = None,
) -> Server:
    """Start `prefect server start` in its own process group and wait until it is healthy.
    A PREFECT_HOME without a database first gets a copy of the template made once per
    Prefect (server/db_template.py). Output goes to `log` (default: discarded), so a
    caller's terminal or CI log stays clean. `auth`: the credentials its API requires (see
    `server_env`)."""
    port = port or free_port()
    if port_taken(port):
        raise InputError(f"--port {port}: something is already listening on {HOST}:{port}")
    env = server_env(port, prefect_home, auth=auth)
    home = prefect_home or user_prefect_home()
    if db_template.seed(home, env, log):  # a fresh home's database, copied rather than migrated
        env |= db_template.FIRST_START
    timeout_s = start_timeout(home) if timeout_s is None else timeout_s
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", LAUNCHER, "server", "start", "--host", HOST, "--port", str(port)],
        env=env, stdin=subprocess.DEVNULL,
        stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = Server(process, f"http://{HOST}:{port}")
    try:
        wait_healthy(server.api_url, process, timeout_s, auth)
    except BaseException:
        server.stop()
        raise
    return server


def user_prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


def serve(port: int = DEFAULT_PORT) -> str:
    """`evalpipe server`: start a server in the foreground, print its UI URL and how to point
    clients at it, block until Ctrl-C or SIGTERM, stop it; return the URL. Its output goes to
    $PREFECT_HOME/evalpipe-server.log (default ~/.prefect/)."""
    home = user_prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "evalpipe-server.log"
    with open(log_path, "ab") as log:
        server = start_server(port, log=log)
    guard(server.process.pid)  # even a kill -9 of this process takes the server with it
    print(f"Prefect UI: {server.url}")
    print(f"export PREFECT_API_URL={server.api_url}", flush=True)
    # The server has its own session, so Ctrl-C or a SIGTERM reaches only this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return server.url
