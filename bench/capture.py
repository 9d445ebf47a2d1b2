"""What does in-process capture add to a `python:` agent's model call? (printed, not asserted)

The scripted model of examples/tools (a server in a process of its own) answers. Measured, in
one process, alternating call by call on one OpenAI client class each:
- the peer: the same OpenAI SDK with its own, uninstrumented `request` (what an agent's call
  costs with no capture);
- ours: the instrumented SDK inside `captured(ctx)`, each call recorded into the sample's
  trajectory (a chat completion, and a streamed one with its usage);
- routed: the same with `--model-concurrency 4` and `--replay-model-calls` on (a slot held per
  call, each request digested and its answer kept for replay: `tasks.agents.sdk_calls`);
and, in a fresh process, what installing the instrumentation costs once (imports included).

Usage: python bench/capture.py [--calls 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MESSAGES = [{"role": "user", "content": "Where is my order 1042?"}]
INSTALL = ("import time; t = time.perf_counter(); from tasks.agents import capture; capture._instrumented();"
           " print(time.perf_counter() - t)")


def timed(client, stream: bool) -> float:
    started = time.perf_counter()
    if stream:
        for _ in client.chat.completions.create(model="support-good", messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}):
            pass
    else:
        client.chat.completions.create(model="support-good", messages=MESSAGES)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    installs = [float(subprocess.run([sys.executable, "-c", INSTALL], cwd=ROOT, capture_output=True, text=True,
                                     check=True).stdout) for _ in range(3)]
    import openai
    from openinference.instrumentation.openai import OpenAIInstrumentor

    from tasks.agents.base import AgentContext
    from tasks.agents.capture import _instrumented, captured
    from tasks.agents.model_calls import CallBook
    from tasks.agents.settings import AgentSettings

    _instrumented()

    class Plain(openai.OpenAI):
        request = OpenAIInstrumentor()._original_request  # the SDK's own, unwrapped

    port = 19000 + os.getpid() % 1000
    model = subprocess.Popen([sys.executable, str(ROOT / "examples/tools/scripted_model.py"), "--port", str(port)],
                             stdout=subprocess.PIPE, text=True)
    model.stdout.readline()
    url = f"http://127.0.0.1:{port}/v1"
    plain, instrumented = Plain(base_url=url, api_key="sk-bench"), openai.OpenAI(base_url=url, api_key="sk-bench")
    results: dict[tuple[str, bool], list[float]] = {}
    ctx = AgentContext(case_id="bench", index=0, seed=0, n=1)
    try:
        for stream in (False, True):
            for _ in range(10):  # warm both
                timed(plain, stream)
                with captured(ctx):
                    timed(instrumented, stream)
            routed = AgentSettings(model_concurrency=4)
            for _ in range(args.calls):
                results.setdefault(("peer", stream), []).append(timed(plain, stream))
                with captured(ctx):  # one sample a call: its trajectory and usage applied each time
                    results.setdefault(("ours", stream), []).append(timed(instrumented, stream))
                kept = AgentContext(case_id="bench", index=0, seed=0, n=1, calls=CallBook())
                with captured(kept, routed):
                    results.setdefault(("routed", stream), []).append(timed(instrumented, stream))
    finally:
        model.terminate()
        model.wait()
    ms = lambda xs, q: 1e3 * statistics.quantiles(xs, n=100)[q - 1]  # noqa: E731
    print(f"load {os.getloadavg()[0]:.2f}; {args.calls} calls each way, alternating")
    for stream in (False, True):
        peer, ours = results[("peer", stream)], results[("ours", stream)]
        kind = "streamed" if stream else "whole"
        print(f"{kind:8} peer (uninstrumented SDK): p50 {ms(peer, 50):.2f} ms  p95 {ms(peer, 95):.2f} ms")
        print(f"{kind:8} captured:                  p50 {ms(ours, 50):.2f} ms  p95 {ms(ours, 95):.2f} ms"
              f"  added at p50 {ms(ours, 50) - ms(peer, 50):+.2f} ms")
        routed_ = results[("routed", stream)]
        print(f"{kind:8} captured, slots and replay: p50 {ms(routed_, 50):.2f} ms  p95 {ms(routed_, 95):.2f} ms"
              f"  added at p50 {ms(routed_, 50) - ms(peer, 50):+.2f} ms")
    print(f"installing the instrumentation once per process (fresh process, imports included):"
          f" {', '.join(f'{s:.2f} s' for s in installs)}")


if __name__ == "__main__":
    main()
