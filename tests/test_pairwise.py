"""Pairwise comparison in both orders: position bias caught, win rates with CIs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from support.judges import ChatServer, ref, user_text
from typer.testing import CliRunner

from tasks.graders.judge import load_judge
from tasks.metrics.pairwise import Pair, compare, judge_pair
from tasks.models import EvalCase, InputError


def case(i: int) -> EvalCase:
    return EvalCase(
        id=f"c{i}", inputs={"prompt": f"q{i}"}, reference="yes", grader={"kind": "exact"}
    )


def pairs(a: list[str], b: list[str]) -> list[Pair]:
    return [Pair(case(i), 0, x, y) for i, (x, y) in enumerate(zip(a, b, strict=True))]


def test_a_judge_that_always_prefers_the_first_position_is_caught():
    doc = compare(load_judge(ref("always_first")), pairs(["yes"] * 6, ["no"] * 6))
    assert doc["inconsistent"] == 6 and doc["inconsistent_rate"] == 1.0
    assert doc["position_bias"] == {"first": 6, "second": 0, "mixed": 0}
    assert doc["wins_a"] == doc["wins_b"] == 0 and doc["win_rate_a"] == 0.5
    assert all(r["a_first"] == r["b_first"] == "first" for r in doc["results"])


def test_a_consistent_judge_gives_wins_ties_and_a_ci():
    a = ["yes", "yes", "yes", "no", "no", "yes"]
    b = ["no", "no", "yes", "yes", "no", "no"]
    doc = compare(load_judge(ref("prefers_reference")), pairs(a, b))
    assert (doc["wins_a"], doc["wins_b"], doc["ties"], doc["inconsistent"]) == (3, 1, 2, 0)
    assert doc["win_rate_a"] == pytest.approx((3 + 0.5 * 2) / 6)
    lo, hi = doc["win_rate_a_ci"]
    assert lo <= doc["win_rate_a"] <= hi and hi - lo > 0
    assert doc["position_bias"] == {"first": 0, "second": 0, "mixed": 0}


def test_judge_errors_are_counted_and_left_out():
    doc = compare(load_judge(ref("flaky_pairwise")), pairs(["yes"], ["no"]))
    assert doc["errors"] == 1 and doc["win_rate_a"] is None and doc["win_rate_a_ci"] is None
    assert "TimeoutError" in doc["results"][0]["error"]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["yes", "no"]), st.sampled_from(["yes", "no"])), min_size=1)
)
def test_swapping_the_runs_mirrors_the_result(rows):
    judge = load_judge(ref("prefers_reference"))
    a, b = [r[0] for r in rows], [r[1] for r in rows]
    ab, ba = compare(judge, pairs(a, b)), compare(judge, pairs(b, a))
    assert (ab["wins_a"], ab["wins_b"], ab["ties"]) == (ba["wins_b"], ba["wins_a"], ba["ties"])
    assert ab["win_rate_a"] == pytest.approx(1 - ba["win_rate_a"])


def test_openai_pairwise_judge_sees_both_orders(monkeypatch):
    def reply(body):
        return 200, json.dumps({"winner": "A", "rationale": "first looks fine"})

    with ChatServer(reply) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        result = judge_pair(
            load_judge("openai:judge-model"), Pair(case(0), 0, "AAA-out", "BBB-out")
        )
    assert result.outcome == "inconsistent" and (result.a_first, result.b_first) == (
        "first",
        "first",
    )
    shown = [user_text(body) for body in server.requests]
    assert shown[0].index("AAA-out") < shown[0].index("BBB-out")
    assert shown[1].index("BBB-out") < shown[1].index("AAA-out")
    assert server.requests[0]["seed"] != server.requests[1]["seed"]


def _runs(tmp_path: Path) -> tuple[str, str]:
    from flows.evaluate import evaluate

    agents = tmp_path / "agents.py"
    agents.write_text(
        "def good(inputs, ctx):\n    return 'yes'\n"
        "def mixed(inputs, ctx):\n    return 'yes' if ctx.case_id < 'c2' else 'no'\n"
    )
    suite = tmp_path / "toy.yaml"
    suite.write_text(
        "name: toy\ncases:\n"
        + "".join(
            f"  - {{id: c{i}, reference: 'yes', grader: {{kind: exact}}}}\n" for i in range(4)
        )
    )
    a = evaluate(suite=str(suite), agent=f"python:{agents}:good", n=2)
    b = evaluate(suite=str(suite), agent=f"python:{agents}:mixed", n=2)
    return a["run_id"], b["run_id"]


def test_compare_two_real_runs(prefect_harness, home, tmp_path):
    from flows.judging import compare as compare_cmd
    from flows.judging import compare_runs
    from storage.store import Store

    run_a, run_b = _runs(tmp_path)
    doc = compare_runs(run_a, run_b, ref("prefers_reference"), store=Store(home))
    # c0, c1: both say yes (ties); c2, c3: A right, B wrong. Two samples each.
    assert doc["pairs"] == 8 and doc["same_suite"] and doc["cases"] == 4
    assert (doc["wins_a"], doc["wins_b"], doc["ties"], doc["inconsistent"]) == (4, 0, 4, 0)
    assert doc["win_rate_a"] == pytest.approx(0.75)

    app = typer.Typer()
    app.command("compare")(compare_cmd)
    app.command("noop")(lambda: None)  # a second command keeps `compare` a subcommand
    out = CliRunner().invoke(app, ["compare", run_a, run_b, "--judge", ref("always_first")])
    assert out.exit_code == 0, out.output
    assert "order-inconsistent 8 (100.0%): first position won both 8" in out.output
    missing = CliRunner().invoke(app, ["compare", run_a, "nope", "--judge", ref("always_first")])
    assert isinstance(missing.exception, InputError) and "'nope'" in str(missing.exception)
