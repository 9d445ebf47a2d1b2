"""The judge grader, its calibration, and the `openai:` judge against a local endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st
from support.judges import ref, user_text
from typer.testing import CliRunner

from tasks.graders import grade, grader_fingerprint
from tasks.graders.judge import delimit, parse_reply, render
from tasks.metrics.calibration import calibrate
from tasks.models import EvalCase, EvalSuite, InputError, Status
from tasks.trace import SampleTrace

CANARY = "CANARY-7f3a"


def judge_case(function: str, samples: int = 1, **grader) -> EvalCase:
    return EvalCase(
        id="q1",
        inputs={"prompt": "Is the sky blue?"},
        reference="yes",
        grader={"kind": "judge", "function": function, "samples": samples, **grader},
        safety={"forbidden_patterns": [CANARY]},
    )


# --- the grader ---------------------------------------------------------------------------


def test_judge_verdict_trace_and_determinism():
    case = judge_case(ref("coin"), samples=5)
    first, second = SampleTrace(), SampleTrace()
    v1, v2 = grade("maybe", case, first), grade("maybe", case, second)
    assert v1 == v2 and first == second  # seeds come from content: the same output, same draws
    record = first.judge
    assert len(record.seeds) == 5 == len(set(record.seeds)) == len(record.draws)
    passes = sum(d.passed for d in record.draws)
    assert record.passes == passes and record.agreement == max(passes, 5 - passes) / 5
    assert v1.passed == (passes >= 3) and f"{passes}/5 draw(s) pass" in v1.detail
    assert len(record.fingerprint) == 64 and record.spec == ref("coin")
    other = SampleTrace()
    grade("maybe not", case, other)
    assert other.judge.seeds != record.seeds


def test_judge_fingerprint_follows_the_judge():
    a = grader_fingerprint(judge_case(ref("coin")))
    assert a == grader_fingerprint(judge_case(ref("coin")))
    assert a != grader_fingerprint(judge_case(ref("coin"), samples=3))
    assert a != grader_fingerprint(judge_case(ref("says_yes")))


@pytest.mark.parametrize("function", ["boom", "garbage"])
def test_a_failing_judge_is_an_error_not_a_fail(function):
    trace = SampleTrace()
    verdict = grade("yes", judge_case(ref(function), samples=3), trace)
    assert verdict.status is Status.error and not verdict.passed
    assert trace.judge.errors == 3 and trace.judge.agreement is None


def test_judge_spec_problems_are_errors():
    assert grade("yes", judge_case("nosuchmodule_xyz:f")).status is Status.error
    with pytest.raises(ValueError, match="grader.samples: Input should be greater than or equal to 1"):
        EvalCase(id="q", grader={"kind": "judge", "function": ref("coin"), "samples": 0})
    assert grade("   ", judge_case(ref("says_yes"))).status is Status.empty


@pytest.mark.parametrize("spec", ["shutil:rmtree", "os:system", "json:loads", "sys:exit", "prefect:flow"])
def test_a_suite_judge_may_name_only_the_users_own_code(spec):
    verdict = grade("yes", judge_case(spec))
    assert verdict.status is Status.error and "may name only its own code" in verdict.detail


def test_a_suite_judge_in_the_users_own_module_loads(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()  # a namespace package of the user's own
    (tmp_path / "mine" / "judging.py").write_text(
        "def yes(output, case, seed):\n    return {'passed': True, 'score': 1.0, 'rationale': 'r'}\n"
    )
    monkeypatch.chdir(tmp_path)
    assert grade("yes", judge_case("mine.judging:yes")).status is Status.passed


def test_a_judge_pass_never_clears_safety():
    verdict = grade(f"yes {CANARY}", judge_case(ref("says_yes"), samples=3))
    assert verdict.passed and verdict.safety == (f"output matches forbidden pattern {CANARY!r}",)


def test_safety_veto_blocks_the_gate(prefect_harness, home, tmp_path):
    from flows.evaluate import evaluate

    agents = tmp_path / "agents.py"
    agents.write_text(
        f"def clean(inputs, ctx):\n    return 'yes'\n"
        f"def leaky(inputs, ctx):\n    return 'yes {CANARY}'\n"
    )
    suite = tmp_path / "judged.yaml"
    suite.write_text(
        "name: judged\n"
        f"safety: {{forbidden_patterns: ['{CANARY}']}}\n"
        "cases:\n"
        + "".join(
            f"  - {{id: c{i}, inputs: {{prompt: q{i}}}, reference: 'yes',"
            f" grader: {{kind: judge, function: '{ref('says_yes')}', samples: 3}}}}\n"
            for i in range(4)
        )
    )
    base = evaluate(suite=str(suite), agent=f"python:{agents}:clean", n=2)
    from flows.steps import GateBlocked

    with pytest.raises(GateBlocked) as blocked:
        evaluate(suite=str(suite), agent=f"python:{agents}:leaky", n=2, baseline=base["run_id"])
    leak = blocked.value.summary
    assert base["pass_at_k"]["1"] == 1.0 == leak["pass_at_k"]["1"]  # the judge says pass ...
    assert leak["safety_failed"] and len(leak["safety_violations"]) == 8  # ... the veto stands
    assert leak["gate"]["decision"] == "block"


# --- the openai: judge against a local endpoint --------------------------------------------


RUBRIC = "Question: {prompt}\nReference: {reference}\nAnswer: {output}\nIs the answer right?"


def test_openai_judge_grades_through_the_endpoint(endpoint):
    def reply(body):
        ok = f"Answer: {delimit('yes')}\n" in user_text(body)
        return 200, json.dumps({"passed": ok, "score": 0.9 if ok else 0.2, "rationale": "checked"})

    with endpoint(reply) as server:
        case = judge_case(
            "openai:judge-model", samples=2, rubric=RUBRIC, params={"temperature": 0.7}
        )
        trace = SampleTrace()
        good, bad = grade("yes", case, trace), grade("no", case)
    assert good.passed and good.score == pytest.approx(0.9) and bad.status is Status.failed
    assert len(server.requests) == 4
    body = server.requests[0]
    assert body["model"] == "judge-model" and body["temperature"] == 0.7
    assert body["seed"] == trace.judge.seeds[0] and body["_auth"] == "Bearer sk-test-judge"
    assert user_text(body) == (
        f"Question: Is the sky blue?\nReference: yes\nAnswer: {delimit('yes')}\nIs the answer right?"
    )
    assert body["messages"][0]["role"] == "system"
    assert body["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(
    ("status", "content"), [(200, "I cannot decide."), (400, "bad request"), (503, "overloaded")]
)
def test_openai_judge_failures_are_errors(endpoint, monkeypatch, status, content):
    monkeypatch.setenv("EVALPIPE_OPENAI_MAX_ATTEMPTS", "1")
    with endpoint(lambda body: (status, content)):
        verdict = grade("yes", judge_case("openai:m", rubric=RUBRIC))
    assert verdict.status is Status.error


def test_a_run_s_grading_task_gives_its_judges_the_run_s_settings_wherever_it_is_unpickled(endpoint, monkeypatch):
    """Issue 30 item 5: a grading task carries the run's `openai_max_attempts` to a worker,
    whose own environment (here 4 attempts) never decides; outside a run, it still does."""
    import pickle

    from tasks.agents.settings import AgentSettings
    from tasks.models import Usage
    from tasks.run.loop import GradeTask
    from tasks.run.sampling import Drawn, plan_samples

    monkeypatch.setenv("EVALPIPE_OPENAI_MAX_ATTEMPTS", "4")
    case = judge_case("openai:m", rubric=RUBRIC)
    (planned,) = plan_samples(EvalSuite(name="s", cases=[case]), "fp", 1, 0)
    drawn = Drawn(planned, "yes", Usage(), SampleTrace(), 0.0)
    task = GradeTask("r", [case], [drawn], settings=AgentSettings(openai_max_attempts=1))
    with endpoint(lambda body: (503, "overloaded")) as server:
        monkeypatch.setenv("EVALPIPE_OPENAI_MAX_ATTEMPTS", "4")  # the fixture's 2 was the edge's
        (row,) = pickle.loads(pickle.dumps(task))().to_pylist()
        assert row["status"] == "error" and len(server.requests) == 1
        del server.requests[:]
        monkeypatch.setenv("EVALPIPE_OPENAI_MAX_ATTEMPTS", "2")
        assert grade("yes", case).status is Status.error and len(server.requests) == 2


def test_openai_judge_needs_a_rubric(endpoint):
    with endpoint(lambda body: (200, "PASS")) as server:
        verdict = grade("yes", judge_case("openai:m"))
    assert verdict.status is Status.error and "needs a 'rubric'" in verdict.detail
    assert server.requests == []


def test_parse_reply_forms():
    assert parse_reply('```json\n{"passed": true}\n```') == {"passed": True}
    assert parse_reply('{"passed": false, "score": 0}') == {"passed": False, "score": 0}
    assert parse_reply("PASS - it is right") == "PASS"


@given(st.text())
def test_render_never_expands_placeholders_inside_the_output(text):
    case = judge_case(ref("coin"))
    assert render("<{output}>", case, output=text) == f"<{text}>"
    assert render("{unknown} {case_id}", case) == "{unknown} q1"


# --- calibration ----------------------------------------------------------------------------


def _fixture(tp: int, fp: int, fn: int, tn: int) -> tuple[list[bool], list[bool]]:
    judge = [True] * tp + [True] * fp + [False] * fn + [False] * tn
    truth = [True] * tp + [False] * fp + [True] * fn + [False] * tn
    return judge, truth


def test_agreement_and_kappa_by_hand():
    # 50 outputs: p_o = 35/50 = 0.7; judge passes 25/50, truth 30/50;
    # p_e = 0.5*0.6 + 0.5*0.4 = 0.5; kappa = (0.7 - 0.5) / (1 - 0.5) = 0.4.
    judge, truth = _fixture(20, 5, 10, 15)
    cal = calibrate(judge, truth, [f"c{i}" for i in range(50)])
    assert cal.confusion == {"tp": 20, "fp": 5, "fn": 10, "tn": 15}
    assert cal.values["agreement"] == pytest.approx(0.7)
    assert cal.values["kappa"] == pytest.approx(0.4)
    assert cal.values["false_pass_rate"] == pytest.approx(5 / 20)
    assert cal.values["false_fail_rate"] == pytest.approx(10 / 30)
    for name, (lo, hi) in cal.cis.items():
        assert lo <= cal.values[name] <= hi and hi - lo > 0


def test_degenerate_calibrations_say_undefined():
    cal = calibrate([True] * 4, [True] * 4, ["a", "a", "b", "b"])
    assert cal.values["agreement"] == 1.0 and cal.values["kappa"] is None
    assert cal.values["false_pass_rate"] is None and cal.cis["false_pass_rate"] is None
    assert cal.values["false_fail_rate"] == 0.0 and cal.cases == 2


@given(
    st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(0, 5)), min_size=1, max_size=40)
)
def test_calibration_properties(rows):
    judge, truth, cases = zip(*rows, strict=True)
    cal = calibrate(judge, truth, [str(c) for c in cases], n_boot=200)
    agree = sum(j == t for j, t, _ in rows) / len(rows)
    assert cal.values["agreement"] == pytest.approx(agree)
    assert sum(cal.confusion.values()) == len(rows)
    kappa = cal.values["kappa"]
    assert kappa is None or -1 - 1e-9 <= kappa <= 1 + 1e-9
    if agree == 1.0 and kappa is not None:
        assert kappa == pytest.approx(1.0)


LABELLED = [  # (output, human label): the length judge passes len > 3
    ("yes!", "pass"),  # tp
    ("right", "pass"),  # tp
    ("nope, wrong", "fail"),  # fp
    ("ok", "pass"),  # fn
    ("no", "fail"),  # tn
    ("x", "fail"),  # tn
    ("", ""),  # left blank: skipped
]


def _labelled_suite(tmp_path: Path) -> tuple[Path, Path]:
    suite = tmp_path / "judged.yaml"
    lines = ["name: judged", "cases:"]
    for i in range(3):
        lines.append(
            f"  - {{id: c{i}, inputs: {{prompt: q{i}}}, reference: 'yes!',"
            f" grader: {{kind: judge, function: '{ref('length_judge')}'}}}}"
        )
    suite.write_text("\n".join(lines) + "\n")
    labels = tmp_path / "labels.jsonl"
    labels.write_text(
        "".join(
            json.dumps({"case_id": f"c{i % 3}", "sample_index": i // 3, "output": o, "label": lab})
            + "\n"
            for i, (o, lab) in enumerate(LABELLED)
        )
    )
    return suite, labels


def test_calibrate_a_judge_on_a_labelled_fixture(home, tmp_path):
    from flows.judging import calibrate_judge
    from storage.store import Store

    suite, labels = _labelled_suite(tmp_path)
    doc = calibrate_judge(str(suite), labels, store=Store(home))
    assert doc["truth"] == "human" and doc["rows"] == 6 and doc["judge_errors"] == 0
    assert doc["confusion"] == {"tp": 2, "fp": 1, "fn": 1, "tn": 2} and doc["cases"] == 3
    # p_o = 4/6; judge and truth both pass 3/6, p_e = 0.5, kappa = (2/3 - 1/2) / (1/2) = 1/3.
    assert doc["agreement"] == pytest.approx(4 / 6) and doc["kappa"] == pytest.approx(1 / 3)
    assert doc["false_pass_rate"] == pytest.approx(1 / 3) == doc["false_fail_rate"]

    override = calibrate_judge(str(suite), labels, judge=ref("says_yes"), store=Store(home))
    assert override["judge"] == ref("says_yes") and override["confusion"]["tp"] == 1


def test_calibrate_against_an_execution_oracle(home, tmp_path):
    from flows.judging import calibrate_judge
    from storage.store import Store

    suite = tmp_path / "exact.yaml"
    suite.write_text(
        "name: exact\ncases:\n  - {id: c0, reference: 'yes!', grader: {kind: exact}}\n"
    )
    labels = tmp_path / "outputs.csv"
    labels.write_text("case_id,output,label\nc0,yes!,\nc0,nope!,\nc0,no,\n")
    # A judge file never loaded before, slow to import: the workers must not race to load it.
    fresh = tmp_path / "fresh_judge.py"
    fresh.write_text(
        "import time\ntime.sleep(0.2)\n\ndef judge(output, case, seed):\n"
        "    return len(output) > 3\n"
    )
    doc = calibrate_judge(str(suite), labels, judge=f"{fresh}:judge", oracle=True, store=Store(home))
    # exact: yes! passes, the rest fail; the length judge passes yes! and nope!.
    assert doc["truth"] == "oracle" and doc["confusion"] == {"tp": 1, "fp": 1, "fn": 0, "tn": 1}
    with pytest.raises(InputError, match="no judge to calibrate"):
        calibrate_judge(str(suite), labels, oracle=True, store=Store(home))


def _judges_section(run_id: str, out: Path) -> str | None:
    """The report's Judges section for a stored run, or None when it has none."""
    from flows.report import write_report
    from storage.store import Store

    page = write_report(run_id, out, Store.default()).read_text(encoding="utf-8")
    if '<section id="judges">' not in page:
        return None
    return page.split('<section id="judges">')[1].split("</section>")[0]


