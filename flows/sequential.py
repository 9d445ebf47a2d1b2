"""`run --baseline RUN --sequential`: draw the suite's cases in a seeded random order, in rounds,
and stop as soon as the gate's decision can no longer change (`tasks.metrics.sequential`).

Each round is an ordinary draw (`tasks.run.loop.reuse_cached`, `draw_and_grade`): its samples are
stored as the run's, under their usual cache keys, so a later full run (or the same command
after a kill) reuses them and draws only the rest. The order depends only on the run's seed,
so a resumed run takes the same looks and reaches the same decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from prefect import get_run_logger

from flows.artifacts import progress_hook
from flows.steps import ShownProgress
from storage.store import Store
from tasks.metrics.cost import PriceTable
from tasks.metrics.percent import signed_points
from tasks.metrics.sequential import Look, SequentialRecord, look_points, sequential_looks
from tasks.metrics.stats import DEFAULT_LEVEL
from tasks.models import EvalSuite
from tasks.run import RunConfig, RunSpec, RunSummary
from tasks.run.loop import Rounds, Stages, draw_and_grade, reuse_cached
from tasks.run.sampling import PlannedSample

# Mixed into the run's seed for the draw order, so the order is not the samples' own seeds.
_ORDER_STREAM = 24


def case_order(hashes: list[str], seed: int) -> list[str]:
    """The case hashes in the run's seeded random order."""
    rng = np.random.default_rng([seed, _ORDER_STREAM])
    return [hashes[i] for i in rng.permutation(len(hashes))]


def sequential_rounds(spec: RunSpec, config: RunConfig, suite: EvalSuite, agent: Any, store: Store, stages: Stages,
                      baseline: str, prices: PriceTable) -> Rounds:
    """The loop's drawing for `run --sequential` against `baseline`."""
    can_pass_early = not (config.min_pass_at_1 is not None or config.max_new_failures is not None
                          or config.min_slice or any(c.must_pass for c in suite.cases))

    def draw(planned: list[PlannedSample]) -> tuple[SequentialRecord, list[PlannedSample]]:
        return draw_sequentially(spec, config, suite, agent, planned, store, stages, baseline=baseline,
                                 alpha=1 - DEFAULT_LEVEL, can_pass_early=can_pass_early, prices=prices)

    return Rounds(draw, apply_stop)


def draw_sequentially(
    spec: RunSpec, config: RunConfig, suite: EvalSuite, agent: Any, planned: list[PlannedSample], store: Store,
    stages: Stages, *, baseline: str, alpha: float, can_pass_early: bool, prices: PriceTable,
) -> tuple[SequentialRecord, list[PlannedSample]]:
    """Draw `planned` round by round against `baseline` until the confidence sequence decides
    or the suite is exhausted; the samples land in the run like any others. Returns the
    record and the planned samples drawn."""
    logger = get_run_logger()
    metric, max_drop = config.metric, config.max_drop
    base = {r.case_hash: r.value(metric) for r in store.case_results(baseline)}
    by_hash: dict[str, list[PlannedSample]] = {}
    for p in planned:
        by_hash.setdefault(p.case_hash, []).append(p)
    paired = case_order(sorted(h for h in by_hash if h in base), spec.seed)
    unpaired = sorted(h for h in by_hash if h not in base)  # drawn only if the run goes to the end
    points = look_points(len(paired), config.sequential_rounds) if paired else []
    looks: list[Look] = []
    decision = None
    drawn = 0
    progress = _CumulativeProgress(len(planned))

    def draw(chunk: list[PlannedSample]) -> None:
        progress.draw(chunk, lambda shown: draw_and_grade(
            spec, config, suite, agent, reuse_cached(spec, chunk, store), len(chunk), store, stages, prices=prices,
            progress=shown))

    for point in points:
        draw([p for h in paired[drawn:point] for p in by_hash[h]])
        drawn = point
        values = {r.case_hash: r.value(metric) for r in store.case_results(spec.run_id)}
        diffs = np.array([values[h] - base[h] for h in paired[:drawn]])
        # Replayed from the first look: the same data, so only the latest look can newly decide.
        looks, decision = sequential_looks(diffs, points[: len(looks) + 1], horizon=len(paired), alpha=alpha,
                                           max_drop=max_drop, can_pass_early=can_pass_early)
        last = looks[-1]
        logger.info("sequential look %d/%d: %d of %d cases, change %s, anytime-valid bounds %s to %s",
                    last.round, len(points), last.cases, len(paired), signed_points(last.mean),
                    signed_points(last.lower), signed_points(last.upper))
        if decision is not None:
            break
    if decision is None:
        draw([p for h in unpaired for p in by_hash[h]])
        drawn = len(paired) + len(unpaired)
    cases_planned = len(by_hash)
    taken = [p for h in (paired[:drawn] if decision else by_hash) for p in by_hash[h]]
    return SequentialRecord(
        decision=decision, stopped_early=decision is not None and drawn < cases_planned, rounds=len(looks),
        planned_rounds=len(points), cases_drawn=drawn, cases_planned=cases_planned,
        samples_drawn=len(taken),
        samples_planned=len(planned), alpha=alpha, max_drop=max_drop, order_seed=spec.seed,
        early_pass=can_pass_early, looks=tuple(looks),
    ), taken


class _CumulativeProgress:
    """Each round's draw, its progress shown against the whole suite's samples (the CLI's
    bar and lines would otherwise start again at 0 every round)."""

    def __init__(self, total: int) -> None:
        self.done, self.total = 0, total

    def draw(self, chunk: list[PlannedSample], draw: Callable[[ShownProgress], Any]) -> None:
        if not chunk:
            return
        hook = progress_hook.get()
        token = progress_hook.set(
            (lambda done, _total: hook(self.done + done, self.total)) if hook else None)
        try:
            draw(ShownProgress())
        finally:
            progress_hook.reset(token)
        self.done += len(chunk)


def apply_stop(summary: RunSummary, record: SequentialRecord) -> None:
    """Record the stop in the summary (`sequential`) and, when the run stopped early, make the
    gate's decision the sequence's: its bounds replace the bootstrap CI of the partial run."""
    summary.sequential = record.to_json()
    if not record.stopped_early or summary.gate is None:
        return
    summary.cases = record.cases_drawn  # what its figures cover; `sequential` has the suite's count
    last = record.looks[-1]
    gate = summary.gate
    allowed = f"-{100 * record.max_drop:g} pts" if record.max_drop else "0"
    verdict = "regressed" if last.upper < 0 else "improved" if last.lower > 0 else "inconclusive"
    said = (f"sequential: stopped after round {record.rounds} of {record.planned_rounds}"
            f" ({record.cases_drawn} of {record.cases_planned} cases, {record.samples_drawn} of"
            f" {record.samples_planned} samples): change {signed_points(last.mean)}, its anytime-valid"
            f" {100 * (1 - record.alpha):g}% confidence sequence {signed_points(last.lower)} to"
            f" {signed_points(last.upper)} lies wholly "
            + (f"below {allowed} (the allowed drop)" if record.decision == "block"
               else f"above {allowed}: a larger drop is ruled out"))
    # The bootstrap CI of the cases drawn so far is not what decided: its sentences make way.
    others = [r for r in gate.reasons if not r.startswith(("regression:", "improved:", "regressed:", "inconclusive:"))]
    decision = "block" if record.decision == "block" or gate.blocks or any(
        r.startswith(("safety:", "threshold:")) for r in gate.reasons) else "pass"
    summary.gate = gate.model_copy(update={"decision": decision, "verdict": verdict, "reasons": [said, *others],
                                           "delta_ci": [last.lower, last.upper]})
