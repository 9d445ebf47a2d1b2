"""Each test's measured seconds (tests/durations.json), so that two workers taking whole files
start with the longest: `pytest --dist loadfile` hands out files in collection order, and a
long file started last runs on alone while the other worker has nothing left. A file weighs
what its selected tests took (`make test-fast` leaves the slow ones out, and weighs less);
a test the table does not hold counts as a quick one. Only the order depends on the figures:
stale ones cost time, never a result.

Refresh after a full run: `pytest -n 2 --dist loadfile --junitxml=/tmp/t.xml`, then
`python tests/support/durations.py /tmp/t.xml` (writes tests/durations.json)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "durations.json"
# Tests quicker than QUICK_S are left out of the table and count as QUICK_AS (806 of 1,237
# took under 0.5 s in a full run: 0.073 s on average).
QUICK_S, QUICK_AS = 0.5, 0.07


def measured(junit_xml: Path) -> dict[str, float]:
    """Seconds per test id (setup, call and teardown) in a JUnit XML report, of the tests
    that took QUICK_S or more."""
    seconds = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module, within = parts[:2], parts[2:]
        took = float(case.get("time") or 0)
        if len(module) == 2 and took >= QUICK_S:
            seconds["::".join([f"{'/'.join(module)}.py", *within, case.get("name", "")])] = round(took, 1)
    return dict(sorted(seconds.items()))


def longest_first(node_ids: Sequence[str], table: dict[str, float]) -> list[str]:
    """The files of `node_ids`, the one whose tests took longest first."""
    weight: dict[str, float] = defaultdict(float)
    for node_id in node_ids:
        weight[node_id.split("::")[0]] += table.get(node_id, QUICK_AS)
    return sorted(weight, key=lambda path: -weight[path])


def load() -> dict[str, float]:
    try:
        return json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(measured(Path(sys.argv[1])), indent=0) + "\n")
