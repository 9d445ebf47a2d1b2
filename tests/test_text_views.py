"""The pure views of stored documents: plain data in, text or rows out, no storage, no
Prefect (`tasks.report.cases`, `case_view`, `plan_text`, `text.sequential_line`, `gate_text`,
`judging_text`)."""

from __future__ import annotations

import json

import pytest

from tasks.metrics import power as pw
from tasks.models import InputError
from tasks.report.case_view import MAX_TEXT_CHARS, case_doc, case_text
from tasks.report.cases import MAX_DETAILS_PER_CASE, case_rows
from tasks.report.gate_text import gate_lines, validation_text
from tasks.report.judging_text import calibration_text, labelled_text, pairwise_text
from tasks.report.plan_text import plan_text
from tasks.report.text import sequential_line
from tasks.run.prepare import no_baseline_message


def sample(case_id: str, passed: bool, detail: str = "", safety: list[str] | None = None) -> dict:
    return {"case_id": case_id, "passed": passed, "status": "passed" if passed else "failed",
            "detail": detail, "safety": safety}


def test_case_rows_group_counts_details_outputs_and_the_first_trajectory() -> None:
    samples = [sample("b", True), *(sample("a", False, f"wrong {i}") for i in range(7)),
               sample("a", True, "kept out: it passed"), sample("b", False, "", ["rm -rf /"])]
    trajectory = {"trajectory": {"entries": [{"role": "assistant", "content": "edit x.py"}]}}
    failing = [{"case_id": "a", "sample_index": 0, "output": "no", "trace": None},
               {"case_id": "a", "sample_index": 1, "output": None, "trace": json.dumps(trajectory)},
               {"case_id": "b", "sample_index": 1, "output": "x", "trace": "{}"}]
    rows = case_rows(samples, failing, {"a": ["easy"]})
    assert [r["case_id"] for r in rows] == ["a", "b"]
    a, b = rows
    assert (a["n"], a["c"], a["statuses"]) == (8, 1, {"failed": 7, "passed": 1})
    assert a["details"] == [f"wrong {i}" for i in range(MAX_DETAILS_PER_CASE)]
    assert a["outputs"] == ["no", ""] and a["slices"] == ["easy"]
    assert a["trajectory"] == {"sample_index": 1, "lines": ["  1. model: edit x.py"]}
    assert (b["n"], b["c"], b["details"], b["safety"], b["slices"]) == (2, 1, [], ["rm -rf /"], [])
    assert "trajectory" not in b
    assert case_rows([], [], {}) == []


def test_case_doc_parses_traces_and_refuses_a_case_without_samples() -> None:
    stored = [{"sample_index": 0, "seed": 7, "status": "failed", "passed": False, "score": 0.0, "duration_s": 0.25,
               "cached": True, "detail": "d" * (MAX_TEXT_CHARS + 5), "safety": ["curl evil"], "output": "out",
               "trace": '{"a": 1}', "cache_key": "not shown"},
              {"sample_index": 1, "seed": 8, "status": "passed", "passed": True, "score": None, "duration_s": None,
               "cached": False, "detail": "", "safety": None, "output": None, "trace": None}]
    doc = case_doc("r1", "c1", stored)
    assert (doc["n"], doc["c"]) == (2, 1) and doc["samples"][0]["trace"] == {"a": 1}
    assert "cache_key" not in doc["samples"][0]
    lines = case_text(doc).splitlines()
    assert lines[0] == "run r1  case c1: 1/2 samples passed"
    assert lines[1] == "#0 failed  score 0  0.250s  (cached)  seed 7"
    assert lines[2].endswith(f"… ({MAX_TEXT_CHARS + 5} chars; --json has all)")
    assert lines[3] == "  SAFETY: curl evil" and lines[4] == "  output: 'out'"
    assert lines[5] == "#1 passed  score ?  ?  seed 8" and lines[6] == "  output: ''"
    with pytest.raises(InputError, match="run r1: no case 'gone'"):
        case_doc("r1", "gone", [])


def test_plan_text_says_what_the_suite_reaches_and_the_table() -> None:
    reachable = plan_text(pw.plan(pw.variance_from_prior(0.7), 0.2, suite_cases=400).to_json())
    assert reachable.startswith("to detect a paired drop of 20 points with power 0.8 (two-sided alpha 0.05):")
    assert "variances from a prior: between cases 0.1050" in reachable
    assert "on the suite's 400 cases: 1 samples per case (400 samples a run)" in reachable
    assert "fits the suite" in reachable.splitlines()[3]
    short = plan_text(pw.plan(pw.variance_from_prior(0.7), 0.01, suite_cases=20, max_samples=3).to_json())
    assert "the suite's 20 cases cannot reach it at up to 3 samples per case" in short
    assert short.splitlines()[-2].split() == ["3", "13736", "41208", "no"]
    unbounded = plan_text(pw.plan(pw.variance_from_prior(0.5), 0.1, suite_cases=None).to_json())
    assert "fits the suite" not in unbounded and "on the suite" not in unbounded


def test_sequential_line_says_whether_the_run_stopped_early() -> None:
    seq = {"stopped_early": True, "decision": "block", "rounds": 3, "planned_rounds": 10,
           "samples_drawn": 30, "samples_planned": 100}
    assert sequential_line(seq) == "sequential: stopped early (block) after 3 of 10 rounds, 30 of 100 samples"
    assert sequential_line({**seq, "stopped_early": False}).startswith("sequential: ran to the end after 3")


