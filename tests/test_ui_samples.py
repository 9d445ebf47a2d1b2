"""Samples in the Prefect UI (issue 47 item 3): the rows of the case tables from stored samples
(no Prefect), the tables a real flow run and a rescore publish, read back with Prefect's
client, the flow runs' names, and a failing sample's detail seen in the UI of a real
`prefect server` in headless Chromium."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from support.task_runs import task_runs

from tasks.report import sample_table as tables

SUITE = """\
name: ui-samples
cases:
  - id: always-right
    inputs: {q: right}
    reference: Paris
    grader: {kind: exact}
    extra_graders:
      - {kind: regex, pattern: "^P", name: starts-with-p}
  - id: always-wrong
    inputs: {q: wrong}
    reference: Paris
    grader: {kind: exact}
  - id: flaky
    inputs: {q: flaky}
    reference: "yes"
    grader: {kind: exact}
    extra_graders:
      - {kind: regex, pattern: "please", name: polite}
"""

AGENT = '''
def answer(inputs, ctx):
    if inputs["q"] == "right":
        return "Paris"
    if inputs["q"] == "wrong":
        return "Lyon, surely\\nsecond line\\nthird line\\nfourth line"
    return "yes" if ctx.index % 2 == 0 else "no"
'''


def write_work(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "ui.yaml").write_text(SUITE)
    (tmp_path / "ui_agent.py").write_text(textwrap.dedent(AGENT))
    return tmp_path / "ui.yaml", f"python:{tmp_path / 'ui_agent.py'}:answer"


# --- the rows, from sample dicts -------------------------------------------------------------

def _sample(index: int, passed: bool, **extra) -> dict:
    return {"case_id": "c", "sample_index": index, "status": "passed" if passed else "failed", "passed": passed,
            "detail": extra.pop("detail", ""), "safety": extra.pop("safety", []), "trace": extra.pop("trace", None),
            "input_tokens": extra.pop("input_tokens", None), "output_tokens": extra.pop("output_tokens", None),
            "latency_s": extra.pop("latency_s", None), "output": extra.pop("output", ""), **extra}


def test_a_row_names_the_grader_that_failed_with_its_detail_shortened() -> None:
    extra = json.dumps({"extra_graders": [
        {"kind": "regex", "name": "polite", "passed": False, "score": 0.0, "status": "failed",
         "detail": "no match for 'please'", "safety": []},
        {"kind": "contains", "passed": False, "score": 0.0, "status": "failed", "detail": "missing", "safety": []},
        {"kind": "regex", "name": "fine", "passed": True, "score": 1.0, "status": "passed", "detail": "", "safety": []},
    ]})
    rows = tables.sample_rows([
        _sample(0, False, detail="expected 'Paris'\ngot 'Lyon'\n" + "x" * 1000, trace=extra,
                input_tokens=1200, output_tokens=34, latency_s=0.0123,
                output="Lyon\n\nsecond\nthird\nfourth\nfifth"),
        _sample(1, True, trace=extra, latency_s=2.5),
        _sample(2, True, safety=["forbidden pattern 'CANARY'"], latency_s=150.0),
        _sample(3, True),
    ], "exact")
    first, second, third, fourth = rows
    assert first["sample"] == 0 and first["status"] == "failed"
    # The deciding grader by its kind, each extra grader by its name, else its kind.
    assert first["failed"] == "exact, polite, contains"
    assert first["detail"].startswith("expected 'Paris' ⏎ got 'Lyon' ⏎ xxx")
    assert len(first["detail"]) == tables.DETAIL_CHARS and first["detail"].endswith("…")
    assert first["tokens"] == "1,200+34" and first["latency"] == "12.3 ms"
    assert first["output"] == "Lyon ⏎ second ⏎ third ⏎ …"
    assert (second["failed"], second["detail"], second["latency"]) == ("polite, contains", "no match for 'please'", "2.5 s")
    assert (third["failed"], third["detail"], third["latency"]) == ("safety", "forbidden pattern 'CANARY'", "150.0 s")
    assert fourth == {"sample": 3, "status": "passed", "failed": "", "detail": "", "output": "", "actions": "",
                      "tokens": "", "latency": ""}
    assert list(first) == ["sample", "status", "failed", "detail", "output", "actions", "tokens", "latency"]


def test_a_case_table_is_bounded_the_failed_samples_first() -> None:
    samples = [_sample(i, i % 7 != 3, detail="" if i % 7 != 3 else f"wrong {i}") for i in range(1000)]
    rows = tables.sample_rows(samples, "exact")
    assert len(rows) == tables.MAX_SAMPLE_ROWS
    failed = [r["sample"] for r in rows if r["failed"]]
    assert failed == list(range(3, 1000, 7))[:tables.MAX_SAMPLE_ROWS]  # 143 failed: the first 100 of them
    few = tables.sample_rows(samples[:40], "exact")
    assert [r["sample"] for r in few] == list(range(40))
    mixed = tables.sample_rows(samples[:150], "exact", limit=30)
    assert [r["sample"] for r in mixed] == sorted([*range(3, 150, 7), *[i for i in range(150) if i % 7 != 3][:9]])
    tally = tables.tally(samples)[0]
    assert tables.case_description("c", tally, "exact", "r").endswith(
        "; the table shows 100 of its 1000 samples, those a grader failed first")


def test_tables_are_bounded_the_worst_cases_first() -> None:
    rows = []
    for i in range(3000):
        passes = 3 if i % 15 else (i // 15) % 3  # every 15th case: 0, 1 or 2 of 3 passes, in turn
        rows += [{"case_id": f"c{i:04d}", "sample_index": j, "status": "passed" if j < passes else "failed",
                  "passed": j < passes, "detail": "" if j < passes else f"wrong {i}", "safety": []} for j in range(3)]
    tallies = tables.tally(rows)
    assert len(tallies) == 3000
    shown, left_out = tables.cases_to_show(tallies)
    assert len(shown) == tables.MAX_CASE_TABLES and left_out == 200 - tables.MAX_CASE_TABLES
    assert all(t.failing for t in shown)  # 0 of 3 before 1 of 3
    assert [t.case_id for t in shown[:2]] == ["c0000", "c0045"]
    overview = tables.case_overview(tallies, {"c0000": "exact"})
    assert len(overview) == tables.MAX_OVERVIEW_ROWS
    assert overview[0] == {"case": "c0000", "passed": "0/3", "result": "failing", "failing grader": "exact",
                           "first failure": "sample 0 (failed): wrong 0"}
    assert overview[199]["result"] == "flaky" and overview[200]["result"] == "passing"
    assert overview[200]["failing grader"] == "" and overview[200]["first failure"] == ""
    note = tables.samples_note("20261206-074012-889c34", len(shown), left_out, len(tallies))
    assert "1000 of 3000 cases" in note and "150 more failing or flaky case(s) left out" in note
    assert "`evalpipe report 20261206-074012-889c34 --out report-889c34.html`" in note


def test_names_a_person_can_read() -> None:
    assert tables.flow_run_name("qa", "reference", 3, "20261206-074012-889c34") == "qa · reference · n=3 · 889c34"
    assert (tables.flow_run_name("qa", "python:/home/me/agents/qa.py:answer", 1, "20261206-074012-889c34")
            == "qa · python:qa.py:answer · n=1 · 889c34")
    assert tables.short_agent("cmd:/opt/venv/bin/python /srv/agent.py --fast") == "cmd:python agent.py --fast"
    assert tables.short_agent("openai:gpt-4o-mini?max_steps=6") == "openai:gpt-4o-mini?max_steps=6"
    assert tables.rescore_run_name("suites/qa.yaml", "889c34") == "qa · rescore of 889c34"
    assert (tables.rescore_run_name("qa", "20261206-074012-889c34", "20261206-080000-a1b2c3")
            == "qa · rescore of 889c34 · a1b2c3")


# --- a real flow run, its artifacts read back with Prefect's client --------------------------

def flow_run_artifacts(flow_run_id: str) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found if a.key}


def flow_run_and_tasks(flow_run_id: str, kinds: frozenset[str] = frozenset()) -> tuple[str, list[str]]:
    """The flow run's name, and its task runs' once those of `kinds` have landed."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        name = client.read_flow_run(flow_run_id).name
        tasks = task_runs(client, flow_run_id, set(kinds))
    return name, sorted(t.name for t in tasks)


