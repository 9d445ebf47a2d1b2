"""The registered metrics of a run as each renderer shows them (the CLI's text, the Markdown
summary, the HTML report): one list of rows, so a new metric needs no renderer edit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.metrics.percent import ci_text, figure
from tasks.run.summary import MetricSummary, RunSummary


def metric_rows(run: RunSummary | Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(name, value, CI) per registered metric, then per extra grader (`grader:NAME`, its
    CI followed by the cases it grades). pass@K metrics are the headline's figures and
    are left to it, as is a metric that does not apply (no value, no error: a mean score of
    samples without scores); a summary stored before metrics were registered shows its mean
    score."""
    run = RunSummary.read(run)
    metrics = run.metrics
    if metrics is None:
        metrics = {} if run.mean_score is None else {
            "mean_score": MetricSummary(value=run.mean_score, ci=run.mean_score_ci)}
    rows = []
    for name, m in metrics.items():
        if name.startswith("pass@") and name.removeprefix("pass@") in run.pass_at_k:
            continue
        if m.error:
            rows.append((name, f"n/a: {m.error}", ""))
        elif m.value is not None:
            over = f" over {m.cases} cases" if m.cases is not None and m.cases > 1 else ""
            rows.append((name, figure(m.value, m.percent), ci_text(m.ci, m.percent) + over))
    return rows
