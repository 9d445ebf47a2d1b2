"""Gate rules a team can state, beside the paired CI (docs/contract.md §6): must-pass cases,
a cap on new failures (of the deciding grader, and of each extra grader by name), per-slice
thresholds, and caps on the growth of what each sample takes (turns, tool calls, tokens, cost). Each block names the cases or the slice
that caused it, so a blocked pull request says what to look at.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tasks.metrics.diff import INCREASE_FIGURES, CaseResult, Metric, RunDiff
from tasks.metrics.percent import percent
from tasks.models import InputError

# A block's message names at most this many cases; its `cases` list names them all.
NAMED_IN_MESSAGE = 10


@dataclass(frozen=True)
class GateRules:
    """Every rule a gate decides by: the thresholds on the paired CI and the run's pass@1,
    and the case-level rules. The gate document records them (`rules`), so each output of
    a decision says what it was decided by."""

    must_pass: frozenset[str] = frozenset()  # case ids of the run's suite marked must_pass
    max_new_failures: int | None = None
    slice_min: Mapping[str, float] = field(default_factory=dict)  # slice → lowest allowed value
    min_pass_at_1: float | None = None
    max_drop: float = 0.0
    # figure (`INCREASE_FIGURES`) → the largest relative growth of its mean per sample allowed.
    max_increase: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, allowed in self.max_increase.items():
            if name not in INCREASE_FIGURES:
                raise InputError(f"--max-increase {name}: not a figure it bounds (one of {', '.join(INCREASE_FIGURES)})")
            if not allowed >= 0:
                raise InputError(f"--max-increase {name}={allowed}: the allowed growth is a fraction >= 0 (0.2: 20 %)")
        if self.max_new_failures is not None and self.max_new_failures < 0:
            raise InputError(f"--max-new-failures must be >= 0, got {self.max_new_failures}")
        if self.max_drop < 0:
            raise InputError(f"--max-drop must be >= 0, got {self.max_drop}")
        if self.min_pass_at_1 is not None and not 0.0 <= self.min_pass_at_1 <= 1.0:
            raise InputError(f"--min-pass-at-1 must lie in 0..1, got {self.min_pass_at_1}")

    def to_json(self) -> dict[str, Any]:
        doc = {"min_pass_at_1": self.min_pass_at_1, "max_drop": self.max_drop,
               "max_new_failures": self.max_new_failures, "min_slice": dict(sorted(self.slice_min.items())),
               "must_pass": sorted(self.must_pass)}
        if self.max_increase:  # absent without it: gates stored before the rule read as they were
            doc["max_increase"] = dict(sorted(self.max_increase.items()))
        return doc


@dataclass(frozen=True)
class Block:
    rule: str  # "must_pass", "new_failures", "slice_threshold" or "max_increase"
    message: str
    cases: tuple[str, ...] = ()
    slice: str | None = None
    grader: str | None = None  # the extra grader whose new failures these are

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"rule": self.rule, "message": self.message, "cases": list(self.cases)}
        if self.slice is not None:
            doc["slice"] = self.slice
        if self.grader is not None:
            doc["grader"] = self.grader
        return doc


def parse_slice_thresholds(specs: Iterable[str]) -> dict[str, float]:
    """`SLICE=X` (X in 0..1) per flag, as given to `--min-slice`."""
    out: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.rpartition("=")
        try:
            threshold = float(value)
        except ValueError:
            threshold = -1.0
        if not sep or not name or not 0.0 <= threshold <= 1.0:
            raise InputError(f"--min-slice: expected SLICE=X with X in 0..1, got {spec!r}")
        out[name] = threshold
    return out


def check_slices(slice_min: Mapping[str, float], suite_slices: Iterable[str]) -> None:
    """Refuse a threshold on a slice the suite does not have, before any sample is drawn."""
    known = set(suite_slices)
    unknown = sorted(set(slice_min) - known)
    if unknown:
        raise InputError(f"--min-slice: the suite has no slice {unknown[0]!r} (its slices: {', '.join(sorted(known)) or 'none'})")


def rule_blocks(
    rules: GateRules,
    run: Sequence[CaseResult],
    diff: RunDiff | None,
    slice_values: Mapping[str, float | None],
    metric_name: str = "pass@1",
) -> list[Block]:
    """The blocks `rules` raise for `run` (its diff against the baseline and its per-slice
    values of the gated metric); without a baseline (`diff` None), every rule but new
    failures, the one that compares."""
    blocks = []
    by_id = {r.case_id: r for r in run}
    if rules.must_pass:
        failing = sorted(cid for cid in rules.must_pass if cid in by_id and by_id[cid].c < by_id[cid].n)
        unmeasured = sorted(cid for cid in rules.must_pass if cid not in by_id)
        if failing:
            detail = ", ".join(f"{cid} ({by_id[cid].c}/{by_id[cid].n})" for cid in failing[:NAMED_IN_MESSAGE])
            blocks.append(Block("must_pass", f"must-pass: {len(failing)} must-pass case(s) failed in some"
                                f" sample: {detail}{_more(failing)}", tuple(failing)))
        if unmeasured:
            blocks.append(Block("must_pass", f"must-pass: {len(unmeasured)} must-pass case(s) were not measured:"
                                f" {', '.join(unmeasured[:NAMED_IN_MESSAGE])}{_more(unmeasured)}",
                                tuple(unmeasured)))
    failing_graders = [(r.case_id, name, *r.graders[name]) for r in sorted(run, key=lambda r: r.case_id)
                       for name in sorted(r.must_pass_graders) if name in r.graders and r.graders[name][1] < r.graders[name][0]]
    if failing_graders:
        detail = ", ".join(f"{cid} {name} ({c}/{n})" for cid, name, n, c in failing_graders[:NAMED_IN_MESSAGE])
        cases = tuple(dict.fromkeys(cid for cid, *_ in failing_graders))
        blocks.append(Block("must_pass", f"must-pass: {len(failing_graders)} must-pass grader(s) failed in some sample:"
                            f" {detail}{_more(failing_graders)}", cases))
    if rules.max_new_failures is not None and diff is not None:
        new = newly_failing(diff)
        if len(new) > rules.max_new_failures:
            detail = ", ".join(new[:NAMED_IN_MESSAGE])
            blocks.append(Block("new_failures", f"new failures: {len(new)} case(s) that always passed in the"
                                f" baseline now fail in some sample (allowed {rules.max_new_failures}):"
                                f" {detail}{_more(new)}", tuple(new)))
        # Each extra grader counts as the deciding one does: its own new failures, by its name.
        for name, new in sorted(newly_failing_graders(diff).items()):
            if len(new) > rules.max_new_failures:
                blocks.append(Block("new_failures", f"new failures of grader {name}: {len(new)} case(s) it passed"
                                    f" in every baseline sample now fail it in some sample (allowed"
                                    f" {rules.max_new_failures}): {', '.join(new[:NAMED_IN_MESSAGE])}{_more(new)}",
                                    tuple(new), grader=name))
    if diff is not None:
        blocks.extend(increase_blocks(rules.max_increase, diff))
    for name, threshold in sorted(rules.slice_min.items()):
        if name not in slice_values:
            known = ", ".join(sorted(slice_values)) or "none"
            raise InputError(f"--min-slice: the run has no slice {name!r} (its slices: {known})")
        value = slice_values[name]
        if value is None or value < threshold:
            shown = "n/a" if value is None else percent(value)
            blocks.append(Block("slice_threshold", f"slice {name}: {metric_name} {shown} is below the required"
                                f" {percent(threshold)}", slice=name))
    return blocks


def newly_failing(diff: RunDiff) -> list[str]:
    """The cases that passed every sample in the baseline and fail some sample now, by id."""
    return sorted(c.case_id for c in diff.cases if c.before is not None and c.after is not None
                  and c.before.c == c.before.n and c.after.c < c.after.n)


def parse_increases(specs: Iterable[str]) -> dict[str, float]:
    """`tool_calls=0.2` → {"tool_calls": 0.2}; `InputError` naming a malformed one."""
    found = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        try:
            found[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise InputError(f"--max-increase {spec!r}: expected FIGURE=FRACTION, e.g. tool_calls=0.2")
    GateRules(max_increase=found)  # checks the names and values
    return found


def increase_blocks(limits: Mapping[str, float], diff: RunDiff, level: float = 0.95,
                    n_boot: int = 2000) -> list[Block]:
    """A block per figure whose mean per sample grew, over the paired cases that report it in
    both runs, by more than its allowed fraction with the whole paired CI above it (the ratio of
    the means, bootstrapped over cases; from a mean of 0, any growth whose CI is above 0)."""
    blocks = []
    for name, allowed in sorted(limits.items()):
        pairs = [(c.before.figures[name] / c.before.n, c.after.figures[name] / c.after.n) for c in diff.cases
                 if c.before is not None and c.after is not None
                 and name in c.before.figures and name in c.after.figures]
        if len(pairs) < 2:
            continue  # no CI to stand on: one case is no evidence of a trend
        before, after = np.array(pairs).T
        rng = np.random.default_rng(0)
        draws = rng.integers(0, len(pairs), size=(n_boot, len(pairs)))
        b, a = before[draws].mean(axis=1), after[draws].mean(axis=1)
        alpha = (1 - level) / 2
        if before.mean() > 0:
            growth = a[b > 0] / b[b > 0] - 1
            lo, hi = np.quantile(growth, [alpha, 1 - alpha])
            point = after.mean() / before.mean() - 1
            if lo > allowed:
                blocks.append(Block("max_increase", f"{name}: the mean per sample grew by {percent(point)}"
                                    f" ({percent(level, 0)} CI +{percent(lo)} to +{percent(hi)}) over {len(pairs)}"
                                    f" shared cases, above the allowed +{percent(allowed)}"))
        elif np.quantile(a - b, alpha) > 0:
            blocks.append(Block("max_increase", f"{name}: {after.mean():.3g} per sample where the baseline had none"
                                f" ({len(pairs)} shared cases), above the allowed +{percent(allowed)}"))
    return blocks


def newly_failing_graders(diff: RunDiff) -> dict[str, list[str]]:
    """Per extra grader (by name): the cases it passed in every baseline sample that it fails in
    some sample now, by id."""
    found: dict[str, list[str]] = {}
    for c in diff.cases:
        if c.before is None or c.after is None:
            continue
        for name, (n, passed) in c.after.graders.items():
            before = c.before.graders.get(name)
            if before is not None and before[1] == before[0] and passed < n:
                found.setdefault(name, []).append(c.case_id)
    return {name: sorted(ids) for name, ids in found.items()}


def _more(ids: Sequence[str]) -> str:
    return f" and {len(ids) - NAMED_IN_MESSAGE} more" if len(ids) > NAMED_IN_MESSAGE else ""


def settled_blocks(
    rules: GateRules,
    drawn: Sequence[CaseResult],
    baseline: Mapping[str, CaseResult],
    planned: Mapping[str, tuple[str, ...]],
    metric: Metric = "pass",
) -> list[str]:
    """The blocks a partly drawn run already has for good, whatever its other cases do: what
    lets a sequential run stop at the first look that shows a broken rule. `drawn`: the
    cases drawn so far (each with all its samples); `baseline`: the baseline's results by
    case hash; `planned`: every case of the run, case id → its slices. A must-pass case that
    failed a sample, more new failures than allowed, and a threshold (pass@1, a slice) that the
    cases not yet drawn could not lift even if each scored 1, are settled."""
    blocks = []
    failing = sorted(r.case_id for r in drawn if r.case_id in rules.must_pass and r.c < r.n)
    if failing:
        blocks.append(f"must-pass: {len(failing)} must-pass case(s) failed in some sample:"
                      f" {', '.join(failing[:NAMED_IN_MESSAGE])}{_more(failing)}")
    if rules.max_new_failures is not None:
        new = sorted(r.case_id for r in drawn if (b := baseline.get(r.case_hash)) is not None
                     and b.c == b.n and r.c < r.n)
        if len(new) > rules.max_new_failures:
            blocks.append(f"new failures: {len(new)} case(s) that always passed in the baseline now fail in some"
                          f" sample (allowed {rules.max_new_failures}): {', '.join(new[:NAMED_IN_MESSAGE])}{_more(new)}")
    if rules.min_pass_at_1 is not None:
        best = _best_mean([r.c / r.n for r in drawn], len(planned))
        if best < rules.min_pass_at_1:
            blocks.append(f"threshold: pass@1 can reach at most {percent(best)} with every case not yet drawn"
                          f" passing, below the required {percent(rules.min_pass_at_1)}")
    for name, threshold in sorted(rules.slice_min.items()):
        members = sum(name in slices for slices in planned.values())
        best = _best_mean([r.value(metric) for r in drawn if name in r.slices], members)
        if members and best < threshold:
            blocks.append(f"slice {name}: can reach at most {percent(best)} with every case not yet drawn"
                          f" scoring 1, below the required {percent(threshold)}")
    return blocks


def _best_mean(values: Sequence[float], total: int) -> float:
    """The highest mean `total` cases can have when `values` are known and the rest score 1."""
    return (sum(values) + (total - len(values))) / total if total else 1.0
