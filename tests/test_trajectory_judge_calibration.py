"""`judge calibrate` on a `trajectory_judge` (issue #43, item 3): the judge is shown each labelled
sample's stored trajectory exactly as when it graded it, its agreement with the labels is
measured as an output judge's is, and its standing shows in the run's summary.

One loopback endpoint serves both sides: the example's scripted support agent
(examples/tools/scripted_model.py, `support-bad`) and an `openai:` judge that fails a
transcript in which the agent called delete_account or create_ticket. The labels fail
close-account and refund-after-lookup, so the judge agrees on close-account (tn), passes
refund-after-lookup (fp), fails outage-ticket (fn) and passes the other 9 (tp)."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

import evalpipe
from flows.judging import calibrate_judge, export_labels
from storage.store import Store
from tasks.models import InputError
from tests.support.judges import ChatServer

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "examples" / "tools" / "support.yaml"
JUDGE = "judge-model"
FLAGGED = ("calls delete_account(", "calls create_ticket(")  # what the scripted judge fails
LABELLED_FAIL = {"close-account", "refund-after-lookup"}


def _scripted_agent():
    spec = importlib.util.spec_from_file_location("scripted_model", ROOT / "examples/tools/scripted_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reply


agent_reply = _scripted_agent()


def _reply(body: dict) -> tuple[int, object]:
    if body["model"] != JUDGE:
        return 200, agent_reply(body)
    shown = next(m["content"] for m in body["messages"] if m["role"] == "user")
    passed = not any(flag in shown for flag in FLAGGED)
    return 200, json.dumps({"passed": passed, "score": float(passed), "rationale": "scripted"})


@pytest.fixture
def endpoint(monkeypatch):
    with ChatServer(_reply) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-trajectory-judge")
        yield server


def _judge_asked(server: ChatServer) -> list[str]:
    """Every judge request, as sent (the key aside), in a stable order."""
    return sorted(json.dumps({k: v for k, v in body.items() if k != "_auth"}, sort_keys=True)
                  for body in server.requests if body["model"] == JUDGE)


@pytest.fixture
def labelled(endpoint, tmp_path):
    """A run of the example suite, each case also graded by a trajectory judge named
    `judged`, and its samples exported and labelled."""
    data = yaml.safe_load(SUITE.read_text())
    for case in data["cases"]:
        case.setdefault("extra_graders", []).append({
            "kind": "trajectory_judge", "name": "judged", "function": f"openai:{JUDGE}",
            "rubric": "Did the agent stay within policy?\n{output}"})
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump(data))
    home = tmp_path / "home"
    run = evalpipe.evaluate(str(suite), "openai:support-bad?max_steps=6", n=1, home=home)
    store = Store(home)
    labels = tmp_path / "labels.csv"
    export_labels(run.run_id, labels, store)
    with labels.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    for row in rows:
        row["label"] = "fail" if row["case_id"] in LABELLED_FAIL else "pass"
    with labels.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return suite, labels, run.run_id, store


def test_a_trajectory_judge_is_calibrated_on_the_trajectories_it_graded(labelled, endpoint):
    suite, labels, run_id, store = labelled
    asked_in_run = _judge_asked(endpoint)
    assert len(asked_in_run) == 12
    endpoint.requests.clear()

    doc = calibrate_judge(str(suite), labels, grader="judged", run=run_id, store=store)

    # Shown exactly what it was shown when it graded: the same requests, byte for byte.
    assert _judge_asked(endpoint) == asked_in_run
    assert doc["kind"] == "trajectory_judge" and doc["run"] == run_id and doc["rows_without_grader"] == 0
    assert doc["confusion"] == {"tp": 9, "fp": 1, "fn": 1, "tn": 1}
    assert (doc["items"], doc["cases"], doc["judge_errors"]) == (12, 12, 0)
    assert doc["agreement"] == pytest.approx(10 / 12)
    # p_e = (10/12)² + (2/12)² = 104/144: kappa (120 - 104) / (144 - 104)
    assert doc["kappa"] == pytest.approx(0.4)
    assert doc["false_pass_rate"] == pytest.approx(1 / 2)
    assert doc["false_fail_rate"] == pytest.approx(1 / 10)
    lo, hi = doc["agreement_ci"]
    assert lo < 10 / 12 < hi

    # Recorded under the fingerprint the run's verdicts carry, so the run's summary shows it.
    (judge,) = store.calibrations.of_run(run_id)
    assert (judge["judge"], judge["judged"], judge["errors"]) == (f"openai:{JUDGE}", 12, 0)
    assert judge["judge_fingerprint"] == doc["judge_fingerprint"]
    assert judge["calibration"]["agreement"] == pytest.approx(10 / 12)
    from tasks.report.text import summary_text

    shown = summary_text(store.runs.get(run_id)["summary"], store.calibrations.of_run(run_id))
    assert f"judge openai:{JUDGE}: agreement 83.3%" in shown and "NOT CALIBRATED" not in shown


def test_the_same_judge_over_outputs_alone_is_another_instrument(labelled, endpoint):
    suite, labels, run_id, store = labelled
    # The judge's function as an output judge: the answers never name a tool call, so it
    # passes everything; its calibration is not the trajectory judge's.
    doc = calibrate_judge(str(suite), labels, judge=f"openai:{JUDGE}",
                          rubric="Did the agent stay within policy?\n{output}", store=store)
    assert doc["kind"] == "judge" and doc["confusion"] == {"tp": 10, "fp": 2, "fn": 0, "tn": 0}
    assert doc["kappa"] is None or doc["kappa"] == pytest.approx(0.0)
    (judge,) = store.calibrations.of_run(run_id)
    assert judge["judge_fingerprint"] != doc["judge_fingerprint"] and judge["calibration"] is None


def test_the_label_file_names_its_run_so_calibrate_needs_no_run(labelled, endpoint):
    """`labels export` writes each row's run (`run_id`): calibrate judges that run's stored
    samples without `--run`, and refuses a `--run` that is another run."""
    suite, labels, run_id, store = labelled
    doc = calibrate_judge(str(suite), labels, grader="judged", store=store)
    assert doc["kind"] == "trajectory_judge" and doc["run"] == run_id
    assert doc["confusion"] == {"tp": 9, "fp": 1, "fn": 1, "tn": 1}
    other = evalpipe.evaluate(str(suite), "openai:support-bad?max_steps=6", n=1, home=store.home, seed=7)
    with pytest.raises(InputError, match=rf"labels.csv: the labels were exported from run {run_id}, not --run"):
        calibrate_judge(str(suite), labels, grader="judged", run=other.run_id, store=store)
    from tasks.report.judging_text import calibration_text

    assert calibration_text(doc).startswith(f"trajectory judge openai:{JUDGE} (")
    assert " on 12 trajectories of 12 cases" in calibration_text(doc)


def test_a_trajectory_judge_without_its_run_or_its_samples_is_bad_input(labelled, tmp_path):
    suite, labels, run_id, store = labelled
    with labels.open(newline="") as fh:  # a file written before label files named their run
        rows = [{k: v for k, v in row.items() if k != "run_id"} for row in csv.DictReader(fh)]
    unnamed = tmp_path / "unnamed.csv"
    with unnamed.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(InputError, match="a trajectory_judge judges the stored trajectory .* pass --run RUN"):
        calibrate_judge(str(suite), unnamed, grader="judged", store=store)
    with pytest.raises(InputError, match="grader 'never-deletes' is a tool_called grader, not a judge"):
        calibrate_judge(str(suite), labels, grader="never-deletes", run=run_id, store=store)
    text = labels.read_text()
    edited = tmp_path / "edited.csv"
    edited.write_text(text.replace("Your account is deleted.", "Your account is kept."))
    with pytest.raises(InputError, match=rf"edited.csv: line \d+: output differs from run {run_id}'s sample"
                                         r" close-account#0"):
        calibrate_judge(str(suite), edited, grader="judged", run=run_id, store=store)
