"""The run layer, the top of the core: what a run is (`RunSpec`), the plain steps of a run
(plan, pending, batches, draw a batch: `tasks.run.steps`, over `tasks.run.sampling`), the
sample rows it stores (`tasks.run.samples`) and what it reports (`RunSummary`).

Flows call these and add only orchestration (task runners, artifacts) and storage.
"""

from tasks.run.spec import RunSpec, check_ks, new_run_id, run_title
from tasks.run.steps import (
    MAX_BATCH,
    TASKS_PER_WORKER,
    batch_cases,
    batch_label,
    batches,
    draw_batch,
    pending,
    plan,
    samples_per_task,
    undrawn,
)
from tasks.run.summary import GateSummary, RunSummary, summarize, summary_columns
from tasks.run.usage import priced

__all__ = [
    "MAX_BATCH", "TASKS_PER_WORKER", "GateSummary", "RunSpec", "RunSummary", "batch_cases", "batch_label",
    "batches", "check_ks", "draw_batch", "new_run_id", "pending", "plan", "run_title", "samples_per_task",
    "summarize", "summary_columns", "undrawn", "priced",
]
