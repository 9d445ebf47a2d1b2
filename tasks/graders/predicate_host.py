"""The sandboxed side of a suite's callable, a `predicate` or a `judge`:
`python -I -m tasks.graders.predicate_host REF BASE [--pidns]`.

Started by `tasks.sandbox.servers.CallServer` inside bubblewrap, as its pid namespace's init (a
process it starts cannot kill it). It loads the suite's callable `REF` relative to
`BASE` and answers framed JSON requests (`tasks.sandbox.forkserver` protocol) one at a time:
- `{"op": "hash"}` → `{"code_sha256": ...}` (the grader fingerprint's part),
- `{"output": str, "case": {...}}` → `{"verdict": {...}}`, decided by
  `tasks.graders.predicate.decide` as it used to be in the harness, and
- `{"op": "judge" | "prefer", ...}` → the judge's answer (`tasks.graders.judge.sandbox_answer`);
any answer may be `{"load_error": message}` instead. The callable is looked up afresh
on each request (cheap when unchanged), so an edited file is what runs. Calls happen in
this process, so module-level state lives on between calls as it would in the harness;
whatever the call started is killed before the answer goes back.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tasks.callables import load_callable
from tasks.graders.predicate import decide
from tasks.models import EvalCase, InputError
from tasks.sandbox.forkserver import become_server, kill_leftovers, read_frame, write_frame


def answer(ref: str, base: Path, request: dict) -> dict:
    try:
        loaded = load_callable(ref, base)
    except InputError as exc:
        return {"load_error": str(exc)}
    if request.get("op") == "hash":
        return {"code_sha256": loaded.code_sha256}
    if request.get("op") in ("judge", "prefer"):
        from tasks.graders.judge import sandbox_answer  # only a judge's server needs its client

        return sandbox_answer(loaded.func, request)
    case = EvalCase.model_validate(request["case"])
    return {"verdict": decide(ref, loaded.func, request["output"], case).model_dump(mode="json")}


def serve(ref: str, base: Path, pidns: bool) -> None:
    rfd, wfd = become_server()
    try:
        os.chdir(base)  # where relative paths resolved in the harness
    except OSError:
        pass
    write_frame(wfd, {"ready": True})
    while (request := read_frame(rfd)) is not None:
        try:
            reply = answer(ref, base, request)
        except Exception as exc:  # our own failure (a malformed request): reported
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        kill_leftovers(pidns)
        write_frame(wfd, reply)


if __name__ == "__main__":
    args = sys.argv[1:]
    # As in the fork server, --pidns is re-checked: kill(-1) must stay in our namespace.
    serve(args[0], Path(args[1]), pidns="--pidns" in args[2:] and os.getpid() == 1)
