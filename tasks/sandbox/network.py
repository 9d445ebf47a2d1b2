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

import os
import shutil
import signal
import subprocess
import tempfile
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


def connect(pid: int, network: OwnNetwork) -> int:
    """Join the network namespace of process `pid` (bubblewrap's sandbox, waiting on its
    block fd) to the outside; returns pasta's pid, for `disconnect`."""
    forwarded = ",".join(map(str, network.ports)) or "none"
    with tempfile.TemporaryDirectory(prefix="evalpipe-pasta-") as scratch:
        pidfile = Path(scratch, "pid")
        argv = [PASTA, "--quiet", "--config-net", "--no-map-gw", "-t", "none", "-u", "none", "-T", forwarded,
                "-U", "none", "--userns", f"/proc/{pid}/ns/user", "--netns", f"/proc/{pid}/ns/net",
                "--pid", str(pidfile)]
        if os.geteuid() == 0:  # pasta would switch to nobody, who cannot enter the namespace
            argv[1:1] = ["--runas", f"{os.getuid()}:{os.getgid()}"]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=_SETUP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxError(f"{PASTA} could not set up the sandbox's network: {exc}") from None
        if done.returncode != 0:
            reason = " ".join(done.stderr.decode("utf-8", "replace").split())[-300:]
            raise SandboxError(f"{PASTA} could not set up the sandbox's network: {reason}")
        return int(pidfile.read_text().strip())  # daemonized once the namespace was configured


def disconnect(pasta_pid: int) -> None:
    """End pasta (it would linger a while after the namespace is gone)."""
    try:
        if Path(f"/proc/{pasta_pid}/comm").read_text().strip() == PASTA:
            os.kill(pasta_pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass  # gone already
