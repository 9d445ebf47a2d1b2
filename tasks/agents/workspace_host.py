"""Runs a `python:` agent's function in the sandbox, in its workspace (`--workspace`):

    python -I -m tasks.agents.workspace_host MODULE:FUNC BASE   (the case JSON on stdin)

`FUNC(inputs, ctx)` with `ctx.workspace` the working directory and `ctx.trajectory` the
file of `EVALPIPE_TRAJECTORY`. What it returns is printed (it goes to the trace: the output
graded is the change in the workspace); what it raises is printed to stderr and ends the
process with status 1, which the harness reports as `agent_error`.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from tasks.agents.base import AgentContext
from tasks.agents.trajectory import TRAJECTORY_ENV
from tasks.callables import load_callable
from tasks.models import InputError


def main(argv: list[str]) -> int:
    ref, base = argv[1], Path(argv[2])
    case = json.load(sys.stdin)
    try:
        func = load_callable(ref, base).func
    except InputError as exc:
        print(f"cannot load the agent: {exc}", file=sys.stderr)
        return 2
    trajectory = os.environ.get(TRAJECTORY_ENV)
    ctx = AgentContext(case_id=case["id"], index=case["index"], seed=case["seed"], n=case["n"],
                       workspace=Path.cwd(), trajectory=Path(trajectory) if trajectory else None)
    try:
        result = func(case["inputs"], ctx)
    except BaseException:  # noqa: BLE001 - whatever the agent raises is its failure
        traceback.print_exc()
        return 1
    if result is not None:
        print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
