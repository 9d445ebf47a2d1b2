"""Mining a real repository's history into a suite (issue #35), as a user runs it.

For each repository given (a path or a git URL; the bench's reference ones are pallets/click,
a src layout with a pyproject.toml, and more-itertools, a flat package with requirements/):
`evalpipe suite mine REPO --max N` in a fresh EVALPIPE_HOME, then `evalpipe suite validate` on
what it wrote. Printed, not asserted: commits walked, candidates, kept, the reasons the rest
were dropped, the cost per candidate and per environment build; then the re-grade of the
mined suite: the share of cases whose reference resolved on every run (target 100 %) and the
share whose tests pass at the base commit with no change (target 0 %). The peer is the cost
of the tests themselves: a candidate runs its test files 2 x reps times.

Usage: python bench/mining.py REPO [REPO...] [--max 200] [--reps 2] [--workers 2] [--validate-reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def evalpipe(*args: str, env: dict[str, str]) -> tuple[dict, float, float]:
    """The command's JSON, its wall seconds and its CPU seconds (its own and every process
    below it that was waited for: the sandboxed test runs), which the load does not inflate."""
    start, cpu = time.monotonic(), _children_cpu()
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args, "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    elapsed = time.monotonic() - start
    try:
        return json.loads(done.stdout), elapsed, _children_cpu() - cpu
    except ValueError:
        sys.exit(f"evalpipe {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")


def bench(repo: str, args: argparse.Namespace, home: Path) -> None:
    env = {**os.environ, "EVALPIPE_HOME": str(home), "PYTHONPATH": str(ROOT),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "EVALPIPE_SERVER": "temporary"}
    suite = home / f"{Path(repo.rstrip('/')).name.removesuffix('.git')}.yaml"
    mine_args = ["suite", "mine", repo, "--out", str(suite), "--max", str(args.max), "--reps", str(args.reps),
                 "--workers", str(args.workers)]
    report, mine_s, mine_cpu = evalpipe(*mine_args, env=env)
    print(f"\n== {repo}: {report['commits']} first-parent commits, {report['candidates']} candidates,"
          f" {report['kept']} kept ({mine_s:.0f} s wall, {mine_cpu:.0f} CPU s)")
    for reason, count in sorted(report["skipped"].items(), key=lambda kv: -kv[1]):
        print(f"  not a candidate  {count:4d}  {reason}")
    dropped = Counter(_reason_kind(d["reason"]) for d in report["dropped"])
    for reason, count in dropped.most_common():
        print(f"  dropped          {count:4d}  {reason}")
    builds = [e for e in report["environments"] if e.get("built")]
    failed = [e for e in report["environments"] if "failed" in e]
    print(f"  environments: {len(report['environments'])} distinct specs, {len(builds)} built, {len(failed)} failed")
    for e in failed:
        print(f"    failed: {e['failed'][:200]}")
    per_build = report["seconds_per_build"]
    per_candidate = report["seconds_per_candidate"]
    print(f"  cost: {per_candidate if per_candidate is not None else float('nan'):.1f} s per candidate run"
          f" ({2 * args.reps} test runs each), {per_build if per_build is not None else float('nan'):.1f} s per"
          " environment build")
    if report["candidates"]:
        print(f"  per candidate, over the whole mine: {mine_s / report['candidates']:.1f} s wall,"
              f" {mine_cpu / report['candidates']:.1f} CPU s (load {os.getloadavg()[0]:.1f} at the end)")
    again, again_s, _ = evalpipe(*mine_args, env=env)
    print(f"  resumed: the same mine again took {again_s:.1f} s, {again['reused']} of {again['candidates']}"
          " candidates reused")
    if not report["kept"]:
        return
    checked, check_s, check_cpu = evalpipe("suite", "validate", str(suite), "--reps", str(args.validate_reps),
                                   "--workers", str(args.workers), env=env)
    cases = checked["cases"]
    resolved = cases - len(checked["broken"]) - len(checked["flaky"])
    print(f"  re-grade ({check_s:.0f} s wall, {check_cpu:.0f} CPU s): reference resolved {resolved}/{cases} ="
          f" {100 * resolved / cases:.0f} % ({args.validate_reps}x each); no change passes"
          f" {len(checked['vacuous'])}/{cases} = {100 * len(checked['vacuous']) / cases:.0f} %")
    for kind in ("broken", "flaky", "vacuous"):
        for c in checked[kind]:
            print(f"    {kind} {c['case_id']}: {c['detail'][:200]}")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reason_kind(reason: str) -> str:
    """A dropped candidate's reason without its particulars (test names, counts)."""
    for kind in ("environment", "before the fix, the tests did not run", "with the fix, the tests did not run",
                 "its test changes hold no test module"):
        if reason.startswith(kind):
            return kind
    if reason.startswith("no test fails before the fix"):
        parts = reason.split(": ", 1)[1].split("; ")
        return "no FAIL_TO_PASS: " + ", ".join(sorted({p.split(" (")[0].lstrip("0123456789 ") for p in parts}))
    return reason[:80]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repos", nargs="+")
    parser.add_argument("--max", type=int, default=200)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--validate-reps", type=int, default=2)
    parser.add_argument("--home", type=Path, help="EVALPIPE_HOME to use (default: a fresh temporary one)")
    args = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}, {os.cpu_count()} cores")
    for repo in args.repos:
        if args.home:
            bench(repo, args, args.home)
        else:
            with tempfile.TemporaryDirectory(prefix="evalpipe-mine-") as tmp:
                bench(repo, args, Path(tmp))


if __name__ == "__main__":
    main()
