"""Kill a child process when its parent dies, however the parent died (kill -9 included).

`guard(pid)` starts `python -S reaper.py PARENT CHILD` beside the child. The reaper waits on
pidfds (no polling, no pid reuse): if the child exits first, it exits too; if the parent dies
first, it sends the child SIGTERM and, after a grace period, SIGKILL. A watchdog inside the
child would need code in Prefect's server process; this needs nothing from the child.
Standard library only, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

GRACE_S = 5.0


def reap(parent: int, child: int) -> None:
    try:
        child_fd = os.pidfd_open(child)
    except ProcessLookupError:
        return
    if os.getppid() == parent:  # else the parent is already gone and this process was re-parented
        parent_fd = os.pidfd_open(parent)
        ready, _, _ = select.select([parent_fd, child_fd], [], [])
        if child_fd in ready:
            return
    try:
        signal.pidfd_send_signal(child_fd, signal.SIGTERM)
        if not select.select([child_fd], [], [], GRACE_S)[0]:
            signal.pidfd_send_signal(child_fd, signal.SIGKILL)
    except ProcessLookupError:
        pass


def guard(child: int) -> None:
    """Make `child`, a process this one started, die with this process."""
    subprocess.Popen([sys.executable, "-S", __file__, str(os.getpid()), str(child)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    # Ctrl-C on a terminal reaches the whole foreground process group; the reaper stays to
    # clean up after whatever the parent does with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    reap(int(sys.argv[1]), int(sys.argv[2]))
