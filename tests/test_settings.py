"""Settings are configuration, not environment (issue 30, item 5): the output cap, the `cmd:`
and `openai:` timeouts, a coding agent's memory and caps are fields of `RunConfig`, their
`EVALPIPE_*` variables documented overrides read once where the configuration is built, and
an agent keeps them wherever it is pickled, whatever that machine's environment says."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from tasks.agents import AgentSettings, load_agent
from tasks.agents.settings import ENV
from tasks.models import InputError
from tasks.run import RunConfig

ROOT = Path(__file__).resolve().parent.parent

# One value per setting, none of them the default; and another, as a worker might have.
EDGE = {"max_output_bytes": 1000, "cmd_timeout": 7.0, "openai_timeout": 3.0, "openai_max_attempts": 2,
        "max_trajectory_bytes": 5000, "agent_memory_mb": 300, "workspace_tree_mb": 20,
        "workspace_change_bytes": 9000}
WORKER = {ENV[name]: str(int(value) * 10) for name, value in EDGE.items()}


def test_every_setting_is_a_run_option_with_its_documented_override():
    contract = (ROOT / "docs/contract.md").read_text()
    for name, var in ENV.items():
        assert name in RunConfig.model_fields, name
        assert f"`{var}`" in contract, f"docs/contract.md does not list {var}"
    default = AgentSettings()
    given = RunConfig.build("run", environ={}, suite="s", agent="reference", cmd_timeout=2.5)
    from_env = RunConfig.build("run", environ={ENV["cmd_timeout"]: "9", ENV["max_output_bytes"]: "77"},
                               suite="s", agent="reference", cmd_timeout=2.5)
    assert given.agent_settings == default.model_copy(update={"cmd_timeout": 2.5})
    # The option wins over the variable; a variable fills what no option gave.
    assert (from_env.cmd_timeout, from_env.max_output_bytes, from_env.output_cap) == (2.5, 77, 77)
    assert RunConfig(suite="s", agent="reference").agent_settings == default  # no edge read: the defaults
    for var, raw, message in ((ENV["openai_max_attempts"], "2.5", "is not a whole number"),
                              (ENV["agent_memory_mb"], "0", "must be positive")):
        with pytest.raises(InputError, match=f"{var}='{raw}' {message}"):
            RunConfig.build("run", environ={var: raw}, suite="s", agent="reference")


def test_a_pickled_agent_keeps_every_setting_whatever_the_worker_s_environment(tmp_path, monkeypatch):
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\necho yes\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)
    config = RunConfig.build("run", environ={ENV[name]: str(value) for name, value in EDGE.items()},
                             suite="s", agent="cmd:./agent.sh")
    assert config.agent_settings == AgentSettings(**EDGE)
    agents = [load_agent(spec, settings=config.agent_settings)
              for spec in ("cmd:./agent.sh", "openai:toy-model", "reference")]
    agents.append(load_agent("cmd:./agent.sh", 60.0, config.agent_settings))  # --workspace
    for var, value in WORKER.items():  # the worker's environment says otherwise
        monkeypatch.setenv(var, value)
    for agent in agents:
        again = pickle.loads(pickle.dumps(agent))
        assert type(again) is type(agent) and again.fingerprint == agent.fingerprint, agent.spec
        assert again.settings == AgentSettings(**EDGE), agent.spec
    cmd, chat = (pickle.loads(pickle.dumps(a)) for a in agents[:2])
    assert (cmd.settings.cmd_timeout, cmd.settings.max_output_bytes) == (7.0, 1000)
    assert (chat.client.timeout_s, chat.client.max_attempts) == (3.0, 2)  # what the SDK is given


AGENT = """#!/bin/sh
case "$(cat)" in
  *'"slow"'*) exec sleep 60 ;;
  *) printf 'y%.0s' $(seq 1 100) ;;
