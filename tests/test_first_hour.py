"""The first hour of a new user (issue 34): every message the CLI prints is true and says
what went wrong — exit 4 quotes the agent's error, an agent that never answered is not said
to "not report usage", a partial run counts the samples it has, a patch reads as a diff."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import test_cache_levels
from support.cli import as_process, in_process
from test_cache_levels import cli
from test_judges import _labelled_suite
from test_usage import suite
from test_workspaces import bwrap  # noqa: F401 - the fixture: skips where bubblewrap cannot run

env = test_cache_levels.env  # the fixture: a Prefect API, a fresh home, no price file
ROOT = Path(__file__).resolve().parent.parent


def closed_port() -> int:
    """A local port nothing listens on: an endpoint that refuses every connection."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_exit_4_quotes_the_agents_error_and_a_never_answering_agent_is_not_said_to_hide_usage(env, tmp_path):
    path = suite(tmp_path / "toy.yaml", 2)
    down = {**env, "OPENAI_BASE_URL": f"http://127.0.0.1:{closed_port()}/v1", "OPENAI_API_KEY": "sk-test",
            "EVALPIPE_OPENAI_MAX_ATTEMPTS": "2"}
    proc = cli(["run", str(path), "--agent", "openai:gpt-4o-mini"], down)
    assert proc.returncode == 4, proc.stderr
    warning = [line for line in proc.stderr.splitlines() if line.startswith("evalpipe: warning:")]
    assert len(warning) == 1 and "the agent is broken" in warning[0]
    assert "gave up after 2 attempts" in warning[0] and "Connect" in warning[0], warning[0]
    assert "does not report usage" not in proc.stdout
    assert "every one is agent_error, the agent never answered" in proc.stdout

    run_id = proc.stdout.split()[1]  # "run RUN_ID  suite ..."
    shown = cli(["runs", "show", run_id, "--json"], down)
    doc = json.loads(shown.stdout)
    assert doc["status_counts"] == {"agent_error": 2}
    assert "never answered" in doc["usage"]["cost_note"]


def test_a_partial_runs_text_counts_the_samples_it_has_of_those_planned(env, tmp_path):
    path = suite(tmp_path / "toy.yaml", 3)
    agent = f"python:{tmp_path / 'agent.py'}:answer"
    (tmp_path / "agent.py").write_text("def answer(inputs, ctx):\n    return 'yes'\n")
    proc = cli(["run", str(path), "--agent", agent, "-n", "2", "--workers", "1", "--max-samples", "4"], env)
    assert proc.returncode == 6, proc.stderr
    assert "4 of 3 cases x n=2 = 6 samples (0 from cache)" in proc.stdout, proc.stdout
    assert "= 4 samples" not in proc.stdout
    whole = cli(["run", str(path), "--agent", agent, "-n", "2"], env)
    assert whole.returncode == 0, whole.stderr
    assert "3 cases x n=2 = 6 samples (4 from cache)" in whole.stdout, whole.stdout


PATCH = ("diff --git a/calc.py b/calc.py\\n--- a/calc.py\\n+++ b/calc.py\\n@@ -1 +1 @@\\n"
         "-    return a - b\\n+    return a + b  # \\x1b[31mred\\n")


