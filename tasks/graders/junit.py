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
from collections.abc import Iterator
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


def _outcome(tags: set[str]) -> str:
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


# pytest writes testsuites > testsuite > testcase > failure: anything much deeper is not its
# report, and a tree of millions of nested elements is how a test makes the parser eat
# gigabytes. Read as a stream: each element is dropped once read.
MAX_DEPTH = 32
_CHUNK = 1 << 16


def parse_junit(xml: str | bytes | Path) -> Report:
    """Read pytest's JUnit XML (text or a file), streaming, in memory bounded by its depth.
    Raises `JUnitError` if it is not that."""
    parser = ET.XMLPullParser(events=("start", "end"))
    outcomes: dict[str, str] = {}
    by_address: dict[tuple[str, str], str] = {}
    stack: list[ET.Element] = []
    children: set[str] = set()  # the tags inside the open testcase
    try:
        for chunk in _chunks(xml):
            parser.feed(chunk)
            for event, elem in parser.read_events():
                if event == "start":
                    if not stack and elem.tag not in ("testsuites", "testsuite"):
                        raise JUnitError(f"not JUnit XML: root element <{elem.tag}>")
                    if stack and stack[-1].tag == "testcase":
                        children.add(elem.tag)
                    stack.append(elem)
                    if len(stack) > MAX_DEPTH:
                        raise JUnitError(f"not JUnit XML: elements nested deeper than {MAX_DEPTH}")
                    continue
                stack.pop()
                if elem.tag == "testcase":
                    _record(elem, children, outcomes, by_address)
                    children = set()
                if stack:
                    del stack[-1][-1]  # the element just closed is its parent's last child
        parser.close()
    except (ET.ParseError, OSError) as exc:
        raise JUnitError(f"unreadable JUnit XML: {exc}") from None
    return Report(outcomes=outcomes, by_address=by_address, tests=len(by_address))


def _chunks(xml: str | bytes | Path) -> Iterator[bytes]:
    if isinstance(xml, Path):
        with xml.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                yield chunk
        return
    data = xml.encode() if isinstance(xml, str) else xml
    if not data.strip():
        raise JUnitError("unreadable JUnit XML: empty")
    for start in range(0, len(data), _CHUNK):
        yield data[start : start + _CHUNK]


def _record(case: ET.Element, tags: set[str], outcomes: dict, by_address: dict) -> None:
    classname, name = case.get("classname", ""), case.get("name", "")
    result = _outcome(tags)
    _keep_worst(by_address, (classname, name), result)
    node_id = _node_id(classname, name, case.get("file"))
    if node_id is not None:
        _keep_worst(outcomes, node_id, result)
