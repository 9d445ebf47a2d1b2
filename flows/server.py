"""A local Prefect server with its UI: the one evalpipe manages, and `evalpipe server`.

`start_server` launches `prefect server start` on 127.0.0.1 in its own session and returns
once the API's health endpoint answers (never a fixed sleep).

The managed server (`evalpipe server start|stop|status`) belongs to an EVALPIPE_HOME and
keeps everything under EVALPIPE_HOME/server/: `server.json` (its pid and port), `server.log`,
and `prefect/`, its PREFECT_HOME, so its database never fights with the user's ~/.prefect.
Flow-running commands use it while it is up (flows/prefect_api.py).

The UI asks the API at `PREFECT_UI_API_URL`, which must name the chosen port whenever it
is not Prefect's default 4200, so it is always set in the server's environment.

The managed server requires credentials (Prefect's `PREFECT_SERVER_API_AUTH_STRING`): a
deployment's run form runs code, so anyone who can reach the port must not be able to
start a run. They are generated once into EVALPIPE_HOME/server/credentials (mode 0600);
evalpipe's commands send them, the UI asks for them. CORS is limited to the UI's own origin.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from flows.reaper import guard
from storage import evalpipe_home
from tasks.files import atomic_write
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


def healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(api_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Poll the health endpoint until it answers; fail early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    while not healthy(api_url):
        if process.poll() is not None:
            raise PlatformError(f"the Prefect server exited with status {process.returncode} while starting")
        if time.monotonic() > deadline:
            raise PlatformError(
                f"the Prefect server at {api_url} did not answer within {timeout_s:g} s (allow longer with "
                f"{START_TIMEOUT_ENV}=SECONDS)"
            )
        time.sleep(0.2)


def start_server(
    port: int | None = None,
    *,
    prefect_home: Path | None = None,
    log: IO | None = None,
    timeout_s: float | None = None,
    auth: str | None = None,
) -> Server:
    """Start `prefect server start` in its own process group and wait until it is healthy.
    Output goes to `log` (default: discarded), so a caller's terminal or CI log stays clean.
    `auth`: the credentials its API requires (see `server_env`)."""
    port = port or free_port()
    if _port_taken(port):
        raise InputError(f"--port {port}: something is already listening on {HOST}:{port}")
    prefect = Path(sys.executable).with_name("prefect")
    process = subprocess.Popen(
        [str(prefect), "server", "start", "--host", HOST, "--port", str(port)],
        env=server_env(port, prefect_home, auth=auth), stdin=subprocess.DEVNULL,
        stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = Server(process, f"http://{HOST}:{port}")
    try:
        timeout_s = start_timeout(prefect_home or user_prefect_home()) if timeout_s is None else timeout_s
        wait_healthy(server.api_url, process, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def user_prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")


def _port_taken(port: int) -> bool:
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


# --- the managed server ---------------------------------------------------------------------


@dataclass(frozen=True)
class Managed:
    """The server evalpipe started in the background for one EVALPIPE_HOME."""

    pid: int
    port: int
    directory: Path  # EVALPIPE_HOME/server

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    @property
    def auth(self) -> str:
        """The credentials its API requires (`user:password`)."""
        return credentials(self.directory)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "port": self.port, "url": self.url, "api_url": self.api_url,
                "log": str(log_path(self.directory)), "prefect_home": str(self.directory / "prefect"),
                "credentials": str(credentials_path(self.directory))}


def state_dir(home: Path | None = None) -> Path:
    return (home or evalpipe_home()) / "server"


def log_path(directory: Path) -> Path:
    return directory / "server.log"


def credentials_path(directory: Path) -> Path:
    return directory / "credentials"


def credentials(directory: Path) -> str:
    """The managed server's credentials, `evalpipe:<random>`, made once (mode 0600: only
    this user may start runs through it)."""
    path = credentials_path(directory)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    auth = f"evalpipe:{secrets.token_urlsafe(32)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # made meanwhile by another command
        return path.read_text().strip()
    with os.fdopen(fd, "w") as fh:
        fh.write(auth + "\n")
    return auth


def _state_file(directory: Path) -> Path:
    return directory / "server.json"


def lookup(home: Path | None = None) -> tuple[Managed | None, Managed | None]:
    """(the managed server if its process is alive, a stale record whose process is gone).
    A stale record is removed, so it is reported once."""
    directory = state_dir(home)
    path = _state_file(directory)
    try:
        doc = json.loads(path.read_text())
        server = Managed(int(doc["pid"]), int(doc["port"]), directory)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, KeyError, TypeError):
        path.unlink(missing_ok=True)  # torn or foreign: nothing to trust in it
        return None, None
    if _is_prefect_process(server.pid):
        return server, None
    path.unlink(missing_ok=True)
    return None, server


def running(home: Path | None = None) -> Managed | None:
    return lookup(home)[0]


def _is_prefect_process(pid: int) -> bool:
    """Alive (not a zombie) and a Prefect server: a recycled pid is someone else's process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X") and b"prefect" in cmdline


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One start or stop at a time per EVALPIPE_HOME: two `start`s must not both launch."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def start_managed(port: int | None = None, home: Path | None = None) -> tuple[Managed, bool]:
    """Start the managed server in the background and wait until it answers.
    Returns (server, started): `started` is False when it was already running. Without a
    port it takes 4200, or a free port when 4200 is in use."""
    directory = state_dir(home)
    with _locked(directory):
        live = running(home)
        if live is not None:
            return live, False
        if port is None:
            port = DEFAULT_PORT if not _port_taken(DEFAULT_PORT) else free_port()
        log = log_path(directory)
        with open(log, "ab") as out:
            try:
                server = start_server(port, prefect_home=directory / "prefect", log=out,
                                      auth=credentials(directory))
            except PlatformError as exc:
                raise PlatformError(f"{exc}; its log: {log}") from None
        managed = Managed(server.process.pid, port, directory)
        atomic_write(_state_file(directory), json.dumps({"pid": managed.pid, "port": managed.port}))
        return managed, True


def stop_managed(home: Path | None = None) -> tuple[Managed | None, Managed | None]:
    """Stop the managed server: SIGTERM to its process group, SIGKILL if it lingers.
    Returns `lookup`'s (stopped server, stale record)."""
    directory = state_dir(home)
    with _locked(directory):
        live, stale = lookup(home)
        if live is not None:
            _stop_group(live.pid)
            _state_file(directory).unlink(missing_ok=True)
        return live, stale


def _stop_group(pid: int) -> None:
    # The server leads its own session (start_new_session), so its group is its pid.
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while _is_prefect_process(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _is_prefect_process(pid):
            return
    raise PlatformError(f"the Prefect server (pid {pid}) did not stop, even on SIGKILL")


def status(home: Path | None = None) -> dict[str, Any]:
    """`evalpipe server status --json`."""
    live, stale = lookup(home)
    doc: dict[str, Any] = {"running": live is not None, "healthy": bool(live and healthy(live.api_url)),
                           "home": str(state_dir(home))}
    if live is not None:
        doc |= live.to_json()
    if stale is not None:
        doc["stale_pid"] = stale.pid
    return doc
