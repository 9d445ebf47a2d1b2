"""A local Prefect server with its UI, for deployments, workers and a shared run history.

`start_server` launches `prefect server start` on 127.0.0.1 and returns once the API's
health endpoint answers (never a fixed sleep); `serve` is the `evalpipe server` command.
The UI asks the API at `PREFECT_UI_API_URL`, which must name the chosen port whenever it
is not Prefect's default 4200, so it is always set in the server's environment.
"""

from __future__ import annotations

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

from tasks.models import InputError

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Server:
    process: subprocess.Popen
    url: str  # the UI; the API is under url + "/api"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def stop(self, timeout_s: float = 20.0) -> None:
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


def server_env(port: int, prefect_home: Path | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: its API and UI on `port`, no telemetry, no stray client URL."""
    env = dict(os.environ if base is None else base)
    env.pop("PREFECT_API_URL", None)  # the server must not try to be a client of another one
    env |= {
        "PREFECT_SERVER_API_HOST": HOST,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_API_URL": f"http://{HOST}:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    }
    if prefect_home is not None:
        env["PREFECT_HOME"] = str(prefect_home)
    return env


def healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(api_url: str, process: subprocess.Popen, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Poll the health endpoint until it answers; fail early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    while not healthy(api_url):
        if process.poll() is not None:
            raise RuntimeError(f"prefect server exited with status {process.returncode} before it was healthy")
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefect server at {api_url} not healthy after {timeout_s:.0f}s")
        time.sleep(0.2)


def start_server(
    port: int | None = None,
    *,
    prefect_home: Path | None = None,
    log: IO | None = None,
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> Server:
    """Start `prefect server start` in its own process group and wait until it is healthy.
    Output goes to `log` (default: discarded), so a caller's terminal or CI log stays clean."""
    port = port or free_port()
    if _port_taken(port):
        raise InputError(f"--port {port}: something is already listening on {HOST}:{port}")
    prefect = Path(sys.executable).with_name("prefect")
    process = subprocess.Popen(
        [str(prefect), "server", "start", "--host", HOST, "--port", str(port)],
        env=server_env(port, prefect_home), stdin=subprocess.DEVNULL,
        stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = Server(process, f"http://{HOST}:{port}")
    try:
        wait_healthy(server.api_url, process, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


def serve(port: int = 4200, background: bool = False) -> str:
    """Start a local server, print its UI URL and how to point clients at it; return the URL.
    In the foreground, block until Ctrl-C and stop the server; in the background, leave it
    running (its output in $PREFECT_HOME/evalpipe-server.log) and print its pid."""
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "evalpipe-server.log"
    with open(log_path, "ab") as log:
        server = start_server(port, log=log)
    print(f"Prefect UI: {server.url}")
    print(f"export PREFECT_API_URL={server.api_url}", flush=True)
    if background:
        print(f"server pid {server.process.pid}; log {log_path}", flush=True)
        return server.url
    # The server has its own session, so Ctrl-C or a SIGTERM reaches only this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return server.url
