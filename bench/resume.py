"""What a stopped run buys twice: `evalpipe run` of 60 cases x 5 (300 samples, agent 50 ms a
call, `--agent-concurrency 4`) is stopped once the agent has started 40 % of its calls —
`kill -9`, Ctrl-C (SIGINT) or SIGTERM — and the same command is run again to the end.
Printed per runner and signal: the calls made in all, the calls made again (a sample whose
call started in both runs: at most the calls in flight at the kill), those made again
although they had returned before the stop (the target is 0 for a polite stop), how long
the stopped run took to end after the signal, and its exit status; then the same stop sent
to a run one of whose agent calls hangs (the target: ended, 130, within 5 s).

`--signal worker` (with `--runner dask`) kills -9 one of two Dask worker processes of a
cluster started for it (`bench/dask_cluster.py`) instead of the run: the scheduler runs the
lost worker's task again on the other, and the run ends by itself (its "ended after" is the
rest of the run); calls made again are those the new attempt made (target: at most the
calls in flight at the kill).

The peer is the figure of main before outputs were stored as they arrived (issue 31): kill
-9 at 40 %: 42 outputs bought twice; SIGINT: drawing went on to 211 calls and the resume
bought 133 again.

    .venv/bin/python bench/resume.py [--runner threads] [--signal kill,int,term] [--cases 60]
    .venv/bin/python bench/resume.py --runner dask --signal worker
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dask_cluster import start_cluster, stop

ROOT = Path(__file__).resolve().parent.parent


SIGNALS = {"kill": signal.SIGKILL, "int": signal.SIGINT, "term": signal.SIGTERM}


def calls(path: Path) -> list[tuple[str, str]]:
    if not path.exists():
        return []
    return [tuple(line.split(" ", 1)) for line in path.read_text().splitlines() if " " in line]


def trial(work: Path, runner: str, how: str, cases: int, n: int, at: float, sleep: float) -> dict:
    home, counter = work / f"home-{runner}-{how}", work / f"calls-{runner}-{how}"
    suite = work / "suite.yaml"
    suite.write_text("name: resume\ncases:\n" + "".join(
        f"  - {{id: c{i:03d}, reference: 'yes', grader: {{kind: exact}}}}\n" for i in range(cases)))
    env = {**os.environ, "EVALPIPE_HOME": str(home), "CALLS": str(counter), "EVALPIPE_TEST_SLEEP": str(sleep),
           "PYTHONPATH": str(ROOT), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    args = [sys.executable, "-m", "flows.cli", "run", str(suite), "--agent", f"python:{ROOT}/tests/support/agents.py:logged",
            "-n", str(n), "--agent-concurrency", "4", "--workers", "2", "--runner", runner, "--json"]
    cluster: list[subprocess.Popen] = []
    if how == "worker":  # the agent runs on the workers: they read the call log's name from their environment
        address, cluster = start_cluster(work, 2, env)
        args += ["--dask-address", address]
    try:
        total = cases * n
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while sum(1 for kind, _ in calls(counter) if kind == "S") < at * total:
            if proc.poll() is not None:
                raise SystemExit(f"the run ended before the stop: {proc.stderr.read()[-2000:]}")
            time.sleep(0.01)
        at_kill = sum(1 for kind, _ in calls(counter) if kind == "S")
        if how == "worker":
            cluster[1].kill()
        else:
            proc.send_signal(SIGNALS[how])
        sent = time.monotonic()
        proc.wait(timeout=300)
    finally:
        stop(cluster)
    ended_s = time.monotonic() - sent
    first = calls(counter)
    returned = {key for kind, key in first if kind == "R"}
    if how != "worker":  # that run went on to its end
        resumed = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if resumed.returncode != 0:
            raise SystemExit(f"the resumed run failed ({resumed.returncode}): {resumed.stderr[-2000:]}")
    started = collections.Counter(key for kind, key in calls(counter) if kind == "S")
    again = [key for key, count in started.items() if count > 1]
    return {"runner": runner, "stop": how, "exit": proc.returncode, "ended_s": ended_s,
            # the calls the stopped run made (a run that lost a worker went on: those made by then)
            "calls_at_stop": at_kill if how == "worker" else sum(1 for kind, _ in first if kind == "S"), "calls": sum(started.values()),
            "made_again": len(again), "returned_made_again": len(returned & set(again))}


def hung_stop(work: Path, runner: str, how: str) -> tuple[int, float]:
    """A run one of whose agent calls hangs, stopped once it hangs: (exit status, seconds to end)."""
    home, counter = work / f"hung-{runner}-{how}", work / f"hung-calls-{runner}-{how}"
    env = {**os.environ, "EVALPIPE_HOME": str(home), "CALLS": str(counter), "PYTHONPATH": str(ROOT),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    args = [sys.executable, "-m", "flows.cli", "run", str(work / "suite.yaml"), "--agent",
            f"python:{ROOT}/tests/support/agents.py:hang_once", "-n", "2", "--agent-concurrency", "4",
            "--workers", "2", "--runner", runner, "--json"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while not Path(f"{counter}.hung").exists():
        if proc.poll() is not None:
            raise SystemExit("the run ended before its agent hung")
        time.sleep(0.01)
    time.sleep(0.5)
    proc.send_signal(SIGNALS[how])
    sent = time.monotonic()
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, time.monotonic() - sent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runner", default="threads")
    parser.add_argument("--signal", default="kill,int,term")
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("-n", type=int, default=5)
    parser.add_argument("--at", type=float, default=0.4)
    parser.add_argument("--sleep", type=float, default=0.05)
    args = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f}; {args.cases} x {args.n} samples, agent {args.sleep * 1000:g} ms,"
          f" concurrency 4, stopped at {args.at:.0%} of calls started")
    print(f"{'runner':<10}{'stop':<6}{'exit':>5}{'ended after':>13}{'calls at stop':>15}{'calls':>7}"
          f"{'made again':>12}{'returned, made again':>22}")
    with tempfile.TemporaryDirectory() as tmp:
        for runner in args.runner.split(","):
            for how in args.signal.split(","):
                r = trial(Path(tmp), runner, how, args.cases, args.n, args.at, args.sleep)
                print(f"{r['runner']:<10}{r['stop']:<6}{r['exit']:>5}{r['ended_s']:>12.2f}s{r['calls_at_stop']:>15}"
                      f"{r['calls']:>7}{r['made_again']:>12}{r['returned_made_again']:>22}", flush=True)
        print("stopped while one agent call hangs (issue 33 #11):")
        for runner in args.runner.split(","):
            for how in [h for h in args.signal.split(",") if h in SIGNALS and h != "kill"]:
                code, seconds = hung_stop(Path(tmp), runner, how)
                print(f"{runner:<10}{how:<6}{code:>5}{seconds:>12.2f}s", flush=True)
    print("peer (main before issue 31): kill -9 at 40 %: 42 made again; SIGINT: 211 calls at stop, 133 made again;"
          " SIGTERM to a dask run waiting on a hung agent: ignored for over 13 s; a Dask worker killed at 40 %"
          " (its task run again from its start): 57, 62 and 0 made again in three runs")


if __name__ == "__main__":
    main()
