"""The steps of a run between its spec and its summary: plan the samples, find what is
still to draw, and name a task's samples (the loop that draws and grades them:
`tasks.run.loop`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc

from tasks.metrics.cost import PriceTable
from tasks.models import EvalCase, EvalSuite
from tasks.run.samples import row_usage
from tasks.run.sampling import PlannedSample, plan_samples
from tasks.run.spec import RunSpec
from tasks.run.stored import StoredOutput
from tasks.run.usage import USAGE_SAMPLE_COLUMNS, priced
from tasks.trace import SampleTrace


def plan(suite: EvalSuite, spec: RunSpec) -> list[PlannedSample]:
    """Every sample the run needs, in (case id, index) order."""
    return plan_samples(suite, spec.agent_fingerprint, spec.n, spec.seed, spec.agent)


# What the cache lookup reads of each stored sample: where it is, its keys and status, and
# what its agent call took; never its output (at the cap, gigabytes for a re-run).
CACHE_LOOKUP_COLUMNS = ("run_id", "case_id", "sample_index", "output_key", "cache_key", "status",
                        *USAGE_SAMPLE_COLUMNS)
# Which stored sample a row names, and this run's hash of its case (`Reuse.copied`, which
# also has the sample's usage, priced anew where it had no price: `cost_usd`).
COPY_COLUMNS = ("run_id", "case_id", "sample_index", "case_hash", "cost_usd")


@dataclass(frozen=True)
class Reuse:
    """What a run takes from the cache: `copied`, the stored samples it keeps whole (same
    output, graded the same way), by their place (`COPY_COLUMNS`: the stored run id, case
    id and index, and this run's hash of the case, which the gate pairs on: a case whose
    slices or tags changed keeps its verdicts but has a new hash); `missing`, the planned
    samples still to draw or to grade anew; `regrade`, the stored samples (lookup rows)
    whose outputs some of `missing` are graded from (`with_stored_outputs`)."""

    copied: pa.Table
    missing: list[PlannedSample]
    regrade: pa.Table

    def priced(self, prices: PriceTable) -> Reuse:
        """The same, every sample copied whole that had no price when it was drawn priced by
        `prices` where it can be (its tokens are stored)."""
        copied = self.copied
        cost = copied["cost_usd"]
        unpriced = pc.and_(pc.is_null(cost), pc.or_(pc.is_valid(copied["input_tokens"]),
                                                     pc.is_valid(copied["output_tokens"])))
        if pc.any(unpriced).as_py():  # most runs have none: no row is read into Python
            rows = iter(copied.filter(unpriced).to_pylist())
            costs = [priced(row_usage(next(rows)), prices).cost_usd if need else known
                     for need, known in zip(unpriced.to_pylist(), cost.to_pylist(), strict=True)]
            copied = copied.set_column(copied.schema.get_field_index("cost_usd"), "cost_usd",
                                       pa.array(costs, pa.float64()))
        return replace(self, copied=copied)


def pending(spec: RunSpec, planned: Sequence[PlannedSample], stored: pa.Table) -> Reuse:
    """Given the stored samples found by output key (`stored`, lookup rows of
    `CACHE_LOOKUP_COLUMNS`, at most one per key): what the run copies whole and what it
    still has to draw, or to grade anew from a stored output: a changed reference, grader or
    safety rule costs grading, not an agent call. With `regrade`, every stored output is
    graded again."""
    out_keys = pa.array([p.output_key for p in planned], pa.string())
    at = pc.index_in(stored["output_key"], value_set=out_keys)  # each stored row's planned sample
    wanted = pa.array([p.cache_key for p in planned], pa.string()).take(at)
    whole = pc.and_(pc.equal(stored["cache_key"], wanted),
                    pc.invert(pc.is_in(stored["status"], value_set=pa.array(NOT_REUSED_STATUSES))))
    if spec.regrade:
        whole = pc.and_(whole, pa.scalar(False))
    kept = stored.filter(whole)
    copied = pa.table({"run_id": kept["run_id"], "case_id": kept["case_id"], "sample_index": kept["sample_index"],
                       "case_hash": pa.array([p.case_hash for p in planned], pa.string()).take(at.filter(whole)),
                       **{c: kept[c] for c in USAGE_SAMPLE_COLUMNS}})
    done = pc.is_in(out_keys, value_set=kept["output_key"]).to_pylist()
    return Reuse(copied, [p for p, d in zip(planned, done, strict=True) if not d], stored.filter(pc.invert(whole)))


# Graded samples not reused whole: the grader or its environment failed, which says
# nothing about the output, so a re-run grades it again.
NOT_REUSED_STATUSES = ("error",)


def with_stored_outputs(missing: Sequence[PlannedSample], regrade: pa.Table,
                        outputs: Mapping[str, tuple[str | StoredOutput, SampleTrace]],
                        prices: PriceTable) -> list[PlannedSample]:
    """The planned samples with the stored output and what its agent recorded (`outputs` by
    output key, read for `regrade`'s rows) and what its call took (priced by `prices` where
    it was not) of each one that has one, graded rather than drawn again, so the agent is not
    asked twice (nor paid twice), and its graders see the trajectory it was drawn with."""
    found = {row["output_key"]: row for row in regrade.to_pylist()}
    return [replace(p, output=outputs[p.output_key][0], trace=outputs[p.output_key][1],
                    usage=priced(row_usage(row), prices))
            if (row := found.get(p.output_key)) else p for p in missing]


def batch_label(chunk: Sequence[PlannedSample]) -> str:
    ids = sorted({p.case_id for p in chunk})
    return ids[0] if len(ids) == 1 else f"{ids[0]}…{ids[-1]} ({len(chunk)})"


def batch_cases(cases: Mapping[str, EvalCase], chunk: Sequence[PlannedSample]) -> list[EvalCase]:
    """The cases a batch draws from (`cases` by id), in id order."""
    return [cases[case_id] for case_id in sorted({p.case_id for p in chunk})]