def table(artifact) -> list[dict]:
    data = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    return data


def test_a_flow_run_publishes_its_cases_and_the_samples_of_its_failing_ones(prefect_harness, home, tmp_path) -> None:
    from flows.evaluate import evaluate
    from flows.rescore import rescore

    suite, agent = write_work(tmp_path)
    summary = evaluate(suite=str(suite), agent=agent, n=4)
    run_id, suffix = summary["run_id"], summary["run_id"].rsplit("-", 1)[1]
    found = flow_run_artifacts(summary["flow_run_id"])
    assert {"evalpipe-ui-samples-cases", "evalpipe-ui-samples-case-always-wrong",
            "evalpipe-ui-samples-case-flaky"} <= set(found)
    assert "evalpipe-ui-samples-case-always-right" not in found  # every sample passed: no table of its own

    assert table(found["evalpipe-ui-samples-cases"]) == [
        {"case": "always-wrong", "passed": "0/4", "result": "failing", "failing grader": "exact",
         "first failure": "sample 0 (failed): " + tables.shorten(wrong_detail(run_id, "always-wrong"), tables.DETAIL_CHARS)},
        {"case": "flaky", "passed": "2/4", "result": "flaky", "failing grader": "exact",
         "first failure": "sample 1 (failed): " + tables.shorten(wrong_detail(run_id, "flaky"), tables.DETAIL_CHARS)},
        {"case": "always-right", "passed": "4/4", "result": "passing", "failing grader": "", "first failure": ""},
    ]
    wrong = table(found["evalpipe-ui-samples-case-always-wrong"])
    assert [r["sample"] for r in wrong] == [0, 1, 2, 3]
    assert {(r["status"], r["failed"]) for r in wrong} == {("failed", "exact")}
    assert "Lyon" in wrong[0]["detail"] and wrong[0]["output"] == "Lyon, surely ⏎ second line ⏎ third line ⏎ …"
    assert wrong[0]["latency"].endswith(("µs", "ms", " s")) and wrong[0]["tokens"] == ""
    flaky = table(found["evalpipe-ui-samples-case-flaky"])
    # The passing samples fail only the extra grader, by its name; the failing ones both.
    assert [(r["sample"], r["status"], r["failed"]) for r in flaky] == [
        (0, "passed", "polite"), (1, "failed", "exact, polite"), (2, "passed", "polite"), (3, "failed", "exact, polite")]
    assert "please" in flaky[0]["detail"] and [r["output"] for r in flaky] == ["yes", "no", "yes", "no"]
    assert found["evalpipe-ui-samples-case-flaky"].description.startswith("case `flaky`: 2/4 samples passed (flaky)")
    summary_md = found["evalpipe-ui-samples-summary"].data
    assert "lists all 3 cases; 2 failing or flaky case(s) have a table of their samples." in summary_md
    assert f"`evalpipe report {run_id} --out report-{suffix}.html`" in summary_md

    name, task_names = flow_run_and_tasks(summary["flow_run_id"], frozenset({"sample"}))
    assert name == f"ui-samples · python:ui_agent.py:answer · n=4 · {suffix}"
    # Each task run is named for what its batch holds: one case, or the first…last case (samples).
    drawn = [t for t in task_names if t.startswith("sample ")]
    assert drawn and all(re.fullmatch(r"sample (always-right|always-wrong|flaky)(…(always-wrong|flaky) \(\d+\))?", t)
                         for t in drawn), task_names

    again = rescore(run_id=run_id, suite=str(suite))
    name, _ = flow_run_and_tasks(again["flow_run_id"])
    assert name == f"ui-samples · rescore of {suffix} · {again['run_id'].rsplit('-', 1)[1]}"
    rescored = flow_run_artifacts(again["flow_run_id"])
    assert table(rescored["evalpipe-ui-samples-case-flaky"]) == flaky


