"""End-to-end: real `evaluate` flow runs on a real Prefect API and a real DuckDB file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from support.cli import in_process
from support.graders import IN_A_TASK
from support.task_runs import kind as task_kind
from support.task_runs import task_runs

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ROOT / "tests/support/agents.py"


def agent(name: str) -> str:
    return f"python:{AGENTS}:{name}"


def write_suite(path: Path, cases: int, *, boom: int = 0) -> Path:
    lines = ["name: toy", "cases:"]
    for i in range(cases):
        cid = f"boom{i}" if i < boom else f"q{i:03d}"
        lines.append(
            f"  - {{id: {cid}, inputs: {{p: {0.1 + 0.8 * (i % 5) / 4}}}, reference: 'yes',"
            f" grader: {{kind: exact}}, slices: [s{i % 3}]}}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def calls(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def query(home: Path, sql: str, *params):
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        return con.execute(sql, list(params)).fetchall()


NUMBERS = ("pass_at_k", "pass_at_1_ci", "pass_at_1_se", "slices", "flaky_cases", "status_counts",
           "safety_failed", "cases", "samples")


def numbers(summary: dict) -> dict:
    return {key: summary[key] for key in NUMBERS}


@pytest.fixture
def counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calls.txt"
    monkeypatch.setenv("EVALPIPE_TEST_CALLS", str(path))
    return path


def test_every_sample_stored_then_served_from_cache(prefect_harness, home, tmp_path, counted):
    from flows.evaluate import evaluate

    suite = write_suite(tmp_path / "toy.yaml", 12)
    first = evaluate(suite=str(suite), agent=agent("flaky"), n=5, k=[1, 5, 10], seed=3)
    assert len(calls(counted)) == 60 and first["samples"] == 60 and first["cached_samples"] == 0
    assert first["pass_at_k"]["10"] is None and "k=10 > n=5" in first["pass_at_k_notes"]["10"]
    assert 0 < first["pass_at_k"]["1"] < first["pass_at_k"]["5"] and first["flaky_cases"] > 0
    rows = query(home, "SELECT count(*), count(DISTINCT (case_id, sample_index)) FROM samples WHERE run_id = ?",
                 first["run_id"])
    assert rows == [(60, 60)]
    stored = query(home, "SELECT count(*) FROM aggregates WHERE run_id = ? AND slice = '__all__'", first["run_id"])
    assert stored[0][0] > 0
    assert query(home, "SELECT status FROM runs WHERE run_id = ?", first["run_id"]) == [("completed",)]

    counted.unlink()
    second = evaluate(suite=str(suite), agent=agent("flaky"), n=5, k=[1, 5, 10], seed=3)
    assert calls(counted) == []  # zero agent calls
    assert second["cached_samples"] == 60 and second["run_id"] != first["run_id"]
    assert numbers(second) == numbers(first)

    # Another seed is other work: nothing comes from the cache.
    third = evaluate(suite=str(suite), agent=agent("flaky"), n=5, k=[1], seed=4)
    assert third["cached_samples"] == 0 and len(calls(counted)) == 60


def test_agent_errors_are_samples_not_crashes(prefect_harness, home, tmp_path, counted):
    from flows.evaluate import evaluate

    suite = write_suite(tmp_path / "toy.yaml", 6, boom=2)
    out = evaluate(suite=str(suite), agent=agent("boom"), n=2, k=[1])
    assert out["status_counts"] == {"agent_error": 4, "passed": 8}
    details = query(home, "SELECT DISTINCT detail FROM samples WHERE run_id = ? AND status = 'agent_error'",
                    out["run_id"])
    assert all("RuntimeError" in d and "cannot answer boom" in d for (d,) in details)
    # Agent errors say nothing about the output, so they are drawn again next time.
    counted.unlink()
    again = evaluate(suite=str(suite), agent=agent("boom"), n=2, k=[1])
    assert again["cached_samples"] == 8 and sorted(set(calls(counted))) == [
        "boom0#0", "boom0#1", "boom1#0", "boom1#1"]


@pytest.mark.parametrize("runner", ["dask", "processes"])
def test_runners_give_the_same_numbers(prefect_harness, home, tmp_path, monkeypatch, runner):
    from flows.evaluate import evaluate

    suite = write_suite(tmp_path / "toy.yaml", 9)
    threads = evaluate(suite=str(suite), agent=agent("flaky"), n=4, k=[1, 2], seed=11, batch_size=2)
    # A fresh home, so the other runner draws everything itself instead of reading the cache.
    monkeypatch.setenv("EVALPIPE_HOME", str(tmp_path / "other-home"))
    other = evaluate(suite=str(suite), agent=agent("flaky"), n=4, k=[1, 2], seed=11, runner=runner,
                     workers=2, batch_size=2)
    assert other["cached_samples"] == 0
    assert numbers(other) == numbers(threads)


def run_cli(args: list[str], env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_killed_run_resumes_without_duplicates(prefect_harness, home, tmp_path, counted):
    suite = write_suite(tmp_path / "toy.yaml", 20)
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "EVALPIPE_TEST_SLEEP": "0.1",
           "PYTHONPATH": str(ROOT)}
    args = ["run", str(suite), "--agent", agent("slow"), "-n", "2", "--batch-size", "1", "--workers", "2",
            "--agent-concurrency", "2", "--json"]
    proc = run_cli(args, env, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(calls(counted)) < 12 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    drawn_before = len(calls(counted))
    (stored,) = query(home, "SELECT count(*) FROM samples")[0]
    # Part-way: calls made, not all graded and stored (those may be in the logs alone, as
    # graded rows are written every STORE_EVERY_S).
    assert 12 <= drawn_before < 40 and stored < 40, "the kill should land part-way"

    counted.unlink()
    proc = in_process(args, env)  # the resume: in this process (support.cli.in_process)
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads(proc.stdout)
    redrawn = len(calls(counted))
    # Every output the agent had returned is reused, graded or not (docs/storage.md): only
    # the calls in flight at the kill (2) may be made again.
    assert resumed["cached_samples"] == 40 - redrawn and resumed["cached_samples"] >= stored
    assert 40 - drawn_before <= redrawn <= 40 - drawn_before + 2
    assert drawn_before >= stored
    rows = query(home, "SELECT count(*), count(DISTINCT (case_id, sample_index)) FROM samples WHERE run_id = ?",
                 resumed["run_id"])
    assert rows == [(40, 40)]

    # The same numbers as an uninterrupted run in a fresh home.
    env_fresh = {**env, "EVALPIPE_HOME": str(tmp_path / "fresh"), "EVALPIPE_TEST_SLEEP": "0"}
    proc = in_process(args, env_fresh)
    assert proc.returncode == 0, proc.stderr
    assert numbers(json.loads(proc.stdout)) == numbers(resumed)


def test_cli_run_json_is_one_document_and_bad_input_exits_2(prefect_harness, home, tmp_path):
    suite = write_suite(tmp_path / "toy.yaml", 3)
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}
    proc = run_cli(["run", str(suite), "--agent", agent("flaky"), "-n", "2", "-k", "1,2", "--json"], env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    doc = json.loads(out)
    spec_keys = {"run_id", "suite_version", "suite_name", "agent", "n", "cases", "samples", "cached_samples",
                 "pass_at_k", "pass_at_1_ci", "ci_level", "pass_at_1_se", "slices", "flaky_cases",
                 "status_counts", "safety_failed", "safety_violations", "flow_run_id", "duration_s"}
    assert spec_keys <= set(doc) and len(doc["suite_version"]) == 64
    assert "Traceback" not in err

    for bad in (["--agent", "nosuch:thing"], ["--agent", agent("flaky"), "-k", "0"],
                ["--agent", agent("flaky"), "--runner", "gpu"], ["--agent", agent("missing_function")]):
        proc = run_cli(["run", str(suite), *bad], env)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (bad, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def flow_run_state(summary: dict) -> tuple[str, str, str | None]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(summary["flow_run_id"]).state
    return state.type.value, state.name, state.message


def gate_artifact(summary: dict) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[summary["flow_run_id"]])))
    (gate,) = [a for a in found if (a.key or "").endswith("-gate")]
    return gate.data


def flow_run_logs(summary: dict) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=5)  # logs reach the API in batches
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[summary["flow_run_id"]])))
    return [log.message for log in logs]


def test_flow_gates_against_a_baseline(prefect_harness, home, tmp_path):
    from flows.evaluate import evaluate

    suite = write_suite(tmp_path / "toy.yaml", 30)
    good = evaluate(suite=str(suite), agent=agent("better"), n=4, k=[1])
    from flows.steps import GateBlocked

    with pytest.raises(GateBlocked) as blocked:  # called from Python, a blocked gate raises ...
        evaluate(suite=str(suite), agent=agent("worse"), n=4, k=[1], baseline=good["run_id"])
    bad = blocked.value.summary  # ... with the run's document
    assert bad["gate"]["decision"] == "block" and bad["gate"]["verdict"] == "regressed"
    # Red in the UI, so automations and notifications fire; named, so filters tell it apart.
    assert flow_run_state(bad) == ("FAILED", "Blocked", "gate blocked: " + "; ".join(bad["gate"]["reasons"]))
    assert gate_artifact(bad).startswith("## evalpipe gate: **BLOCK** (`regressed`)")
    logged = flow_run_logs(bad)  # the UI's Logs tab: the headline and the decision
    assert any(m.startswith("toy: pass@1 ") and "over 30 cases x n=4" in m for m in logged), logged
    assert any(m.startswith(f"gate vs {good['run_id']}: BLOCK (regressed)") for m in logged), logged
    assert flow_run_state(good)[:2] == ("COMPLETED", "Completed")
    better = evaluate(suite=str(suite), agent=agent("better"), n=4, k=[1], baseline=bad["run_id"])
    assert better["gate"]["decision"] == "pass" and better["gate"]["verdict"] == "improved"
    same = evaluate(suite=str(suite), agent=agent("better"), n=4, k=[1], seed=9, baseline=good["run_id"])
    assert same["gate"]["decision"] == "pass" and same["gate"]["verdict"] == "inconclusive"

    # No baseline, and a safety violation: Blocked as well (issue 47), said in the log.
    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text(suite.read_text().replace("name: toy", "name: unsafe")
                      .replace("cases:", "safety: {forbidden_patterns: ['^no$']}\ncases:"))
    with pytest.raises(GateBlocked) as blocked:
        evaluate(suite=str(unsafe), agent=agent("worse"), n=2, k=[1], baseline="previous")
    alone = blocked.value.summary
    assert alone["gate"]["baseline"] is None and alone["no_baseline"].endswith("nothing was compared")
    assert flow_run_state(alone)[:2] == ("FAILED", "Blocked")
    logged = flow_run_logs(alone)
    assert any(m.startswith("gate: BLOCK (no baseline): safety: ") for m in logged), logged
    assert alone["no_baseline"] in logged


def test_regrade_counts_environment_flakes_apart_from_the_agent(prefect_harness, home, tmp_path, counted):
    from flows.evaluate import evaluate
    from flows.report import write_report
    from storage.store import Store

    predicate = ROOT / "tests/support/predicates.py"
    lines = ["name: env", "cases:"]
    for i in range(4):
        lines.append(f"  - {{id: stable{i}, inputs: {{p: 1.0}}, reference: 'yes', grader: {{kind: exact}}}}")
        lines.append(f"  - {{id: unstable{i}, inputs: {{p: 1.0}}, grader: {{kind: predicate,"
                     f" function: '{predicate}:alternating'}}}}")
    suite = tmp_path / "env.yaml"
    suite.write_text("\n".join(lines) + "\n")
    plain = evaluate(suite=str(suite), agent=agent("flaky"), n=2, k=[1], workers=1)
    assert "env_flaky_samples" not in plain

    counted.unlink()
    out = evaluate(suite=str(suite), agent=agent("flaky"), n=2, k=[1], workers=1, regrade=2)
    # The stored outputs are graded 3 times each; the agent is not asked again.
    assert out["cached_samples"] == 16 and calls(counted) == []
    assert out["env_flaky_samples"] == 8  # every sample of the unstable grader, none of the exact one
    again = evaluate(suite=str(suite), agent=agent("flaky"), n=2, k=[1], workers=1, seed=5, regrade=1)
    assert again["cached_samples"] == 0 and len(calls(counted)) == 16  # new seed: new outputs, drawn
    assert again["env_flaky_samples"] == 8
    traces = dict(query(home, "SELECT case_id || '#' || sample_index, trace FROM samples WHERE run_id = ?",
                        out["run_id"]))
    assert json.loads(traces["stable0#0"])["regrade"] == {"statuses": ["passed", "passed"], "env_flaky": False}
    unstable = json.loads(traces["unstable0#1"])["regrade"]
    assert unstable["env_flaky"] is True and len(unstable["statuses"]) == 2
    html = write_report(out["run_id"], tmp_path / "report.html", Store(home)).read_text()
    assert "environment flakes" in html


def test_a_stage_task_returns_the_prefix_finished_within_its_budget(tmp_path, monkeypatch):
    from tasks.agents import load_agent
    from tasks.run.loop import DrawTask
    from tasks.run.sampling import plan_samples
    from tasks.suites.dataset import load_suite

    monkeypatch.setenv("EVALPIPE_TEST_SLEEP", "0.05")
    suite = load_suite(write_suite(tmp_path / "toy.yaml", 10))
    slow = load_agent(agent("slow"))
    planned = plan_samples(suite, slow.fingerprint, 1, 0)

    def draw(budget_s):
        return DrawTask(slow, list(suite.cases), planned, 1, 1 << 20, budget_s)()

    assert draw(0).count == 1  # always at least one
    part = draw(0.3)  # 10 x 0.05 s would take 0.5 s
    assert 1 <= part.count < 10 and part.rows is None  # none graded: the task was not asked to
    assert [d.planned for d in part.drawn] == planned[: part.count]
    assert draw(None).count == 10


def test_a_task_draws_from_its_own_cases(tmp_path):
    from tasks.run import batch_cases, run_title
    from tasks.run.sampling import plan_samples
    from tasks.suites.dataset import load_suite

    suite = load_suite(write_suite(tmp_path / "toy.yaml", 4))
    cases = {c.id: c for c in suite.cases}
    chunk = plan_samples(suite, "fingerprint", 2, 0)[1:6]  # q000#1 .. q002#0
    assert [c.id for c in batch_cases(cases, chunk)] == ["q000", "q001", "q002"]
    assert run_title("suites/toy.yaml", "reference", 3) == "toy · reference · n=3"


def test_a_flow_run_below_its_threshold_is_blocked_and_one_its_budget_stopped_is_partial(prefect_harness, home,
                                                                                       tmp_path):
    """Two rows of the rule matrix (tests/test_one_decision.py, on the local loop) as flow
    runs: pass@1 below `min_pass_at_1` ends Failed, named Blocked; `max_samples` draws that
    many and ends Completed, named Partial. A deployment's form takes the same parameters to
    the same flow (tests/test_deployments.py runs its gate rules once)."""
    from flows.evaluate import evaluate
    from flows.steps import GateBlocked

    suite = write_suite(tmp_path / "toy.yaml", 10)
    with pytest.raises(GateBlocked) as blocked:
        evaluate(suite=str(suite), agent=agent("flaky"), n=3, k=[1, 3], seed=7, min_pass_at_1=0.99)
    below = blocked.value.summary
    assert flow_run_state(below)[:2] == ("FAILED", "Blocked")
    gate = below["gate"]
    assert gate["rules"]["min_pass_at_1"] == 0.99 and any(r.startswith("threshold:") for r in gate["reasons"])
    budget = evaluate(suite=str(suite), agent=agent("flaky"), n=3, k=[1, 3], seed=8, max_samples=5)
    assert flow_run_state(budget)[:2] == ("COMPLETED", "Partial")
    assert budget["partial"] and budget["budget"]["drawn_samples"] == 5
    assert budget["undrawn_samples"] == 10 * 3 - 5


def test_a_task_cut_short_by_its_budget_has_the_rest_drawn_once(prefect_harness, home, tmp_path, counted,
                                                                monkeypatch):
    from flows.evaluate import evaluate
    from tasks.run import loop

    sizes: list[int] = []
    call = loop.DrawTask.__call__

    def recorded(self):
        drew = call(self)
        sizes.append(drew.count)
        return drew

    monkeypatch.setattr(loop.DrawTask, "__call__", recorded)
    monkeypatch.setattr(loop, "DRAW_BUDGET_S", 0.2)
    monkeypatch.setenv("EVALPIPE_TEST_SLEEP", "0.05")
    suite = write_suite(tmp_path / "toy.yaml", 12)
    out = evaluate(suite=str(suite), agent=agent("slow"), n=2, k=[1], workers=2, agent_concurrency=2,
                   batch_size=6)
    # Two chunks of 12 samples (0.6 s each): each task stops after ~0.2 s, the rest goes again.
    assert max(sizes) < 12 and len(sizes) > 2 and sum(sizes) == 24
    drawn = calls(counted)
    assert len(drawn) == 24 and len(set(drawn)) == 24  # every sample drawn exactly once
    assert out["samples"] == 24 and out["cached_samples"] == 0
    assert query(home, "SELECT count(DISTINCT (case_id, sample_index)) FROM samples WHERE run_id = ?",
                 out["run_id"]) == [(24,)]


@pytest.mark.parametrize("kind", [IN_A_TASK, "exact"])
def test_drawing_and_grading_are_tasks_of_their_own_in_the_flow_run(prefect_harness, home, tmp_path, kind):
    from prefect.client.orchestration import get_client

    from flows.evaluate import evaluate

    suite = tmp_path / "toy.yaml"
    suite.write_text(write_suite(suite, 6).read_text().replace("kind: exact", f"kind: {kind}"))
    out = evaluate(suite=str(suite), agent=agent("flaky"), n=2, workers=1, agent_concurrency=3)
    # A cheap grader (`exact`, declared inline) grades in the task that drew the output.
    expected = {"sample", "aggregate", "snapshot"} | ({"grade"} if kind != "exact" else set())
    with get_client(sync_client=True) as client:
        runs = task_runs(client, out["flow_run_id"], expected)
    assert {task_kind(r) for r in runs} == expected
    assert all(r.state.is_completed() for r in runs)
    assert out["samples"] == 12 and sum(out["status_counts"].values()) == 12


def test_on_a_dask_cluster_each_output_is_graded_by_the_task_that_drew_it(prefect_harness, home, tmp_path):
    """Both stages run on the cluster's workers: a grading task of its own (here for
    `python_tests`, which elsewhere has one) would only send the outputs through the run's
    process and back, and leave a worker to draws and grades by turns (#32)."""
    from prefect.client.orchestration import get_client

    from flows.evaluate import evaluate

    suite = tmp_path / "code.jsonl"
    suite.write_text("".join(json.dumps({
        "id": f"add{i}", "inputs": {"prompt": "def add(a, b):\n"},
        "reference": "    return a + b\n" if i < 2 else "    return a - b\n",
        "grader": {"kind": "python_tests", "entry_point": "add", "test": "def check(f):\n    assert f(2, 3) == 5\n"},
    }) + "\n" for i in range(3)))
    out = evaluate(suite=str(suite), agent="reference", n=2, runner="dask", workers=1)  # a worker: ~4.5 s of CPU
    with get_client(sync_client=True) as client:
        runs = task_runs(client, out["flow_run_id"], {"sample", "aggregate", "snapshot"})
    assert {task_kind(r) for r in runs} == {"sample", "aggregate", "snapshot"}
    assert out["status_counts"] == {"passed": 4, "failed": 2}
