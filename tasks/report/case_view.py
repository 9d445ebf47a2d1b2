"""What the agent said on one case of a run, sample by sample, with the grader's verdict,
detail and timing (`evalpipe runs show RUN_ID --case ID`): one document, as text."""

from __future__ import annotations

import json
from typing import Any

from tasks.models import InputError
from tasks.report.trajectory import trajectory_lines
from tasks.run.stored import output_text
from tasks.trace import SampleTrace

# The text form clips each output and detail; `--json` has them whole.
MAX_TEXT_CHARS = 4000
SAMPLE_KEYS = ("sample_index", "seed", "status", "passed", "score", "duration_s", "cached", "detail", "safety",
               "output", "trace")


def case_doc(run_id: str, case_id: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The samples' document; a long output stays a `StoredOutput`, read when it is printed
    (the text clips it, `--json` takes its `str`), so one is held at a time."""
    if not samples:
        raise InputError(f"run {run_id}: no case {case_id!r} (no samples stored for it)")
    rows = []
    for s in samples:
        row = {key: s.get(key) for key in SAMPLE_KEYS}
        if isinstance(row["trace"], str):
            row["trace"] = json.loads(row["trace"])
        rows.append(row)
    return {"run_id": run_id, "case_id": case_id, "n": len(rows), "c": sum(bool(r["passed"]) for r in rows),
            "samples": rows}


def case_text(doc: dict[str, Any]) -> str:
    lines = [f"run {doc['run_id']}  case {doc['case_id']}: {doc['c']}/{doc['n']} samples passed"]
    for s in doc["samples"]:
        timing = f"{s['duration_s']:.3f}s" if s["duration_s"] is not None else "?"
        score = "?" if s["score"] is None else f"{s['score']:g}"
        lines.append(f"#{s['sample_index']} {s['status']}  score {score}  {timing}"
                     f"{'  (cached)' if s['cached'] else ''}  seed {s['seed']}")
        if s["detail"]:
            lines.append(f"  detail: {_clip(s['detail'])}")
        for violation in s["safety"] or []:
            lines.append(f"  SAFETY: {violation}")
        trace = SampleTrace.parse(s["trace"])
        for extra in trace.extra_graders or ():  # every grader's verdict, the failing ones' why
            lines.append(f"  grader {extra.label}: {extra.verdict.status.value}"
                         + (f": {_clip(extra.verdict.detail)}" if extra.verdict.detail else ""))
        lines.extend(_output_lines(_clip(output_text(s["output"] or ""))))
        if steps := trajectory_lines(trace.trajectory):  # what the agent did
            lines += [f"  trajectory: {trace.trajectory.steps} step(s)", *(f"  {step}" for step in steps)]
    return "\n".join(lines)


def _output_lines(output: str) -> list[str]:
    """One line quoted (so a trailing space or an empty answer shows), several (a coding
    agent's patch) as they read, indented, with control characters (a terminal's escape
    sequences) escaped."""
    if "\n" not in output.rstrip("\n"):
        return [f"  output: {output!r}"]
    return ["  output:", *(f"    {_printable(line)}" for line in output.rstrip("\n").split("\n"))]


def _printable(line: str) -> str:
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in line)


def _clip(text: str | None) -> str:
    text = text or ""
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS] + f"… ({len(text)} chars; --json has all)"
