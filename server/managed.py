"""The server evalpipe manages for an EVALPIPE_HOME: started in the background by the first
flow-running command (or `evalpipe server start`), reused by every later one, stopped by
`evalpipe server stop` or, when a command started it, after an idle time (server/idle.py).

It keeps everything under EVALPIPE_HOME/server/: `server.json` (its pid and port, present
while it runs), `server.log`, `credentials`, and `prefect/`, its PREFECT_HOME, so its
database never fights with the user's ~/.prefect and the runs stay in its UI across starts.

It requires credentials (Prefect's `PREFECT_SERVER_API_AUTH_STRING`): a deployment's run form
runs code, so anyone who can reach the port must not be able to start a run. They are
generated once into EVALPIPE_HOME/server/credentials (mode 0600); evalpipe's commands send
them, the UI asks for them. CORS is limited to the UI's own origin.

Two locks, both `flock`s on directories that stay anyway, so no lock file is left behind:
the state lock (EVALPIPE_HOME/server) lets one start or stop happen at a time, so two
commands starting at once start one server; the use lock (EVALPIPE_HOME/server/prefect) is
held shared by every command using the server, and the idle stop takes it exclusively
without waiting, so it never stops a server under a command.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from server.local import (
    DEFAULT_PORT,
    HOST,
    LAUNCHER,
    STOP_TIMEOUT_S,
    free_port,
    healthy,
    port_taken,
    start_server,
)
from tasks.files import atomic_write
from tasks.home import CODE_ROOT, evalpipe_home
from tasks.models import InputError, PlatformError

MODE_ENV = "EVALPIPE_SERVER"
IDLE_ENV = "EVALPIPE_SERVER_IDLE_S"
DEFAULT_IDLE_S = 1800.0
UI_V2 = "v2"  # the path of Prefect's current UI (its UI_VERSION_PATH_SEGMENT)
Mode = Literal["managed", "temporary"]


def mode() -> Mode:
    """Where a flow-running command without PREFECT_API_URL runs: `managed` (start the managed
    server when it is down, then use it) or `temporary` (use it only when it is up, else
    Prefect's temporary server, which ends with the command). EVALPIPE_SERVER says which;
    unset, it is `temporary` where `CI` is set (no background process on a CI runner)."""
    raw = os.environ.get(MODE_ENV, "").strip()
    if raw in ("managed", "temporary"):
        return raw  # type: ignore[return-value]
    if raw:
        raise InputError(f"{MODE_ENV}={raw!r}: expected managed or temporary")
    ci = os.environ.get("CI", "").strip().lower()
    return "temporary" if ci not in ("", "0", "false", "no") else "managed"


def idle_timeout() -> float:
    """Seconds without use after which a server a command started stops itself:
    EVALPIPE_SERVER_IDLE_S, default 1800; 0 means never."""
    raw = os.environ.get(IDLE_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_IDLE_S
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise InputError(f"{IDLE_ENV}={raw!r}: expected seconds >= 0 (0: never stop)")
    return value


@dataclass(frozen=True)
class Managed:
    """The server evalpipe started in the background for one EVALPIPE_HOME."""

    pid: int
    port: int
    directory: Path  # EVALPIPE_HOME/server
    idle_s: float | None = None  # None: runs until stopped

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    @property
    def ui_url(self) -> str:
        """Where evalpipe's links into the UI start: Prefect's current UI (under /v2). Its
        login page shows just the form; the classic UI, which Prefect serves at a link
        without /v2 (`/runs/flow-run/ID`), probes the API before its login and greets a
        visitor without credentials with "Authentication failed" and "Oops" toasts."""
        return f"{self.url}/{UI_V2}"

    @property
    def auth(self) -> str:
        """The credentials its API requires (`user:password`)."""
        return credentials(self.directory)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "port": self.port, "url": self.url, "ui_url": self.ui_url, "api_url": self.api_url,
                "log": str(log_path(self.directory)), "prefect_home": str(self.directory / "prefect"),
                "credentials": str(credentials_path(self.directory)), "idle_stop_s": self.idle_s}


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
    return _lookup(state_dir(home))


def _lookup(directory: Path) -> tuple[Managed | None, Managed | None]:
    path = _state_file(directory)
    try:
        doc = json.loads(path.read_text())
        server = Managed(int(doc["pid"]), int(doc["port"]), directory, doc.get("idle_s"))
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
    """Alive (not a zombie) and a Prefect server, as `start_server` launches it (or an earlier
    evalpipe did, as `prefect server start`): a recycled pid is someone else's process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X") and (LAUNCHER.encode() in cmdline or b"prefect" in cmdline)


@contextmanager
def _flock(directory: Path, how: int) -> Iterator[bool]:
    """Hold a lock on `directory` (made if missing) for the block; yields False when `how`
    has LOCK_NB and another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def _state_lock(directory: Path, wait: bool = True) -> Any:
    return _flock(directory, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))


def _use_lock(directory: Path, how: int) -> Any:
    return _flock(directory / "prefect", how)


def start_managed(port: int | None = None, home: Path | None = None,
                  idle_s: float | None = None) -> tuple[Managed, bool]:
    """Start the managed server in the background and wait until it answers; with `idle_s`
    (> 0) it stops itself after that long unused, without it runs until stopped (also one a
    command started). Returns (server, started): `started` is False when it was already
    running. Without a port it takes 4200, or a free port when 4200 is in use."""
    directory = state_dir(home)
    with _state_lock(directory):
        live = _lookup(directory)[0]
        if live is not None:
            if live.idle_s is not None and idle_s is None:  # started by a command: now kept until stopped
                live = Managed(live.pid, live.port, directory)
                _record(live)
            return live, False
        return _start(directory, port, idle_s), True


def idle_time(directory: Path, pid: int) -> float | None:
    """The idle time on record for server `pid`; None when it is kept until stopped, or the
    record is no longer its own (its idle watch then ends)."""
    live = _lookup(directory)[0]
    return live.idle_s if live is not None and live.pid == pid else None


def _record(server: Managed) -> None:
    atomic_write(_state_file(server.directory),
                 json.dumps({"pid": server.pid, "port": server.port, "idle_s": server.idle_s}))


def _start(directory: Path, port: int | None, idle_s: float | None) -> Managed:
    """Under the state lock: start the server, record it, start its idle watch."""
    chosen = port is None
    if port is None:
        port = DEFAULT_PORT if not port_taken(DEFAULT_PORT) else free_port()
    log = log_path(directory)
    with open(log, "ab") as out:
        try:
            while True:
                try:
                    server = start_server(port, prefect_home=directory / "prefect", log=out,
                                          auth=credentials(directory))
                    break
                except PlatformError:
                    if not (chosen and port_taken(port)):
                        raise
                    # Another home's server took the port between the check and the start.
                    chosen, port = False, free_port()
        except PlatformError as exc:
            raise PlatformError(f"{exc}; its log: {log}") from None
        idle_s = idle_s or None  # 0: never stops
        managed = Managed(server.process.pid, port, directory, idle_s)
        _record(managed)
        if idle_s is not None:
            # Its own session: it outlives this command, as the server does. Run from our code's
            # root, so that a `server/` folder in the user's working directory is not ours.
            subprocess.Popen([sys.executable, "-m", "server.idle", str(directory), str(managed.pid), str(port),
                              str(idle_s)], cwd=CODE_ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                             start_new_session=True)
    return managed


@dataclass(frozen=True)
class Use:
    """What `used` found: the server to use (None: none), whether this command started it,
    and a server that is up but does not answer."""

    server: Managed | None
    started: bool = False
    hung: Managed | None = None


@contextmanager
def used(start: bool, home: Path | None = None, idle_s: float | None = None) -> Iterator[Use]:
    """The managed server for the block, held in use (the idle stop waits for the block to
    end). With `start`, one is started when none is up, stopping itself after `idle_s`."""
    directory = state_dir(home)
    if not start and not _state_file(directory).exists():  # none to use: nothing is written
        yield Use(None)
        return
    with ExitStack() as stack:
        with _state_lock(directory):
            live, started, hung = _lookup(directory)[0], False, None
            if live is None and start:
                live, started = _start(directory, None, idle_s), True
            elif live is not None and not healthy(live.api_url):
                live, hung = None, live
            if live is not None:  # cannot wait: the idle stop takes this lock only under the state lock
                stack.enter_context(_use_lock(directory, fcntl.LOCK_SH))
        yield Use(live, started, hung)


def stop_if_unused(directory: Path, pid: int, recently_used: Any) -> bool:
    """The idle stop: stop server `pid` unless a command holds it, or `recently_used()`
    (asked under the locks) says it was used meanwhile. True when it is gone."""
    with _state_lock(directory, wait=False) as free, _use_lock(directory, fcntl.LOCK_EX | fcntl.LOCK_NB) as unused:
        if not (free and unused):
            return False
        live = _lookup(directory)[0]
        if live is None or live.pid != pid:  # stopped, or replaced by another start
            return True
        if recently_used():
            return False
        _stop_group(pid)
        _state_file(directory).unlink(missing_ok=True)
        return True


def stop_homeless(pid: int) -> None:
    """Stop server `pid`, whose home (its record, its database) was deleted: no command can
    find it, or use it, again."""
    if _is_prefect_process(pid):
        _stop_group(pid)


def stop_managed(home: Path | None = None) -> tuple[Managed | None, Managed | None]:
    """Stop the managed server: SIGTERM to its process group, SIGKILL if it lingers.
    Returns `lookup`'s (stopped server, stale record)."""
    directory = state_dir(home)
    with _state_lock(directory):
        live, stale = _lookup(directory)
        if live is not None:
            _stop_group(live.pid)
            _state_file(directory).unlink(missing_ok=True)
        return live, stale


def _exited(pid: int) -> bool:
    """Gone, or a zombie. Not `_is_prefect_process`: an exiting process's command line reads
    empty before it has ended, so a stop that waited on that returned with it still there."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _stop_group(pid: int) -> None:
    # The server leads its own session (start_new_session), so its group is its pid.
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while not _exited(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _exited(pid):
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
