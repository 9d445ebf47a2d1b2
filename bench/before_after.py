"""Is a change no worse? Run one bench script on an earlier commit and on this tree, in
turns, and print each of its figures side by side with the ratio after / before.

The earlier commit is checked out in a temporary git worktree with a copy of this tree's venv
pointed at it (the pinned dependencies are the same unless pyproject.toml changed between
the two; the script says so if it did). A copy, not PYTHONPATH: the sandbox starts its
servers with a scrubbed environment, and they must import the earlier commit's code too. Runs alternate, before then after, `--rounds` times, and
the best figure of each side is kept, so that a burst of load on a shared machine costs one
round, not the comparison. A figure is every number followed by `s`, `ms`, `µs` or `MB` on a
line of the bench's output; lines are matched by their text with the figures and ratios taken out.

Usage: python bench/before_after.py REF bench/aggregate.py [--rounds 3] [-- ARGS FOR THE BENCH]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURE = re.compile(r"(\d[\d,]*\.?\d*)\s*(µs|ms|s|MB)\b")
RATIO = re.compile(r"\d+\.?\d*\s?x\b")


def figures(output: str) -> dict[str, list[float]]:
    """Each output line with figures, keyed by its text with the numbers taken out."""
    found: dict[str, list[float]] = {}
    for line in output.splitlines():
        values = [float(v.replace(",", "")) for v, _ in FIGURE.findall(line)]
        if values:  # the key keeps the line's other numbers (J=1, J=5) but not its results
            key = RATIO.sub("#x", FIGURE.sub(lambda m: "#" + m.group(2), line))
            found[" ".join(key.split())] = values
    return found


def venv_for(tree: Path) -> Path:
    """A copy of this tree's venv whose editable install, scripts and records name `tree`."""
    venv = tree / ".venv"
    subprocess.run(["cp", "-a", str(ROOT / ".venv"), str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    for path in [*(venv / "bin").iterdir(), *site.glob("__editable__*.pth"), *site.glob("evalpipe-*/*")]:
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if str(ROOT).encode() in data:
                path.write_bytes(data.replace(str(ROOT).encode(), str(tree).encode()))
    return venv / "bin" / "python"


def run(python: Path, tree: Path, script: str, args: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(python), str(tree / script), *args], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{script} failed in {tree}:\n{done.stderr[-2000:]}")
    return done.stdout


def best(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, list[float]]:
    return {k: [min(x, y) for x, y in zip(a[k], b.get(k, a[k]), strict=False)] for k in a}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref", help="the earlier commit")
    parser.add_argument("script", help="the bench script, relative to the repository")
    parser.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    opts = parser.parse_args(argv[:cut])
    opts.args = argv[cut + 1 :]
    changed = subprocess.run(["git", "diff", "--quiet", opts.ref, "--", "pyproject.toml"], cwd=ROOT).returncode
    if changed:
        print(f"note: pyproject.toml differs from {opts.ref}; both sides run on this tree's dependencies")
    with tempfile.TemporaryDirectory(prefix="evalpipe-before-") as tmp:
        before_tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(before_tree), opts.ref], cwd=ROOT, check=True)
        try:
            before_python = venv_for(before_tree)
            before: dict[str, list[float]] = {}
            after: dict[str, list[float]] = {}
            for i in range(opts.rounds):
                print(f"round {i + 1}/{opts.rounds}", file=sys.stderr, flush=True)
                before = best(figures(run(before_python, before_tree, opts.script, opts.args)), before)
                after = best(figures(run(Path(sys.executable), ROOT, opts.script, opts.args)), after)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=ROOT, check=False)
    print(f"{opts.script}: best of {opts.rounds}, before = {opts.ref}, after = this tree")
    for line, values in after.items():
        old = before.get(line)
        if old is None:
            print(f"  {line}: after {values} (no such line before)")
            continue
        pairs = ", ".join(f"{b:g} -> {a:g} ({a / b:.2f}x)" if b else f"{b:g} -> {a:g}"
                          for b, a in zip(old, values, strict=False))
        print(f"  {line}: {pairs}")


if __name__ == "__main__":
    main()
