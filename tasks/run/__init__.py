"""The run layer, the top of the core: what a run is (`RunSpec`, `RunConfig`, `RunStatus`),
the run loop (`tasks.run.loop`: plan, reuse, draw, grade, store, reduce, gate, over stages
and a store the caller passes), its plain steps (`tasks.run.steps`, over
`tasks.run.sampling`), the sample rows it stores (`tasks.run.samples`) and what it reports
(`RunSummary`).

Flows call these and add only orchestration (task runners, artifacts) and storage.
"""

from tasks.run.config import RunConfig
from tasks.run.spec import RunSpec, RunStatus, check_ks, new_run_id, run_title
from tasks.run.steps import batch_cases, batch_label, pending, plan
from tasks.run.summary import GateSummary, RunSummary, summarize, summary_columns

__all__ = [
    "GateSummary", "RunConfig", "RunSpec", "RunStatus", "RunSummary", "batch_cases", "batch_label", "check_ks",
    "new_run_id", "pending", "plan", "run_title", "summarize", "summary_columns",
]
