"""A judge that graded a run, as each renderer shows it (the CLI's text, the Markdown summary):
its calibration's figures, or that it has none, so no reader takes an uncalibrated
instrument's verdicts for measured ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.metrics.percent import with_ci

UNCALIBRATED = "its verdicts come from an uncalibrated instrument"


def judge_standing(judge: Mapping[str, Any]) -> str | None:
    """The newest calibration's agreement and kappa, or None when the judge has none."""
    doc = judge.get("calibration")
    return f"agreement {with_ci(doc, 'agreement')}, kappa {with_ci(doc, 'kappa')}" if doc else None


def judged_count(judge: Mapping[str, Any]) -> str:
    return f"{judge.get('errors', 0)} errors in {judge.get('judged', 0)}"