def test_runs_show_case_prints_a_multi_line_output_as_it_reads_with_escapes_shown(env, tmp_path):
    path = suite(tmp_path / "toy.yaml", 1)
    (tmp_path / "agent.py").write_text(f"def answer(inputs, ctx):\n    return \"{PATCH}\"\n")
    proc = cli(["run", str(path), "--agent", f"python:{tmp_path / 'agent.py'}:answer"], env)
    assert proc.returncode == 0, proc.stderr
    shown = cli(["runs", "show", proc.stdout.split()[1], "--case", "q0"], env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    at = lines.index("  output:")
    assert lines[at + 1:at + 7] == ["    diff --git a/calc.py b/calc.py", "    --- a/calc.py", "    +++ b/calc.py",
                                    "    @@ -1 +1 @@", "    -    return a - b",
                                    "    +    return a + b  # \\x1b[31mred"]
    assert "\\\\n" not in shown.stdout and "\x1b" not in shown.stdout  # no escaped newlines, no raw escapes


@pytest.mark.usefixtures("bwrap")
def test_the_coding_example_runs_from_another_folder_and_a_missing_repository_is_exit_2(env, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(suite: Path, *extra: str) -> subprocess.CompletedProcess:
        return in_process(["run", str(suite), "--agent", f"cmd:{ROOT / 'examples/coding/calc_fixer.sh'}",
                           "--workspace", *extra], env, elsewhere)

    proc = run(ROOT / "examples/coding/calc.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status_counts"] == {"passed": 1}

    moved = tmp_path / "moved.yaml"  # the same suite where its relative repository is not
    moved.write_text((ROOT / "examples/coding/calc.yaml").read_text())
    proc = run(moved)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "'add-bug'" in proc.stderr and "../calc/calc.bundle" in proc.stderr and "no such repository" in proc.stderr


def test_rescore_prints_no_prefect_log_lines_where_run_prints_none(env, tmp_path):
    user = {k: v for k, v in env.items() if not k.startswith("PREFECT_LOGGING")} | {"PREFECT_API_URL": env["PREFECT_API_URL"]}
    path = suite(tmp_path / "toy.yaml", 2)
    (tmp_path / "agent.py").write_text("def answer(inputs, ctx):\n    return 'yes'\n")
    # Processes of their own: Prefect's log lines reach a process's stderr, not this test's.
    run = as_process(["run", str(path), "--agent", f"python:{tmp_path / 'agent.py'}:answer"], user)
    assert run.returncode == 0, run.stderr
    rescore = as_process(["rescore", run.stdout.split()[1], str(path)], user)
    assert rescore.returncode == 0, rescore.stderr
    assert "graded on the stored outputs" in rescore.stdout
    for proc in (run, rescore):
        assert "| INFO" not in proc.stderr and "Finished in state" not in proc.stderr, proc.stderr


def test_the_text_summary_says_a_judge_is_uncalibrated_until_it_is_calibrated(env, tmp_path):
    path, labels = _labelled_suite(tmp_path)
    run = cli(["run", str(path), "--agent", "reference"], env)
    assert run.returncode == 0, run.stderr
    judge = [line for line in run.stdout.splitlines() if line.startswith("judge ")]
    assert len(judge) == 1 and "length_judge" in judge[0], run.stdout
    assert judge[0].endswith(": NOT CALIBRATED: its verdicts come from an uncalibrated instrument; 0 errors in 3")

    calibrated = cli(["judge", "calibrate", str(path), "--labels", str(labels)], env)
    assert calibrated.returncode == 0, calibrated.stderr
    shown = cli(["runs", "show", run.stdout.split()[1]], env)
    judge = [line for line in shown.stdout.splitlines() if line.startswith("judge ")]
    assert len(judge) == 1 and ": agreement 66.7% [" in judge[0] and "kappa 0.333 [" in judge[0], shown.stdout
    assert "NOT CALIBRATED" not in shown.stdout


def test_a_run_s_flow_run_logs_its_start_progress_headline_and_decision_to_the_ui(env, tmp_path):
    """The Prefect UI's Logs tab of a `run` flow run: what a user reads there, while the
    terminal shows no Prefect log line."""
    import httpx

    user = {k: v for k, v in env.items() if not k.startswith("PREFECT_LOGGING")} | {"PREFECT_API_URL": env["PREFECT_API_URL"]}
    path = suite(tmp_path / "toy.yaml", 4)
    (tmp_path / "agent.py").write_text("def answer(inputs, ctx):\n    return 'yes'\n")
    agent = f"python:{tmp_path / 'agent.py'}:answer"
    # A process of its own: its stderr whole, and its log sent to the API before it ends.
    first = cli(["run", str(path), "--agent", agent, "--json"], user)
    gated = as_process(["run", str(path), "--agent", agent, "-n", "2", "--baseline", "previous", "--json"], user)
    assert gated.returncode == 0, gated.stderr
    assert "| INFO" not in gated.stderr
    doc = json.loads(gated.stdout)
    response = httpx.post(f"{env['PREFECT_API_URL']}/logs/filter",
                          json={"logs": {"flow_run_id": {"any_": [doc["flow_run_id"]]}}, "sort": "TIMESTAMP_ASC"})
    messages = [log["message"] for log in response.json()]
    assert any(m.startswith(f"run {doc['run_id']}: suite toy (") and "4 cases" in m and "n=2" in m
               and f"gated against {json.loads(first.stdout)['run_id']}" in m for m in messages), messages
    assert any(m.startswith("progress: 8 of 8 samples (100%)") for m in messages), messages
    assert any(m.startswith("toy: pass@1 100.0%") for m in messages), messages
    assert any(m.startswith(f"gate vs {doc['gate']['baseline']}: PASS") for m in messages), messages
