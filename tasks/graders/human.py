"""`human`: a person's label is the verdict — the top of the ladder's reliability, and the
slowest rung.

A label cannot be produced while a run grades, so a live run of a `human` case records
`error` ("awaiting a label"; such samples are not cached). Labels arrive afterwards
through `evalpipe labels import`, which turns each one into a verdict with
`label_verdict` and stores it in a derived run (see `tasks/metrics/labels.py`).
"""

from __future__ import annotations

from tasks.models import EvalCase, InputError, Status, Verdict
from tasks.params import HumanParams
from tasks.registry import grader

PASS_LABELS = frozenset({"pass", "passed", "1", "true", "yes", "y", "good"})
FAIL_LABELS = frozenset({"fail", "failed", "0", "false", "no", "n", "bad"})


def parse_label(text: str, where: str) -> bool | None:
    """A label cell as pass (True) / fail (False); None when blank (not labelled yet)."""
    word = text.strip().lower()
    if not word:
        return None
    if word in PASS_LABELS:
        return True
    if word in FAIL_LABELS:
        return False
    raise InputError(f"{where}: label {text.strip()!r} is not pass/fail (or 1/0, yes/no)")


def label_verdict(passed: bool, labeller: str, note: str = "") -> Verdict:
    detail = f"human label by {labeller}: {'pass' if passed else 'fail'}" + (
        f" ({note})" if note else ""
    )
    return Verdict.ok(detail) if passed else Verdict.fail(Status.failed, detail)


@grader("human", params=HumanParams, oracle=False)
def human(output: str, case: EvalCase, params: HumanParams) -> Verdict:
    return Verdict.fail(
        Status.error, "awaiting a human label: `evalpipe labels export RUN`, then `labels import`"
    )
