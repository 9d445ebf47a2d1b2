"""A sample's trajectory (`SampleTrace.trajectory`, see `tasks.agents.trajectory`) as text lines:
one line per step, for `runs show RUN --case ID` and the HTML report's failing and flaky
cases. Plain text; the report escapes it where it prints it."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping
from typing import Any

from tasks.trace import Trajectory

STEP_CHARS = 600  # of one step's line; the stored trajectory keeps all of it


def trajectory_lines(doc: Trajectory | None, step_chars: int = STEP_CHARS) -> list[str]:
    """The steps of a sample's trajectory, numbered; [] when it has none."""
    if doc is None:
        return []
    lines = [f"{i:>3}. {textwrap.shorten(_step_text(step), step_chars, placeholder=' …')}"
             for i, step in enumerate(doc.entries, 1)]
    if cut := doc.truncated:
        lines.append(f"     [trajectory cut at {cut.cap_bytes} of its {cut.bytes} bytes]")
    return lines


def steps_text(steps: Mapping[str, float]) -> str:
    """A run's `agent_steps` in words, for the summary and the report."""
    return (f"{steps['total']:g} in {steps['samples']:g} trajectories"
            f" (mean {steps['mean']:g}, max {steps['max']:g} per sample)")


def _step_text(step: Mapping[str, Any]) -> str:
    """`role: content`, `tool NAME: input -> output`, or the step's JSON."""
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