def wrong_detail(run_id: str, case_id: str) -> str:
    from storage.store import Store

    return next(s["detail"] for s in Store.default().samples.of_case(run_id, case_id) if not s["passed"])


# --- the UI of a real server, in headless Chromium -------------------------------------------

@pytest.fixture(scope="module")
def ui_server(prefect_harness: str) -> str:
    """The session's real `prefect server` (tests/conftest.py), whose UI these tests open:
    each test's run and flow run are its own, found by their ids. Its UI's address."""
    return prefect_harness.removesuffix("/api")


@pytest.mark.slow
def test_the_ui_shows_a_failing_samples_detail(tmp_path: Path, ui_server) -> None:
    suite, agent = write_work(tmp_path)

    def detail_shown(run_id: str) -> list[str]:
        detail = next(s["detail"] for s in _stored(tmp_path / "home", run_id, "always-wrong") if not s["passed"])
        return [tables.shorten(detail, tables.DETAIL_CHARS), "Lyon, surely ⏎ second line"]

    text, shot = _artifact_in_the_ui(ui_server, tmp_path, ["run", str(suite), "--agent", agent, "-n", "4", "--json"], {},
                                     "evalpipe-ui-samples-case-always-wrong", detail_shown)
    assert "Lyon, surely ⏎ second line" in text and "exact" in text
    assert shot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_the_ui_shows_a_failing_samples_timeline(tmp_path: Path, ui_server) -> None:
    with _scripted_model()() as model:
        text, _ = _artifact_in_the_ui(
            ui_server, tmp_path, ["run", str(TOOLS_SUITE), "--agent", "openai:support-bad?max_steps=6", "-n", "1", "--json"],
            {"OPENAI_BASE_URL": model.url, "OPENAI_API_KEY": "sk-test-timelines"},
            "evalpipe-tools-support-timelines", lambda run_id: ['1. model: calls delete_account({"user_id": "77"})',
                                                                '3. model: Your account is deleted.'])
    assert '2. -> delete_account: {"deleted": true}' in text and "3. model: Your account is deleted." in text
    assert "What the agent did: the first failing sample of 2 case(s)" in text


