"""A small tool-using coding agent over any OpenAI-compatible chat endpoint: a loop of model
turns with a `bash` tool (run in the workspace) and a `finish` tool, every step written to
the trajectory. Standard library only.

    OPENAI_BASE_URL=https://api.openai.com/v1 OPENAI_API_KEY=sk-... \\
    EVALPIPE_AGENT_ENV=TOOL_AGENT_MODEL TOOL_AGENT_MODEL=gpt-4o-mini \\
    evalpipe run examples/coding/calc.yaml --agent python:examples/coding/tool_agent.py:solve --workspace

evalpipe runs `solve` in the sandbox, in a fresh checkout of the case's base commit
(`ctx.workspace`); what it leaves there is the output graded. `OPENAI_BASE_URL` and
`OPENAI_API_KEY` reach the sandbox by default; `TOOL_AGENT_MODEL` (default gpt-4o-mini)
and `TOOL_AGENT_MAX_TURNS` (default 30) only when named in `EVALPIPE_AGENT_ENV`.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from typing import Any

SYSTEM = (
    "You are a software engineer working in a git repository (your working directory). "
    "Fix the issue you are given by editing files with the bash tool; run the tests with "
    "$EVALPIPE_PYTHON -m pytest. Call finish when the fix is done."
)
TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a bash command in the repository; returns its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "finish", "description": "End the task; the repository's state is the answer.",
        "parameters": {"type": "object", "properties": {"summary": {"type": "string"}}}}},
]
COMMAND_TIMEOUT_S = 120
OUTPUT_CHARS = 10_000  # of a command's output sent back to the model


def solve(inputs: dict[str, Any], ctx: Any) -> str:
    task = inputs.get("problem_statement") or inputs.get("issue") or json.dumps(inputs)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": task}]
    ctx.record({"role": "user", "content": task})
    for _ in range(int(os.environ.get("TOOL_AGENT_MAX_TURNS", "30"))):
        message = _chat(messages)
        messages.append(message)
        calls = message.get("tool_calls") or []
        ctx.record({"role": "assistant", "content": message.get("content"),
                    "tool_calls": [c["function"] for c in calls]})
        if not calls:
            return message.get("content") or ""
        for call in calls:
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"] or "{}")
            if name == "finish":
                ctx.record({"tool": "finish", "summary": args.get("summary", "")})
                return args.get("summary", "")
            result = _bash(args.get("command", "")) if name == "bash" else f"unknown tool {name!r}"
            ctx.record({"tool": name, "input": args, "output": result})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    raise RuntimeError("no finish within the turn limit")


def _chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    base = os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1").rstrip("/")
    body = {"model": os.environ.get("TOOL_AGENT_MODEL", "gpt-4o-mini"), "messages": messages,
            "tools": TOOLS}
    request = urllib.request.Request(
        f"{base}/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json",
                 "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]["message"]


def _bash(command: str) -> str:
    try:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"timed out after {COMMAND_TIMEOUT_S} s"
    return f"exit {done.returncode}\n{(done.stdout + done.stderr)[-OUTPUT_CHARS:]}"
