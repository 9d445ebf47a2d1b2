"""Suite validation: does each case's oracle tell right from wrong, every time?

A case is sound when its reference passes on every one of R gradings and the empty
output fails. This is the check that catches SWE-bench-style defects: FAIL_TO_PASS
tests that already pass before the fix (the empty patch passes), and gold patches that
pass only intermittently (an environment flake).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tasks.agents import reference_text
from tasks.graders import error_verdict, grade
from tasks.models import EvalCase, Verdict
from tasks.registry import grader_spec


@dataclass(frozen=True)
class CaseCheck:
    case_id: str
    reference_statuses: tuple[str, ...]
    empty_status: str
    detail: str

    @property
    def problem(self) -> str | None:
        passes = sum(s == "passed" for s in self.reference_statuses)
        if passes == 0:
            return "broken"  # the reference never passes
        if passes < len(self.reference_statuses):
            return "flaky"  # same output, different verdicts
        if self.empty_status == "passed":
            return "vacuous"  # doing nothing passes: the tests do not test the change
        return None


def check_case(case: EvalCase, reps: int) -> CaseCheck:
    reference = reference_text(case.reference)
    verdicts = [grade(reference, case) for _ in range(reps)]
    empty = _do_nothing(case)
    failing = next((v.detail for v in verdicts if not v.passed), "")
    return CaseCheck(
        case_id=case.id,
        reference_statuses=tuple(v.status.value for v in verdicts),
        empty_status=empty.status.value,
        detail=failing or (empty.detail if empty.passed else ""),
    )


def _do_nothing(case: EvalCase) -> Verdict:
    """Grade "no change": the empty output, or the kind's registered baseline where that
    would prove nothing (for a repository case, the tests at the base commit: an empty patch
    is `empty` before any test runs)."""
    spec = grader_spec(case.kind)
    if spec is None or spec.baseline is None:
        return grade("", case)
    try:
        return spec.baseline(case)
    except Exception as exc:  # noqa: BLE001 - validation reports, it does not crash
        return error_verdict(exc, "tests at the base commit")


def validation_report(checks: Sequence[CaseCheck], suite_version: str, reps: int) -> dict:
    problems = {kind: [asdict(c) for c in checks if c.problem == kind]
                for kind in ("broken", "flaky", "vacuous")}
    return {
        "suite_version": suite_version,
        "cases": len(checks),
        "reps": reps,
        "valid": not any(problems.values()),
        **problems,
    }
