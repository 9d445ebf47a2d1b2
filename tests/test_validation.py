"""`suite validate`: broken, flaky and vacuous cases are found; sound ones pass."""

from __future__ import annotations

import json
import os
from pathlib import Path

from support.cli import in_process

from tasks.graders.validation import check_case, validation_report
from tasks.suites.dataset import build_suite

ROOT = Path(__file__).resolve().parent.parent


def case(data: dict):
    return build_suite("v", [("case", data)], {}, source="t").cases[0]


def test_sound_broken_and_flaky_cases(tmp_path: Path):
    predicate = tmp_path / "alternate.py"
    # State in the predicate's process (it runs in the sandbox, where files it could write vanish).
    predicate.write_text(
        "calls = [0]\n"
        "def check(output, case):\n"
        "    calls[0] += 1\n"
        "    return bool(output) and calls[0] % 2 == 1\n"
    )
    sound = check_case(case({"id": "ok", "reference": "Paris", "grader": {"kind": "exact"}}), 3)
    broken = check_case(case({"id": "bad", "reference": 3, "grader": {"kind": "regex", "pattern": "^4$"}}), 3)
    flaky = check_case(case({"id": "fl", "reference": "x", "grader": {"kind": "predicate",
                                                                       "function": f"{predicate}:check"}}), 4)
    assert sound.problem is None and sound.reference_statuses == ("passed",) * 3
    assert broken.problem == "broken"
    assert flaky.problem == "flaky" and set(flaky.reference_statuses) == {"passed", "failed"}
    report = validation_report([sound, broken, flaky], "v" * 64, 3)
    assert not report["valid"] and [c["case_id"] for c in report["broken"]] == ["bad"]


def test_vacuous_repo_case_where_the_fail_to_pass_test_already_passes(calc_repo, home):
    path, base = calc_repo
    reference = "calc.py\n<<<<<<< SEARCH\n    return abs(a) + b\n=======\n    return a + b\n>>>>>>> REPLACE\n"
    grader = {"kind": "repo_tests", "repo": str(path), "base_commit": base, "allowed_files": ["calc.py"],
              "fail_to_pass": ["test_calc.py::test_negative"], "pass_to_pass": ["test_calc.py::test_positive"]}
    sound = check_case(case({"id": "s", "reference": reference, "grader": grader}), 1)
    assert sound.problem is None and sound.empty_status == "failed"
    # test_positive already passes before any fix: as FAIL_TO_PASS it proves nothing.
    vacuous = {**grader, "fail_to_pass": ["test_calc.py::test_positive"], "pass_to_pass": []}
    checked = check_case(case({"id": "v", "reference": reference, "grader": vacuous}), 1)
    assert checked.reference_statuses == ("passed",) and checked.problem == "vacuous"


def test_cli_validate_exit_codes(prefect_harness, tmp_path: Path, home: Path):
    good = tmp_path / "good.yaml"
    good.write_text("name: g\ncases:\n  - {id: a, reference: yes, grader: {kind: exact}}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\ncases:\n  - {id: a, reference: yes, grader: {kind: regex, pattern: '^no$'}}\n")
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}
    for path, code in ((good, 0), (bad, 1)):
        proc = in_process(["suite", "validate", str(path), "--json"], env)
        assert proc.returncode == code, proc.stderr
        assert json.loads(proc.stdout)["valid"] is (code == 0)
