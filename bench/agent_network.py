"""What does a workspace agent's own network cost at each sandbox start? (printed, not asserted)

The same command (`/bin/true`) started in the sandbox with no network (the peer), and with
its own network: pasta joining it to the outside, then the filter keeping this host's
addresses out of reach (reading the host's routes, then adding local routes in the
namespace), and the watch of the addresses the host gains while it runs (its socket,
thread and end, timed on this process's own namespaces). Medians of N starts.

Usage: python bench/agent_network.py [--starts 21]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from tasks.sandbox import network
from tasks.sandbox.limits import Limits
from tasks.sandbox.network import OwnNetwork
from tasks.sandbox.processes import run_command

PARTS = ("_start_pasta", "host_destinations", "guard")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=21)
    starts = parser.parse_args().starts
    spent: dict[str, list[float]] = {part: [] for part in PARTS}
    for part in PARTS:  # timed where connect calls them
        def timed(*args, _part=part, _original=getattr(network, part)):
            began = time.perf_counter()
            try:
                return _original(*args)
            finally:
                spent[_part].append(time.perf_counter() - began)
        setattr(network, part, timed)
    whole: dict[str, list[float]] = {"no network": [], "own network": []}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(starts):
            for label, net in (("no network", False), ("own network", OwnNetwork(()))):
                began = time.perf_counter()
                run_command(["/bin/true"], workdir=Path(work), limits=Limits(timeout_s=30), network=net)
                whole[label].append(time.perf_counter() - began)
    ms = lambda values: f"{statistics.median(values) * 1000:7.2f} ms"  # noqa: E731
    print(f"sandbox start and end, median of {starts}:")
    for label, values in whole.items():
        print(f"  {label:<28}{ms(values)}")
    print("  of which, with its own network:")
    for part, label in zip(PARTS, ("pasta start", "reading the host's routes", "filter (local routes)"), strict=True):
        print(f"    {label:<26}{ms(spent[part])}")
    watch = []
    net, user = os.open("/proc/self/ns/net", os.O_RDONLY), os.open("/proc/self/ns/user", os.O_RDONLY)
    for _ in range(starts):
        began = time.perf_counter()
        network.AddressWatch(net, user, os.getpid()).start().close()
        watch.append(time.perf_counter() - began)
    print(f"    {'address watch, start to end':<26}{ms(watch)}")


if __name__ == "__main__":
    main()