esac
"""


@pytest.mark.parametrize("runner", ["processes", "dask"])
def test_a_run_s_agent_takes_the_option_and_the_edge_s_override_not_the_worker_s(
        prefect_harness, home, tmp_path, runner):
    """A real run: `--max-output-bytes 10` from the command line, though the environment the
    workers inherit says 1000; the `cmd:` timeout from `EVALPIPE_AGENT_TIMEOUT_S` read where
    the CLI builds the run. With dask the agent is pickled to the cluster's workers."""
    (tmp_path / "agent.sh").write_text(AGENT)
    (tmp_path / "agent.sh").chmod(0o755)
    (tmp_path / "suite.yaml").write_text(
        "name: settings\ncases:\n"
        "  - {id: fast, inputs: {q: fast}, reference: y, grader: {kind: exact}}\n"
        "  - {id: slow, inputs: {q: slow}, reference: y, grader: {kind: exact}}\n")
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT),
           "EVALPIPE_MAX_OUTPUT_BYTES": "1000", "EVALPIPE_AGENT_TIMEOUT_S": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "suite.yaml", "--agent", "cmd:./agent.sh", "--runner", runner,
         "--workers", "1", "--max-output-bytes", "10", "--max-agent-errors", "1", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = json.loads(done.stdout)["run_id"]
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        rows = dict(con.execute("SELECT case_id, output || '|' || coalesce(detail, '') FROM samples WHERE run_id = ?",
                                [run_id]).fetchall())
        (config,) = con.execute("SELECT config FROM runs WHERE run_id = ?", [run_id]).fetchone()
    assert rows["fast"].startswith("y" * 10 + "\n[evalpipe: output truncated at 10 bytes]"), rows["fast"]
    assert "timed out after 1 s" in rows["slow"], rows["slow"]
    recorded = json.loads(config)["agent_settings"]
    assert (recorded["max_output_bytes"], recorded["cmd_timeout"]) == (10, 1.0)


def test_two_runs_in_one_process_each_keep_their_own_unsafe_no_sandbox(home, monkeypatch):
    """Issue 46, item 2: `--unsafe-no-sandbox` travels with a run's tasks, not through the
    process's environment. A run that allowed the fallback is drawing; a second run in the same
    process, which did not, is refused (before, it read the first run's variable and ran the
    suite's code unprotected), and the first grades its program under rlimits as it asked."""
    import threading

    from support.sandbox_modes import _reset

    from evalpipe import evaluate
    from tasks.sandbox import policy

    monkeypatch.setenv(policy.MODE_ENV, "rlimits")  # no bubblewrap, as on a machine without it
    monkeypatch.delenv(policy.UNSAFE_ENV, raising=False)
    _reset()
    cases = [{"id": f"inc{i}", "inputs": {"i": i}, "grader": {
        "kind": "python_tests", "entry_point": "inc", "test": "def check(f):\n    assert f(1) == 2\n"}}
        for i in range(3)]
    drawing, release = threading.Event(), threading.Event()

    def slow(inputs, ctx):
        drawing.set()
        assert release.wait(60)
        return "def inc(x):\n    return x + 1\n"

    done: dict[str, object] = {}
    first = threading.Thread(target=lambda: done.update(run=evaluate(cases, slow, name="allowed",
                                                                     unsafe_no_sandbox=True)))
    first.start()
    try:
        assert drawing.wait(60)
        with pytest.raises(Exception, match="no sandbox") as refused:
            evaluate(cases, lambda inputs, ctx: "def inc(x):\n    return x + 1\n", name="not-allowed")
        assert "--unsafe-no-sandbox" in str(refused.value)
        assert os.environ.get(policy.UNSAFE_ENV) is None  # nothing was written for the first run
    finally:
        release.set()
        first.join(120)
        _reset()
    summary = done["run"]
    assert summary.sandbox == "unsafe-no-sandbox"
    assert summary.pass_at_k["1"] == 1.0  # graded, under rlimits, as that run allowed
