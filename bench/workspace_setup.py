"""What a coding agent's workspace (`--workspace`) costs to set up and read back, per sample.

A generated repository (default 2000 files in 100 directories, 20 commits: the base is the
10th, so the mirror holds later history the workspace must not show). Measured in the same
run, median of `--samples` rounds, the measurements interleaved round by round (a shared
machine's load falls on all alike), everything warm (mirror and base-commit store made):

- workspace: `tasks.repos.workspaces.workspace` entered and left (pooled checkout reset to
  the base, the agent's own shallow git directory, scratch directory removed);
- read: `read_change` on a workspace with one edited file (the agent's output);
- grading setup: what `repo_tests` does for the same case before its tests start (its
  `checkout`, `apply`, `scope`, `restore` and `disk` steps, from the sample's trace, grading
  a one-line patch), and its `checkout` step alone (the target: workspace <= grading setup);
- peer: a fresh `git clone` of the mirror + `checkout` of the base (what a harness without
  a pool pays per sample; `--shared` clone, the cheapest a clone gets).
The one-time cost of the base-commit store (packed on first use per commit) is printed too.

Usage: python bench/workspace_setup.py [--files 2000] [--samples 15]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def build_repo(dest: Path, files: int, commits: int) -> list[str]:
    git = ["git", "-C", str(dest), "-c", "user.name=b", "-c", "user.email=b@b.invalid"]
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    shas = []
    for c in range(commits):
        for i in range(files if c == 0 else files // 20):
            path = dest / f"pkg{i % 100:03d}" / f"mod{i:05d}.py"
            path.parent.mkdir(exist_ok=True)
            path.write_text(f'"""Module {i}, revision {c}."""\n\n' + "".join(
                f"def f{j}(x):\n    return x * {j + c}\n\n" for j in range(20)))
        (dest / "test_first.py").write_text("from pkg000.mod00000 import f1\n\n\ndef test_f1():\n"
                                           f"    assert f1(1) == {1 + c}\n")
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", f"c{c}"], check=True)
        shas.append(subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                   check=True).stdout.strip())
    return shas


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


SETUP_STEPS = ("checkout", "apply", "scope", "restore", "disk")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--samples", type=int, default=15)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="evalpipe-bench-ws-"))
    os.environ["EVALPIPE_HOME"] = str(tmp / "home")
    from tasks.repos.workspaces import base_store, read_change, workspace
    from tasks.repos.worktrees import checkout, ensure_commit, mirror

    repo = tmp / "repo"
    shas = build_repo(repo, args.files, 20)
    base = shas[9]
    mirror_path = mirror(str(repo))
    sha = ensure_commit(mirror_path, base, str(repo))
    start = time.perf_counter()
    base_store(mirror_path, sha)
    store_s = time.perf_counter() - start
    with workspace(str(repo), base):  # warm: the pooled tree exists
        pass

    def enter_workspace() -> None:
        with workspace(str(repo), base):
            pass

    def enter_checkout() -> None:
        with checkout(str(repo), base):
            pass

    def edit_and_read() -> None:
        with workspace(str(repo), base) as ws:
            target = ws.tree / "pkg000" / "mod00000.py"
            target.write_text(target.read_text() + "# edited\n")
            assert read_change(ws).files == ("pkg000/mod00000.py",)

    def clone() -> None:
        dest = tmp / "clone"
        subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(mirror_path), str(dest)], check=True)
        subprocess.run(["git", "-C", str(dest), "checkout", "-q", "--detach", base], check=True)
        shutil.rmtree(dest)

    from tasks.graders import grade
    from tasks.models import EvalCase

    case = EvalCase(id="c", grader={"kind": "repo_tests", "repo": str(repo), "base_commit": base,
                                    "fail_to_pass": ["test_first.py::test_f1"], "timeout_s": 60})
    patch = ('pkg000/mod00000.py\n<<<<<<< SEARCH\n"""Module 0, revision 9."""\n=======\n'
             '"""Module 0, revision 9, edited."""\n>>>>>>> REPLACE\n')
    rounds: dict[str, list[float]] = {k: [] for k in ("ws", "checkout", "grading", "read", "clone")}
    for _ in range(args.samples):
        # Each from a clean pooled tree: a reset after an edited one costs more, whoever pays it.
        enter_checkout()
        rounds["ws"].append(timed(enter_workspace))
        enter_checkout()
        rounds["checkout"].append(timed(enter_checkout))
        trace: dict = {}
        verdict = grade(patch, case, trace)
        assert verdict.passed, verdict.detail
        rounds["grading"].append(sum(trace["repo_tests"]["timings"].get(step, 0.0) for step in SETUP_STEPS))
        rounds["read"].append(timed(edit_and_read))
        rounds["clone"].append(timed(clone))
    ws_s, checkout_s, grading_s, clone_s = (statistics.median(rounds[k]) for k in ("ws", "checkout", "grading", "clone"))
    read_s = statistics.median(rounds["read"]) - ws_s
    print(f"repository: {args.files} files, 20 commits (base: the 10th); median of {args.samples} rounds; "
          f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"workspace setup (pooled checkout + own git)  {1000 * ws_s:8.1f} ms")
    print(f"grading setup before the tests (repo_tests)  {1000 * grading_s:8.1f} ms"
          f"   workspace/grading setup = {ws_s / grading_s:.2f} x")
    print(f"  its checkout step alone                    {1000 * checkout_s:8.1f} ms"
          f"   workspace/checkout = {ws_s / checkout_s:.2f} x")
    print(f"peer: fresh git clone --shared + checkout    {1000 * clone_s:8.1f} ms"
          f"   workspace is {clone_s / ws_s:.1f} x faster")
    print(f"reading the change (one edited file)         {1000 * read_s:8.1f} ms")
    print(f"base-commit store, once per commit           {1000 * store_s:8.1f} ms")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