def _artifact_in_the_ui(server: str, tmp_path: Path, args: list[str], env: dict[str, str], key: str,
                        shown) -> tuple[str, Path]:
    """Run the CLI (`args`, in this process) against `server`, a real `prefect server`'s UI address, open the flow run's
    artifact `key` in headless Chromium and wait until the page shows every string of
    `shown(run_id)` (the page renders in parts: one string seen says nothing of another):
    the page's text and a screenshot."""
    from support.browser import Browser
    from support.cli import client_env, in_process

    logs = tmp_path / "logs"
    logs.mkdir()
    ran = in_process(args, client_env(tmp_path, tmp_path / "home", PREFECT_API_URL=f"{server}/api", **env))
    doc = json.loads(ran.stdout)  # a blocked gate exits 1, its document printed all the same
    assert "flow_run_id" in doc, ran.stderr
    wanted = shown(doc["run_id"])
    seen = " && ".join(f"document.body.innerText.includes({json.dumps(w)})" for w in wanted)
    (tmp_path / "profile").mkdir()
    browser = Browser(tmp_path / "profile", logs / "chromium.log")
    try:
        browser.open(f"{server}/runs/flow-run/{doc['flow_run_id']}")
        browser.wait_for(_click("li.p-tab", "Artifacts"), timeout_s=60)
        browser.wait_for(_click("a, .artifact-card, [class*=card]", key), timeout_s=60)
        text = browser.wait_for(f"{seen} && document.body.innerText", timeout_s=60)
        return text, browser.screenshot(tmp_path / "artifact.png")
    finally:
        browser.close()


def _stored(home: Path, run_id: str, case_id: str) -> list[dict]:
    from storage.store import Store

    return Store(home).samples.of_case(run_id, case_id)


def _click(selector: str, text: str) -> str:
    """JS: click the innermost element matching `selector` whose text contains `text`."""
    return f"""(() => {{
        const hits = [...document.querySelectorAll({json.dumps(selector)})]
            .filter(e => e.textContent.includes({json.dumps(text)}));
        const el = hits[hits.length - 1];
        if (el) el.click();
        return !!el;
    }})()"""


