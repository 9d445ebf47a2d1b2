"""One run, one decision (issue 30): every gate rule holds in every mode, the budget is one
meter per run, and the decision is computed once and rendered with the same numbers by every
output.

The suite: 40 cases. v1 fails q00-q03; v2 fails those and breaks q30 and q31 (both in the
`hard` slice, q30-q39). Over 40 cases that -5 point change is inconclusive by the paired CI,
so a pass by default: each rule below is what blocks."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.cli import as_process, in_process

from evalpipe import evaluate, rescore
from tasks.metrics.sequential import look_points
from tasks.models import InputError
from tasks.run.sequential import case_order

ROOT = Path(__file__).resolve().parent.parent
CASES = 40
BROKEN = ("q30", "q31")
CALLS: list[str] = []


def v1(inputs, ctx) -> str:
    CALLS.append(ctx.case_id)
    ctx.report_usage(input_tokens=1000, output_tokens=10, model="toy-model")
    return inputs["v1"]


def v2(inputs, ctx) -> str:
    CALLS.append(ctx.case_id)
    ctx.report_usage(input_tokens=1000, output_tokens=10, model="toy-model")
    return inputs["v2"]


def cases(must_pass: tuple[str, ...] = ()) -> list[dict]:
    out = []
    for i in range(CASES):
        cid = f"q{i:02d}"
        answer_v1 = "no" if i < 4 else "yes"
        answer_v2 = "no" if i < 4 or cid in BROKEN else "yes"
        case = {"id": cid, "inputs": {"v1": answer_v1, "v2": answer_v2}, "reference": "yes",
                "grader": {"kind": "exact"}, "slices": ["hard"] if i >= 30 else ["easy"]}
        if cid in must_pass:
            case["must_pass"] = True
        out.append(case)
    return out


# rule -> (options, the reason's head, when a look's drawn cases already break it for good)
RULES = {
    "min_pass_at_1": ({"min_pass_at_1": 0.9}, "threshold:", lambda drawn: _failing(drawn) >= 5),
    "max_drop": ({"max_drop": 0.0, "metric": "pass"}, None, None),
    "max_new_failures": ({"max_new_failures": 0}, "new failures:", lambda drawn: bool(set(BROKEN) & drawn)),
    "must_pass": ({}, "must-pass:", lambda drawn: "q31" in drawn),
    "min_slice": ({"min_slice": {"hard": 0.9}}, "slice hard:", lambda drawn: set(BROKEN) <= drawn),
}


def _failing(drawn: set[str]) -> int:
    return sum(int(c[1:]) < 4 or c in BROKEN for c in drawn)


def _baseline(home: Path, must_pass: tuple[str, ...] = ()):
    return evaluate(cases(must_pass), v1, name="rules", seed=3)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_blocks_a_plain_run_and_the_python_api(home, rule):
    options, head, _ = RULES[rule]
    must_pass = ("q31",) if rule == "must_pass" else ()
    base = _baseline(home, must_pass)
    summary = evaluate(cases(must_pass), v2, name="rules", seed=3, baseline="previous", **options)
    gate = summary.gate
    assert gate.baseline == base.run_id and gate.baseline_choice == "previous: the latest completed run of suite 'rules'"
    if head is None:  # the paired CI alone: -5 points over 40 cases is not evidence of a drop
        assert gate.decision == "pass" and gate.verdict == "inconclusive" and gate.rules["max_drop"] == 0.0
        return
    assert gate.decision == "block" and any(r.startswith(head) for r in gate.reasons), gate.reasons
    assert gate.rules == {"min_pass_at_1": None, "max_drop": 0.0, "max_new_failures": None, "min_slice": {},
                          "must_pass": list(must_pass)} | {k: v for k, v in options.items() if k in gate.rules}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_blocks_a_rescore_as_it_blocks_the_run(home, rule):
    """Rescore is a mode of the same loop: v2's stored outputs, re-graded without its agent and
    gated against v1 by each rule, decide what the plain run of v2 decided."""
    options, head, _ = RULES[rule]
    must_pass = ("q31",) if rule == "must_pass" else ()
    base = _baseline(home, must_pass)
    ran = evaluate(cases(must_pass), v2, name="rules", seed=3, baseline=base.run_id, **options)
    CALLS.clear()
    again = rescore(ran.run_id, cases(must_pass), name="rules", baseline=base.run_id, **options)
    assert CALLS == [] and again.run_id != ran.run_id and again.pass_at_k == ran.pass_at_k
    assert (again.gate.decision, again.gate.reasons, again.gate.rules) == (
        ran.gate.decision, ran.gate.reasons, ran.gate.rules)
    assert again.gate.delta_ci == ran.gate.delta_ci
    assert again.gate.decision == ("pass" if head is None else "block")


def test_a_rescore_refuses_the_options_it_would_ignore(home):
    ran = evaluate(cases(), v1, name="rules", seed=3)
    for options, named in (({"n": 3}, "n: not an option of a rescore"),
                           ({"max_samples": 2, "seed": 1}, "max_samples, seed: not an option"),
                           ({"runner": "processes"}, "runner='processes': the Python API grades")):
        with pytest.raises(InputError, match=named):
            rescore(ran.run_id, cases(), name="rules", **options)


@pytest.mark.parametrize("rule", sorted(r for r in RULES if RULES[r][1]))
def test_a_sequential_run_stops_at_the_first_look_that_breaks_a_rule(home, rule):
    options, head, broken = RULES[rule]
    must_pass = ("q31",) if rule == "must_pass" else ()
    base = _baseline(home, must_pass)
    CALLS.clear()
    summary = evaluate(cases(must_pass), v2, name="rules", seed=3, baseline=base.run_id, sequential=True,
                       sequential_rounds=10, **options)
    seq = summary.sequential
    # Where it must stop: the first look whose drawn cases break the rule, in the run's own order.
    from storage.store import Store

    by_hash = {r.case_hash: r.case_id for r in Store(home).samples.case_results(base.run_id)}
    order = [by_hash[h] for h in case_order(sorted(by_hash), 3)]
    points = look_points(CASES, 10)
    first = next(i for i, p in enumerate(points) if broken(set(order[:p])))
    assert seq["decision"] == "block" and seq["rounds"] == first + 1 and seq["rule"].startswith(head)
    assert seq["cases_drawn"] == points[first] == len(CALLS) and seq["stopped_early"] == (points[first] < CASES)
    assert summary.gate.decision == "block" and summary.gate.reasons[0].startswith(
        f"sequential: stopped after round {first + 1} of 10")
    assert head in summary.gate.reasons[0]


@pytest.mark.parametrize("sequential", [False, True])
def test_one_budget_per_run_whatever_the_mode(home, tmp_path, sequential):
    base = _baseline(home)
    CALLS.clear()
    summary = evaluate(cases(), v2, name="rules", seed=3, baseline=base.run_id, sequential=sequential,
                       max_samples=10)
    assert len(CALLS) == 10 and summary.partial and summary.undrawn_samples == CASES - 10
    assert summary.budget.drawn_samples == 10 and summary.budget.stopped == "--max-samples 10 drawn"

    prices = tmp_path / "prices.yaml"
    prices.write_text("toy-model: {input_per_mtok: 1000, output_per_mtok: 0}\n")  # $1 a call
    CALLS.clear()
    spent = evaluate(cases(), v2, name="rules", seed=4, baseline=base.run_id, sequential=sequential,
                     max_cost=3.0, prices=str(prices))
    assert spent.partial and len(CALLS) == spent.budget.drawn_samples <= 4 and spent.budget.spent_usd <= 4.0
    assert spent.budget.stopped.startswith("--max-cost 3 spent")


# Through the command line: the decision rendered by every output from the one stored object.

def cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """gate, diff and report in a process of their own; run and rescore, which run as
    processes in tests/test_cli_run.py, in this one (support.cli.in_process)."""
    if args[0] in ("run", "rescore"):
        return in_process(args, env)
    return as_process(args, env)


def write_suite(path: Path, edited: bool = False) -> Path:
    lines = ["name: story", "cases:"]
    for case in cases():
        if edited and case["id"] == "q05":
            case["reference"] = "no"  # one reference rewritten: a new case hash
        if edited and case["id"] == "q06":
            case["grader"] = {"kind": "contains"}  # one grader changed
        lines.append("  - " + json.dumps(case))
    if edited:
        lines.append("  - " + json.dumps({"id": "q99", "inputs": {"v1": "yes", "v2": "yes"}, "reference": "yes",
                                          "grader": {"kind": "exact"}}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def env(prefect_harness, home) -> dict:
    return {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}


def test_the_stored_decision_is_what_every_output_shows(env, home, tmp_path):
    agents = f"python:{ROOT / 'tests/test_one_decision.py'}"
    first = cli(["run", str(write_suite(tmp_path / "story.yaml")), "--agent", f"{agents}:v1", "--json"], env)
    assert first.returncode == 0, first.stderr
    v1_run = json.loads(first.stdout)["run_id"]
    # An edited suite: `previous` still finds the last run, compares the shared cases, and blocks
    # on the broken cases by the rule the run was given.
    proc = cli(["run", str(write_suite(tmp_path / "story.yaml", edited=True)), "--agent", f"{agents}:v2",
                "--baseline", "previous", "--max-new-failures", "0", "--json"], env)
    assert proc.returncode == 1, proc.stderr
    run = json.loads(proc.stdout)
    stored = run["gate"]
    assert stored["baseline"] == v1_run and stored["decision"] == "block"
    assert (stored["shared_cases"], stored["added_cases"], stored["removed_cases"]) == (38, 3, 2)
    assert stored["rules"]["max_new_failures"] == 0 and stored["blocks"][0]["cases"] == list(BROKEN)

    gate = cli(["gate", run["run_id"], "--baseline", "previous", "--json"], env)
    doc = json.loads(gate.stdout)
    assert gate.returncode == 1 and doc["decided"] == "at run time"
    assert {k: v for k, v in doc.items() if k != "decided"} == stored
    diff = json.loads(cli(["diff", run["run_id"], v1_run, "--json"], env).stdout)
    assert diff["delta_ci"] == stored["delta_ci"] and diff["delta"] == stored["delta_pass_at_1"]
    lo, hi = (f"{100 * x:+.1f} pts" for x in stored["delta_ci"])
    ci_text = f"CI {lo} to {hi}"

    markdown = cli(["gate", run["run_id"], "--baseline", v1_run, "--format", "markdown"], env).stdout
    assert markdown.startswith("## evalpipe gate: **BLOCK**") and markdown.count(ci_text) == 2  # header, reason
    text = cli(["gate", run["run_id"], "--baseline", v1_run], env).stdout
    assert text.startswith("BLOCK (inconclusive)") and ci_text in text and "max new failures 0" in text

    page = tmp_path / "diff.html"
    assert cli(["report", run["run_id"], "--baseline", v1_run, "--out", str(page)], env).returncode == 0
    html = page.read_text()
    assert '<span class="badge block">block</span>' in html and ci_text in html
    assert "max new failures 0; decided when the run was made" in html
    # Other rules, asked for: decided now by them, and said.
    page2 = tmp_path / "lenient.html"
    assert cli(["report", run["run_id"], "--baseline", v1_run, "--max-new-failures", "5",
                "--out", str(page2)], env).returncode == 0
    lenient = page2.read_text()
    assert '<span class="badge pass">pass</span>' in lenient and "max new failures 5; decided now" in lenient
    assert ci_text in lenient  # the same paired CI, whatever the rules

    # Rescore honours the same rules: v2's outputs graded on the edited suite, gated against v1.
    rescored = cli(["rescore", run["run_id"], str(tmp_path / "story.yaml"), "--baseline", v1_run,
                    "--max-new-failures", "0", "--json"], env)
    assert rescored.returncode == 1, rescored.stderr
    doc = json.loads(rescored.stdout)
    assert doc["source_run"] == run["run_id"] and doc["gate"]["blocks"][0]["cases"] == list(BROKEN)
    assert doc["gate"]["delta_ci"] == stored["delta_ci"]
