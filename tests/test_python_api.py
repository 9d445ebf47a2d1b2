"""`from evalpipe import evaluate` (docs/python-api.md): the CLI's run from Python, stored the
same way, with a callable as the agent and a list of cases as the suite."""

from __future__ import annotations

import json
import os
from pathlib import Path

import duckdb
import pytest
from support.cli import in_process

from evalpipe import evaluate
from flows.output import rounded
from tasks.models import EvalCase, InputError
from tasks.run import RunSummary

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ROOT / "tests/support/agents.py"
SAMPLE_FIELDS = ("case_id", "sample_index", "seed", "output", "status", "passed", "score", "detail", "cache_key",
                 "cached", "case_hash", "output_key")


def rows(home: Path, sql: str, *params):
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        return con.execute(sql, list(params)).fetchall()


CASES = [
    {"id": "add", "inputs": {"a": 2, "b": 3}, "reference": "5", "grader": {"kind": "exact"}, "slices": ["math"]},
    {"id": "mul", "inputs": {"a": 2, "b": 4}, "reference": "8", "grader": {"kind": "exact"}, "slices": ["math"]},
    {"id": "neg", "inputs": {"a": -1, "b": 1}, "reference": "-1", "grader": {"kind": "exact"}},
]


def test_a_callable_agent_on_a_list_of_cases_returns_the_typed_summary(home):
    calls: list[str] = []

    def adder(inputs, ctx):
        calls.append(ctx.case_id)
        return str(inputs["a"] + inputs["b"])

    seen: list[tuple[int, int]] = []
    summary = evaluate(CASES, adder, name="arith", n=2, k=[1, 2], progress=lambda d, t: seen.append((d, t)))
    assert isinstance(summary, RunSummary)
    assert summary.suite_name == "arith" and summary.samples == 6 and summary.cases == 3
    assert summary.pass_at_k["1"] == pytest.approx(1 / 3)  # only `add` is a sum
    assert summary.slices["math"].pass_at_1 == pytest.approx(0.5)
    assert summary.agent.startswith("callable:") and summary.flow_run_id is None
    assert len(calls) == 6 and seen[-1] == (6, 6)
    stored = rows(home, "SELECT status, summary FROM runs WHERE run_id = ?", summary.run_id)
    assert stored[0][0] == "completed" and json.loads(stored[0][1]) == summary.to_json()
    # The in-memory suite is snapshotted like any: the CLI can name it by its version.
    assert rows(home, "SELECT name, n_cases FROM suites WHERE version = ?", summary.suite_version) == [("arith", 3)]

    again = evaluate([EvalCase.model_validate(c) for c in CASES], adder, name="arith", n=2, k=[1, 2])
    assert again.cached_samples == 6 and len(calls) == 6  # same suite, same code: from the cache

    def fixed(inputs, ctx):
        return str(inputs["a"] * inputs["b"]) if inputs["b"] == 4 else str(inputs["a"] + inputs["b"])

    changed = evaluate(CASES, fixed, name="arith", n=2, baseline=summary.run_id)
    assert changed.cached_samples == 0  # another function: drawn anew
    assert changed.gate is not None and changed.gate.baseline == summary.run_id


def test_bad_input_is_one_line_before_any_call(home):
    with pytest.raises(InputError, match="n: Input should be greater than or equal to 1"):
        evaluate(CASES, lambda inputs, ctx: "", n=0)
    with pytest.raises(InputError, match="unknown scheme"):
        evaluate(CASES, "nosuch:agent")
    with pytest.raises(InputError, match="missing 'grader'"):
        evaluate([{"id": "x", "inputs": {}}], lambda inputs, ctx: "")
    # Runners are the flow's: asked for here, they would be silently ignored.
    with pytest.raises(InputError, match="runner='dask', dask_address='tcp://127.0.0.1:1'"):
        evaluate(CASES, lambda inputs, ctx: "", runner="dask", dask_address="tcp://127.0.0.1:1")
    with pytest.raises(InputError, match="runner='processes'"):
        evaluate(CASES, lambda inputs, ctx: "", runner="processes")


