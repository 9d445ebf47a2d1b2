"""A sample's trajectory (`SampleTrace.trajectory`, see `tasks.agents.trajectory`) as text lines:
one line per step, for `runs show RUN --case ID` and the HTML report's failing and flaky
cases. Plain text; the report escapes it where it prints it."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping
from typing import Any

from tasks.trace import Trajectory
from tasks.trajectory import ModelTurn, ToolResult, call_text, parse_step

STEP_CHARS = 600  # of one step's line; the stored trajectory keeps all of it


def trajectory_lines(doc: Trajectory | None, step_chars: int = STEP_CHARS) -> list[str]:
    """The steps of a sample's trajectory, numbered; [] when it has none."""
    if doc is None:
        return []
    lines = [f"{i:>3}. {textwrap.shorten(_step_text(step), step_chars, placeholder=' …')}"
             for i, step in enumerate(doc.entries, 1)]
    if cut := doc.truncated:
        lines.append(f"     [trajectory cut at {cut.cap_bytes} of its {cut.bytes} bytes]")
    if doc.stop:
        lines.append(f"     [stopped: {doc.stop}]")
    return lines


def steps_text(steps: Mapping[str, float]) -> str:
    """A run's `agent_steps` in words, for the summary and the report."""
    return (f"{steps['total']:g} in {steps['samples']:g} trajectories"
            f" (mean {steps['mean']:g}, max {steps['max']:g} per sample)")


def _step_text(step: Mapping[str, Any]) -> str:
    """A model turn (`model: content  calls NAME(ARGS), ...  [tokens, seconds]`), a tool result
    (`-> NAME: result` or `-> NAME error: ...`), else `role: content`, `tool NAME: input ->
    output` (an agent's own shape), or the step's JSON."""
    typed = parse_step(0, step)
    if isinstance(typed, ModelTurn):
        text = "model:" + (f" {_flat(typed.content)}" if typed.content else "")
        if typed.tool_calls:
            text += "  calls " + ", ".join(call_text(c.name, c.arguments) for c in typed.tool_calls)
        took = [f"{typed.tokens} tokens" if typed.tokens is not None else "",
                f"{typed.latency_s:.2f} s" if typed.latency_s is not None else ""]
        return text + (f"  [{', '.join(t for t in took if t)}]" if any(took) else "")
    if isinstance(typed, ToolResult):
        head = f"-> {typed.name or typed.call_id}"
        return f"{head} error: {_flat(typed.error)}" if typed.error else f"{head}: {_flat(typed.content)}"
    rest = {k: v for k, v in step.items() if k not in ("role", "content", "tool", "input", "output", "text")}
    if "tool" in step:
        text = f"tool {step['tool']}: {_flat(step.get('input', ''))}"
        if "output" in step:
            text += f" -> {_flat(step['output'])}"
    elif "role" in step:
        text = f"{step['role']}: {_flat(step.get('content') or '')}"
    elif set(step) == {"text"}:
        return _flat(step["text"])
    else:
        return _flat(step)
    return f"{text} {_flat(rest)}" if any(v not in (None, [], "") for v in rest.values()) else text


def _flat(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return " ".join(text.split())

