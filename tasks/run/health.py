"""Whether a run's figures measure anything: too many samples where the agent failed (exit
4) or the grader could not run (exit 5) make them meaningless, said in one line, never a
silent pass@1 of 0 (docs/contract.md §10)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def error_share(summary: Mapping[str, Any], status: str, max_share: float) -> tuple[int, int] | None:
    """(samples with `status`, samples) when their share is over `max_share`, else None."""
    errors, samples = summary["status_counts"].get(status, 0), summary["samples"]
    if not samples or errors / samples <= max_share:
        return None
    return errors, samples


def broken_agent(summary: Mapping[str, Any], max_share: float, detail: str) -> str | None:
    """The exit-4 line: over `max_share` of the samples are agent_error (an endpoint that
    cannot be reached, a command that crashes), with `detail`, the commonest one's, first line."""
    return _over(summary, "agent_error", max_share, "--max-agent-errors",
                 "the agent is broken, so these numbers say nothing about the model (exit 4)", detail)


def broken_grader(summary: Mapping[str, Any], max_share: float, detail: str) -> str | None:
    """The exit-5 line: over `max_share` of the samples are error (a missing predicate file,
    a repository that is not there), with `detail`, the commonest error's, first line."""
    return _over(summary, "error", max_share, "--max-grader-errors",
                 "the grader could not run, so these numbers measure nothing (exit 5)", detail)


def _over(summary: Mapping[str, Any], status: str, max_share: float, option: str, meaning: str,
          detail: str) -> str | None:
    over = error_share(summary, status, max_share)
    if over is None:
        return None
    errors, samples = over
    return (f"{errors} of {samples} samples ({errors / samples:.0%}) are {status}, over {option} {max_share:g}:"
            f" {meaning}: {detail.splitlines()[0] if detail.strip() else 'no detail'}")
