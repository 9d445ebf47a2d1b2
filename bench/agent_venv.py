"""An agent in its own venv: persistent workers (`pyworker:`) beside the same agent imported in
evalpipe's process (`python:`, the peer) and a process per sample (`cmd:`). (printed, not asserted)

The agent: an OpenAI Agents SDK agent (`Runner.run_sync`, chat completions, tracing off) when
openai-agents can be installed into a temporary venv (uv, from PyPI or its cache); else a
stdlib agent that makes the same HTTP call. Its model is a stub endpoint on loopback that
answers each call in 0.1 s. 10 cases x 5 samples, the run's default concurrency, no cache
(a fresh home each). Each run is timed in a fresh process of its own, from `evaluate` called
to its summary: what the agent's import costs lands where it is paid.
The issue's target (#47): the own venv in at most 2x the time of in-process.

Usage: python bench/agent_venv.py [--cases 10] [--n 5] [--sdk-version 0.24.0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DELAY_S = 0.1

SDK_AGENT = """\
from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)


def solve(inputs, ctx):
    # A client per call: an async client belongs to the event loop of the run that made it.
    model = OpenAIChatCompletionsModel(model="stub", openai_client=AsyncOpenAI())
    agent = Agent(name="echo", instructions="Answer with the question's word.", model=model)
    return Runner.run_sync(agent, inputs["q"]).final_output
"""

STDLIB_AGENT = """\
import json, os, urllib.request


def solve(inputs, ctx):
    body = json.dumps({"model": "stub", "messages": [{"role": "user", "content": inputs["q"]}]}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)["choices"][0]["message"]["content"]
"""

# The same function as a `cmd:` agent: the case on stdin, the answer on stdout.
CMD_AGENT = """\
import json, sys
from agent import solve

case = json.load(sys.stdin)
sys.stdout.write(solve(case["inputs"], None))
"""

RUN = """\
import json, sys, time
sys.path.insert(0, {root!r})
import evalpipe
cases = json.load(open({cases!r}))
started = time.perf_counter()
run = evalpipe.evaluate(cases, {agent!r}, n={n}, home={home!r})
print(json.dumps({{"s": time.perf_counter() - started, "counts": run.status_counts}}))
"""


class Stub(BaseHTTPRequestHandler):
    """A chat-completions endpoint answering in DELAY_S with the last user message's text."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(DELAY_S)
        text = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        data = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": text}}],
                           "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def sdk_venv(where: Path, version: str) -> Path | None:
    """A venv with openai-agents==version, or None (with the reason printed) where it cannot be made."""
    venv = where / "sdk-venv"
    uv = [sys.executable, "-m", "uv"]
    try:
        subprocess.run([*uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
        subprocess.run([*uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                        f"openai-agents=={version}"], check=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"openai-agents=={version} cannot be installed ({exc}): the stdlib agent instead")
        return None
    return venv


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--sdk-version", default="0.24.0")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    server.request_queue_size = 256
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="bench-agent-venv-") as tmp:
        work = Path(tmp)
        venv = sdk_venv(work, args.sdk_version)
        try:
            import agents  # noqa: F401 - the peer imports it in evalpipe's own process
            in_process_ok = True
        except ImportError:
            in_process_ok = False
        sdk = venv is not None and in_process_ok
        (work / "agent.py").write_text(SDK_AGENT if sdk else STDLIB_AGENT)
        (work / "cmd_agent.py").write_text(CMD_AGENT)
        python = str(venv / "bin" / "python") if venv is not None else sys.executable
        cases = [{"id": f"c{i}", "inputs": {"q": f"word{i}"}, "reference": f"word{i}", "grader": {"kind": "exact"}}
                 for i in range(args.cases)]
        (work / "cases.json").write_text(json.dumps(cases))
        env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{server.server_address[1]}/v1",
               "OPENAI_API_KEY": "sk-bench"}
        agents_ = {
            "own venv, persistent workers (pyworker:)": f"pyworker:agent.py:solve?python={python}",
            "in evalpipe's process (python:), the peer": "python:agent.py:solve",
            "own venv, a process per sample (cmd:)": f"cmd:{python} cmd_agent.py",
        }
        print(f"agent: {'OpenAI Agents SDK ' + args.sdk_version if sdk else 'stdlib HTTP'}; stub answers in "
              f"{DELAY_S} s; {args.cases} cases x {args.n} samples; load {os.getloadavg()[0]:.2f}")
        times = {}
        for i, (label, spec) in enumerate(agents_.items()):
            script = RUN.format(root=str(ROOT), cases=str(work / "cases.json"), agent=spec, n=args.n,
                                home=str(work / f"home{i}"))
            done = subprocess.run([sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True,
                                  timeout=1200)
            if done.returncode != 0:
                print(f"{label}: failed: {done.stderr.strip().splitlines()[-1:]}")
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            times[label] = result["s"]
            print(f"{label:45} {result['s']:7.2f} s  {result['counts']}")
        ours, peer = (times.get(k) for k in list(agents_)[:2])
        if ours and peer:
            print(f"own venv / in-process: {ours / peer:.2f}x (target: at most 2x); load now {os.getloadavg()[0]:.2f}")
    server.shutdown()


if __name__ == "__main__":
    main()
