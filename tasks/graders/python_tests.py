"""`python_tests` (HumanEval style): the candidate's code is prompt + output; the oracle is
the prompt's own definitions + test + `check(entry_point)`.

They run on a warm fork server in the sandbox (`tasks.sandbox`), in two processes: the
oracle calls the candidate's functions across a boundary that carries plain values only,
so no object, patched builtin or forged nonce of the candidate's reaches the check (see
`tasks/sandbox/forkserver.py`). A program passes only when the per-run completion nonce
came back, which the oracle writes after `check(...)` returned: exit status 0,
`sys.exit(0)`, `os._exit(0)` or printing "passed" never pass. Statuses: `passed`, `failed` (assertion, exception, wrong
answer, exited early, killed its own server), `timeout`, `error` (no sandbox could be
started, or bubblewrap is missing and the run did not allow running without it), `empty`
(blank output, not run).
"""

from __future__ import annotations

from tasks.graders import file_hash
from tasks.models import EvalCase, InputError, Status, Verdict
from tasks.params import PythonTestsParams
from tasks.registry import grader
from tasks.sandbox import Limits, SandboxError, ServerDied, SplitProgram, run_python_program
from tasks.trace import PythonTestsTrace, SampleTrace

_TAIL = 2000


def _limits(params: PythonTestsParams) -> Limits:
    return Limits(timeout_s=params.timeout_s, memory_mb=params.memory_mb)


def build_program(output: str, case: EvalCase) -> SplitProgram:
    prompt = case.inputs.get("prompt", "")
    if not isinstance(prompt, str):
        raise InputError(f"case {case.id!r}: inputs.prompt must be a string")
    entry = case.params.entry_point
    return SplitProgram(candidate=f"{prompt}{output}\n", prelude=prompt,
                        oracle=f"{case.params.test}\n\ncheck({entry})\n", entry_point=entry)


def _tail(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")[-_TAIL:]


def _sandbox_code(case: EvalCase) -> list[str]:
    import tasks.sandbox.forkserver
    import tasks.sandbox.servers

    # How a program is run and its result read: the server's requests and its program.
    return [file_hash(tasks.sandbox.servers.__file__), file_hash(tasks.sandbox.forkserver.__file__)]


@grader("python_tests", params=PythonTestsParams, runs_code=True, fingerprint=_sandbox_code, trace=SampleTrace)
def python_tests(output: str, case: EvalCase, params: PythonTestsParams, *, trace: SampleTrace) -> Verdict:
    limits = _limits(params)
    program = build_program(output, case)
    if not output.strip():
        return Verdict.fail(Status.empty, "empty output: nothing to run")
    try:
        run = run_python_program(program, limits)
    except ServerDied as exc:
        return Verdict.fail(Status.failed, f"the program brought its sandbox down: {exc}")
    except SandboxError as exc:
        return Verdict.fail(Status.error, f"sandbox could not start: {exc}")
    res = run.result
    trace.python_tests = PythonTestsTrace(
        isolation=res.isolation,
        returncode=res.returncode,
        timed_out=res.timed_out,
        completed=run.completed,
        duration_s=res.duration_s,
        stdout=_tail(res.stdout),
        stderr=_tail(res.stderr),
        stdout_truncated=res.stdout_truncated,
        stderr_truncated=res.stderr_truncated,
    )
    if run.completed:
        return Verdict.ok("check() returned")
    if res.timed_out:
        return Verdict.fail(Status.timeout, f"timed out after {limits.timeout_s:g} s")
    return Verdict.fail(Status.failed, _failure(res.returncode, res.stderr))


def _failure(returncode: int | None, stderr: bytes) -> str:
    lines = [ln for ln in stderr.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    if lines:
        return f"{lines[-1].strip()[:300]} (exit {returncode})"
    if returncode is not None and returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exited with status {returncode} before check() returned"