def test_the_api_stores_the_rows_the_cli_stores(prefect_harness, tmp_path, monkeypatch):
    suite = tmp_path / "toy.yaml"
    suite.write_text("name: toy\ncases:\n" + "".join(
        f"  - {{id: q{i}, inputs: {{p: {0.2 + 0.15 * i}}}, reference: 'yes', grader: {{kind: exact}}}}\n"
        for i in range(5)))
    agent = f"python:{AGENTS}:flaky"
    api_home, cli_home = tmp_path / "api", tmp_path / "cli"
    monkeypatch.setenv("EVALPIPE_HOME", str(api_home))
    summary = evaluate(str(suite), agent, n=3, k=[1, 3], seed=4, workers=2)

    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT), "EVALPIPE_HOME": str(cli_home)}
    done = in_process(["run", str(suite), "--agent", agent, "-n", "3", "-k", "1,3", "--seed", "4", "--workers", "2",
                       "--json"], env)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)

    query = f"SELECT {', '.join(SAMPLE_FIELDS)} FROM samples ORDER BY case_id, sample_index"
    assert rows(api_home, query) == rows(cli_home, query)
    api, cli = rounded(summary.to_json()), doc  # the CLI prints 6 significant digits
    for varying in ("run_id", "flow_run_id", "duration_s", "usage"):
        api.pop(varying, None), cli.pop(varying, None)
    assert api == cli
    config = "SELECT agent, agent_fingerprint, n, ks, seed, status, config FROM runs"
    (a,), (c,) = rows(api_home, config), rows(cli_home, config)
    assert a[:6] == c[:6]
    assert json.loads(a[6]) == json.loads(c[6])


def test_a_sequential_run_needs_no_prefect_and_is_the_clis(prefect_harness, tmp_path, monkeypatch, caplog):
    """`evaluate(..., baseline=X, sequential=True)` stops where `run --baseline X --sequential`
    stops, with the same looks, gate and samples; its looks go to the `evalpipe` logger."""
    suite = tmp_path / "loss.yaml"
    suite.write_text("name: loss\ncases:\n" + "".join(
        f"  - {{id: q{i:02d}, inputs: {{v1: 'yes', v2: '{'no' if i % 2 else 'yes'}'}}, reference: 'yes',"
        " grader: {kind: exact}}\n" for i in range(60)))
    v1, v2 = f"python:{AGENTS}:v1", f"python:{AGENTS}:v2"
    api_home, cli_home = tmp_path / "api", tmp_path / "cli"
    monkeypatch.setenv("EVALPIPE_HOME", str(api_home))
    base = evaluate(str(suite), v1)
    seen: list[tuple[int, int]] = []
    with caplog.at_level("INFO", logger="evalpipe"):
        summary = evaluate(str(suite), v2, baseline=base.run_id, sequential=True, progress=lambda d, t: seen.append((d, t)))
    seq = summary.sequential
    assert seq is not None and seq["stopped_early"] and seq["decision"] == "block"
    assert summary.cases == seq["cases_drawn"] < 60 and summary.gate is not None and summary.gate.decision == "block"
    assert summary.gate.reasons[0].startswith(f"sequential: stopped after round {seq['rounds']} of 10")
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.name == "evalpipe"] == [
        f"sequential look {i + 1}/10" for i in range(seq["rounds"])]
    assert seen[-1] == (seq["samples_drawn"], 60) and seen == sorted(seen)  # one count over every round

    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT), "EVALPIPE_HOME": str(cli_home)}

    def cli(*args: str, code: int) -> dict:
        done = in_process(["run", str(suite), "--json", *args], env)
        assert done.returncode == code, done.stderr
        return json.loads(done.stdout)

    cli_base = cli("--agent", v1, code=0)["run_id"]
    doc = cli("--agent", v2, "--baseline", cli_base, "--sequential", code=1)
    query = f"SELECT {', '.join(SAMPLE_FIELDS)} FROM samples WHERE run_id = ? ORDER BY case_id, sample_index"
    assert rows(api_home, query, summary.run_id) == rows(cli_home, query, doc["run_id"])
    api = rounded(summary.to_json())
    for varying in ("run_id", "flow_run_id", "duration_s", "usage"):
        api.pop(varying, None), doc.pop(varying, None)
    for gate, baseline in ((api["gate"], base.run_id), (doc["gate"], cli_base)):
        assert gate.pop("baseline") == baseline
        gate.pop("run_id")
    assert api == doc
