"""Which process owns a run, and whether it is still there.

A run records the pid, host and start time of the process that runs it. A `running` run
whose process is gone was killed without finishing: it is `interrupted`, however young.
The start time (boot id and clock ticks since boot, from /proc) tells a reused pid from
the original; where /proc is not available, the pid alone is checked.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Owner:
    pid: int
    host: str
    started: str | None  # None where it cannot be read


def current() -> Owner:
    return Owner(pid=os.getpid(), host=socket.gethostname(), started=_started(os.getpid()))


def _started(pid: int) -> str | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        boot = (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    # Fields after the command name, which is in parentheses and may itself hold any.
    fields = stat.rpartition(")")[2].split()
    if fields[0] == "Z":  # a zombie has finished; only its exit status is left
        return None
    return f"{boot}:{fields[19]}"


def gone(owner: Owner) -> bool:
    """Whether `owner` has certainly ended. A process on another host cannot be seen from
    here, so it is never called gone."""
    if owner.host != socket.gethostname():
        return False
    if owner.started is not None and PROC.is_dir():
        return _started(owner.pid) != owner.started
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False


def describe(pid: int) -> str | None:
    """A process's command line, shortened, when this host can see it."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    text = " ".join(" ".join(a.decode(errors="replace") for a in argv).split())
    return text if len(text) <= 100 else text[:97] + "..."
