"""Graders: one total entry point, `grade(output, case) -> Verdict`, dispatching on kind.

A grader module registers its function with `@tasks.registry.grader(kind, params=...)`,
as a plugin's does (importing this package registers the built-in ones). `grade` never
raises: an exception anywhere becomes `Verdict(status=error)` with the exception type,
message and a short traceback in `detail`. After the kind's grader, the case's
`safety.forbidden_patterns` are applied to the output and its `forbidden_tools` to the
trajectory; they add to `Verdict.safety` and never change `passed`. Every grader, deciding or
extra, sees the sample's trajectory (the agent's sections of its trace).
"""

from __future__ import annotations

import importlib
import inspect
import traceback
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from tasks.graders.safety import output_violations, tool_violations
from tasks.models import EvalCase, InputError, Status, Verdict, canonical_json, sha256_hex
from tasks.registry import grader_spec
from tasks.trace import AGENT_SECTIONS, ExtraGrader, SampleTrace


def grade(output: str, case: EvalCase, trace: SampleTrace | dict | None = None) -> Verdict:
    """Grade one output, recording in `trace` what the graders did. Total: never raises
    (KeyboardInterrupt aside), never hangs past the grader's own timeout. A plain `dict`
    (the untyped trace earlier evalpipe took, which scripts and benches still pass) is
    filled with the sections as they are stored."""
    if isinstance(trace, dict):
        typed = SampleTrace()
        verdict = grade(output, case, typed)
        trace.update(typed.to_dict())
        return verdict
    trace = SampleTrace() if trace is None else trace
    verdict = _total(output, case, trace)
    if case.extra_graders:
        verdict = verdict.with_safety(_grade_extra(output, case, trace))
    try:
        violations = output_violations(output, case.safety) if isinstance(output, str) else []
        violations += tool_violations(trace.trajectory, case.safety)
    except Exception as exc:
        # Fail closed: a safety rule that cannot be checked is reported, not skipped.
        violations = [f"safety check failed: {type(exc).__name__}: {exc}"]
    return verdict.with_safety(violations)


def _total(output: str, case: EvalCase, trace: SampleTrace) -> Verdict:
    try:
        return _dispatch(output, case, trace)
    except (Exception, SystemExit) as exc:
        return error_verdict(exc, f"{case.kind} grader raised")


def _grade_extra(output: str, case: EvalCase, trace: SampleTrace) -> list[str]:
    """Each of the case's `extra_graders` grades the output (totally, as the deciding one
    does): its verdict, and what it traced, go to `trace.extra_graders`, in order. They
    never change `passed`; their safety violations are the sample's."""
    found, safety = [], []
    for grader, label in zip(case.extra_graders, case.grader_labels[1:], strict=True):
        # It sees what the agent did, as the deciding grader does; what it records itself is
        # kept under its own entry.
        own = trace.agent_part()
        verdict = _total(output, _graded_by(grader, case), own)
        recorded = {k: v for k, v in own.to_dict().items() if k not in AGENT_SECTIONS}
        traced = {"trace": SampleTrace.model_validate(recorded)} if recorded else {}
        named = {"name": label} if label != grader["kind"] else {}
        marked = {"must_pass": True} if grader.get("must_pass") else {}
        found.append(ExtraGrader(kind=grader["kind"], verdict=verdict, **named, **traced, **marked))
        safety.extend(verdict.safety)
    trace.extra_graders = found
    return safety


def graded_inline(case: EvalCase) -> bool:
    """Whether every grader of `case` is cheap enough to grade where its output is drawn
    (`GraderSpec.inline`)."""
    kinds = [case.kind, *(g.get("kind") for g in case.extra_graders)]
    return all((spec := grader_spec(kind)) is not None and spec.inline for kind in kinds)


def _graded_by(grader: dict[str, Any], case: EvalCase) -> EvalCase:
    """The case as one of its extra graders sees it (`EvalCase.graded_by`)."""
    return case.graded_by(grader)


def _dispatch(output: str, case: EvalCase, trace: SampleTrace) -> Verdict:
    if not isinstance(output, str):
        return Verdict.fail(Status.error, f"output is {type(output).__name__}, not str")
    entry = grader_spec(case.kind)
    if entry is None:
        return Verdict.fail(Status.error, f"no grader registered for kind {case.kind!r}")
    verdict = entry(output, case, trace)
    if not isinstance(verdict, Verdict):
        return Verdict.fail(
            Status.error, f"{case.kind} grader returned {type(verdict).__name__}, not a Verdict"
        )
    return verdict


def error_verdict(exc: BaseException, what: str) -> Verdict:
    """`status: error` with the exception type, message and the last frames."""
    if isinstance(exc, InputError):
        return Verdict.fail(Status.error, f"{what}: {exc}")
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)
    tb = "".join(frames).strip()
    return Verdict.fail(Status.error, f"{what}: {type(exc).__name__}: {exc}\n{tb[-2000:]}")


def grader_fingerprint(case: EvalCase) -> str:
    """sha256 of what a verdict depends on besides the output: kind, parameters,
    reference, the registered version and the grader module's source (a plugin's too, so
    its cached verdicts are graded again when its code changes)."""
    entry = grader_spec(case.kind)
    content: dict[str, Any] = {
        "kind": case.kind,
        "grader": case.grader,
        "reference": case.reference,
        "version": entry.version if entry else None,
        "source": _source_hash(entry.fn) if entry else "",
    }
    if entry and entry.fingerprint is not None:
        try:
            content["extra"] = entry.fingerprint(case)
        except Exception as exc:  # grading will report it; the key just has to be stable
            content["extra"] = f"unavailable: {type(exc).__name__}: {exc}"
    if case.extra_graders:  # absent without them: the keys of stored verdicts stay valid
        content["extra_graders"] = [
            grader_fingerprint(_graded_by(g, case)) for g in case.extra_graders
        ]
    return sha256_hex(canonical_json(content))


@lru_cache(maxsize=64)
def _source_hash(fn: Callable) -> str:
    return file_hash(inspect.getsourcefile(fn) or "")


@lru_cache(maxsize=64)
def file_hash(path: str) -> str:
    return sha256_hex(Path(path).read_bytes()) if path and Path(path).is_file() else ""


# The built-in graders register themselves on import.
for _name in ("assertions", "predicate", "python_tests", "repo_tests", "judge", "human", "trajectory"):
    importlib.import_module(f"{__name__}.{_name}")
