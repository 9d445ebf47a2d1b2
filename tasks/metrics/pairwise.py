"""Pairwise comparison: which of two outputs for the same case is better, asked in both orders.

Judges prefer whatever they see first (or second) more often than chance; asking twice
with the order swapped is the control. A pair's outcome is `a`, `b` or `tie` when both
orders agree, and `inconsistent` when they do not — which `position_bias` then splits by
the position that won both times (`first`, `second`) or `mixed` (a tie against a win).
Inconsistent pairs count as ties in the win rate: the judge could not tell them apart.

The win rate of A is the mean over cases of each case's mean pair score (a win 1, a tie
or inconsistent pair 0.5, a loss 0), with a bootstrap CI clustered by case. A pair whose
judge call errored is counted in `errors` and left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tasks.graders.judge import Judge, JudgeError
from tasks.metrics.stats import DEFAULT_LEVEL, bootstrap_mean_ci, standard_error
from tasks.models import EvalCase, content_seed

Outcome = Literal["a", "b", "tie", "inconsistent", "error"]
SCORE = {"a": 1.0, "tie": 0.5, "inconsistent": 0.5, "b": 0.0}


@dataclass(frozen=True)
class Pair:
    """Two runs' outputs for one case and sample index: each a `str`, or an output kept in the
    home whose `str` reads it (`tasks.run.stored.StoredOutput`), read when the pair is judged."""

    case: EvalCase
    sample_index: int
    output_a: str | Any
    output_b: str | Any


@dataclass(frozen=True)
class PairResult:
    case_id: str
    sample_index: int
    a_first: str  # the judge's answer with A shown first: first/second/tie ("" on error)
    b_first: str
    outcome: Outcome
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        doc = {
            "case_id": self.case_id,
            "sample_index": self.sample_index,
            "a_first": self.a_first,
            "b_first": self.b_first,
            "outcome": self.outcome,
        }
        return doc | ({"error": self.error} if self.error else {})


def judge_pair(judge: Judge, pair: Pair) -> PairResult:
    """Ask in both orders, each with a seed derived from the shown content."""
    case, a, b = pair.case, str(pair.output_a), str(pair.output_b)
    try:
        ab = judge.prefer(case, a, b, content_seed("pairwise", case.case_hash, a, b))
        ba = judge.prefer(case, b, a, content_seed("pairwise", case.case_hash, b, a))
    except JudgeError as exc:
        return PairResult(case.id, pair.sample_index, "", "", "error", str(exc))
    # In run terms: A-first "first" is A; B-first "first" is B.
    as_run = {"first": "a", "second": "b", "tie": "tie"}
    one, two = as_run[ab], {"first": "b", "second": "a", "tie": "tie"}[ba]
    outcome: Outcome = one if one == two else "inconsistent"  # type: ignore[assignment]
    return PairResult(case.id, pair.sample_index, ab, ba, outcome)


def position_bias(results: Sequence[PairResult]) -> dict[str, int]:
    """Inconsistent pairs by the position that won both times (or `mixed`)."""
    bias = {"first": 0, "second": 0, "mixed": 0}
    for r in results:
        if r.outcome == "inconsistent":
            bias[r.a_first if r.a_first == r.b_first else "mixed"] += 1
    return bias


def compare(
    judge: Judge,
    pairs: Sequence[Pair],
    *,
    workers: int = 4,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
) -> dict[str, Any]:
    """Judge every pair in both orders; counts, position bias and A's win rate with a CI."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda p: judge_pair(judge, p), pairs))
    counts = {
        o: sum(r.outcome == o for r in results) for o in ("a", "b", "tie", "inconsistent", "error")
    }
    per_case: dict[str, list[float]] = {}
    for r in results:
        if r.outcome != "error":
            per_case.setdefault(r.case_id, []).append(SCORE[r.outcome])
    means = np.array([np.mean(v) for _, v in sorted(per_case.items())])
    judged = len(results) - counts["error"]
    return {
        "judge": judge.spec,
        "judge_fingerprint": judge.fingerprint,
        "pairs": len(results),
        "cases": len(per_case),
        "wins_a": counts["a"],
        "wins_b": counts["b"],
        "ties": counts["tie"],
        "inconsistent": counts["inconsistent"],
        "inconsistent_rate": counts["inconsistent"] / judged if judged else None,
        "errors": counts["error"],
        "position_bias": position_bias(results),
        "win_rate_a": float(means.mean()) if means.size else None,
        "win_rate_a_ci": list(bootstrap_mean_ci(means, seed=seed, level=level))
        if means.size
        else None,
        "win_rate_a_se": standard_error(means) if means.size else None,
        "ci_level": level,
        "results": [r.to_json() for r in results],
    }


def pair_samples(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]],
                 cases_by_hash: dict[str, EvalCase]) -> list[Pair]:
    """Pairs of run A's and run B's sample rows (`case_hash`, `sample_index`, `output`) of
    the same case (by case hash, so two suite versions pair on the cases they share) and the
    same sample index, in case order."""
    b_outputs = {(row["case_hash"], row["sample_index"]): row["output"] for row in b}
    pairs = []
    for row in a:
        key = (row["case_hash"], row["sample_index"])
        if key in b_outputs and key[0] in cases_by_hash:
            pairs.append(Pair(cases_by_hash[key[0]], key[1], row["output"], b_outputs[key]))
    return sorted(pairs, key=lambda p: (p.case.id, p.sample_index))
