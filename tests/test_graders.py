"""Assertion and predicate graders, the total wrapper, fingerprints and safety checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_python_tests import _case as hostile_case

from tasks.graders import grade, grader_fingerprint
from tasks.graders.assertions import parse_number
from tasks.graders.safety import output_violations, path_violations
from tasks.models import EvalCase, InputError, Status, Verdict
from tasks.trace import SampleTrace


def case(kind: str, reference: Any = None, safety: dict | None = None, **params: Any) -> EvalCase:
    return EvalCase(id="c1", reference=reference, grader={"kind": kind, **params}, safety=safety)


@pytest.mark.parametrize(
    ("output", "grader", "status"),
    [
        ("Paris", case("exact", "Paris"), Status.passed),
        (" paris\n", case("exact", "Paris"), Status.failed),
        ("  PARIS  is\n\tnice ", case("exact", "Paris is nice", normalize=True), Status.passed),
        ("the city of Paris", case("contains", "Paris"), Status.passed),
        ("the city of paris", case("contains", "Paris"), Status.failed),
        ("the city of paris", case("contains", "Paris", case_sensitive=False), Status.passed),
        ("order 66", case("regex", pattern=r"\d+"), Status.passed),
        ("order 66", case("regex", pattern=r"\d+", fullmatch=True), Status.failed),
        ("66", case("regex", pattern=r"\d+", fullmatch=True), Status.passed),
        ("The answer is 1,000.5 km/s", case("numeric", 1000.5), Status.passed),
        ("about 3.14159", case("numeric", "3.14", abs_tol=0.01), Status.passed),
        ("about 3.2", case("numeric", 3.14, abs_tol=0.01), Status.failed),
        ("105", case("numeric", 100, rel_tol=0.1), Status.passed),
        ("no digits here", case("numeric", 1), Status.failed),
        ('{"a": 1, "b": [true]}', case("json", {"b": [True], "a": 1.0}), Status.passed),
        ('{"a": true}', case("json", {"a": 1}), Status.failed),
        (
            '```json\n{"a": 1, "x": 0}\n```',
            case("json", {"a": 1, "y": 2}, fields=["a"]),
            Status.passed,
        ),
        ('{"x": 0}', case("json", {"a": 1}, fields=["a"]), Status.failed),
        ("[1, 2]", case("json", {"a": 1}, fields=["a"]), Status.failed),
        ("not json", case("json", {"a": 1}), Status.failed),
        ("NaN", case("json", 1), Status.failed),
    ],
)
def test_assertion_graders(output: str, grader: EvalCase, status: Status) -> None:
    verdict = grade(output, grader)
    assert verdict.status is status, verdict.detail
    assert verdict.passed == (status is Status.passed)
    assert verdict.score == (1.0 if verdict.passed else 0.0)


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The answer is 1,000.5 km/s", 1000.5),
        ("42", 42.0),
        ("-7 degrees", -7.0),
        ("\u22123.5", -3.5),
        ("It went from 3 to 5", 5.0),
        ("#### 72", 72.0),
        ("The answer is 12, not 13", 12.0),
        ("\\boxed{3/4}", 0.75),
        ("50% of them", 50.0),
        ("1e3", 1000.0),
        ("H2O and x86", None),
        ("3-5", 5.0),
        ("", None),
    ],
)
def test_number_parsing(text: str, number: float | None) -> None:
    assert parse_number(text) == number


@pytest.mark.parametrize(
    "bad",
    [
        case("exact"),  # no reference
        case("numeric", "many"),
        case("numeric", True),
        case("json", {"a": 1}, fields=["b"]),
        case("predicate", function="no_such_module_xyz:fn"),
    ],
)
def test_malformed_grader_specs_are_errors(bad: EvalCase) -> None:
    verdict = grade("1", bad)
    assert verdict.status is Status.error and not verdict.passed
    assert verdict.detail


@pytest.mark.parametrize(
    ("kind", "params", "field"),
    [
        ("regex", {"pattern": "("}, "grader.pattern: invalid regex"),
        ("regex", {}, "grader.pattern: required"),
        ("numeric", {"abs_tol": -1}, "grader.abs_tol"),
        ("exact", {"normalize": "yes"}, "grader.normalize"),
        ("exact", {"normalise": True}, "grader.normalise: not a parameter of exact graders"),
        ("predicate", {}, "grader.function: required"),
    ],
)
def test_malformed_grader_parameters_are_refused_when_the_case_is_made(kind, params, field) -> None:
    with pytest.raises(ValueError, match=field):
        case(kind, "1", **params)


def test_a_copied_case_with_bad_parameters_still_grades_as_an_error() -> None:
    bad = case("regex", pattern="a").model_copy(update={"grader": {"kind": "regex"}})
    verdict = grade("a", bad)
    assert verdict.status is Status.error and "grader.pattern: required" in verdict.detail


PREDICATES = """
import numpy

