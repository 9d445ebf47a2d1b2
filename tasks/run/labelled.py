"""A run of human labels (`evalpipe labels import`): derived from a stored run, its samples
the source's with verdicts from the labels (`tasks.metrics.labels.labelled_samples`), stored
and aggregated like any run. Here: its spec and what its summary says beyond a run's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.run.spec import RunSpec
from tasks.run.summary import RunSummary


def labelled_spec(source: Mapping[str, Any], *, labeller: str, labels_file: str, labels_sha256: str) -> RunSpec:
    """The derived run of `source` (a stored run's row): the same suite, agent, n and seed;
    its config names the source, the labeller and the label file (its path and content hash)."""
    return RunSpec(
        **{k: source[k] for k in ("suite_version", "suite_name", "agent", "agent_fingerprint", "n", "seed")},
        ks=list(source["ks"]),
        config={
            "derived_from": source["run_id"],
            "grader": "human",
            "labeller": labeller,
            "labels_file": labels_file,
            "labels_sha256": labels_sha256,
        },
    )


def labelled_summary(summary: RunSummary, *, source_run: str, labeller: str, labelled: int, labels: int,
                     duration_s: float) -> RunSummary:
    """The derived run's summary: who labelled which run, how many of the `labels` rows had a
    label; no usage, as no agent was called (the samples' usage is the source run's)."""
    return summary.model_copy(update={
        "source_run": source_run, "labeller": labeller, "usage": None, "labelled": labelled,
        "unlabelled": labels - labelled, "duration_s": round(duration_s, 3),
    })
