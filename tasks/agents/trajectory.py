"""An agent's trajectory: the steps the `openai:` tool loop recorded (`capped`), or those it wrote as JSON lines to the file named by
`EVALPIPE_TRAJECTORY` (`ctx.trajectory`; `ctx.record` appends a step), read back with a cap (the run's
`max_trajectory_bytes`) for the sample's trace. Secrets are masked where every trace string is (`tasks.run.sampling`).

Each line is one step, a JSON object such as `{"role": "assistant", "content": ...}`,
`{"tool": "bash", "input": ..., "output": ...}`; a line that is not a JSON object is kept
as `{"text": line}`, so nothing an agent wrote is lost without saying so.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from tasks.trace import Trajectory, Truncation

TRAJECTORY_ENV = "EVALPIPE_TRAJECTORY"


def read_trajectory(path: Path, cap: int) -> Trajectory | None:
    """`{"steps": N, "entries": [...]}` from the JSON lines at `path` (None if there is no
    such regular file), its first `cap` bytes; `truncated` says how much more there was.
    Never follows a link: the agent made the file and could have pointed it anywhere."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            return None
        data = fh.read(cap)
    lines = data.split(b"\n")
    if info.st_size > cap and len(lines) > 1:
        lines = lines[:-1]  # the last line was cut at the cap
    entries = [_entry(line) for line in lines if line.strip()]
    if info.st_size > cap:
        return Trajectory(steps=len(entries), entries=entries, truncated=Truncation(cap_bytes=cap, bytes=info.st_size))
    return Trajectory(steps=len(entries), entries=entries)


def capped(entries: list[dict[str, Any]], cap: int, stop: str | None = None) -> Trajectory:
    """A trajectory the harness recorded (the `openai:` tool loop's): its entries up to `cap`
    bytes of JSON lines, as `read_trajectory` keeps an agent's file; `truncated` says how much
    there was."""
    lines = [json.dumps(e, ensure_ascii=False, default=str).encode("utf-8") + b"\n" for e in entries]
    total = sum(map(len, lines))
    if total <= cap:
        return Trajectory(steps=len(entries), entries=entries, stop=stop)
    kept, size = [], 0
    for entry, line in zip(entries, lines, strict=True):
        if size + len(line) > cap:
            break
        kept.append(entry)
        size += len(line)
    return Trajectory(steps=len(kept), entries=kept, truncated=Truncation(cap_bytes=cap, bytes=total), stop=stop)


def _entry(line: bytes) -> dict[str, Any]:
    text = line.decode("utf-8", "replace")
    try:
        value = json.loads(text)
    except ValueError:
        return {"text": text}
    return value if isinstance(value, dict) else {"text": text}

