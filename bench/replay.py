"""What does `--replay-model-calls` save when an agent's tool code changes? (printed, not asserted)

A `cmd:` agent on the OpenAI SDK makes 3 calls per sample through the run's gateway; its third
request holds the result of its `scale` tool. A stdlib endpoint on loopback answers each call
after `--delay` seconds (a model's latency) and counts what reaches it. In each of two homes a
first run draws with `scale` multiplying by 2; the tool then changes (by 3) and a second run
draws again, with `--replay-model-calls` in one home (ours; its first run kept the calls too)
and without it in the other (the peer: today's re-run). Printed for each second run: upstream
calls and wall seconds. The issue's target: upstream calls only from the first changed request
on (1 of 3 per sample).

Usage: python bench/replay.py [--cases 10] [--delay 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AGENT = """
import json, sys
import openai
n = json.load(sys.stdin)["inputs"]["n"]
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": f"measure {n} then scale it"}]
for _ in range(3):
    message = client.chat.completions.create(model="m", messages=messages).choices[0].message
    if not message.tool_calls:
        break
    call = message.tool_calls[0]
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
    x = int(json.loads(call.function.arguments)["x"])
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(x * FACTOR if call.function.name == "scale" else x)})
print(message.content)
"""


class Endpoint(ThreadingHTTPServer):
    """Measure, then scale what was measured, then answer: by the conversation's length."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, delay_s: float) -> None:
        super().__init__(("127.0.0.1", 0), _Scripted)
        self.delay_s, self.requests, self.lock = delay_s, 0, threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Scripted(BaseHTTPRequestHandler):
    server: Endpoint

    def do_POST(self) -> None:
        messages = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))["messages"]
        with self.server.lock:
            self.server.requests += 1
        time.sleep(self.server.delay_s)
        if len(messages) < 5:
            name = "measure" if len(messages) == 1 else "scale"
            x = messages[0]["content"].split()[1] if name == "measure" else messages[-1]["content"]
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{len(messages)}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps({"x": x})}}]}
        else:
            message = {"role": "assistant", "content": f"the answer is {messages[-1]['content']}"}
        data = json.dumps({"id": "r", "object": "chat.completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                           "usage": {"prompt_tokens": 100 * len(messages), "completion_tokens": 10}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.5)
    args = parser.parse_args()
    import evalpipe

    endpoint = Endpoint(args.delay)
    threading.Thread(target=endpoint.serve_forever, daemon=True).start()
    os.environ.update(OPENAI_BASE_URL=endpoint.url, OPENAI_API_KEY="sk-bench-key")
    cases = [{"id": f"c{i}", "inputs": {"n": i + 1}, "reference": "the answer", "grader": {"kind": "contains"}}
             for i in range(args.cases)]
    figures = {}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            os.chdir(scratch)  # the agent's file is in the tree its fingerprint covers
            agent = Path("agent.py")
            for label, replay in (("peer (no replay)", False), ("ours (--replay-model-calls)", True)):
                home = Path(scratch) / label.split()[0]
                for factor in (2, 3):  # the tool's code changes between the two runs
                    agent.write_text(AGENT.replace("FACTOR", str(factor)))
                    before, started = endpoint.requests, time.perf_counter()
                    run = evalpipe.evaluate(cases, f"cmd:{sys.executable} agent.py", home=home,
                                            replay_model_calls=replay)
                    took, upstream = time.perf_counter() - started, endpoint.requests - before
                    assert run.pass_at_k["1"] == 1.0, run.status_counts
                figures[label] = (upstream, took, run.to_json().get("model_calls"))
    finally:
        endpoint.shutdown()
        endpoint.server_close()
    print(f"{args.cases} cases x 3 calls, endpoint latency {args.delay:g} s; the re-run after the tool changed:")
    for label, (upstream, took, counts) in figures.items():
        replayed = f", {counts['replayed']} replayed" if counts else ""
        print(f"  {label:<28} {upstream:>4} upstream calls{replayed}  {took:6.2f} s")
    print(f"load: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
