"""Re-scoring a stored run without its agent (`evalpipe rescore RUN_ID SUITE`): the plan of a
new run of SUITE, with each sample's output taken from the source run where the source
asked the agent the same question (same case id, same inputs), and the cases it never
asked reported `unscored`, never drawn and never counted as failures.

A source sample drawn under this run's own output key (same agent, same seed derivation)
keeps that key, so the new verdicts join the cache like any. One from a run stored before
output keys existed was drawn with another seed: it is graded under its own seed and a
key no planned sample has, so it can never be served as a draw of the current plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pyarrow as pa

from tasks.models import EvalSuite, canonical_json, sha256_hex
from tasks.run.samples import row_usage
from tasks.run.sampling import PlannedSample, grading_fingerprint
from tasks.run.stored import OutputReader, row_output


@dataclass(frozen=True)
class RescorePlan:
    """What a rescore grades in place of drawing (`tasks.run.loop.run_loop`'s `rescoring`)."""

    source_run: str
    to_grade: list[PlannedSample]  # each with its stored output
    failed_calls: pa.Table  # the source's agent_error samples: facts about the agent, carried as they are
    unscored: list[str]  # case ids with no stored sample


def rescore_plan(run_id: str, planned: Sequence[PlannedSample], suite: EvalSuite, source_suite: EvalSuite,
                 source_run: str, source: pa.Table, reader: OutputReader) -> RescorePlan:
    """`planned`: the plan of the new run `run_id` (with the source's agent fingerprint, n
    and seed); `source`: the sample rows of run `source_run` as stored (a long output by its
    `output_sha`, read from `reader` when it is graded); `source_suite`: the suite it ran."""
    asked = {c.id: c.inputs_hash for c in source_suite.cases}
    same_question = {c.id for c in suite.cases if asked.get(c.id) == c.inputs_hash}
    rows = {(r["case_id"], r["sample_index"]): r for r in source.to_pylist() if r["case_id"] in same_question}
    grading = {c.id: grading_fingerprint(c) for c in suite.cases}
    to_grade, failed, scored = [], [], set()
    for p in planned:
        row = rows.get((p.case_id, p.index))
        if row is None:
            continue
        scored.add(p.case_id)
        if row["status"] == "agent_error":
            failed.append(row | {"run_id": run_id, "case_hash": p.case_hash, "cached": True})
            continue
        stored = replace(p, output=row_output(row, reader), usage=row_usage(row))
        if row["output_key"] != p.output_key:
            stored = replace(stored, seed=row["seed"], output_key="", cache_key=sha256_hex(
                canonical_json(["rescored", row["cache_key"], grading[p.case_id]])))
        to_grade.append(stored)
    unscored = sorted(c.id for c in suite.cases if c.id not in scored)
    return RescorePlan(source_run, to_grade, pa.Table.from_pylist(failed, schema=source.schema), unscored)
