"""A run on its Prefect flow-run page: its progress while it runs (and the CLI's progress
hook), then its summary, as artifacts."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from storage.store import Store
from tasks.report import slices_table, summary_markdown
from tasks.run import RunSummary

# Set by the CLI to draw a progress bar: called with (samples done, samples total).
progress_hook: ContextVar[Callable[[int, int], None] | None] = ContextVar("progress_hook", default=None)


def publish(run: RunSummary, store: Store) -> None:
    """The run's summary and per-slice table."""
    slug = artifact_slug(run.suite_name, run.suite_version)
    judges = store.run_calibrations(run.run_id)
    gate = run.gate.model_dump(mode="json") if run.gate else None
    create_markdown_artifact(
        key=f"evalpipe-{slug}-summary", markdown=summary_markdown(run, gate, judges),
        description=f"evalpipe run {run.run_id}",
    )
    if run.gate and run.gate.baseline:  # the pull-request comment's Markdown, on the flow run's page
        from flows.gate import pair_runs

        comparison = pair_runs(run.run_id, run.gate.baseline, metric=run.gate.metric or "pass", store=store)
        create_markdown_artifact(
            key=f"evalpipe-{slug}-gate",
            markdown=comparison.markdown(gate),
            description=f"evalpipe gate {run.gate.decision}: run {run.run_id} against {run.gate.baseline}",
        )
    rows = slices_table(run)
    if rows:
        create_table_artifact(key=f"evalpipe-{slug}-slices", table=rows,
                              description=f"per-slice pass@1, run {run.run_id}")


def artifact_slug(name: str, version: str) -> str:
    """A suite's name as Prefect takes it in an artifact key (lowercase ASCII letters,
    digits and dashes): `Café` is `caf`, and a name with none of those is its version's prefix."""
    slug = "-".join("".join(ch if ch.isascii() and ch.isalnum() else " " for ch in name.lower()).split())
    return slug or version[:12]


class Progress:
    """Samples graded so far: a progress artifact (updated at most once a second) and the
    CLI's progress hook (every batch)."""

    def __init__(self, done: int, total: int, hook: Callable[[int, int], None] | None) -> None:
        self.done, self.total, self.hook = done, total, hook
        self.artifact = create_progress_artifact(progress=100 * done / total, description="samples graded")
        self.updated = time.monotonic()

    def advance(self, count: int) -> None:
        self.done += count
        if self.hook:
            self.hook(self.done, self.total)
        if time.monotonic() - self.updated > 1.0 or self.done == self.total:
            update_progress_artifact(self.artifact, 100 * self.done / self.total)
            self.updated = time.monotonic()
