"""Drawing and grading as two stages (issue 23): an agent that waits 1 s per call (an API)
and a grader that computes ~0.2 s (a test), 40 samples, on 2 grading workers.

Printed side by side, each in a fresh EVALPIPE_HOME:
- today's single knob: each worker draws a sample and then grades it, 2 workers
  (`draw_sample` on a 2-thread pool: what a sampling task did per sample before the stages);
- the two-stage loop, `--agent-concurrency 16 --workers 2`, without Prefect (`evalpipe.evaluate`);
- the same through `evalpipe run` (the Prefect flow, on whatever server the CLI picks).

The floor is max(40 x 1 s / 16, 40 x 0.2 s / 2) = 4 s; the single knob's is 40 x 1.2 s / 2 = 24 s.

Usage: python bench/stages.py [--samples 40] [--wait 1.0] [--compute 0.2] [--no-cli]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

AGENT = """
import time

def answer(inputs, ctx):
    time.sleep({wait})
    return "    return a + b\\n"
"""
# CPU time, not wall time: under contention the test takes longer, as a real one would.
TEST = """
import time
def check(candidate):
    t = time.process_time()
    while time.process_time() - t < {compute}:
        pass
    assert candidate(2, 3) == 5
"""


def write_suite(path: Path, samples: int, compute: float) -> Path:
    test = TEST.format(compute=compute)
    path.write_text("".join(json.dumps({
        "id": f"c{i:03d}", "inputs": {"prompt": "def add(a, b):\n"}, "reference": "    return a + b\n",
        "grader": {"kind": "python_tests", "entry_point": "add", "test": test}}) + "\n" for i in range(samples)))
    return path


def single_knob(suite: Path, agent: str, workers: int) -> float:
    """Each worker draws a sample, then grades it: the loop before the stages, without Prefect."""
    from tasks.agents import load_agent
    from tasks.run.sampling import draw_sample, plan_samples
    from tasks.suites.dataset import load_suite

    loaded, cases = load_agent(agent), {c.id: c for c in load_suite(suite).cases}
    planned = plan_samples(load_suite(suite), loaded.fingerprint, 1, 0)
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        samples = list(pool.map(lambda p: draw_sample(loaded, cases[p.case_id], p, 1), planned))
    took = time.perf_counter() - start
    assert all(s.verdict.passed for s in samples), [s.verdict.detail for s in samples if not s.verdict.passed]
    return took


def two_stages(suite: Path, agent: str, workers: int, concurrency: int) -> float:
    from evalpipe import evaluate

    start = time.perf_counter()
    summary = evaluate(str(suite), agent, workers=workers, agent_concurrency=concurrency)
    took = time.perf_counter() - start
    assert summary.pass_at_k["1"] == 1.0 and summary.cached_samples == 0, summary.status_counts
    return took


def through_cli(suite: Path, agent: str, workers: int, concurrency: int, home: Path) -> tuple[float, float]:
    """The whole command's time, and the flow's own (`duration_s`)."""
    env = {**os.environ, "EVALPIPE_HOME": str(home), "PREFECT_LOGGING_LEVEL": "WARNING",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(suite), "--agent", agent, "--workers",
                           str(workers), "--agent-concurrency", str(concurrency), "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"evalpipe run failed:\n{done.stderr[-2000:]}")
    return took, json.loads(done.stdout)["duration_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--wait", type=float, default=1.0, help="seconds each agent call waits")
    parser.add_argument("--compute", type=float, default=0.2, help="CPU seconds each test computes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--agent-concurrency", type=int, default=16)
    parser.add_argument("--no-cli", action="store_true", help="leave out the run through the Prefect flow")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="evalpipe-bench-stages-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its homes, suites and samples
    (work / "agent.py").write_text(AGENT.format(wait=args.wait))
    agent = f"python:{work / 'agent.py'}:answer"
    suite = write_suite(work / "suite.jsonl", args.samples, args.compute)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["EVALPIPE_HOME"] = str(work / "single")
    single = single_knob(suite, agent, args.workers)
    os.environ["EVALPIPE_HOME"] = str(work / "stages")
    staged = two_stages(suite, agent, args.workers, args.agent_concurrency)
    floor = max(args.samples * args.wait / args.agent_concurrency, args.samples * args.compute / args.workers)
    print(f"{args.samples} samples, agent waits {args.wait:g} s a call, tests compute {args.compute:g} s,"
          f" {args.workers} grading workers")
    print(f"single knob (draw then grade per worker, {args.workers} workers):   {single:6.2f} s")
    print(f"two stages (--agent-concurrency {args.agent_concurrency} --workers {args.workers}), no Prefect:"
          f" {staged:6.2f} s   {staged / single:.2f} x single knob   floor {floor:.2f} s")
    if not args.no_cli:
        whole, flow = through_cli(suite, agent, args.workers, args.agent_concurrency, work / "cli")
        print(f"two stages through `evalpipe run` (Prefect flow):   {whole:6.2f} s   flow {flow:.2f} s")


if __name__ == "__main__":
    main()
