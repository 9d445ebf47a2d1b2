"""A sample's trajectory (`SampleTrace.trajectory`, see `tasks.agents.trajectory`) as text lines:
one line per step, for `runs show RUN --case ID` and the HTML report's failing and flaky
cases. Plain text; the report escapes it where it prints it."""

from __future__ import annotations

from collections.abc import Mapping

from tasks.trace import Trajectory
from tasks.trajectory import step_text

STEP_CHARS = 600  # of one step's line; the stored trajectory keeps all of it


def trajectory_lines(doc: Trajectory | None, step_chars: int = STEP_CHARS) -> list[str]:
    """The steps of a sample's trajectory, numbered; [] when it has none."""
    if doc is None:
        return []
    lines = [f"{i:>3}. {folded(step_text(step), step_chars)}" for i, step in enumerate(doc.entries, 1)]
    if cut := doc.truncated:
        lines.append(f"     [trajectory cut at {cut.cap_bytes} of its {cut.bytes} bytes]")
    if doc.stop:
        lines.append(f"     [stopped: {doc.stop}]")
    return lines


def folded(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, the cut saying how much it left out."""
    return text if len(text) <= limit else f"{text[:limit]} … ({len(text) - limit} more characters)"


def steps_text(steps: Mapping[str, float]) -> str:
    """A run's `agent_steps` in words, for the summary and the report."""
    return (f"{steps['total']:g} in {steps['samples']:g} trajectories"
            f" (mean {steps['mean']:g}, max {steps['max']:g} per sample)")
