"""JUnit XML written by a real pytest run, read back into outcomes per node id."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tasks.graders.junit import JUnitError, junit_address, parse_junit

SUITE = {
    "tests/unit/test_mod.py": """
import pytest

def test_ok():
    pass

def test_bad():
    assert False

@pytest.mark.parametrize("x", [1, "a/b::c", "d[e]", "sp ace"])
def test_param(x):
    assert x != 1

@pytest.mark.skip(reason="no")
def test_skipped():
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_setup_error(broken):
    pass

class TestGroup:
    def test_method(self):
        pass

    class TestInner:
        @pytest.mark.parametrize("n", [0, 1])
        def test_deep(self, n):
            assert n == 0
""",
    "test_top.py": "def test_top():\n    pass\n",
}

EXPECTED = {
    "tests/unit/test_mod.py::test_ok": "passed",
    "tests/unit/test_mod.py::test_bad": "failed",
    "tests/unit/test_mod.py::test_param[1]": "failed",
    "tests/unit/test_mod.py::test_param[a/b::c]": "passed",
    "tests/unit/test_mod.py::test_param[d[e]]": "passed",
    "tests/unit/test_mod.py::test_param[sp ace]": "passed",
    "tests/unit/test_mod.py::test_skipped": "skipped",
    "tests/unit/test_mod.py::test_xfail": "skipped",
    "tests/unit/test_mod.py::test_setup_error": "error",
    "tests/unit/test_mod.py::TestGroup::test_method": "passed",
    "tests/unit/test_mod.py::TestGroup::TestInner::test_deep[0]": "passed",
    "tests/unit/test_mod.py::TestGroup::TestInner::test_deep[1]": "failed",
    "test_top.py::test_top": "passed",
}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("junit")
    for rel, text in SUITE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def run_pytest(root: Path, family: str) -> Path:
    out = root / f"{family}.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={out}",
         "-o", f"junit_family={family}", "--rootdir", str(root), "."],
        cwd=root, capture_output=True, check=False,
    )  # fmt: skip
    return out


def test_node_ids_are_recovered_exactly_from_xunit1(project: Path) -> None:
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "."],
        cwd=project, capture_output=True, text=True,
    ).stdout.splitlines()  # fmt: skip
    assert set(EXPECTED) <= set(collected)  # the ids above are pytest's own
    report = parse_junit(run_pytest(project, "xunit1"))
    assert report.outcomes == EXPECTED
    assert report.tests == len(EXPECTED)


def test_xunit2_without_file_is_matched_through_the_address(project: Path) -> None:
    report = parse_junit(run_pytest(project, "xunit2"))
    assert {node: report.outcome(node) for node in EXPECTED} == EXPECTED
    assert report.outcome("tests/unit/test_mod.py::test_never_written") == "missing"


def test_address_mangling_matches_pytest() -> None:
    assert junit_address("a/b/test_c.py::TestX::test_y[p::q/r]") == (
        "a.b.test_c.TestX",
        "test_y[p::q/r]",
    )
    assert junit_address("test_top.py::test_top") == ("test_top", "test_top")


def test_collection_error_and_duplicates_keep_the_worst() -> None:
    xml = """<testsuites><testsuite tests="3">
      <testcase classname="test_a" name="test_x" file="test_a.py"/>
      <testcase classname="test_a" name="test_x" file="test_a.py"><error message="teardown"/></testcase>
      <testcase classname="" name="test_b"><error message="collection failure"/></testcase>
    </testsuite></testsuites>"""
    report = parse_junit(xml)
    assert report.outcome("test_a.py::test_x") == "error"
    assert report.outcome("test_b.py::test_y") == "missing"


@pytest.mark.parametrize("text", ["", "not xml", "<html><body/></html>"])
def test_non_junit_is_refused(text: str) -> None:
    with pytest.raises(JUnitError):
        parse_junit(text)


def test_a_deeply_nested_report_is_refused_without_building_it() -> None:
    """5 M nested elements used to build a 1.5 GB tree; the stream stops at the depth bound."""
    depth = 200_000
    xml = b"<testsuites><testsuite>" + b"<x>" * depth + b"</x>" * depth + b"</testsuite></testsuites>"
    with pytest.raises(JUnitError, match="nested deeper"):
        parse_junit(xml)


def test_a_report_is_read_in_a_stream_whatever_its_size(tmp_path) -> None:
    failure = '<failure message="no">trace</failure>'
    cases = "".join(f'<testcase classname="test_a" name="test_{i}" file="test_a.py">'
                    f'{failure if i % 2 else ""}</testcase>' for i in range(20_000))
    path = tmp_path / "r.xml"
    path.write_text(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")
    report = parse_junit(path)
    assert report.tests == 20_000
    assert report.outcome("test_a.py::test_0") == "passed" and report.outcome("test_a.py::test_1") == "failed"
