"""Outputs are bought once (issue 19): an output is keyed by what the agent saw, a verdict by
how it is graded. Through the real CLI with an agent that counts its calls: what each kind
of suite edit costs in agent calls, and `rescore`, which grades a stored run's outputs on a
suite without calling its agent at all."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.cli import in_process
from test_evaluate import AGENTS, NUMBERS, calls

ROOT = Path(__file__).resolve().parent.parent


def cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`evalpipe ARGS` in this process (support.cli.in_process: the same output and exit
    status without a fresh interpreter's imports); tests/test_cli_run.py runs it as a process."""
    return in_process(args, env)


@pytest.fixture
def env(prefect_harness, home, tmp_path) -> dict:
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT),
           "EVALPIPE_TEST_CALLS": str(tmp_path / "calls.txt")}
    env.pop("EVALPIPE_PRICES", None)  # prices come from the test's own files
    return env


CASES = {
    "a": "{id: a, inputs: {p: 0.9}, reference: 'yes', grader: {kind: exact}, slices: [s1]}",
    "b": "{id: b, inputs: {p: 0.5}, reference: 'yes', grader: {kind: exact}}",
    "c": "{id: c, inputs: {p: 0.2}, reference: 'yes', grader: {kind: exact}}",
}


def write(path: Path, cases: dict[str, str]) -> Path:
    path.write_text("name: toy\ncases:\n" + "".join(f"  - {c}\n" for c in cases.values()))
    return path


class Runner:
    """`evalpipe run --json` of one suite file, counting the agent's calls of each run."""

    def __init__(self, env: dict, suite: Path, tmp_path: Path) -> None:
        self.env, self.suite, self.log = env, suite, Path(env["EVALPIPE_TEST_CALLS"])

    def __call__(self, cases: dict[str, str], *args: str, agent: str = "flaky") -> tuple[dict, list[str]]:
        write(self.suite, cases)
        before = len(calls(self.log))
        proc = cli(["run", str(self.suite), "--agent", f"python:{AGENTS}:{agent}", "--json", *args], self.env)
        doc = json.loads(proc.stdout)
        # A safety violation blocks a run even without a baseline (issue 47).
        assert proc.returncode == (1 if doc["safety_failed"] else 0), proc.stderr
        return doc, calls(self.log)[before:]


def test_each_suite_edit_costs_only_the_agent_calls_it_must(env, tmp_path):
    run = Runner(env, tmp_path / "toy.yaml", tmp_path)
    first, drawn = run(CASES, "-n", "2")
    assert len(drawn) == 6 and first["cached_samples"] == 0

    again, drawn = run(CASES, "-n", "2")
    assert drawn == [] and again["cached_samples"] == 6
    assert {k: again[k] for k in NUMBERS} == {k: first[k] for k in NUMBERS}  # same command, same numbers

    # A changed reference re-grades the stored outputs: 0 calls, other verdicts.
    edited = {**CASES, "a": CASES["a"].replace("reference: 'yes'", "reference: 'no'")}
    regraded, drawn = run(edited, "-n", "2")
    assert drawn == [] and regraded["cached_samples"] == 6
    passed_before = first["status_counts"].get("passed", 0)
    assert regraded["status_counts"].get("passed", 0) != passed_before

    # A grader parameter and a safety rule, likewise: 0 calls; the rule is applied.
    ruled = {**CASES, "b": CASES["b"].replace("{kind: exact}", "{kind: exact, normalize: true}"),
             "c": CASES["c"].replace("grader:", "safety: {forbidden_patterns: ['^(yes|no)$']}, grader:")}
    safety, drawn = run(ruled, "-n", "2")
    assert drawn == [] and safety["safety_failed"] is True and safety["gate"]["decision"] == "block"

    # Slices and tags are not what the agent sees either.
    sliced = {**CASES, "b": CASES["b"].replace("grader:", "slices: [hard], tags: [t], grader:")}
    _, drawn = run(sliced, "-n", "2")
    assert drawn == []

    # An added case draws only its own samples; a removed one draws nothing.
    added = {**CASES, "d": "{id: d, inputs: {p: 0.7}, reference: 'yes', grader: {kind: exact}}"}
    grown, drawn = run(added, "-n", "2")
    assert sorted(drawn) == ["d#0", "d#1"] and grown["cached_samples"] == 6
    _, drawn = run({k: v for k, v in added.items() if k != "b"}, "-n", "2")
    assert drawn == []

    # -n 3 after -n 2: one more per case.
    _, drawn = run(CASES, "-n", "3")
    assert sorted(drawn) == ["a#2", "b#2", "c#2"]

    # A case whose inputs changed is a new question: its samples are drawn again, only its.
    asked = {**CASES, "c": CASES["c"].replace("p: 0.2", "p: 0.3")}
    _, drawn = run(asked, "-n", "3")
    assert sorted(drawn) == ["c#0", "c#1", "c#2"]

    # Another agent draws everything.
    other, drawn = run(CASES, "-n", "3", agent="better")
    assert len(drawn) == 9 and other["cached_samples"] == 0


