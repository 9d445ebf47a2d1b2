"""Harness overhead of `repo_tests` per sample, apart from the test command's own time.

50 samples on the calc example (the fix as search/replace blocks, the clamp trap, and the
fix as a unified diff, in turn).
Overhead = checkout + apply + scope + restore + disk + parse, read from each sample's
`trace["repo_tests"]["timings"]`; test time = the sandboxed pytest run. Targets (printed, not asserted):
overhead <= 150 ms per sample and <= 20% of the test time. The peer, measured in the same
run: a fresh `git clone` of the mirror per sample plus `git apply` (what a harness without
a worktree pool pays before its tests start).

Usage: python bench/repo_grading.py [--samples 50]
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OVERHEAD_STEPS = ("checkout", "apply", "scope", "restore", "disk", "parse")


def build_calc(dest: Path) -> str:
    spec = importlib.util.spec_from_file_location(
        "build_calc", ROOT / "examples/calc/build_repo.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(dest)


def peer_overhead(mirror: Path, sha: str, diff: str, work: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["git", "clone", "-q", "--shared", str(mirror), str(work)], check=True)
    subprocess.run(["git", "-C", str(work), "checkout", "-q", "--detach", sha], check=True)
    subprocess.run(["git", "-C", str(work), "apply", "-"], input=diff.encode(), check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="evalpipe-bench-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its homes, suites and samples
    os.environ["EVALPIPE_HOME"] = str(tmp / "home")
    sha = build_calc(tmp / "calc")

    from tasks.graders import grade
    from tasks.repos.worktrees import mirror
    from tasks.suites.dataset import load_suite

    case = load_suite(ROOT / "examples/calc/calc.yaml").case("add-bug")
    case = case.model_copy(update={"grader": {**case.grader, "repo": str(tmp / "calc")}})
    clamp = case.reference.replace("return a + b", "return min(abs(a) + b, 1)")
    fixed = (tmp / "calc/calc.py").read_text().replace("abs(a) + b", "a + b")
    scratch = tmp / "scratch"
    subprocess.run(["git", "clone", "-q", str(tmp / "calc"), str(scratch)], check=True)
    (scratch / "calc.py").write_text(fixed)
    diff = subprocess.run(
        ["git", "-C", str(scratch), "diff"], capture_output=True, text=True
    ).stdout
    # The fix as search/replace blocks and as a unified diff (git apply), and the trap.
    outputs = [case.reference, clamp, diff]
    grade(case.reference, case, {})  # warm-up: the mirror and first worktree

    overheads, tests, statuses = [], [], []
    for i in range(args.samples):
        trace: dict = {}
        verdict = grade(outputs[i % len(outputs)], case, trace)
        statuses.append(verdict.status.value)
        graded = trace["repo_tests"]
        overheads.append(sum(graded["timings"].get(s, 0.0) for s in OVERHEAD_STEPS))
        tests.append(graded["test_run"]["duration_s"])

    mirror_path = mirror(str(tmp / "calc"))
    peer = [peer_overhead(mirror_path, sha, diff, tmp / f"peer-{i}") for i in range(args.samples)]

    ms = 1000.0
    over, test, peer_ms = (statistics.median(x) * ms for x in (overheads, tests, peer))
    print(
        f"samples: {args.samples}  statuses: {dict((s, statuses.count(s)) for s in set(statuses))}"
    )
    print(f"harness overhead per sample: median {over:.1f} ms, max {max(overheads) * ms:.1f} ms")
    for step in OVERHEAD_STEPS:
        print(f"  {step:9s} (last sample) {graded['timings'].get(step, 0.0) * ms:6.2f} ms")
    print(f"test command per sample:     median {test:.1f} ms")
    print(
        f"overhead / test time:        {over / test:.1%}  (target <= 20%; overhead target <= 150 ms)"
    )
    print(f"peer (fresh clone + git apply, no tests): median {peer_ms:.1f} ms")
    print(f"overhead / peer:             {over / peer_ms:.2f}x")


if __name__ == "__main__":
    main()
