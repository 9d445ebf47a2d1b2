"""Orchestration cost of `evaluate`: 2,000 cases x 10 samples, trivial agent, `exact` grader.

Each figure is one fresh process in Prefect's ephemeral mode (what a user's ad-hoc run
pays), beside Prefect's own floor measured the same way: a process that runs two empty
flows. Targets: the big run within 30 s; its fully cached re-run within 3 s of the floor;
a one-case run within 1.3 x the floor.
"""

from __future__ import annotations

import argparse
import os
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

    floor = timed([sys.executable, "-c", FLOOR], env)
    full = timed([*cli[:4], str(big), *cli[4:], "-n", str(args.n)], env)
    cached = timed([*cli[:4], str(big), *cli[4:], "-n", str(args.n)], env)
    single = timed([*cli[:4], str(one), *cli[4:]], env)
    print(f"prefect floor (two empty flows, fresh process): {floor:6.2f} s")
    print(f"{args.cases:,} x {args.n} run:            {full:6.2f} s   {1000 * full / (args.cases * args.n):.2f} ms/sample"
          "   target <= 30 s at 2,000 x 10")
    print(f"fully cached re-run:       {cached:6.2f} s   floor + {cached - floor:.2f} s   target <= floor + 3 s")
    print(f"one-case run:              {single:6.2f} s   {single / floor:.2f} x floor   target <= 1.3 x")


if __name__ == "__main__":
    main()