def test_a_row_says_what_the_agent_did_its_turns_and_calls_a_failed_one_marked():
    from tasks.report.sample_table import sample_rows

    trajectory = {"trajectory": {"steps": 4, "stop": "max_steps", "entries": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": "7"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "error: no scripted result", "error": "no scripted result"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "b", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "[]"}]}}
    (row,) = sample_rows([_sample(0, False, trace=trajectory)], "final_state")
    assert row["actions"] == '2 turns (stopped: max_steps): get_order({"order_id": "7"}) ✗, search({})'


# --- a trajectory's timeline (issue 43 item 4) ------------------------------------------------

def _turn(call_id: str, name: str, args: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]}


def test_a_timeline_shows_each_turn_and_call_with_its_result_long_parts_folded():
    long_result = "<b>" + "r" * 500 + "</b>"  # 507 characters: cut at FOLD_CHARS, escaped where folded
    trajectory = {"trajectory": {"stop": "max_steps", "entries": [
        _turn("a", "get_order", '{"order_id": "7"}'),
        {"role": "tool", "tool_call_id": "a", "name": "get_order", "content": long_result},
        _turn("b", "refund_order", '{"order_id": "7", "amount": 5}'),
        {"role": "tool", "tool_call_id": "b", "name": "refund_order", "content": "error: no scripted result",
         "error": "no scripted result"},
        {"role": "assistant", "content": "Done."}]}}
    sample = _sample(0, False, detail="expected a lookup ``` then a refund", trace=json.dumps(trajectory))
    lines = tables.timeline_section("refund `7`", sample, "final_state", "20261206-074012-889c34")
    text = "\n".join(lines)
    assert lines[0] == "### `` refund `7` ``: sample 0 (failed)"
    assert "- `final_state`: ````expected a lookup ``` then a refund````" in text
    step = f"-> get_order: {long_result}"
    cut = f"  2. {step[:tables.FOLD_CHARS]} … ({len(step) - tables.FOLD_CHARS} more characters)"
    at = lines.index("```text")
    assert [*lines[at + 1].splitlines(), lines[at + 2]] == [
        '  1. model: calls get_order({"order_id": "7"})',
        cut,
        '  3. model: calls refund_order({"amount": 5, "order_id": "7"})',
        "  4. -> refund_order error: no scripted result",
        "  5. model: Done.",
        "     [stopped: max_steps]",
        "```",
    ]
    # The cut step whole (under STEP_CHARS) in one folded HTML block, its markup escaped.
    (folded,) = [line for line in lines if line.startswith("<details>")]
    assert folded == ("<details><summary>the 1 step(s) cut above, up to 600 characters each</summary><pre>"
                      f"  2. -&gt; get_order: &lt;b&gt;{'r' * 500}&lt;/b&gt;</pre></details>")
    assert tables.timeline_section("c", _sample(0, False), "exact", "r") == []  # no trajectory, no timeline


def test_a_long_timeline_shows_its_first_and_last_steps():
    entries = [_turn(str(i), "get_weather", '{"city": "Paris"}') for i in range(45)]
    sample = _sample(3, False, trace=json.dumps({"trajectory": {"entries": entries}}))
    lines = tables.timeline_section("loop", sample, "steps", "20261206-074012-889c34")
    steps = lines[lines.index("```text") + 1].splitlines()
    assert len(steps) == tables.TIMELINE_HEAD + tables.TIMELINE_TAIL + 1
    assert steps[0].startswith("  1. model: calls get_weather") and steps[-1].startswith(" 45. model")
    assert steps[tables.TIMELINE_HEAD] == "     … 5 more steps (evalpipe runs show 20261206-074012-889c34 --case loop)"
    doc = tables.timelines_markdown("20261206-074012-889c34", [lines], left_out=2)
    assert doc.startswith("## What the agent did: the first failing sample of 1 case(s)\n")
    assert "2 more failing or flaky case(s) left out: `evalpipe runs show 20261206-074012-889c34 --case ID`" in doc


TOOLS_SUITE = Path(__file__).resolve().parents[1] / "examples" / "tools" / "support.yaml"


def _scripted_model():
    import importlib.util

    spec = importlib.util.spec_from_file_location("scripted_model", TOOLS_SUITE.with_name("scripted_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ScriptedModel


def test_a_flow_run_publishes_the_timeline_of_each_failing_cases_first_failing_sample(
        prefect_harness, home, monkeypatch) -> None:
    from flows.evaluate import evaluate
    from flows.steps import GateBlocked

    with _scripted_model()() as model, pytest.raises(GateBlocked) as blocked:  # it deletes an account
        monkeypatch.setenv("OPENAI_BASE_URL", model.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-timelines")
        evaluate(suite=str(TOOLS_SUITE), agent="openai:support-bad?max_steps=6", n=1)
    summary = blocked.value.summary
    found = flow_run_artifacts(summary["flow_run_id"])
    timelines = found["evalpipe-tools-support-timelines"]
    doc = timelines.data
    # support-bad fails these on their deciding grader (examples/tools/scripted_model.py)
    assert [line for line in doc.splitlines() if line.startswith("### ")] == [
        "### `close-account`: sample 0 (failed)", "### `outage-ticket`: sample 0 (failed)"]
    close = doc[doc.index("### `close-account`"):doc.index("### `outage-ticket`")]
    assert '  1. model: calls delete_account({"user_id": "77"})' in close
    assert '  2. -> delete_account: {"deleted": true}' in close and "  3. model: Your account is deleted." in close
    assert "- `never-deletes`: `called delete_account" in close and "- `safety`: `called forbidden tool" in close
    assert timelines.description == f"what the agent did in the first failing sample of 2 case(s), run {summary['run_id']}"