def test_rescore_grades_stored_outputs_without_the_agent(env, tmp_path):
    gone = tmp_path / "gone_agent.py"  # a colleague's agent: deleted after the run
    shutil.copy(AGENTS, gone)
    suite = write(tmp_path / "toy.yaml", CASES)
    proc = cli(["run", str(suite), "--agent", f"python:{gone}:flaky", "-n", "2", "--json"], env)
    assert proc.returncode == 0, proc.stderr
    source = json.loads(proc.stdout)
    gone.unlink()
    log = Path(env["EVALPIPE_TEST_CALLS"])
    assert len(calls(log)) == 6

    # A reference edit and an added case: the edited case is graded anew, the new one unscored.
    edited = {**CASES, "a": CASES["a"].replace("reference: 'yes'", "reference: 'no'"),
              "d": "{id: d, inputs: {p: 0.7}, reference: 'yes', grader: {kind: exact}}"}
    write(suite, edited)
    proc = cli(["rescore", source["run_id"][:17], str(suite), "--json"], env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(calls(log)) == 6  # no call
    assert doc["source_run"] == source["run_id"] and doc["unscored"] == ["d"]
    assert doc["cases"] == 3 and doc["samples"] == 6 and doc["cached_samples"] == 6
    assert doc["usage"]["samples"] == 0 and doc["usage"]["cached"]["samples"] == 6
    from storage.store import Store

    rows = {(r["case_id"], r["sample_index"]): r for r in Store.default().samples.of_run(doc["run_id"]).to_pylist()}
    old = {(r["case_id"], r["sample_index"]): r for r in Store.default().samples.of_run(source["run_id"]).to_pylist()}
    assert rows.keys() == old.keys()
    for key, row in rows.items():
        assert row["output"] == old[key]["output"]
        assert row["passed"] == ((row["output"] == "no") if key[0] == "a" else old[key]["passed"])

    # Text mode names the unscored cases; gate and report work on it like on any run.
    text = cli(["rescore", source["run_id"], str(suite)], env)
    assert text.returncode == 0 and "unscored" in text.stdout and "d" in text.stdout.split("unscored")[1]
    again = text.stdout.split()[1]  # "run <id> ..."
    gate = cli(["gate", again, "--baseline", doc["run_id"], "--json"], env)
    assert gate.returncode == 0, gate.stderr
    assert json.loads(gate.stdout)["shared_cases"] == 3
    report = cli(["report", doc["run_id"], "--out", str(tmp_path / "r.html")], env)
    assert report.returncode == 0, report.stderr
    assert "Unscored" in (tmp_path / "r.html").read_text()


def test_rescore_refuses_a_suite_it_has_no_output_for(env, tmp_path):
    suite = write(tmp_path / "toy.yaml", CASES)
    proc = cli(["run", str(suite), "--agent", f"python:{AGENTS}:flaky", "--json"], env)
    other = write(tmp_path / "other.yaml", {"z": "{id: z, inputs: {}, reference: 'yes', grader: {kind: exact}}"})
    refused = cli(["rescore", json.loads(proc.stdout)["run_id"], str(other)], env)
    assert refused.returncode == 2 and "no output for any case" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_keys_hold_what_the_agent_sees_and_how_its_output_is_graded():
    """The output key moves with the inputs only, except for the `reference` agent, which
    answers with the reference; the verdict key moves with the grading too."""
    from tasks.models import EvalCase, EvalSuite
    from tasks.run.sampling import plan_samples

    def plan(reference: str, agent: str, **changes):
        case = EvalCase(**{"id": "a", "inputs": {"q": 1}, "reference": reference, "grader": {"kind": "exact"},
                           **changes})
        (planned,) = plan_samples(EvalSuite(name="s", cases=(case,)), "fp", 1, 0, agent)
        return planned

    base = plan("x", "python:a.py:f")
    edited = plan("y", "python:a.py:f")
    assert edited.output_key == base.output_key and edited.seed == base.seed
    assert edited.cache_key != base.cache_key
    ruled = plan("x", "python:a.py:f", safety={"forbidden_patterns": ["z"]})
    assert ruled.output_key == base.output_key and ruled.cache_key != base.cache_key
    assert plan("x", "python:a.py:f", slices=["s"]).cache_key == base.cache_key
    assert plan("x", "reference").output_key != plan("y", "reference").output_key


def test_rescore_checks_its_inputs_once_and_the_flow_grades_what_was_checked(env, tmp_path, monkeypatch):
    """`evalpipe rescore` prepares the rescore (every check) before Prefect starts and hands it
    to the flow: the flow does not look again, so a snapshot that vanishes in between (which
    preparing refuses) does not stop it, and it grades the suite as it was checked."""
    suite = write(tmp_path / "toy.yaml", CASES)
    proc = cli(["run", str(suite), "--agent", f"python:{AGENTS}:flaky", "-n", "2", "--json"], env)
    assert proc.returncode == 0, proc.stderr
    source = json.loads(proc.stdout)
    monkeypatch.setenv("PREFECT_API_URL", env["PREFECT_API_URL"])
    from flows.cli import rescore_flow
    from storage.store import Store
    from tasks.errors import InputError
    from tasks.run.rescore import prepare_rescore

    store = Store.default()
    options = {"suite": str(suite), "runner": "threads", "workers": 1, "unsafe_no_sandbox": False,
               "baseline": None, "min_pass_at_1": None, "max_drop": 0.0, "max_new_failures": None,
               "min_slice": None, "max_increase": None, "metric": "pass"}
    prepared = prepare_rescore(source["run_id"][:17], store, **options)
    assert prepared.config.suite == prepared.run.spec.config["suite_source"]  # pinned
    snapshot = store.snapshots.path(source["suite_version"])
    snapshot.unlink()
    write(suite, {"z": "{id: z, inputs: {}, reference: 'yes', grader: {kind: exact}}"})  # edited meanwhile
    with pytest.raises(InputError, match="snapshot of its suite"):
        prepare_rescore(source["run_id"], store, **options)
    environ = dict(os.environ)
    try:
        doc = rescore_flow(prepared, options, as_json=True)
    finally:  # as a command ends: this process goes on with other tests' flow runs
        os.environ.clear()
        os.environ.update(environ)
        logging.disable(logging.NOTSET)
    assert doc["source_run"] == source["run_id"] and doc["run_id"] == prepared.run.spec.run_id
    assert doc["cases"] == 3 and doc["samples"] == 6 and doc["unscored"] == []


def test_a_changed_declared_config_draws_afresh_and_a_fully_cached_run_says_so(env, tmp_path):
    """Issue 47: an agent answering from a config file beside it. Declared, the changed file
    draws anew; a run that drew nothing says so first, with the fingerprint and a new seed."""
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "agent.py").write_text("from pathlib import Path\n\n"
                                    "def answer(inputs, ctx):\n"
                                    "    return (Path(__file__).parent / 'config.txt').read_text().strip()\n")
    (agent / "config.txt").write_text("no")
    (agent / "evalpipe-agent.toml").write_text('files = ["config.txt"]\n')
    suite = write(tmp_path / "toy.yaml", {"a": CASES["a"], "b": CASES["b"]})
    args = ["run", str(suite), "--agent", f"python:{agent}/agent.py:answer", "-n", "2"]

    first = json.loads(cli([*args, "--json"], env).stdout)
    assert first["cached_samples"] == 0 and "all_cached" not in first

    again = cli(args, env)  # the text summary: what the user reads first
    assert again.returncode == 0, again.stderr
    fingerprint = cli([*args, "--json"], env)
    doc = json.loads(fingerprint.stdout)
    assert doc["cached_samples"] == 4 and len(doc["all_cached"]["agent_fingerprint"]) == 64
    lines = again.stdout.splitlines()
    assert lines[2].startswith("ALL FROM CACHE: every output came from the cache"), lines[:3]
    assert doc["all_cached"]["agent_fingerprint"][:12] in lines[2] and "--seed 1" in lines[2]
    assert doc["all_cached"]["message"] in lines[2]

    (agent / "config.txt").write_text("yes")
    changed = json.loads(cli([*args, "--json"], env).stdout)
    assert changed["cached_samples"] == 0 and "all_cached" not in changed
    assert changed["pass_at_k"]["1"] == 1.0 and first["pass_at_k"]["1"] == 0.0

    # A new seed, as the message says, draws afresh too.
    reseeded = json.loads(cli([*args, "--json", "--seed", "1"], env).stdout)
    assert reseeded["cached_samples"] == 0
