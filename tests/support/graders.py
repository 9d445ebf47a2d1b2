"""A grader for tests that need a grading task of its own: `exact`'s verdict, registered
without `inline` (as a plugin's grader is by default), so the run hands its outputs to a
grading task rather than grading them where they are drawn."""

from __future__ import annotations

import os

from pydantic import BaseModel

from tasks.models import EvalCase, Verdict
from tasks.registry import grader

IN_A_TASK = "exact_in_a_task"
GRADED_IN_ENV = "EVALPIPE_TEST_GRADED_IN"


class _Params(BaseModel):
    pass


@grader(IN_A_TASK, params=_Params)
def exact_in_a_task(output: str, case: EvalCase, params: _Params) -> Verdict:
    if where := os.environ.get(GRADED_IN_ENV):  # the processes that graded, for a test to kill one
        with open(where, "a") as out:
            out.write(f"{os.getpid()}\n")
    return Verdict.ok() if output == case.reference else Verdict.fail(detail=f"expected {case.reference!r}")
