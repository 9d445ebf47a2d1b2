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
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from tasks.metrics.cost import PriceTable
from tasks.models import EvalSuite, InputError, canonical_json, sha256_hex
from tasks.run.config import RunConfig
from tasks.run.prepare import PreparedRun, RunSources, gate_baseline
from tasks.run.samples import row_usage
from tasks.run.sampling import PlannedSample, grading_fingerprint
from tasks.run.spec import RunSpec
from tasks.run.steps import plan
from tasks.run.stored import OutputReader, row_output
from tasks.sandbox import run_sandbox_mode
from tasks.trace import SampleTrace


@dataclass(frozen=True)
class RescorePlan:
    """What a rescore grades in place of drawing (`tasks.run.loop.run_loop`'s `rescoring`)."""

    source_run: str
    to_grade: list[PlannedSample]  # each with its stored output
    failed_calls: pa.Table  # the source's agent_error samples: facts about the agent, carried as they are
    unscored: list[str]  # case ids with no stored sample


class SnapshotReader(Protocol):
    """The stored suites (`storage.snapshots.Snapshots`)."""

    def path(self, version: str) -> Path: ...
    def read(self, version: str) -> EvalSuite: ...


class SampleReader(Protocol):
    """The stored samples (`storage.samples.Samples`)."""

    def of_run(self, run_id: str, columns: Sequence[str] | None = None, *,
               whole_outputs: bool = True) -> pa.Table: ...


class RescoreSources(RunSources, Protocol):
    """Where a rescore's source run, its suite's snapshot and its outputs are read
    (`storage.store.Store`)."""

    @property
    def snapshots(self) -> SnapshotReader: ...
    @property
    def samples(self) -> SampleReader: ...
    @property
    def db(self) -> OutputReader: ...


@dataclass(frozen=True)
class PreparedRescore:
    """A rescore, resolved and checked: the run it records and what it grades."""

    config: RunConfig
    run: PreparedRun
    plan: RescorePlan


# What a rescore takes of a run's options: it calls no agent, and its agent, n and seed are
# the source run's, so none of drawing's options mean anything to it.
RESCORE_OPTIONS = frozenset({"suite", "runner", "workers", "unsafe_no_sandbox", "baseline", "min_pass_at_1",
                             "max_drop", "max_new_failures", "min_slice", "max_increase", "metric"})


def prepare_rescore(source_ref: str, store: RescoreSources, **options: Any) -> PreparedRescore:
    """The rescore of the stored run `source_ref` (id or prefix) that `options` (of
    `RESCORE_OPTIONS`, fields of a `RunConfig`) describe, every input checked once, before
    anything is graded: the suite, the sandbox, the source's snapshot, the rules and baseline.
    Another option is `InputError`, not silently ignored."""
    unknown = sorted(set(options) - RESCORE_OPTIONS)
    if unknown:
        raise InputError(f"rescore: {', '.join(unknown)}: not an option of a rescore (it calls no agent: its"
                         " agent, n and seed are the source run's)")
    source = store.runs.find(source_ref)
    suite, suite_source = store.resolve_suite(options["suite"])
    # Pinned, as a run's: the suite that was checked is the one graded, even if a branch moves.
    # No environment overrides: a rescore calls no agent and prices nothing.
    config = RunConfig.build("rescore", lambda field: "--" + field.replace("_", "-"), environ={},
                             **options | {"agent": source["agent"], "suite": suite_source})
    sandbox = run_sandbox_mode(suite.grader_kinds, config.unsafe_no_sandbox)
    source_suite = source_suite_of(source, suite, store)
    baseline, no_baseline = gate_baseline(config, suite, store)
    spec = RunSpec(
        suite_version=suite.version, suite_name=suite.name, agent=source["agent"],
        agent_fingerprint=source["agent_fingerprint"], n=source["n"], ks=list(source["ks"]), seed=source["seed"],
        config={"rescored_from": source["run_id"], "suite_ref": config.suite, "suite_source": suite_source,
                "runner": config.runner, "workers": config.grade_workers, "sandbox": sandbox,
                "baseline": baseline.run_id if baseline else None},
    )
    grading = rescore_plan(spec.run_id, plan(suite, spec), suite, source_suite, source["run_id"],
                           store.samples.of_run(source["run_id"], whole_outputs=False), store.db)
    return PreparedRescore(config, PreparedRun(spec, suite, None, PriceTable(), baseline, config.rules, no_baseline),
                           grading)


def source_suite_of(source: dict[str, Any], suite: EvalSuite, store: RescoreSources) -> EvalSuite:
    """The suite the stored run `source` ran (its snapshot); bad input, before any work,
    when it is gone or shares no question (case id and inputs) with `suite`."""
    if not store.snapshots.path(source["suite_version"]).exists():
        raise InputError(f"run {source['run_id']}: the snapshot of its suite {source['suite_version'][:12]}"
                         f" is missing from {store.snapshots.path(source['suite_version']).parent}:"
                         " cannot tell which questions it asked")
    ran = store.snapshots.read(source["suite_version"])
    asked = {(c.id, c.inputs_hash) for c in ran.cases}
    if not any((c.id, c.inputs_hash) in asked for c in suite.cases):
        raise InputError(f"run {source['run_id']} has no output for any case of suite {suite.name!r}"
                         " (no case with the same id and inputs): nothing to score")
    return ran


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
        stored = replace(p, output=row_output(row, reader), usage=row_usage(row),
                         trace=SampleTrace.parse(row.get("trace")).agent_part())
        if row["output_key"] != p.output_key:
            stored = replace(stored, seed=row["seed"], output_key="", cache_key=sha256_hex(
                canonical_json(["rescored", row["cache_key"], grading[p.case_id]])))
        to_grade.append(stored)
    unscored = sorted(c.id for c in suite.cases if c.id not in scored)
    return RescorePlan(source_run, to_grade, pa.Table.from_pylist(failed, schema=source.schema), unscored)