def is_upper(output, case):
    return output.isupper()

def raises(output, case):
    raise RuntimeError("predicate broke")

def exits(output, case):
    raise SystemExit(3)

def ambiguous(output, case):
    return numpy.array([1, 2])

def full_verdict(output, case):
    from tasks.models import Verdict
    return Verdict.ok("custom", score=0.5)

def sandboxed(output, case):
    from tasks.sandbox import run_python
    return run_python(output).stdout == b"42\\n"
"""


@pytest.fixture
def predicates(tmp_path: Path) -> Path:
    path = tmp_path / "preds.py"
    path.write_text(PREDICATES)
    return path


@pytest.mark.parametrize(
    ("func", "output", "status"),
    [
        ("is_upper", "LOUD", Status.passed),
        ("is_upper", "quiet", Status.failed),
        ("raises", "x", Status.error),
        ("exits", "x", Status.error),
        ("ambiguous", "x", Status.error),
        ("full_verdict", "x", Status.passed),
        ("sandboxed", "print(6 * 7)", Status.passed),
        ("sandboxed", "import os; os.kill(os.getppid(), 9)", Status.failed),
    ],
)
def test_predicate(predicates: Path, func: str, output: str, status: Status, mode: str) -> None:
    if (func, mode) == ("sandboxed", "rlimits") and "kill" in output:
        pytest.skip("only bubblewrap holds this: the predicate's process is not its namespace's init")
    verdict = grade(output, case("predicate", function=f"{predicates}:{func}"))
    assert verdict.status is status, verdict.detail
    if func == "raises":
        assert "RuntimeError: predicate broke" in verdict.detail
        assert "Traceback" in verdict.detail


def test_predicate_fingerprint_follows_its_code(predicates: Path) -> None:
    c = case("predicate", function=f"{predicates}:is_upper")
    before = grader_fingerprint(c)
    assert grader_fingerprint(c) == before
    predicates.write_text(PREDICATES + "\n# edited\n")
    assert grader_fingerprint(c) != before


def test_fingerprint_covers_kind_parameters_reference_and_version() -> None:
    base = grader_fingerprint(case("exact", "a"))
    assert len(base) == 64 and base == grader_fingerprint(case("exact", "a"))
    others = {
        grader_fingerprint(case("exact", "b")),
        grader_fingerprint(case("exact", "a", normalize=True)),
        grader_fingerprint(case("contains", "a")),
    }
    assert base not in others and len(others) == 3


def test_registry_decorator_and_total_wrapper(monkeypatch) -> None:
    from tasks import registry
    from tasks.params import HumanParams

    monkeypatch.setattr(registry, "_GRADERS", dict(registry._GRADERS))  # undone after the test
    calls = []

    @registry.grader("explode", params=HumanParams, version="7")
    def explode(output: str, c: EvalCase, params: HumanParams, *, trace: dict) -> Verdict:
        calls.append((output, params))
        trace["notes"] = ["about to fail"]
        raise ZeroDivisionError("boom")

    assert "explode" in registry.grader_kinds()
    trace = SampleTrace()
    verdict = grade("out", case("explode"), trace)
    assert calls == [("out", HumanParams())] and trace.to_dict() == {"notes": ["about to fail"]}
    assert verdict.status is Status.error
    assert "ZeroDivisionError: boom" in verdict.detail
    v7 = grader_fingerprint(case("explode"))

    del registry._GRADERS["explode"]

    @registry.grader("explode", params=HumanParams, version="8")
    def wrong_type(output: str, c: EvalCase, params: HumanParams) -> Verdict:
        return "yes"  # type: ignore[return-value]

    assert grade("out", case("explode")).status is Status.error
    assert grader_fingerprint(case("explode")) != v7
    with pytest.raises(ValueError, match="already registered by test_graders"):
        registry.grader("explode", params=HumanParams)(explode)


def test_non_string_output_is_an_error() -> None:
    assert grade(b"bytes", case("exact", "bytes")).status is Status.error  # type: ignore[arg-type]


def test_safety_patterns_never_change_passed() -> None:
    safety = {"forbidden_patterns": [r"sk-[A-Za-z0-9]{8}", "CANARY"]}
    leaked = grade("Paris sk-abcdefgh", case("contains", "Paris", safety=safety))
    assert leaked.passed and leaked.safety == (
        r"output matches forbidden pattern 'sk-[A-Za-z0-9]{8}'",
    )
    failed = grade("CANARY", case("exact", "x", safety=safety))
    assert failed.status is Status.failed and len(failed.safety) == 1
    assert grade("Paris", case("contains", "Paris", safety=safety)).safety == ()


def test_broken_safety_rule_fails_closed() -> None:
    verdict = grade("Paris", case("contains", "Paris", safety={"forbidden_patterns": ["("]}))
    assert verdict.passed and verdict.safety and "safety check failed" in verdict.safety[0]


def test_path_violations() -> None:
    safety = {"forbidden_files": ["secrets/*", "*.pem", ".github"]}
    paths = ["src/a.py", "secrets/key.txt", "deploy/cert.pem", ".github/workflows/ci.yml"]
    found = path_violations(paths, safety)
    assert len(found) == 3 and all("forbidden file" in v for v in found)
    assert path_violations(paths, None) == [] and path_violations(["./ok.py"], safety) == []
    with pytest.raises(InputError):
        path_violations(paths, {"forbidden_files": 3})


def test_output_violations_without_rules() -> None:
    assert output_violations("anything", None) == []
    assert output_violations("anything", {}) == []


ASSERTION_CASES = [
    case("exact", "x"),
    case("exact", "x", normalize=True),
    case("contains", "x", case_sensitive=False),
    case("regex", pattern=r"(a|b)+$", fullmatch=True),
    case("numeric", 3.5, abs_tol=0.1),
    case("json", {"a": [1, {"b": None}]}),
    case("json", {"a": 1}, fields=["a"]),
    case("exact", "x", safety={"forbidden_patterns": ["secret"]}),
]
texts = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=2000),
    st.binary(max_size=500).map(lambda b: b.decode("latin-1")),
    st.sampled_from(["", "[" * 100_000, "9" * 5000, "1e999", "{" * 10 + "}" * 10, "\x00\udcff"]),
    st.integers(1, 4).map(lambda n: "x" * (n * 1_000_000)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(output=texts, which=st.integers(0, len(ASSERTION_CASES) - 1))
def test_graders_are_total_over_arbitrary_strings(output: str, which: int) -> None:
    verdict = grade(output, ASSERTION_CASES[which])
    assert isinstance(verdict, Verdict)
    assert verdict.passed == (verdict.status is Status.passed)


@settings(max_examples=25, deadline=None)
@given(
    output=st.one_of(
        st.text(max_size=300), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))
    )
)
def test_python_tests_grader_is_total(output: str) -> None:
    verdict = grade(output, hostile_case(timeout_s=2))
    assert verdict.status in {Status.failed, Status.empty, Status.timeout, Status.passed}
