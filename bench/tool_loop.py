"""What does the `openai:` agent's tool loop cost the harness per model turn? (printed, not asserted)

The scripted model of examples/tools (a server in a process of its own, so its CPU is not
counted) answers the example suite's cases. Measured in this process: its CPU time per model
turn for
- the peer: a hand-written loop on the same OpenAI SDK client (ask with the tools, answer each
  call from the case's world with a dict lookup, send the results back), and
- evalpipe's loop (`OpenAIAgent.generate`: the typed tool calls, the world's rules, the JSON
  schema check of the arguments, the trajectory with usage per turn, its cap).
The difference is what the loop adds per turn; the issue's target is at most 1 ms.

Usage: python bench/tool_loop.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "examples" / "tools" / "support.yaml"


def serve() -> tuple[subprocess.Popen, str]:
    port = 18000 + os.getpid() % 1000
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples/tools/scripted_model.py"), "--port", str(port)],
                            stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # "serving ...": it listens
    return proc, f"http://127.0.0.1:{port}/v1"


def peer_loop(client, case, max_steps: int = 6) -> int:
    """A hand-written loop: what a team writes without a harness. Returns its turns."""
    inputs = case.inputs
    world = {name: rules for name, rules in inputs["world"].items()}
    tools = [t if "type" in t else {"type": "function", "function": t} for t in inputs["tools"]]
    messages = [{"role": "user", "content": inputs["question"]}]
    for turn in range(1, max_steps + 1):
        reply = client.chat.completions.create(model="support-good", messages=messages, tools=tools, seed=1)
        message = reply.choices[0].message
        if not message.tool_calls:
            return turn
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            rule = next((r for r in world.get(call.function.name, []) if all(
                args.get(k) == v for k, v in (r.get("when") or {}).items())), None)
            content = json.dumps(rule["result"]) if rule else "error: no rule"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return max_steps


def cpu_per_turn(run, cases, rounds: int) -> tuple[float, int]:
    for case in cases:  # warm: the SDK's modules, the client, the schema validators
        run(case)
    turns, started = 0, time.process_time()
    for _ in range(rounds):
        for case in cases:
            turns += run(case)
    return (time.process_time() - started) / turns * 1e3, turns


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    proc, url = serve()
    try:
        os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = url, "sk-bench"
        import openai

        from tasks.agents import load_agent
        from tasks.agents.base import AgentContext
        from tasks.suites.dataset import load_suite

        cases = load_suite(SUITE).cases
        client = openai.OpenAI(base_url=url, api_key="sk-bench", max_retries=0)
        agent = load_agent("openai:support-good?max_steps=6")

        def ours(case) -> int:
            ctx = AgentContext(case_id=case.id, index=0, seed=1, n=1)
            agent.generate(case, ctx)
            return len(ctx.trace.trajectory.typed.turns)

        peer_ms, peer_turns = cpu_per_turn(lambda case: peer_loop(client, case), cases, args.rounds)
        ours_ms, our_turns = cpu_per_turn(ours, cases, args.rounds)
    finally:
        proc.terminate()
        proc.wait()
    print(f"load {os.getloadavg()[0]:.2f}; {len(cases)} cases x {args.rounds} rounds")
    print(f"peer, a hand-written loop on the SDK: {peer_ms:.3f} ms CPU per model turn ({peer_turns} turns)")
    print(f"evalpipe's tool loop:                 {ours_ms:.3f} ms CPU per model turn ({our_turns} turns)")
    print(f"added by the loop: {ours_ms - peer_ms:+.3f} ms per turn (target: at most 1 ms)")


if __name__ == "__main__":
    main()