def test_calibration_is_shown_for_runs_graded_by_that_judge(prefect_harness, home, tmp_path):
    from flows.evaluate import evaluate
    from flows.judging import calibrate_judge
    from storage.store import Store

    store = Store(home)
    suite, labels = _labelled_suite(tmp_path)
    run = evaluate(suite=str(suite), agent="reference", n=1)
    [before] = store.calibrations.of_run(run["run_id"])
    assert before["calibration"] is None and before["judge"] == ref("length_judge")
    assert before["judged"] == 3 and before["errors"] == 0
    section = _judges_section(run["run_id"], tmp_path / "before.html")
    assert ref("length_judge") in section and before["judge_fingerprint"][:12] in section
    assert "not calibrated — its verdicts come from an uncalibrated instrument" in section
    assert "evalpipe judge calibrate" in section and "0 of 3 (0.0%)" in section

    doc = calibrate_judge(str(suite), labels, store=store)
    [after] = store.calibrations.of_run(run["run_id"])
    assert after["calibration"] == doc and after["judge_fingerprint"] == doc["judge_fingerprint"]
    section = _judges_section(run["run_id"], tmp_path / "after.html")
    assert "not calibrated" not in section
    # The stored figures (agreement 4/6, kappa 1/3, see above), formatted with their CIs.
    lo, hi = doc["agreement_ci"]
    assert f"agreement <b>66.7% [{100 * lo:.1f}%, {100 * hi:.1f}%]</b>" in section
    lo, hi = doc["kappa_ci"]
    assert f"Cohen&#39;s kappa <b>0.333 [{lo:.3f}, {hi:.3f}]</b>" in section
    assert "false-pass rate <b>33.3% [" in section and "false-fail rate <b>33.3% [" in section
    assert "6 labelled outputs of 3 cases · truth: human labels" in section
    assert doc["created_at"][:10] in section


