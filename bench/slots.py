"""Slots kept full (issue #32, item 4): a latency-bound run through one OpenAI-compatible
endpoint that answers each call in DELAY seconds, CALLS calls at `--agent-concurrency SLOTS`.

The endpoint (a stdlib HTTP server in this process) counts the calls in flight, sampled
every 0.1 s from the first request to the last answer. Printed: the run's wall time beside
its floor, `calls x delay / slots` plus the fixed cost (a one-case run against the same
endpoint, less its one call), and the mean calls in flight beside the slots.
Targets: mean in flight >= 17 of 20; wall <= the fixed cost + 1.2 x the floor.

    .venv/bin/python bench/slots.py [--calls 200] [--slots 20] [--delay 0.3]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests"))


class Counter:
    """Calls in flight, sampled every 0.1 s while any call has been made and not all answered."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.samples: list[int] = []
        self.first = self.last = 0.0
        self.edges = (0.0, 0.0)  # seconds before the first call, after the last answer
        self.stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.first = self.first or time.perf_counter()

    def leave(self) -> None:
        with self.lock:
            self.now -= 1
            self.last = time.perf_counter()

    def reset(self) -> None:
        with self.lock:
            self.samples, self.first, self.last = [], 0.0, 0.0

    def _sample(self) -> None:
        while not self.stop.wait(0.1):
            with self.lock:
                if self.first:
                    self.samples.append(self.now)

    def mean(self) -> float:
        # Samples after the last answer (the run writing its results) are not drawing time.
        drawing = self.samples[: max(1, round((self.last - self.first) / 0.1))]
        return sum(drawing) / len(drawing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--slots", type=int, default=20)
    parser.add_argument("--delay", type=float, default=0.3)
    args = parser.parse_args()
    from support.judges import ChatServer

    counter = Counter()

    def reply(body):
        counter.enter()
        try:
            time.sleep(args.delay)
        finally:
            counter.leave()
        return 200, "yes"

    work = Path(tempfile.mkdtemp(prefix="evalpipe-slots-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its homes, suites and samples
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "EVALPIPE_", "OPENAI_"))}
    env |= {"PREFECT_HOME": str(work / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "EVALPIPE_HOME": str(work / "home"), "OPENAI_API_KEY": "sk-bench"}
    suite, one = work / "suite.jsonl", work / "one.jsonl"
    suite.write_text("".join(f'{{"id": "c{i:04d}", "inputs": {{"prompt": "q{i}"}}, "reference": "yes",'
                             f' "grader": {{"kind": "exact"}}}}\n' for i in range(args.calls)))
    one.write_text('{"id": "c0", "inputs": {"prompt": "q"}, "reference": "yes", "grader": {"kind": "exact"}}\n')
    seeds = iter(range(1, 1000))  # a seed of its own each: drawn anew, never cached
    load = os.getloadavg()[0]
    with ChatServer(reply) as server:
        env["OPENAI_BASE_URL"] = server.url

        def run(path: Path) -> float:
            counter.reset()
            start = time.perf_counter()
            proc = subprocess.run([str(BIN / "evalpipe"), "run", str(path), "--agent", "openai:bench-model",
                                   "--agent-concurrency", str(args.slots), "--seed", str(next(seeds)), "--json"],
                                  cwd=ROOT, env=env, capture_output=True, text=True)
            end = time.perf_counter()
            wall = end - start
            counter.edges = (counter.first - start, end - counter.last)
            if proc.returncode:
                sys.exit(f"evalpipe run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
            passed = json.loads(proc.stdout)["status_counts"].get("passed", 0)
            if passed != len(path.read_text().splitlines()):
                sys.exit(f"only {passed} samples passed: the endpoint did not answer every call")
            return wall

        try:
            run(one)  # starts the server
            fixed = min(run(one) for _ in range(2)) - args.delay
            one_edges = counter.edges
            walls = []
            for _ in range(2):
                walls.append((run(suite), counter.mean(), counter.last - counter.first, counter.edges))
        finally:
            subprocess.run([str(BIN / "evalpipe"), "server", "stop"], env=env, stdout=subprocess.DEVNULL)
    counter.stop.set()
    floor = args.calls * args.delay / args.slots
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")
    print(f"{args.calls} calls of {args.delay:g} s on {args.slots} slots: floor {floor:.2f} s; fixed cost"
          f" (a one-case run less its call) {fixed:.2f} s: {one_edges[0]:.2f} s before its call,"
          f" {one_edges[1]:.2f} s after")
    for wall, mean, drawing, (before, after) in walls:
        print(f"run {wall:6.2f} s = fixed + {wall - fixed:.2f} s ({(wall - fixed) / floor:.2f} x the floor);"
              f" drawing {drawing:.2f} s with {mean:.1f} calls in flight on average (of {args.slots});"
              f" {before:.2f} s before the first call, {after:.2f} s after the last")
    print("targets: wall <= fixed + 1.2 x the floor; mean in flight >= 17 of 20"
          " (issue #32: inspect_ai 9.8 s / 13.5, promptfoo 7.7 s / 14.3, measured there)")


if __name__ == "__main__":
    main()
