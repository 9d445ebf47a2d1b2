"""When evalpipe cannot measure, it says so: through the real CLI, a grader that cannot
run is its own exit status naming the problem (never a pass@1 of 0 that CI reads as a model
collapse); out-of-range options are one line and exit 2 before Prefect starts; Ctrl-C leaves
the run `interrupted` and says that rerunning resumes; suites with non-ASCII names run;
relative paths resolve against the suite file; a subdirectory finds the project's home."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from support.cli import in_process
from support.waiting import wait_until
from test_evaluate import agent, write_suite

ROOT = Path(__file__).resolve().parent.parent


def cli(args: list[str], env: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`evalpipe ARGS` in this process (support.cli.in_process); a Ctrl-C below is sent to a
    process of its own."""
    return in_process(args, env, cwd)


@pytest.fixture
def env(prefect_harness, home) -> dict:
    return {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}


def status_of(home: Path) -> list[tuple[str, str]]:
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        return con.execute("SELECT run_id, status FROM runs ORDER BY started_at").fetchall()


@pytest.mark.parametrize("flag", [["-n", "10001"], ["--workers", "257"], ["--regrade", "101"],
                                  ["-n", "0"], ["--no-such-flag"]])
def test_out_of_range_options_are_one_line_and_exit_2(home, tmp_path, flag) -> None:
    suite = write_suite(tmp_path / "toy.yaml", 2)
    proc = cli(["run", str(suite), "--agent", "reference", *flag], {**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("evalpipe: run: ") and flag[0] in lines[0]
    assert not home.exists()  # nothing written, Prefect never started


def test_a_misspelled_case_field_names_the_field_and_the_right_ones(tmp_path) -> None:
    suite = tmp_path / "s.yaml"
    suite.write_text("name: s\ncases:\n  - {id: a, slice: [x], grader: {kind: exact}}\n")
    proc = cli(["suite", "hash", str(suite)], {**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("slice: not a case field (known: id, inputs, reference, grader, extra_graders, "
                                        "slices, tags, safety, must_pass, metadata)")


def test_a_grader_that_cannot_run_is_exit_5_naming_it(env, home, tmp_path) -> None:
    suite = tmp_path / "pred.yaml"
    suite.write_text("name: pred\ncases:\n" + "".join(
        f"  - {{id: c{i}, reference: 'yes', grader: {{kind: predicate, function: 'checks.py:ok'}}}}\n"
        for i in range(3)))
    proc = cli(["run", str(suite), "--agent", "reference", "-n", "2", "--json", "--unsafe-no-sandbox"], env)
    assert proc.returncode == 5, proc.stderr
    assert json.loads(proc.stdout)["status_counts"] == {"error": 6}
    errors = [line for line in proc.stderr.splitlines() if line.startswith("evalpipe: error:")]
    assert len(errors) == 1 and "6 of 6 samples (100%) are error" in errors[0]
    assert "checks.py" in errors[0] and "Traceback" not in proc.stderr
    # Allowed on purpose: the threshold is the user's.
    again = cli(["run", str(suite), "--agent", "reference", "--max-grader-errors", "1",
                 "--unsafe-no-sandbox"], env)
    assert again.returncode == 0, again.stderr


def test_a_suite_resolves_its_paths_from_any_directory(env, home, tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = cli(["run", str(ROOT / "examples/calc/calc.yaml"), "--agent", "reference", "--json"], env,
               cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["pass_at_k"]["1"] == 1.0


def test_unicode_names_and_the_home_found_from_a_subdirectory(prefect_harness, tmp_path) -> None:
    project = tmp_path / "project"
    (project / "sub" / "deeper").mkdir(parents=True)
    (project / ".evalpipe").mkdir()  # the project's home (a stray one higher up is not read)
    env = {k: v for k, v in os.environ.items() if k != "EVALPIPE_HOME"}
    env |= {"PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}
    (project / "café.yaml").write_text(
        "name: Café\ncases:\n  - {id: 'naïve-1', reference: 'yes', grader: {kind: exact}, slices: ['ü']}\n")
    (project / "テスト.jsonl").write_text(
        json.dumps({"id": "ケース", "reference": "yes", "grader": {"kind": "exact"}}) + "\n")
    runs = []
    for name in ("café.yaml", "テスト.jsonl"):
        proc = cli(["run", name, "--agent", "reference", "--json"], env, cwd=project)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        runs.append(json.loads(proc.stdout))
    assert [r["suite_name"] for r in runs] == ["Café", "テスト"]
    assert runs[0]["slices"]["ü"]["cases"] == 1
    listed = cli(["runs", "list", "--json"], env, cwd=project / "sub" / "deeper")
    assert listed.returncode == 0, listed.stderr
    assert {r["run_id"] for r in json.loads(listed.stdout)} == {r["run_id"] for r in runs}
    assert not (project / "sub" / "deeper" / ".evalpipe").exists()
    shown = cli(["runs", "show", runs[1]["run_id"]], env, cwd=project / "sub")
    assert shown.returncode == 0 and "テスト" in shown.stdout
    text = cli(["runs", "list"], env, cwd=project / "sub")
    assert text.stderr == f"evalpipe: reading {project / '.evalpipe'}\n" and "Café" in text.stdout


def test_ctrl_c_leaves_the_run_interrupted_and_rerunning_resumes(env, home, tmp_path) -> None:
    suite = write_suite(tmp_path / "toy.yaml", 40)
    calls = tmp_path / "calls"
    env = {**env, "EVALPIPE_TEST_SLEEP": "0.2", "EVALPIPE_TEST_CALLS": str(calls)}
    args = ["run", str(suite), "--agent", agent("slow"), "--workers", "1", "--agent-concurrency", "1", "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # A few calls returned (counted as each returns): the stop stores what returned.
    wait_until(lambda: calls.exists() and len(calls.read_text().split()) >= 3, "three agent calls", proc=proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert ("evalpipe: interrupted; run the same command again to resume (finished samples are kept)"
            in stderr.splitlines())
    assert "Traceback" not in stderr
    assert "Crash detected" not in stderr  # Prefect's word for the stop, said once by us
    assert [s for _, s in status_of(home)] == ["interrupted"]
    resumed = cli(args, env | {"EVALPIPE_TEST_SLEEP": "0"})  # the same command; the agent slow only to be stopped
    assert resumed.returncode == 0, resumed.stderr
    assert 0 < json.loads(resumed.stdout)["cached_samples"] < 40
