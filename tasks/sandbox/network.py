"""A sandboxed program's own network: bubblewrap's network namespace joined to the outside
by pasta (user-mode networking, Debian's `passt` package), so that it reaches the internet
and nothing on this machine.

pasta copies the host's address and routes into the namespace and carries its connections
out through the host's stack, with `--no-map-gw` (the gateway is not the host's loopback)
and no port forwarded either way (`-t none -u none -U none`) but the TCP ports of `-T`:
the endpoints the run itself names on this machine's loopback (an `OPENAI_BASE_URL` of
`http://127.0.0.1:8000/v1`). So a service on the host's 127.0.0.1 (a Dask scheduler, a
Prefect server, a database) is refused, the host's own address is the namespace's own
(nothing listens on it there), and a connection to any other address goes out as the
host's would. Where pasta is missing, a workspace run refuses unless
`EVALPIPE_AGENT_NETWORK=host` lets its agent share the host's network (docs/sandbox.md).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tasks.errors import InputError
from tasks.sandbox.limits import SandboxError

PASTA = "pasta"
NETWORK_ENV = "EVALPIPE_AGENT_NETWORK"  # "own" (the default) or "host"
_LOOPBACK_NAMES = ("localhost", "::1")
_SETUP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class OwnNetwork:
    """A network namespace of its own: the outside, and of the host only TCP `ports` on
    its loopback (the run's named endpoints)."""

    ports: tuple[int, ...] = ()


def agent_network(env: Mapping[str, str]) -> OwnNetwork | bool:
    """What network a workspace agent gets: its own (reaching the loopback endpoints named
    in `env`, its environment), or True, the host's, where `EVALPIPE_AGENT_NETWORK=host`
    asks for it. `InputError` for another value, or for its own without pasta."""
    mode = os.environ.get(NETWORK_ENV) or "own"
    if mode == "host":
        return True
    if mode != "own":
        raise InputError(f"{NETWORK_ENV}={mode!r}: expected own or host")
    if shutil.which(PASTA) is None:
        raise InputError(
            f"the workspace agent's own network needs {PASTA} (Debian/Ubuntu package passt), which is not"
            f" installed: install it, or set {NETWORK_ENV}=host to let the agent share this machine's"
            " network (it can then reach every service on this machine, its loopback included)")
    return OwnNetwork(loopback_ports(env))


def loopback_ports(env: Mapping[str, str]) -> tuple[int, ...]:
    """The ports of the URLs in `env` that name this machine's loopback."""
    ports = set()
    for value in env.values():
        if "://" not in value:
            continue
        try:
            url = urlsplit(value)
            port = url.port or {"http": 80, "https": 443}.get(url.scheme)
        except ValueError:
            continue
        host = url.hostname or ""
        if port and (host.startswith("127.") or host in _LOOPBACK_NAMES):
            ports.add(port)
    return tuple(sorted(ports))


def connect(pid: int, network: OwnNetwork) -> subprocess.Popen:
    """Join the network namespace of process `pid` (bubblewrap's sandbox, waiting on its
    block fd) to the outside; returns pasta, to be ended by `disconnect`. pasta runs in
    the foreground as our child, killed with this thread if the harness dies (it would
    outlive the namespace otherwise)."""
    forwarded = ",".join(map(str, network.ports)) or "none"
    with tempfile.TemporaryDirectory(prefix="evalpipe-pasta-") as scratch:
        pidfile, log = Path(scratch, "pid"), Path(scratch, "log")
        argv = [PASTA, "--foreground", "--quiet", "--config-net", "--no-map-gw", "-t", "none", "-u", "none",
                "-T", forwarded, "-U", "none", "--userns", f"/proc/{pid}/ns/user", "--netns", f"/proc/{pid}/ns/net",
                "--pid", str(pidfile)]
        if os.geteuid() == 0:  # pasta would switch to nobody, who cannot enter the namespace
            argv[1:1] = ["--runas", f"{os.getuid()}:{os.getgid()}"]
        with log.open("wb") as err:
            try:
                pasta = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509 - the one way to set it
            except OSError as exc:
                raise SandboxError(f"{PASTA} could not set up the sandbox's network: {exc}") from None
        # It writes its pid once the namespace is configured, before it starts serving.
        deadline = time.monotonic() + _SETUP_TIMEOUT_S
        while not _read(pidfile) and pasta.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if not _read(pidfile):
            disconnect(pasta)
            reason = " ".join(_read(log).split())[-300:] or f"no answer within {_SETUP_TIMEOUT_S:g} s"
            raise SandboxError(f"{PASTA} could not set up the sandbox's network: {reason}")
    return pasta


def disconnect(pasta: subprocess.Popen) -> None:
    """End pasta."""
    pasta.kill()
    pasta.wait()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
