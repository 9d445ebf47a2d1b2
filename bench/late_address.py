"""How long is an address the host gains while a sandbox runs reachable from it? (printed,
not asserted; needs root and iproute2's `ip`)

A sandbox with its own network (`OwnNetwork`, as a workspace agent's) polls its namespace's
local routes over rtnetlink; the host then adds an address to its loopback device
(`ip addr add`). Printed, per try: how long `ip` itself took, and when the address's local
route appeared in the namespace (`AddressWatch`), both from just before `ip` was started
(one monotonic clock for both sides): the window in which the sandbox could reach the
address is at most the second, less the part of the first before the kernel added it.

`--child`: the routes added by a forked child, as a harness without CAP_SYS_ADMIN does.

Usage: sudo python bench/late_address.py [--tries 9] [--child]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tasks.sandbox import network
from tasks.sandbox.limits import Limits
from tasks.sandbox.network import OwnNetwork
from tasks.sandbox.processes import run_command

WATCHER = """
import pathlib, socket, struct, sys, time
wanted = socket.inet_aton(sys.argv[1])
dump = struct.pack("=IHHII", 28, 26, 0x301, 1, 0) + struct.pack("=BBBBBBBBI", 2, 0, 0, 0, 255, 0, 0, 0, 0)
pathlib.Path("ready").touch()
deadline = time.monotonic() + 20
with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
    while time.monotonic() < deadline:
        nl.send(dump)  # every route of the namespace; the new address is in none until its local route
        seen = done = False
        while not done:
            data, offset = nl.recv(1 << 16), 0
            while offset < len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                seen = seen or wanted in data[offset:offset + length]
                done = done or kind in (2, 3)
                offset += (length + 3) & ~3
        if seen:
            print(time.monotonic())
            break
"""


def one(address: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as work:
        found: dict[str, object] = {}
        runner = threading.Thread(target=lambda: found.update(result=run_command(
            [sys.executable, "-I", "-c", WATCHER, address], workdir=Path(work), limits=Limits(timeout_s=30),
            network=OwnNetwork(()))))
        runner.start()
        while not Path(work, "ready").exists() and runner.is_alive():
            time.sleep(0.01)
        time.sleep(0.2)
        began = time.monotonic()
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True)
        ip_done = time.monotonic()
        try:
            runner.join()
        finally:
            subprocess.run(["ip", "addr", "del", f"{address}/32", "dev", "lo"], check=False)
        seen = float(found["result"].stdout.decode().strip() or "nan")
        return ip_done - began, seen - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tries", type=int, default=9)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    tries = args.tries
    if args.child:
        network._is_admin = lambda: False
    ip_ms, seen_ms = [], []
    for n in range(tries):
        took, seen = one(f"198.18.250.{n + 1}")
        ip_ms.append(took * 1000)
        seen_ms.append(seen * 1000)
    print(f"{'child' if args.child else 'thread'}, median of {tries}: ip addr add {statistics.median(ip_ms):6.2f} ms; the local route in the sandbox"
          f" {statistics.median(seen_ms):6.2f} ms after ip started (max {max(seen_ms):.2f} ms)")


if __name__ == "__main__":
    main()
