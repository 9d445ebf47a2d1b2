"""The `validate_suite` flow: grade every reference R times and the empty output once."""

from __future__ import annotations

from typing import Annotated, Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from storage.store import Store
from storage.suites import load_suite_ref
from tasks.graders.validation import CaseCheck, check_case, validation_report
from tasks.models import EvalCase
from tasks.sandbox import allowing_unsafe, run_sandbox_mode


@task(name="validate", cache_policy=NO_CACHE, persist_result=False, task_run_name="validate {case.id}")
def validate_case(case: EvalCase, reps: int) -> CaseCheck:
    return check_case(case, reps)


@flow(name="validate_suite", persist_result=False, log_prints=False)
def validate_suite(
    suite: Annotated[str, Field(description="Suite file or stored version.")],
    reps: Annotated[int, Field(ge=1, le=100, description="Gradings of each reference.")] = 3,
    workers: Annotated[int, Field(ge=1, le=64)] = 2,
    unsafe_no_sandbox: Annotated[bool, Field(description="Without bubblewrap, run code unprotected.")] = False,
) -> dict[str, Any]:
    suite_obj = load_suite_ref(suite, Store.default().snapshots)
    sandbox = run_sandbox_mode(suite_obj.grader_kinds, unsafe_no_sandbox)
    with allowing_unsafe(unsafe_no_sandbox), ThreadPoolTaskRunner(max_workers=workers) as runner:
        futures = [runner.submit(validate_case, {"case": c, "reps": reps}) for c in suite_obj.cases]
        checks = sorted((f.result() for f in as_completed(futures)), key=lambda c: c.case_id)
    return {**validation_report(checks, suite_obj.version, reps), "sandbox": sandbox}