def test_gate_lines_put_the_decision_first_then_each_reason() -> None:
    gate = {"decision": "block", "verdict": "regressed", "reasons": ["regressed: -12.0 pts", "safety: 1 violation"]}
    assert gate_lines(gate) == ["BLOCK (regressed)", "  - regressed: -12.0 pts", "  - safety: 1 violation"]
    assert gate_lines({"decision": "pass", "verdict": "inconclusive", "reasons": []}) == ["PASS (inconclusive)"]
    assert no_baseline_message("story", "r2") == "no baseline: no completed run of suite 'story' before r2; nothing was compared"
    decided = {"decision": "block", "verdict": "inconclusive", "reasons": ["new failures: c3"], "baseline": "r1",
               "baseline_choice": "previous: the latest completed run of suite 'story'", "shared_cases": 7,
               "added_cases": 1, "removed_cases": 0, "decided": "now",
               "rules": {"max_drop": 0.0, "min_pass_at_1": None, "max_new_failures": 0, "min_slice": {"odd": 0.5},
                         "must_pass": ["c1"]}}
    assert gate_lines(decided)[1] == (
        "  against r1 (previous: the latest completed run of suite 'story'): 7 shared, 1 added, 0 removed cases;"
        " rules: max drop 0.0%, max new failures 0, slice odd >= 50.0%, 1 must-pass case(s); decided now")


def test_validation_text_lists_each_problem_case_with_its_statuses() -> None:
    flaky = {"case_id": "q1", "reference_statuses": ["passed", "failed"], "empty_status": "failed",
             "detail": "x" * 300}
    report = {"cases": 3, "reps": 2, "valid": False, "broken": [], "flaky": [flaky], "vacuous": []}
    assert validation_text(report) == (
        "3 cases, reference graded 2x each: problems found\n"
        "  flaky    q1: reference passed/failed, empty output failed  " + "x" * 200)
    sound = {**report, "valid": True, "flaky": []}
    assert validation_text(sound) == "3 cases, reference graded 2x each: all sound"


def test_calibration_text_shows_kappa_as_a_coefficient_and_rates_as_percentages() -> None:
    doc = {"judge": "j.py:judge", "judge_fingerprint": "0123456789abcdef", "truth": "human", "items": 6, "cases": 3,
           "ci_level": 0.95, "agreement": 2 / 3, "agreement_ci": [0.25, 1.0], "kappa": 1 / 3, "kappa_ci": None,
           "false_pass_rate": None, "false_fail_rate": 0.5, "false_fail_rate_ci": [0.0, 1.0],
           "confusion": {"tp": 2, "fp": 1, "fn": 1, "tn": 2}, "judge_errors": 0, "judge_error_rate": 0.0}
    assert calibration_text(doc).splitlines() == [
        "judge j.py:judge (0123456789ab) vs human on 6 outputs of 3 cases; 95% CIs",
        "agreement       66.7% [25.0%, 100.0%]",
        "Cohen's kappa   0.333",
        "false-pass rate n/a  (judge passed, truth failed)",
        "false-fail rate 50.0% [0.0%, 100.0%]  (judge failed, truth passed)",
        "confusion tp 2 fp 1 fn 1 tn 2; judge errors 0 (0.0%)",
    ]


def test_pairwise_text_shows_the_win_rate_its_ci_and_the_position_bias() -> None:
    doc = {"run_a": "ra", "run_b": "rb", "judge": "j.py:pick", "pairs": 8, "cases": 4, "win_rate_a": 0.75,
           "win_rate_a_ci": [0.5, 1.0], "ci_level": 0.95, "wins_a": 4, "wins_b": 0, "ties": 4, "errors": 0,
           "inconsistent": 1, "inconsistent_rate": 0.125, "position_bias": {"first": 1, "second": 0, "mixed": 0}}
    assert pairwise_text(doc).splitlines() == [
        "ra (A) vs rb (B), judge j.py:pick: 8 pairs, 4 cases",
        "win rate of A 75.0% [50.0%, 100.0%] (95% CI; ties and inconsistent pairs count half)",
        "A wins 4  B wins 0  ties 4  errors 0",
        "order-inconsistent 1 (12.5%): first position won both 1, second 0, mixed 0",
    ]
    assert "win rate of A n/a (95% CI" in pairwise_text({**doc, "win_rate_a": None, "win_rate_a_ci": None})


def test_labelled_text_names_the_labeller_the_source_and_a_safety_failure() -> None:
    summary = {"run_id": "r2", "labelled": 7, "labeller": "cy", "source_run": "r1", "unlabelled": 1,
               "pass_at_k": {"1": 0.75}, "pass_at_1_ci": [0.5, 1.0], "cases": 4, "safety_failed": False}
    assert labelled_text(summary) == "run r2: 7 labels by cy on run r1 (1 left blank); human pass@1 75.0% [50.0%, 100.0%]"
    assert labelled_text({**summary, "safety_failed": True}).endswith("; SAFETY FAILED")
    assert labelled_text({**summary, "cases": 1}).endswith("human pass@1 75.0% [no CI: one case]")
