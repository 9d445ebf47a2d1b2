"""The steps of a run between its spec and its summary: plan the samples, find what is
still to draw, and name a task's samples (the loop that draws and grades them:
`tasks.run.loop`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc

from tasks.models import EvalCase, EvalSuite
from tasks.run.samples import row_usage
from tasks.run.sampling import PlannedSample, plan_samples
from tasks.run.spec import RunSpec


def plan(suite: EvalSuite, spec: RunSpec) -> list[PlannedSample]:
    """Every sample the run needs, in (case id, index) order."""
    return plan_samples(suite, spec.agent_fingerprint, spec.n, spec.seed, spec.agent)


def pending(spec: RunSpec, planned: Sequence[PlannedSample], stored: pa.Table) -> tuple[pa.Table, list[PlannedSample]]:
    """Given the stored samples found by output key (`stored`, at most one per key): the
    rows this run reuses whole (same output, graded the same way), and the planned samples
    it still has to draw, or to grade anew from a stored output (`output` set): a changed
    reference, grader or safety rule costs grading, not an agent call. With `regrade`,
    every stored output is graded again."""
    out_keys = pa.array([p.output_key for p in planned], pa.string())
    at = pc.index_in(stored["output_key"], value_set=out_keys)  # each stored row's planned sample
    wanted = pa.array([p.cache_key for p in planned], pa.string()).take(at)
    whole = pc.and_(pc.equal(stored["cache_key"], wanted),
                    pc.invert(pc.is_in(stored["status"], value_set=pa.array(NOT_REUSED_STATUSES))))
    if spec.regrade:
        whole = pc.and_(whole, pa.scalar(False))
    reused = _as_this_runs(spec.run_id, stored.filter(whole),
                           pa.array([p.case_hash for p in planned], pa.string()).take(at.filter(whole)))
    done = pc.is_in(out_keys, value_set=reused["output_key"]).to_pylist()
    return reused, _with_stored_outputs([p for p, d in zip(planned, done, strict=True) if not d],
                                        stored.filter(pc.invert(whole)))


# Graded samples not reused whole: the grader or its environment failed, which says
# nothing about the output, so a re-run grades it again.
NOT_REUSED_STATUSES = ("error",)


def _as_this_runs(run_id: str, rows: pa.Table, case_hashes: pa.Array) -> pa.Table:
    """Stored rows as this run's cached samples: its run id, and its cases' hashes (a case
    whose slices or tags changed keeps its verdicts but has a new hash, which the gate pairs on)."""
    count = rows.num_rows
    for name, values in (("run_id", pa.array([run_id] * count, pa.string())),
                         ("cached", pa.array([True] * count, pa.bool_())),
                         ("case_hash", case_hashes)):
        rows = rows.set_column(rows.schema.get_field_index(name), name, values)
    return rows


def _with_stored_outputs(planned: Sequence[PlannedSample], stored: pa.Table) -> list[PlannedSample]:
    """The planned samples with the stored output (and what its call took) of each one that
    has one, graded rather than drawn again, so the agent is not asked twice (nor paid twice)."""
    found = {row["output_key"]: row for row in stored.select(list(_STORED_OUTPUT)).to_pylist()}
    return [replace(p, output=row["output"], usage=row_usage(row)) if (row := found.get(p.output_key)) else p
            for p in planned]


_STORED_OUTPUT = ("output_key", "output", "latency_s", "input_tokens", "output_tokens", "usage_model", "cost_usd")


def batch_label(chunk: Sequence[PlannedSample]) -> str:
    ids = sorted({p.case_id for p in chunk})
    return ids[0] if len(ids) == 1 else f"{ids[0]}…{ids[-1]} ({len(chunk)})"


def batch_cases(cases: Mapping[str, EvalCase], chunk: Sequence[PlannedSample]) -> list[EvalCase]:
    """The cases a batch draws from (`cases` by id), in id order."""
    return [cases[case_id] for case_id in sorted({p.case_id for p in chunk})]
