"""Grader parameters are typed per kind and checked when the suite loads (exit 2 naming
the case and the field), while a case keeps hashing its grader mapping as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tasks.graders import grade
from tasks.models import EvalCase, Status
from tasks.suites.dataset import load_suite

ROOT = Path(__file__).resolve().parent.parent

PYTHON_TESTS = "entry_point: f, test: 'def check(c): assert c(1) == 2'"
REPO = "repo: /nowhere, base_commit: abc123, fail_to_pass: [t]"

MISTAKES = {
    "typo": ("kind: exact, normalise: true", "grader.normalise: not a parameter of exact graders"),
    "missing": ("kind: regex", "grader.pattern: required by regex graders"),
    "bad-regex": ("kind: regex, pattern: '('", "grader.pattern: invalid regex"),
    "wrong-type": (f"kind: python_tests, {PYTHON_TESTS}, timeout_s: ten", "grader.timeout_s"),
    "bool-number": (f"kind: python_tests, {PYTHON_TESTS}, memory_mb: true", "grader.memory_mb"),
    "flag": ("kind: contains, case_sensitive: 'no'", "grader.case_sensitive"),
    "nested": (f"kind: repo_tests, {REPO}, environment: {{pyton: '3.11'}}",
               "grader.environment.pyton: not a parameter of repo_tests graders"),
    "judge": ("kind: judge, function: 'm:f', samples: 0", "grader.samples"),
    "test_cmd": (f"kind: repo_tests, {REPO}, test_cmd: pytest", "grader.test_cmd: must write JUnit XML"),
}


def write_suite(tmp_path: Path, grader: str) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(f"name: s\ncases:\n  - {{id: ok, reference: x, grader: {{kind: exact}}}}\n"
                    f"  - {{id: bad-one, reference: x, grader: {{{grader}}}}}\n")
    return path


def evalpipe(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "EVALPIPE_HOME": str(home), "HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_kind_of_mistake_is_bad_input_at_suite_hash(tmp_path, mistake):
    grader, field = MISTAKES[mistake]
    done = evalpipe("suite", "hash", str(write_suite(tmp_path, grader)), home=tmp_path / "home")
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "'bad-one'" in line and field in line and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["suite", "validate", "{suite}"], ["run", "{suite}", "--agent", "reference"]])
def test_validate_and_run_refuse_before_anything_runs(tmp_path, command):
    suite = write_suite(tmp_path, MISTAKES["typo"][0])
    done = evalpipe(*(arg.format(suite=suite) for arg in command), home=tmp_path / "home")
    assert done.returncode == 2 and "grader.normalise" in done.stderr and "'bad-one'" in done.stderr
    assert not (tmp_path / "home" / "evalpipe.duckdb").exists()  # nothing half-written


def test_numbers_read_alike_in_both_sandboxed_kinds_and_the_mapping_is_hashed_as_written(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\ncases:\n  - {{id: p, grader: {{kind: python_tests, {PYTHON_TESTS}, timeout_s: '10'}}}}\n"
                    f"  - {{id: r, grader: {{kind: repo_tests, {REPO}, timeout_s: '10'}}}}\n")
    suite = load_suite(path)
    assert suite.case("p").params.timeout_s == suite.case("r").params.timeout_s == 10.0
    assert suite.case("p").grader["timeout_s"] == "10"  # checked, not rewritten
    same = EvalCase(id="p", grader=suite.case("p").grader)
    assert same.case_hash == suite.case("p").case_hash


def test_suite_grader_defaults_apply_to_the_kinds_that_take_them(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ngrader_defaults: {timeout_s: 30, normalize: true}\ncases:\n"
                    "  - {id: e, reference: X, grader: {kind: exact}}\n"
                    f"  - {{id: p, grader: {{kind: python_tests, {PYTHON_TESTS}}}}}\n")
    suite = load_suite(path)
    assert suite.case("e").grader == {"kind": "exact", "normalize": True}
    assert suite.case("p").params.timeout_s == 30.0
    assert grade(" x ", suite.case("e")).status is Status.passed


def test_one_registry_of_kinds():
    from tasks.params import ExactParams
    from tasks.registry import grader, grader_kinds, grader_spec, runs_code

    builtin = {"exact", "contains", "regex", "numeric", "json", "predicate", "python_tests", "repo_tests",
               "judge", "human"}
    assert builtin <= grader_kinds()
    assert {k for k in builtin if runs_code(k)} == {"predicate", "python_tests", "repo_tests"}
    assert {k for k in builtin if not grader_spec(k).oracle} == {"judge", "human"}
    with pytest.raises(ValueError, match="already registered by tasks.graders.assertions.exact"):
        grader("exact", params=ExactParams)(lambda output, case, params: None)
    with pytest.raises(ValueError, match="pydantic model"):
        grader("telepathy", params=dict)
