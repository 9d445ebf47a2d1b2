"""Overhead of repository environments for `repo_tests` (issue #15), apart from test time.

The pricing example (src layout, a pinned dependency, pytest vendored: no index needed),
graded in its environment. Printed, not asserted:
- per run: a fresh process getting the already-built environment (identity, lock, stat)
  — target <= 1 s — beside the cold build it no longer pays (the peer);
- per sample: the `environment` step and the whole harness overhead (every timed step
  but the tests) — target <= 150 ms — beside the test time, and beside the same figures
  for the calc example graded without an environment (today's path, the peer).

Usage: python bench/env_grading.py [--samples 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"examples/{name}/build_repo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_sample(case, output: str, samples: int) -> tuple[list[float], list[float], list[float]]:
    from tasks.graders import grade

    env_step, overhead, tests = [], [], []
    for _ in range(samples):
        trace: dict = {}
        start = time.perf_counter()
        verdict = grade(output, case, trace)
        total = time.perf_counter() - start
        assert verdict.passed, verdict.detail
        timings = trace["repo_tests"]["timings"]
        env_step.append(timings.get("environment", 0.0))
        tests.append(timings["tests"])
        overhead.append(total - timings["tests"])
    return env_step, overhead, tests


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:7.1f} ms  max {max(values) * 1000:7.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()
    pricing, calc = load("pricing"), load("calc")
    with tempfile.TemporaryDirectory(prefix="evalpipe-envbench-") as tmp:
        home = Path(tmp) / "home"
        os.environ["EVALPIPE_HOME"] = str(home)
        from tasks.models import EvalCase
        from tasks.repos.environments import parse_environment, runtime_for

        repo = Path(tmp) / "evalpipe__pricing"
        sha = pricing.build_offline(repo)
        spec = parse_environment(pricing.OFFLINE_ENVIRONMENT)
        start = time.perf_counter()
        runtime_for(spec, str(repo), sha, needs_pytest=True)
        cold = time.perf_counter() - start

        probe = (  # imports first: a run has them loaded anyway
            "import sys, time; sys.path.insert(0, sys.argv[1]);"
            "from tasks.repos.environments import parse_environment, runtime_for;"
            "from tasks.sandbox import bwrap_available; bwrap_available(); t = time.perf_counter();"
            f"runtime_for(parse_environment({pricing.OFFLINE_ENVIRONMENT!r}), {str(repo)!r}, {sha!r},"
            " needs_pytest=True); print(time.perf_counter() - t)"
        )
        warm = [
            float(subprocess.run([sys.executable, "-c", probe, str(ROOT)], check=True,
                                 capture_output=True, text=True).stdout)
            for _ in range(3)
        ]
        print("per run (a new process, environment already built):")
        print(f"  environment overhead  median {statistics.median(warm):.3f} s  (target <= 1 s)")
        print(f"  peer: the cold build  {cold:.1f} s  (paid once)")

        gold = (
            "src/pricing/cart.py\n<<<<<<< SEARCH\n    return sub - sub * discount_percent // 10\n"
            "=======\n    return sub - sub * discount_percent // 100\n>>>>>>> REPLACE\n"
        )
        case = EvalCase(id="pricing", grader={
            "kind": "repo_tests", "repo": str(repo), "base_commit": sha,
            "fail_to_pass": ["tests/test_cart.py::test_discount"],
            "pass_to_pass": ["tests/test_cart.py::test_subtotal", "tests/test_cart.py::test_receipt"],
            "environment": pricing.OFFLINE_ENVIRONMENT,
        })
        env_step, overhead, tests = per_sample(case, gold, args.samples)
        calc_repo = Path(tmp) / "calc"
        calc_sha = calc.build(calc_repo)
        calc_case = EvalCase(id="calc", grader={
            "kind": "repo_tests", "repo": str(calc_repo), "base_commit": calc_sha,
            "fail_to_pass": ["test_calc.py::test_negative"],
            "pass_to_pass": ["test_calc.py::test_positive", "test_calc.py::test_sub"],
        })
        fix = "calc.py\n<<<<<<< SEARCH\n    return abs(a) + b\n=======\n    return a + b\n>>>>>>> REPLACE\n"
        _, peer_overhead, peer_tests = per_sample(calc_case, fix, args.samples)
    print(f"per sample ({args.samples} samples each):")
    print(f"  with an environment:    environment step {ms(env_step)}")
    print(f"                          harness overhead {ms(overhead)}  (target <= 150 ms)")
    print(f"                          tests            {ms(tests)}")
    print(f"  peer, no environment:   harness overhead {ms(peer_overhead)}")
    print(f"                          tests            {ms(peer_tests)}")


if __name__ == "__main__":
    main()
