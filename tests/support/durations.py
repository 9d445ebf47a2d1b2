"""Each test file's measured seconds (tests/durations.json), so that two workers taking whole
files start with the longest: `pytest --dist loadfile` hands out files in collection order, and
a long file started last runs on alone while the other worker has nothing left. Only the order
depends on the figures; stale ones cost time, never a result.

Refresh after a full run: `pytest -n 2 --dist loadfile --junitxml=/tmp/t.xml`, then
`python tests/support/durations.py /tmp/t.xml` (writes tests/durations.json)."""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "durations.json"


def measured(junit_xml: Path) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of its tests) in a JUnit XML report."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        if len(module) > 1:
            seconds[f"{'/'.join(module[:2])}.py"] += float(case.get("time") or 0)
    return {path: round(s, 1) for path, s in sorted(seconds.items())}


def longest_first(paths: Sequence[str], table: dict[str, float]) -> list[str]:
    """`paths` (test files, relative to the repository), the longest first; a file the table
    does not know counts as a median one."""
    default = statistics.median(table.values()) if table else 0.0
    return sorted(paths, key=lambda path: -table.get(path, default))


def load() -> dict[str, float]:
    try:
        return json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(measured(Path(sys.argv[1])), indent=1) + "\n")
