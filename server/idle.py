"""The idle stop of a managed server a command started: `python -m server.idle DIR PID PORT IDLE_S`.

A small process in its own session beside the server. Use is read from the kernel's TCP
table, not from the server: any connection to the server's port (a command's client, a
worker, a UI tab, an events websocket held through a long agent call) is use now, and a
closed one, lingering in TIME_WAIT for 60 s, says how long ago it closed. A command also
holds the use lock (server/managed.py) for as long as it runs. When neither was seen for
IDLE_S seconds, it stops the server and removes its record, then exits; it stops the server
within HOME_CHECK_S of its home's deletion too, whatever the idle time; it exits as well
when the server ends otherwise (`evalpipe server stop`), or when `evalpipe server start`
made the record say it is kept until stopped. It never connects to the server,
so it is not use itself.
"""

from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path

TIME_WAIT_S = 60.0  # Linux's TCP_TIMEWAIT_LEN
HOME_CHECK_S = 2.0  # a look (home, record, TCP table) costs ~3 ms: 0.15% of a core
LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (also the tail of its IPv6-mapped form)
LISTEN, TIME_WAIT = "0A", "06"


def last_use_age(port: int, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> float | None:
    """Seconds since a connection to 127.0.0.1:`port` was last open (0: one is open now);
    None when the TCP table holds none."""
    tick = os.sysconf("SC_CLK_TCK")
    ages = []
    for table in tables:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            ends = [end.split(":") for end in fields[1:3]]
            if fields[3] == LISTEN or not any(a.endswith(LOOPBACK) and int(p, 16) == port for a, p in ends):
                continue
            if fields[3] == TIME_WAIT:
                remaining = int(fields[5].split(":")[1], 16) / tick
                ages.append(max(0.0, TIME_WAIT_S - remaining))
            else:
                ages.append(0.0)
    return min(ages, default=None)


def watch(directory: Path, pid: int, port: int, idle_s: float) -> None:
    from server.managed import idle_time, stop_homeless, stop_if_unused

    try:
        server = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    # Its home is looked for as often, at most HOME_CHECK_S apart: a deleted home (a
    # temporary one, a cleaned CI workspace) leaves a server no command can use again.
    poll_s = min(max(idle_s / 10, 0.2), HOME_CHECK_S)
    last_use = time.monotonic()

    def recently_used() -> bool:
        nonlocal last_use
        age = last_use_age(port)
        if age is not None:
            last_use = max(last_use, time.monotonic() - age)
        return time.monotonic() - last_use < idle_s

    while not select.select([server], [], [], poll_s)[0]:  # readable: the server exited
        if not directory.exists():
            stop_homeless(pid)
            return
        if idle_time(directory, pid) is None:  # `evalpipe server start` keeps it now, or it was replaced
            return
        if not recently_used():
            if stop_if_unused(directory, pid, recently_used):
                return
            last_use = time.monotonic()  # a command holds it, or it was used meanwhile


if __name__ == "__main__":
    watch(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
