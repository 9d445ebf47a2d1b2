"""Assertion graders: exact, contains, regex, numeric, json (docs/contract.md §4).

Pure functions of (output, case). Parameters are checked when the suite loads
(`tasks.params`); what depends on the reference (none given, a `fields` key missing from
it) raises `InputError`, which `grade` turns into `status: error`; an output that merely
fails the assertion is `failed`.
"""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from typing import Any

from tasks.fences import fenced_body
from tasks.graders.safety import compile_pattern
from tasks.models import EvalCase, InputError, Status, Verdict, canonical_json
from tasks.params import ContainsParams, ExactParams, JsonParams, NumericParams, RegexParams
from tasks.registry import grader
from tasks.trace import GraderStep, NumericCheck, SampleTrace


def _verdict(ok: bool, detail: str) -> Verdict:
    return Verdict.ok(detail) if ok else Verdict.fail(Status.failed, detail)


def _reference_text(case: EvalCase) -> str:
    ref = case.reference
    if ref is None:
        raise InputError(f"case {case.id!r}: {case.kind} grader needs a reference")
    return ref if isinstance(ref, str) else canonical_json(ref).decode()


def _preview(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def normalize_text(text: str) -> str:
    """strip, casefold, collapse every run of whitespace to one space."""
    return " ".join(text.split()).casefold()


@grader("exact", params=ExactParams, inline=True)
def exact(output: str, case: EvalCase, params: ExactParams) -> Verdict:
    ref = _reference_text(case)
    if params.normalize:
        output, ref = normalize_text(output), normalize_text(ref)
    return _verdict(output == ref, f"expected {_preview(ref)}, got {_preview(output)}")


@grader("contains", params=ContainsParams, inline=True)
def contains(output: str, case: EvalCase, params: ContainsParams) -> Verdict:
    ref = _reference_text(case)
    if not params.case_sensitive:
        output, ref = output.casefold(), ref.casefold()
    found = ref in output
    return _verdict(found, f"{_preview(ref)} {'found' if found else 'not found'} in output")


@grader("regex", params=RegexParams, inline=True)
def regex(output: str, case: EvalCase, params: RegexParams) -> Verdict:
    pattern, full = params.pattern, params.fullmatch
    rx = compile_pattern(pattern, f"case {case.id!r}: grader.pattern")
    hit = rx.fullmatch(output) if full else rx.search(output)
    how = "fully matches" if full else "matches"
    return _verdict(hit is not None, f"output {'' if hit else 'never '}{how} {pattern!r}")


# A number as people write it: optional sign (ASCII or U+2212), thousands groups of three
# ("1,000"), decimals, exponent, or an integer fraction ("3/4"). Not preceded by a letter
# or digit, so "H2O" or "x86" are not numbers.
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(rf"(?<![\w.])([-+\u2212]?)(\d+/\d+(?![\d/])|{_NUM})")
# Where an answer is marked, the number after the last marker wins over the last number.
_MARKER = re.compile(r"####|\\boxed\{|answer\s*(?:is|:|=)", re.IGNORECASE)


def _to_number(sign: str, body: str) -> float:
    if "/" in body:
        num, den = body.split("/")
        value = float(Fraction(int(num), int(den))) if int(den) else math.nan
    else:
        value = float(body.replace(",", ""))
    return -value if sign in {"-", "\u2212"} else value


def parse_number(text: str) -> float | None:
    """The answer number in free text, or None.

    "The answer is 1,000.5 km/s" → 1000.5. Rules: after the last answer marker
    (`####`, `\\boxed{`, "answer is/:/=") the first number; otherwise the last number in
    the text. Units and `%` are ignored ("50%" → 50.0); "3/4" → 0.75; a comma is only a
    thousands separator (no decimal commas).
    """
    markers = list(_MARKER.finditer(text))
    if markers:
        match = _NUMBER.search(text, markers[-1].end())
        if match:
            return _to_number(*match.groups())
    last = None
    for last in _NUMBER.finditer(text):  # noqa: B007 - we want the last one
        pass
    return _to_number(*last.groups()) if last else None


def _reference_number(case: EvalCase) -> float:
    ref = case.reference
    if isinstance(ref, int | float) and not isinstance(ref, bool):
        return float(ref)
    if isinstance(ref, str):
        match = _NUMBER.fullmatch(ref.strip())
        if match:
            return _to_number(*match.groups())
    raise InputError(f"case {case.id!r}: numeric grader needs a number reference, got {ref!r}")


@grader("numeric", params=NumericParams, trace=SampleTrace, inline=True)
def numeric(output: str, case: EvalCase, params: NumericParams, *, trace: SampleTrace) -> Verdict:
    ref = _reference_number(case)
    abs_tol, rel_tol = params.abs_tol, params.rel_tol
    got = parse_number(output)
    trace.grader_steps = [*(trace.grader_steps or ()), GraderStep(numeric=NumericCheck(parsed=got, reference=ref))]
    if got is None:
        return Verdict.fail(Status.failed, f"no number found in output (expected {ref:g})")
    close = math.isclose(got, ref, rel_tol=rel_tol, abs_tol=abs_tol)
    return _verdict(
        close, f"parsed {got:g}, expected {ref:g} (abs_tol {abs_tol:g}, rel_tol {rel_tol:g})"
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(output: str) -> Any:
    """Parse the output as strict JSON (no NaN/Infinity); one surrounding markdown code
    fence is allowed. Raises ValueError on anything else."""
    text = output.strip()
    fenced = fenced_body(text)
    if fenced is not None:
        text = fenced
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


@grader("json", params=JsonParams, inline=True)
def json_grader(output: str, case: EvalCase, params: JsonParams) -> Verdict:
    ref = case.reference
    fields = params.fields
    if fields is not None and (not isinstance(ref, dict) or set(fields) - set(ref)):
        raise InputError(
            f"case {case.id!r}: grader.fields must all be keys of the reference object"
        )
    try:
        got = parse_json(output)
    except ValueError as exc:
        return Verdict.fail(Status.failed, f"output is not JSON: {exc}")
    # Compare canonical encodings: JSON equality, so true != 1 but 1 == 1.0.
    if fields is None:
        same = canonical_json(got) == canonical_json(ref)
        return _verdict(same, f"output {'equals' if same else 'differs from'} the reference")
    if not isinstance(got, dict):
        return Verdict.fail(Status.failed, f"output is a JSON {type(got).__name__}, not an object")
    wrong = [f for f in fields if f not in got or canonical_json(got[f]) != canonical_json(ref[f])]
    return _verdict(not wrong, f"fields differ: {', '.join(wrong)}" if wrong else "fields match")
