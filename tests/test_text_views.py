"""The pure views of stored documents: plain data in, text or rows out, no storage, no
Prefect (`tasks.report.cases`, `case_view`, `plan_text`, `text.sequential_line`)."""

from __future__ import annotations

import json

import pytest

from tasks.metrics import power as pw
from tasks.models import InputError
from tasks.report.case_view import MAX_TEXT_CHARS, case_doc, case_text
from tasks.report.cases import MAX_DETAILS_PER_CASE, case_rows
from tasks.report.plan_text import plan_text
from tasks.report.text import sequential_line


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
    assert a["trajectory"] == {"sample_index": 1, "lines": ["  1. assistant: edit x.py"]}
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
