"""`predicate`: a user's Python callable decides, `fn(output, case)`.

`function` is `module:function` or `path/to/file.py:function` (relative to the working
directory). Truthy → passed, falsy → failed, a returned `Verdict` is used as is; raising,
or returning something whose truth is undefined (a numpy array), → `status: error`.

The predicate itself is the suite author's code and runs in the harness process. When it
runs *candidate* code it should do so through the sandbox:
`tasks.sandbox.run_python(source, limits=Limits(...))` returns a `SandboxResult`.
"""

from __future__ import annotations

from tasks.callables import load_callable
from tasks.graders import error_verdict, register
from tasks.models import EvalCase, Status, Verdict


def _code_hash(case: EvalCase) -> str:
    return load_callable(case.params.function).code_sha256


@register("predicate", fingerprint=_code_hash)
def predicate(output: str, case: EvalCase, trace: dict) -> Verdict:
    ref = case.params.function
    fn = load_callable(ref).func
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
