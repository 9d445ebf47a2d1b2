"""Per-test outcomes from JUnit XML, keyed by pytest node ids (`path::Class::test[param]`).

pytest writes each test as `<testcase classname=... name=...>`: `classname` is the node
id's path with `/` turned into `.` and `.py` dropped, followed by the class chain, and
`name` is the function with its parameters. With `junit_family=xunit1` it also writes
`file`, which makes the node id recoverable exactly; without it the module/class split
is ambiguous, so every test is also indexed under pytest's own mangling of the id, and
`Report.outcome` looks up either way. A test that is not in the file is `missing`.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

PASSED, FAILED, ERROR, SKIPPED, MISSING = "passed", "failed", "error", "skipped", "missing"
# When a test appears more than once (a teardown error, a rerun plugin) the worst counts.
_RANK = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}


class JUnitError(ValueError):
    """The file is not JUnit XML: no evidence that any test ran."""


@dataclass(frozen=True)
class Report:
    outcomes: dict[str, str]  # node id → passed | failed | error | skipped
    by_address: dict[tuple[str, str], str] = field(default_factory=dict)
    tests: int = 0

    def outcome(self, node_id: str) -> str:
        if node_id in self.outcomes:
            return self.outcomes[node_id]
        return self.by_address.get(junit_address(node_id), MISSING)


def junit_address(node_id: str) -> tuple[str, str]:
    """(classname, name) as pytest's junitxml writes them for `node_id`."""
    path, bracket, params = node_id.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def _outcome(case: ET.Element) -> str:
    tags = {child.tag for child in case}
    if "error" in tags:
        return ERROR
    if "failure" in tags:
        return FAILED
    if "skipped" in tags:  # also pytest's xfail: expected to fail is not a pass
        return SKIPPED
    return PASSED


def _node_id(classname: str, name: str, file: str | None) -> str | None:
    if not file:
        return None
    module = re.sub(r"\.py$", "", file.replace("/", "."))
    if classname == module:
        return f"{file}::{name}"
    if classname.startswith(module + "."):
        return "::".join([file, *classname[len(module) + 1 :].split("."), name])
    return None  # defined in another file (an inherited test): only the address is known


def _keep_worst(index: dict, key: object, result: str) -> None:
    if _RANK[result] >= _RANK[index.get(key, PASSED)]:
        index[key] = result


def parse_junit(xml: str | bytes | Path) -> Report:
    """Read pytest's JUnit XML (text or a file). Raises `JUnitError` if it is not that."""
    try:
        root = ET.parse(xml).getroot() if isinstance(xml, Path) else ET.fromstring(xml)
    except (ET.ParseError, OSError) as exc:
        raise JUnitError(f"unreadable JUnit XML: {exc}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise JUnitError(f"not JUnit XML: root element <{root.tag}>")
    outcomes: dict[str, str] = {}
    by_address: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        result = _outcome(case)
        _keep_worst(by_address, (classname, name), result)
        node_id = _node_id(classname, name, case.get("file"))
        if node_id is not None:
            _keep_worst(outcomes, node_id, result)
    return Report(outcomes=outcomes, by_address=by_address, tests=len(by_address))
