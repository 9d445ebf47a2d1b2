"""A run on its Prefect flow-run page: its progress while it runs (and the CLI's progress
hook), then its summary, its cases, the samples of its failing and flaky cases and what the
agent did in the first failing sample of each (its trajectory's timeline), as artifacts (the
tables and the timelines: `tasks.report.sample_table`); and the flow run's name."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from storage.store import Store
from tasks.report import sample_table as tables
from tasks.report import slices_table, summary_markdown
from tasks.run import RunSummary
from tasks.run.stored import output_text

# Set by the CLI to draw a progress bar: called with (samples done, samples total).
progress_hook: ContextVar[Callable[[int, int], None] | None] = ContextVar("progress_hook", default=None)


def publish(run: RunSummary, store: Store, kinds: Mapping[str, str]) -> None:
    """The run's summary, its per-slice table, its cases and the samples of its failing and
    flaky cases (`kinds`: case id → the case's deciding grader kind)."""
    slug = artifact_slug(run.suite_name, run.suite_version)
    note = publish_samples(run, store, kinds, slug)
    judges = store.calibrations.of_run(run.run_id)
    gate = run.gate.model_dump(mode="json") if run.gate else None
    create_markdown_artifact(
        key=f"evalpipe-{slug}-summary", markdown=summary_markdown(run, gate, judges) + note,
        description=f"evalpipe run {run.run_id}",
    )
    if run.gate and run.gate.baseline:  # the pull-request comment's Markdown, on the flow run's page
        from service.gate import pair_runs

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


def publish_samples(run: RunSummary, store: Store, kinds: Mapping[str, str], slug: str) -> str:
    """One table of the run's cases (`evalpipe-SUITE-cases`) and one of each failing or flaky
    case's samples (`evalpipe-SUITE-case-CASE`), at most `tables.MAX_CASE_TABLES` of them, the
    worst first: a suite of thousands of cases makes 51 artifacts, not thousands; and one
    Markdown artifact (`evalpipe-SUITE-timelines`) of the first failing sample's timeline of
    the first `tables.MAX_TIMELINES` of those cases whose agent recorded one. Returns the
    summary's note on them (how many cases were left out, how to write the HTML report)."""
    tallies = tables.tally(store.samples.of_run(run.run_id, tables.OVERVIEW_COLUMNS).to_pylist())
    if not tallies:
        return ""
    create_table_artifact(key=f"evalpipe-{slug}-cases", table=tables.case_overview(tallies, kinds),
                          description=f"every case of run {run.run_id}: samples passed, the failing grader")
    shown, left_out = tables.cases_to_show(tallies)
    timelines: list[list[str]] = []
    unshown = 0  # failing or flaky cases with a timeline past MAX_TIMELINES
    for case in shown:
        samples = [{**row, "output": output_text(row["output"]) if row["output"] is not None else ""}
                   for row in store.samples.of_case(run.run_id, case.case_id)]
        kind = kinds.get(case.case_id)
        create_table_artifact(key=f"evalpipe-{slug}-case-{case_slug(case.case_id)}",
                              table=tables.sample_rows(samples, kind),
                              description=tables.case_description(case.case_id, case, kind, run.run_id))
        first = next(s for s in samples if s["sample_index"] == case.first_failing[0])
        if section := tables.timeline_section(case.case_id, first, kind, run.run_id):
            if len(timelines) < tables.MAX_TIMELINES:
                timelines.append(section)
            else:
                unshown += 1
    if timelines:
        create_markdown_artifact(key=f"evalpipe-{slug}-timelines",
                                 markdown=tables.timelines_markdown(run.run_id, timelines, unshown),
                                 description=f"what the agent did in the first failing sample of"
                                             f" {len(timelines)} case(s), run {run.run_id}")
    return tables.samples_note(run.run_id, len(shown), left_out, len(tallies))


def case_slug(case_id: str) -> str:
    """A case id in an artifact key: its slug, with a hash of the id unless the slug is the id
    itself (`Q1` and `q1` get different keys)."""
    slug = artifact_slug(case_id, "")[:60].strip("-")
    if slug == case_id:
        return slug
    digest = hashlib.sha256(case_id.encode()).hexdigest()[:6]
    return f"{slug}-{digest}" if slug else digest


def name_flow_run(flow_run_id: str | None, name: str) -> None:
    """Rename the flow run once its evalpipe run id is known (Prefect names it before). A name
    is not worth a run: a failure is a warning in the flow run's log."""
    if not flow_run_id:
        return
    from prefect import get_run_logger
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run_id, name=name)
    except Exception as exc:  # the run goes on under the name Prefect gave it
        get_run_logger().warning("could not rename the flow run to %r: %s", name, exc)


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