def test_report_counts_judge_errors_and_omits_judges_when_none_graded(
    prefect_harness, home, tmp_path
):
    from flows.evaluate import evaluate

    suite = tmp_path / "mixed.yaml"
    suite.write_text(
        "name: mixed\ncases:\n"
        f"  - {{id: j0, reference: 'yes', grader: {{kind: judge, function: '{ref('says_yes')}'}}}}\n"
        f"  - {{id: j1, reference: 'yes', grader: {{kind: judge, function: '{ref('boom')}'}}}}\n"
        f"  - {{id: j2, reference: '', grader: {{kind: judge, function: '{ref('boom')}'}}}}\n"
        "  - {id: e0, reference: 'yes', grader: {kind: exact}}\n"
    )
    run = evaluate(suite=str(suite), agent="reference", n=2)
    section = _judges_section(run["run_id"], tmp_path / "mixed.html")
    rows = {row.split("</td>")[0].removeprefix("<td>"): row for row in section.split("<tr>")[2:]}
    assert set(rows) == {ref("says_yes"), ref("boom")}  # the exact case has no judge
    assert "0 of 2 (0.0%)" in rows[ref("says_yes")]
    assert "2 of 2 (100.0%)" in rows[ref("boom")]  # its empty outputs were never put to it
    assert section.count("not calibrated") == 2
    # The flow run's summary artifact in Prefect says the same.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run["flow_run_id"]])))
    [markdown] = [a.data for a in arts if a.key == "evalpipe-mixed-summary"]
    assert markdown.count("**not calibrated**") == 2 and "2 errors in 2" in markdown

    plain = tmp_path / "plain.yaml"
    plain.write_text("name: plain\ncases:\n  - {id: e0, reference: 'yes', grader: {kind: exact}}\n")
    assert _judges_section(evaluate(suite=str(plain), agent="reference", n=1)["run_id"],
                           tmp_path / "plain.html") is None


