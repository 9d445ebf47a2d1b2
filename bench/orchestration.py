"""Orchestration cost of `evaluate`: 2,000 cases x 10 samples, trivial agent, `exact` grader.

Each figure is one fresh `evalpipe run` process on the default path (the first command
starts evalpipe's managed server, untimed here beyond its own line; the later ones use it),
beside Prefect's own floor: a process that runs two empty flows on the same server.
Targets (issue 22): the big run within 20 s; its fully cached re-run within the one-case
run + 1 s. The server is stopped at the end.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOOR = """
from prefect import flow
@flow
def empty(): pass
empty(); empty()
"""
AGENT = "def answer(inputs, ctx):\n    return 'yes' if ctx.seed % 3 else 'no'\n"


def timed(args: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(args, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description="orchestration cost of evaluate")
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("-n", type=int, default=10, help="samples per case")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="evalpipe-bench-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its homes, suites and samples
    env = {**os.environ, "EVALPIPE_HOME": str(work / "home"), "PREFECT_LOGGING_LEVEL": "WARNING",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    (work / "agent.py").write_text(AGENT)
    big = work / "big.jsonl"
    big.write_text("".join(
        f'{{"id": "c{i:05d}", "inputs": {{"q": {i}}}, "reference": "yes", "grader": {{"kind": "exact"}}}}\n'
        for i in range(args.cases)))
    one = work / "one.jsonl"
    one.write_text('{"id": "c0", "inputs": {}, "reference": "yes", "grader": {"kind": "exact"}}\n')
    cli = [sys.executable, "-m", "flows.cli", "run", "--agent", f"python:{work / 'agent.py'}:answer", "--json"]

    try:
        first = timed([*cli[:4], str(one), *cli[4:], "--seed", "1"], env)  # starts the server
        env["PREFECT_API_URL"] = json.loads(subprocess.run(
            [*cli[:3], "server", "status", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
            check=True).stdout)["api_url"]
        env["PREFECT_API_AUTH_STRING"] = (work / "home/server/credentials").read_text().strip()
        floor = timed([sys.executable, "-c", FLOOR], env)
        del env["PREFECT_API_URL"], env["PREFECT_API_AUTH_STRING"]
        full = timed([*cli[:4], str(big), *cli[4:], "-n", str(args.n)], env)
        cached = timed([*cli[:4], str(big), *cli[4:], "-n", str(args.n)], env)
        single = timed([*cli[:4], str(one), *cli[4:]], env)
    finally:
        subprocess.run([*cli[:3], "server", "stop"], cwd=ROOT, env=env, capture_output=True)
    print(f"first one-case run (starts the server):    {first:6.2f} s")
    print(f"prefect floor (two empty flows, same server): {floor:6.2f} s")
    print(f"{args.cases:,} x {args.n} run:            {full:6.2f} s   {1000 * full / (args.cases * args.n):.2f} ms/sample"
          "   target <= 20 s at 2,000 x 10")
    print(f"fully cached re-run:       {cached:6.2f} s   one-case + {cached - single:.2f} s   target <= one-case + 1 s")
    print(f"one-case run:              {single:6.2f} s   {single / floor:.2f} x floor")


if __name__ == "__main__":
    main()
