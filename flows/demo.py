"""`make demo`: the pipeline on the bundled examples, as far as it exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sh(*args: str) -> None:
    print(f"$ {' '.join(args)}", flush=True)
    subprocess.run(args, check=True, cwd=ROOT)


def main() -> None:
    evalpipe = str(Path(sys.executable).with_name("evalpipe"))
    sh(sys.executable, "examples/calc/build_repo.py")
    out = ROOT / ".evalpipe" / "demo"
    out.mkdir(parents=True, exist_ok=True)
    sh(evalpipe, "suite", "import", "humaneval", "--out", str(out / "humaneval.jsonl"))
    for suite in ("examples/qa.yaml", "examples/calc/calc.yaml", str(out / "humaneval.jsonl")):
        sh(evalpipe, "suite", "snapshot", suite)
    sh(evalpipe, "suite", "diff", "examples/qa.yaml", "examples/qa.yaml")


if __name__ == "__main__":
    main()
