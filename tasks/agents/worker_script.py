"""A persistent `pyworker:` agent worker (tasks/agents/worker.py), run by the agent's own
interpreter as a script: it needs the standard library only, so the agent's virtual
environment need not have evalpipe installed. Keep it free of evalpipe imports and of
syntax newer than Python 3.8.

    PYTHON worker_script.py REQUESTS_FD REPLIES_FD FILE FUNC

It imports FILE once, says `{"ready": true}` (or `{"ready": false, "error": ...}`), then
reads one JSON request a line (`case_id`, `inputs`, `index`, `seed`, `n`, `cap`) and
answers each with one JSON line: `{"output": ..., "steps": [...], "usage": {...},
"latency_s": ...}` or `{"error": "Type: message", ...}`. The agent's own prints go to
stderr, never into the replies. It exits at the end of its requests or when the harness
that started it is gone.
"""

import asyncio
import importlib.util
import inspect
import json
import os
import sys
import threading
import time

WATCH_S = 1.0  # how often the worker looks for its harness


class Context:
    """What a `python:` agent's `ctx` offers that can cross a process."""

    workspace = None
    trajectory = None

    def __init__(self, request):
        self.case_id = request["case_id"]
        self.index = request["index"]
        self.seed = request["seed"]
        self.n = request["n"]
        self.steps = []
        self.usage = {}

    def record(self, step):
        # Made JSON here, so that a step that cannot be is this call's failure.
        self.steps.append(json.loads(json.dumps(step, default=str)))

    def report_usage(self, *, input_tokens=None, output_tokens=None, model=None):
        given = {"input_tokens": input_tokens, "output_tokens": output_tokens, "model": model}
        self.usage.update({k: v for k, v in given.items() if v is not None})

    def report_latency(self, seconds):
        self.usage["latency_s"] = seconds


def _watch(parent):
    """The harness gone (killed: no one closes the pipes while a call runs): exit at once."""
    while True:
        time.sleep(WATCH_S)
        if os.getppid() != parent:
            os._exit(1)


def _load(path, name):
    spec = importlib.util.spec_from_file_location("evalpipe_agent_" + str(abs(hash(path))), path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    func = getattr(module, name, None)
    if not callable(func):
        raise AttributeError(f"{path} has no function {name!r}")
    return func


def _bounded(output, cap):
    """The output as sent: a str's first `cap` bytes (the harness marks the cut), or what
    type it was, which the harness refuses as it refuses it in process."""
    if not isinstance(output, str):
        return {"returned": type(output).__name__}
    data = output.encode("utf-8", "surrogatepass")
    if len(data) > cap:
        output = data[:cap].decode("utf-8", "ignore")
    return {"output": output}


def _answer(func, request):
    ctx = Context(request)
    started = time.perf_counter()
    try:
        output = func(request["inputs"], ctx)
        if inspect.iscoroutine(output):
            output = asyncio.run(output)
        reply = _bounded(output, request["cap"])
    except BaseException as exc:  # the agent's failure, whatever it raised (as in process)
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    reply.update(steps=ctx.steps, usage=ctx.usage, latency_s=time.perf_counter() - started)
    return reply


def main():
    requests = os.fdopen(int(sys.argv[1]), "rb")
    replies = os.fdopen(int(sys.argv[2]), "wb")
    path, name = sys.argv[3], sys.argv[4]
    threading.Thread(target=_watch, args=(os.getppid(),), daemon=True).start()
    os.dup2(2, 1)  # the agent's prints: to stderr, never into the replies

    def send(doc):
        replies.write(json.dumps(doc).encode("utf-8") + b"\n")
        replies.flush()

    sys.path.insert(0, os.path.dirname(path))
    try:
        func = _load(path, name)
    except BaseException as exc:
        send({"ready": False, "error": f"cannot import {path}: {type(exc).__name__}: {exc}"})
        return
    send({"ready": True})
    for line in requests:
        send(_answer(func, json.loads(line)))


if __name__ == "__main__":
    main()
