"""`predicate`: a suite's Python callable decides, `fn(output, case)`.

`function` is `module:function` or `path/to/file.py:function` (relative to the suite file's
directory: `EvalCase.local_path`). Truthy → passed, falsy → failed, a returned `Verdict` is used as is; raising,
or returning something whose truth is undefined (a numpy array), → `status: error`.

A suite is not trusted (it may come from a git URL), so the callable it names is never
imported into the harness: it is loaded and called in the sandbox, on a warm server per
callable (`tasks.sandbox.call_in_sandbox`, `tasks.graders.predicate_host`), which returns the
verdict as JSON. `shutil:rmtree` runs there against a read-only file system. To run
*candidate* code, a predicate calls `tasks.sandbox.run_python(source, limits=...)`.
"""

from __future__ import annotations

from collections.abc import Callable

from tasks.callables import source_dirs
from tasks.graders import error_verdict
from tasks.models import EvalCase, InputError, Status, Verdict
from tasks.params import PredicateParams
from tasks.registry import grader
from tasks.sandbox import SandboxError, ServerDied, call_in_sandbox


def _call(case: EvalCase, request: dict) -> dict:
    ref, base = case.params.function, case.local_path(".")
    reply = call_in_sandbox(ref, base, source_dirs(ref, base), request)
    if "load_error" in reply:
        raise InputError(reply["load_error"])
    return reply


def _code_hash(case: EvalCase) -> str:
    return _call(case, {"op": "hash"})["code_sha256"]


@grader("predicate", params=PredicateParams, runs_code=True, fingerprint=_code_hash)
def predicate(output: str, case: EvalCase, params: PredicateParams) -> Verdict:
    ref = params.function
    try:
        reply = _call(case, {"output": output, "case": case.model_dump(mode="json")})
    except ServerDied as exc:
        return Verdict.fail(Status.error, f"predicate {ref}: its sandbox died ({exc})")
    except SandboxError as exc:
        return Verdict.fail(Status.error, f"predicate {ref}: sandbox could not start: {exc}")
    return Verdict.model_validate(reply["verdict"])


def decide(ref: str, fn: Callable, output: str, case: EvalCase) -> Verdict:
    """The verdict of `fn(output, case)`; runs in the sandbox (`tasks.graders.predicate_host`)."""
    try:
        result = fn(output, case)
    except (Exception, SystemExit) as exc:
        return error_verdict(exc, f"predicate {ref} raised")
    if isinstance(result, Verdict):
        return result
    try:
        truth = bool(result)
    except Exception as exc:
        return error_verdict(
            exc, f"predicate {ref} returned a {type(result).__name__} with no truth value"
        )
    if truth:
        return Verdict.ok(f"predicate {ref} returned {_short(result)}")
    return Verdict.fail(Status.failed, f"predicate {ref} returned {_short(result)}")


def _short(value: object) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:80] + "…"