def test_calibrate_command(home, tmp_path):
    from flows.judging import judge_app

    app = typer.Typer()
    app.add_typer(judge_app, name="judge")
    suite, labels = _labelled_suite(tmp_path)
    result = CliRunner().invoke(
        app, ["judge", "calibrate", str(suite), "--labels", str(labels), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["kappa"] == pytest.approx(1 / 3)
    text = CliRunner().invoke(app, ["judge", "calibrate", str(suite), "--labels", str(labels)])
    assert "Cohen's kappa   0.333" in text.output and "false-pass rate 33.3%" in text.output
    labels.write_text('{"case_id": "c0", "output": "x", "label": "maybe"}\n')
    bad = CliRunner().invoke(app, ["judge", "calibrate", str(suite), "--labels", str(labels)])
    assert isinstance(bad.exception, InputError) and "line 1: label 'maybe'" in str(bad.exception)


# --- hostile judges: what a judge does stays in its verdict ---------------------------------


def test_a_judge_raising_keyboard_interrupt_is_an_error_draw(tmp_path):
    judge = tmp_path / "interrupting.py"
    judge.write_text("def judge(output, case, seed):\n    raise KeyboardInterrupt('judge')\n")
    trace = SampleTrace()
    try:
        verdict = grade("yes", judge_case(f"{judge}:judge", samples=2), trace)
    except BaseException as exc:  # noqa: BLE001 - what used to end the run
        pytest.fail(f"the judge's {type(exc).__name__} escaped the verdict")
    assert verdict.status is Status.error and "KeyboardInterrupt: judge" in verdict.detail
    assert trace.judge.errors == 2


def test_openai_judge_errors_never_carry_the_key(endpoint, monkeypatch):
    key = "sk-judge-" + "Q1w2E3r4" * 8
    monkeypatch.setenv("EVALPIPE_OPENAI_MAX_ATTEMPTS", "1")
    # A careless server: its error echoes the key after enough noise that the key straddles
    # the point where the message is cut.
    with endpoint(lambda body: (401, "." * 200 + body["_auth"])):
        monkeypatch.setenv("OPENAI_API_KEY", key)
        trace = SampleTrace()
        verdict = grade("yes", judge_case("openai:m", rubric=RUBRIC), trace)
    assert verdict.status is Status.error and "HTTP 401" in verdict.detail
    stored = verdict.detail + json.dumps(trace.to_dict())
    assert not [key[i : i + 8] for i in range(len(key) - 7) if key[i : i + 8] in stored]


# --- the calibration's pure steps ----------------------------------------------------------


def test_judge_items_pair_labelled_rows_with_their_case_and_judge():
    from tasks.metrics.calibration import judge_items
    from tasks.metrics.labels import LabelRow
    from tasks.models import EvalSuite

    exact = EvalCase(id="x", inputs={"prompt": "2+2"}, reference="4", grader={"kind": "exact"})
    own = judge_case(ref("says_yes"), samples=3, rubric="own rubric")
    suite = EvalSuite(name="s", cases=(exact, own))
    rows = [LabelRow(2, "q1", 0, "yes", True), LabelRow(3, "x", 0, "4", None), LabelRow(4, "x", 1, "5", False)]
    with pytest.raises(InputError, match=r"case 'x': no judge to calibrate \(pass --judge\)"):
        judge_items(rows, suite, {}, oracle=False, where="f.csv")
    items = judge_items(rows, suite, {"samples": 1, "function": ref("coin")}, oracle=False, where="f.csv")
    assert [(i.row.line, i.case.id) for i in items] == [(2, "q1"), (4, "x")]  # the blank label is skipped
    assert items[0].judge_case.grader == {"kind": "judge", "function": ref("coin"), "samples": 1,
                                          "rubric": "own rubric"}  # overrides over the case's own judge
    assert items[1].judge_case.grader == {"kind": "judge", "function": ref("coin"), "samples": 1}
    oracle = judge_items(rows[1:], suite, {"function": ref("coin")}, oracle=True, where="f.csv")
    assert [i.row.line for i in oracle] == [3, 4]  # with an oracle, a blank label is graded too
    with pytest.raises(InputError, match=r"f.csv: line 2: case 'q1' has no execution oracle"):
        judge_items(rows[:1], suite, {}, oracle=True, where="f.csv")
    with pytest.raises(InputError, match=r"f.csv: line 9: suite s has no case 'gone'"):
        judge_items([LabelRow(9, "gone", 0, "", True)], suite, {}, oracle=False, where="f.csv")
    with pytest.raises(InputError, match=r"f.csv: no labelled rows to calibrate on"):
        judge_items([rows[1]], suite, {}, oracle=False, where="f.csv")


def test_measure_counts_errors_apart_and_calibrates_the_rest():
    from tasks.metrics.calibration import JudgeItem, measure
    from tasks.metrics.labels import LabelRow

    case = judge_case(ref("coin"))
    items = [JudgeItem(LabelRow(i, case.id, i, "o", True), case, case) for i in range(5)]
    verdicts = [("passed", "passed"), ("failed", "passed"), ("error", "passed"), ("passed", "failed"),
                ("passed", "error")]
    doc = measure(items, verdicts, where="f.csv")
    assert (doc["rows"], doc["judge_errors"], doc["truth_errors"], doc["items"]) == (5, 1, 1, 3)
    assert doc["judge_error_rate"] == 0.2
    assert doc["confusion"] == {"tp": 1, "fp": 1, "fn": 1, "tn": 0}
    with pytest.raises(InputError, match="f.csv: the judge .or the oracle. gave no pass/fail verdict"):
        measure(items[:2], [("error", "passed"), ("passed", "empty")], where="f.csv")
