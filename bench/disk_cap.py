"""How far past its disk cap does a fast writer get, and what does the watcher cost? (printed,
not asserted)

A sandboxed writer (`run_command`, as a workspace agent runs) fills its work directory as
fast as it can (`dd`, 4 MB writes into files of 256 MB) until the watcher
(`tasks.sandbox.disk`) stops it; printed: the cap, what the directory held when it was
stopped, the overshoot and the rate written. Then the cost of the watcher beside no cap: a
sandbox start and end of `/bin/true` (median of N), and the harness's CPU time while a
command sleeps 5 s.

Usage: python bench/disk_cap.py [--caps 8,64,512] [--starts 21]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

from tasks.sandbox import DiskCap, Limits, run_command

WRITER = """
i=0
while :; do dd if=/dev/zero of=f$i bs=4M count=64 2>/dev/null; i=$((i+1)); done
"""
LIMITS = Limits(timeout_s=120, file_size_mb=1024)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--caps", default="8,64,512")
    parser.add_argument("--starts", type=int, default=21)
    args = parser.parse_args()
    for mb in map(int, args.caps.split(",")):
        with tempfile.TemporaryDirectory(dir=Path.home()) as work:
            cap = mb << 20
            began = time.perf_counter()
            result = run_command(["/bin/sh", "-c", WRITER], workdir=Path(work), limits=LIMITS,
                                 disk=DiskCap((work,), cap))
            spent = time.perf_counter() - began
            over = result.disk_over
            if over is None:
                print(f"cap {mb} MB: not stopped ({result.returncode}, timed out {result.timed_out})")
                continue
            print(f"cap {mb:>5} MB: stopped at {over / 2**20:8.1f} MB, {(over - cap) / 2**20:6.1f} MB past it,"
                  f" after {spent:5.2f} s ({over / spent / 2**20:6.0f} MB/s written)")
    with tempfile.TemporaryDirectory() as work:
        spent: dict[str, list[float]] = {"no cap": [], "cap": []}
        for _ in range(args.starts):
            for label, disk in (("no cap", None), ("cap", DiskCap((work,), 1 << 30))):
                began = time.perf_counter()
                run_command(["/bin/true"], workdir=Path(work), limits=LIMITS, disk=disk)
                spent[label].append(time.perf_counter() - began)
        print(f"sandbox start and end of /bin/true, median of {args.starts}:")
        for label, values in spent.items():
            print(f"  {label:<8}{statistics.median(values) * 1000:7.2f} ms")
        for label, disk in (("no cap", None), ("cap", DiskCap((work,), 1 << 30))):
            before = _cpu()
            run_command(["sleep", "5"], workdir=Path(work), limits=LIMITS, disk=disk)
            print(f"harness CPU during a 5 s sleep, {label:<7}{(_cpu() - before) * 1000:6.1f} ms")


if __name__ == "__main__":
    main()
