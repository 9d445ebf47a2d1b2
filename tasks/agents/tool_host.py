"""The sandboxed side of a registered tool declared `runs_code=True`:
`python -I -m tasks.agents.tool_host FILE:FUNCTION BASE [--pidns]`.

Started by `tasks.sandbox.servers.CallServer` in bubblewrap, as a suite's predicate is. It
imports the tool's module (which registers the tool in this process too) and answers framed
JSON requests `{"name", "args"}` one at a time with `{"value": ...}` (what the model is told:
text as it is, anything else as JSON) or `{"failure": why}` (an error the model sees).
Whatever a call started is killed before the answer goes back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tasks.callables import load_callable
from tasks.models import InputError
from tasks.registry import tool_spec
from tasks.sandbox.forkserver import become_server, kill_leftovers, read_frame, write_frame


def answer(ref: str, base: Path, request: dict[str, Any]) -> dict[str, Any]:
    try:
        loaded = load_callable(ref, base)
    except InputError as exc:
        return {"failure": f"cannot load the tool: {exc}"}
    name, args = request["name"], request["args"]
    spec = tool_spec(name)
    try:
        value = spec.fn(spec.model.model_validate(args)) if spec is not None and spec.model else loaded.func(**args)
    except BaseException as exc:  # noqa: BLE001 - what a tool raises is the model's error result
        return {"failure": f"{name} raised {type(exc).__name__}: {exc}"}
    return {"value": value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)}


def serve(ref: str, base: Path, pidns: bool) -> None:
    rfd, wfd = become_server()
    try:
        os.chdir(base)
    except OSError:
        pass
    write_frame(wfd, {"ready": True})
    while (request := read_frame(rfd)) is not None:
        reply = answer(ref, base, request)
        kill_leftovers(pidns)
        write_frame(wfd, reply)


if __name__ == "__main__":
    args = sys.argv[1:]
    serve(args[0], Path(args[1]), pidns="--pidns" in args[2:] and os.getpid() == 1)
