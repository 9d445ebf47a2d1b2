"""`run --baseline RUN --sequential`: draw the suite's cases in a seeded random order, in rounds,
and stop as soon as the gate's decision can no longer change: the anytime-valid test decides
(`tasks.metrics.sequential`), or a rule of the gate is broken for good (a must-pass case
failed, too many new failures, a threshold out of reach: `tasks.metrics.rules.settled_blocks`).
The run's budget is one meter over all rounds: once spent, no round starts and the run is partial.

Each round is an ordinary draw (the loop's `draw` of a chunk: reuse the cached, draw and grade
the rest): its samples are stored as the run's, under their usual cache keys, so a later full
run (or the same command after a kill) reuses them and draws only the rest. The order depends
only on the run's seed, so a resumed run takes the same looks and reaches the same decision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from tasks.metrics.diff import CaseResult, needs_records, with_metric
from tasks.metrics.percent import signed_points
from tasks.metrics.rules import GateRules, settled_blocks
from tasks.metrics.sequential import Look, SequentialRecord, look_points, sequential_looks
from tasks.metrics.stats import DEFAULT_LEVEL
from tasks.models import EvalSuite
from tasks.run.config import RunConfig
from tasks.run.sampling import PlannedSample
from tasks.run.spec import RunSpec
from tasks.run.summary import GateSummary

# Mixed into the run's seed for the draw order, so the order is not the samples' own seeds.
_ORDER_STREAM = 24

Progress = Callable[[int, int], None]  # (samples done, samples total), as the loop's
# One round's draw, its progress: the samples the run's budget left undrawn (0: all drawn).
DrawChunk = Callable[[list[PlannedSample], Progress | None], int]


class CaseResults(Protocol):
    def case_results(self, run_id: str, *, records: bool = False) -> list[CaseResult]: ...


@dataclass(frozen=True)
class SequentialDraw:
    record: SequentialRecord
    taken: list[PlannedSample]  # the planned samples drawn
    undrawn: int  # samples the budget left undrawn (the run is partial)


def case_order(hashes: list[str], seed: int) -> list[str]:
    """The case hashes in the run's seeded random order."""
    rng = np.random.default_rng([seed, _ORDER_STREAM])
    return [hashes[i] for i in rng.permutation(len(hashes))]


def can_pass_early(rules: GateRules) -> bool:
    """Whether a clear win may stop the run: not when a rule needs every case."""
    return not (rules.min_pass_at_1 is not None or rules.max_new_failures is not None
                or rules.slice_min or rules.must_pass)


def draw_sequentially(
    spec: RunSpec, config: RunConfig, suite: EvalSuite, planned: list[PlannedSample], samples: CaseResults,
    draw: DrawChunk, *, baseline: str, rules: GateRules, log: logging.Logger | logging.LoggerAdapter,
    progress: Progress | None = None,
) -> SequentialDraw:
    """Draw `planned` round by round against `baseline` until the run is decided (the
    confidence sequence decides, or a gate rule is broken for good: `settled_blocks`), the
    budget is spent, or the suite is exhausted; the samples land in the run like any others.
    Each look goes to `log`; `progress` counts over the whole suite's samples."""
    rules = replace(rules, must_pass=frozenset(c.id for c in suite.cases if c.must_pass))
    alpha, early = 1 - DEFAULT_LEVEL, can_pass_early(rules)
    metric, max_drop = config.metric, rules.max_drop
    records = needs_records(metric)
    base_results = {r.case_hash: r for r in with_metric(samples.case_results(baseline, records=records), metric,
                                                        f"baseline {baseline}")}
    base = {h: r.value(metric) for h, r in base_results.items()}
    by_hash: dict[str, list[PlannedSample]] = {}
    for p in planned:
        by_hash.setdefault(p.case_hash, []).append(p)
    slices = {c.id: c.slices for c in suite.cases}
    paired = case_order(sorted(h for h in by_hash if h in base), spec.seed)
    unpaired = sorted(h for h in by_hash if h not in base)  # drawn only if the run goes to the end
    points = look_points(len(paired), config.sequential_rounds) if paired else []
    looks: list[Look] = []
    decision, rule = None, None
    drawn = 0
    done = 0

    def draw_round(hashes: list[str]) -> int:
        # Each round's progress shown against the whole suite (a bar would restart at 0 every round).
        nonlocal done
        chunk = [p for h in hashes for p in by_hash[h]]
        if not chunk:
            return 0
        offset = done
        left = draw(chunk, (lambda d, _total: progress(offset + d, len(planned))) if progress else None)
        done += len(chunk) - left
        return left

    undrawn = 0
    for point in points:
        undrawn = draw_round(paired[drawn:point])
        if undrawn:  # the budget is spent: this round's cases are not all drawn, and no look is taken
            undrawn += sum(len(by_hash[h]) for h in [*paired[point:], *unpaired])
            log.info("sequential: the budget is spent in round %d of %d; %d samples undrawn",
                     len(looks) + 1, len(points), undrawn)
            break
        drawn = point
        results = with_metric(samples.case_results(spec.run_id, records=records), metric, f"run {spec.run_id}")
        values = {r.case_hash: r.value(metric) for r in results}
        diffs = np.array([values[h] - base[h] for h in paired[:drawn]])
        # Replayed from the first look: the same data, so only the latest look can newly decide.
        looks, decision = sequential_looks(diffs, points[: len(looks) + 1], horizon=len(paired), alpha=alpha,
                                           max_drop=max_drop, can_pass_early=early)
        last = looks[-1]
        log.info("sequential look %d/%d: %d of %d cases, change %s, anytime-valid bounds %s to %s",
                 last.round, len(points), last.cases, len(paired), signed_points(last.mean),
                 signed_points(last.lower), signed_points(last.upper))
        settled = settled_blocks(rules, results, base_results, slices, metric)
        if settled:  # a broken rule decides as surely as the test: block now
            decision, rule = "block", settled[0]
            log.info("sequential: %s", rule)
        if decision is not None:
            break
    if decision is None and not undrawn:
        undrawn = draw_round(unpaired)
        drawn = len(paired) + len(unpaired)
    cases_planned = len(by_hash)
    taken = [p for h in (paired[:drawn] if decision else by_hash) for p in by_hash[h]]
    record = SequentialRecord(
        decision=decision, stopped_early=decision is not None and drawn < cases_planned, rounds=len(looks),
        planned_rounds=len(points), cases_drawn=drawn, cases_planned=cases_planned,
        samples_drawn=done,
        samples_planned=len(planned), alpha=alpha, max_drop=max_drop, order_seed=spec.seed,
        early_pass=early, looks=tuple(looks), rule=rule,
    )
    return SequentialDraw(record, taken, undrawn)


def stopped_gate(gate: GateSummary, record: SequentialRecord) -> GateSummary:
    """The gate of a run that stopped early: the sequence's decision, its bounds in place of
    the bootstrap CI of the partial run, its stop as the first reason."""
    last = record.looks[-1]
    verdict = "regressed" if last.upper < 0 else "improved" if last.lower > 0 else "inconclusive"
    # The bootstrap CI of the cases drawn so far is not what decided: its sentences make way.
    others = [r for r in gate.reasons if not r.startswith(("regression:", "improved:", "regressed:", "inconclusive:"))]
    decision = "block" if record.decision == "block" or gate.blocks or any(
        r.startswith(("safety:", "threshold:")) for r in gate.reasons) else "pass"
    return gate.model_copy(update={"decision": decision, "verdict": verdict,
                                   "reasons": [record.stop_reason(), *others], "delta_ci": [last.lower, last.upper]})
