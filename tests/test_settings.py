"""Settings are configuration, not environment (issue 30, item 5): the output cap, the `cmd:`
and `openai:` timeouts, a coding agent's memory and caps are fields of `RunConfig`, their
`EVALPIPE_*` variables documented overrides read once where the configuration is built, and
an agent keeps them wherever it is pickled, whatever that machine's environment says. The
machine's settings (issue 46, item 2: `tasks.settings.MachineSettings`) are read once at the
edge too and travel with the run's tasks, whatever the environment of the process they run in.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import duckdb
import pytest
from support.cli import in_process

from tasks.agents import AgentSettings, load_agent
from tasks.agents.settings import ENV
from tasks.metrics.cost import PRICES_ENV
from tasks.models import InputError
from tasks.run import RunConfig
from tasks.settings import ENV as MACHINE_ENV

ROOT = Path(__file__).resolve().parent.parent

# One value per setting, none of them the default; and another, as a worker might have.
EDGE = {"max_output_bytes": 1000, "cmd_timeout": 7.0, "openai_timeout": 3.0, "openai_max_attempts": 2,
        "max_trajectory_bytes": 5000, "agent_memory_mb": 300, "workspace_tree_mb": 20,
        "workspace_change_bytes": 9000}
WORKER = {ENV[name]: str(int(value) * 10) for name, value in EDGE.items()}
# Every variable that is a setting (the machine's, the run's defaults), not the agent protocol.
SETTINGS_VARIABLES = {*MACHINE_ENV.values(), *ENV.values(), PRICES_ENV}


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
    done = in_process(["run", "suite.yaml", "--agent", "cmd:./agent.sh", "--runner", runner, "--workers", "1",
                       "--max-output-bytes", "10", "--max-agent-errors", "1", "--json"], env, tmp_path)
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


def test_two_runs_in_one_process_each_keep_their_own_unsafe_no_sandbox(home, monkeypatch, tmp_path):
    """Issue 46, item 2: `--unsafe-no-sandbox` travels with a run's tasks, not through the
    process's environment. Two `evaluate` calls at the same time: the first, which allowed the
    fallback, is grading (its program is running, unprotected, as it asked); the second, which
    did not, is refused meanwhile (before, it read the first run's variable and ran the suite's
    code unprotected); then the first's program passes."""
    import threading

    from support.sandbox_modes import _reset

    from evalpipe import evaluate
    from tasks.sandbox import policy

    monkeypatch.setenv(policy.MODE_ENV, "rlimits")  # no bubblewrap, as on a machine without it
    monkeypatch.delenv(policy.UNSAFE_ENV, raising=False)
    _reset()
    grading, go = tmp_path / "grading", tmp_path / "go"
    waits = (f"    import os, time\n    open({str(grading)!r}, 'w').close()\n"
             f"    for _ in range(300):\n        if os.path.exists({str(go)!r}):\n            break\n"
             "        time.sleep(0.05)\n")
    cases = [{"id": f"inc{i}", "inputs": {"i": i}, "grader": {
        "kind": "python_tests", "entry_point": "inc", "test": "def check(f):\n" + waits + "    assert f(1) == 2\n"}}
        for i in range(3)]
    solution = "def inc(x):\n    return x + 1\n"
    done: dict[str, object] = {}
    first = threading.Thread(target=lambda: done.update(run=evaluate(cases, lambda inputs, ctx: solution,
                                                                     name="allowed", unsafe_no_sandbox=True)))
    first.start()
    try:
        deadline = time.monotonic() + 60
        while not grading.exists() and first.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert grading.exists(), "the first run never graded"
        with pytest.raises(Exception, match="no sandbox") as refused:
            evaluate(cases, lambda inputs, ctx: solution, name="not-allowed")
        assert "--unsafe-no-sandbox" in str(refused.value)
        assert os.environ.get(policy.UNSAFE_ENV) is None  # nothing was written for the first run
        assert not go.exists()  # the first run's program was still running while the second was refused
    finally:
        go.touch()
        first.join(120)
        _reset()
    summary = done["run"]
    assert summary.sandbox == "unsafe-no-sandbox"
    assert summary.pass_at_k["1"] == 1.0  # graded, under rlimits, as that run allowed


def test_a_worker_process_grades_with_the_edge_s_machine_settings_not_its_own_environment(home, monkeypatch, tmp_path):
    """The machine settings read at the edge travel with each grading task into a worker process
    (`--runner processes`): the edge's say bubblewrap; the workers' environment says
    `EVALPIPE_SANDBOX=rlimits` without the unsafe fallback, where every program would be refused."""
    from concurrent.futures import ThreadPoolExecutor

    from support.sandbox_modes import _reset

    from service.run import Shell, execute
    from storage.store import Store
    from tasks.run.loop import LocalStages
    from tasks.run.prepare import prepare_run
    from tasks.run.workers import run_in, worker_processes
    from tasks.sandbox import policy
    from tasks.settings import MachineSettings, current, using

    monkeypatch.delenv(policy.MODE_ENV, raising=False)
    monkeypatch.delenv(policy.UNSAFE_ENV, raising=False)
    _reset()
    if not policy.bwrap_available():
        pytest.skip("bubblewrap does not run here")
    edge = MachineSettings.from_environ(os.environ)
    (tmp_path / "suite.yaml").write_text(
        "name: machine\ncases:\n" + "".join(
            f"  - {{id: inc{i}, inputs: {{i: {i}}}, reference: \"def inc(x):\\n    return x + 1\\n\","
            " grader: {kind: python_tests, entry_point: inc, test: \"def check(f):\\n    assert f(1) == 2\\n\"}}\n"
            for i in range(2)))
    monkeypatch.setenv(policy.MODE_ENV, "rlimits")  # what the workers inherit
    config = RunConfig.build("run", environ={}, suite=str(tmp_path / "suite.yaml"), agent="reference", workers=1)
    store = Store(home)

    class ProcessGrades(LocalStages):
        def grade(self, task):
            return self.grades.submit(run_in, pool, task)

    with worker_processes(1) as pool, ThreadPoolExecutor(2) as draws, ThreadPoolExecutor(1) as grades:
        worker_s_own = pool.submit(current).result()
        assert (worker_s_own.sandbox, worker_s_own.unsafe_no_sandbox) == ("rlimits", False)
        with using(edge):
            prepared = prepare_run(config, store)
        summary = execute(prepared, config, store, Shell(stages=lambda _: nullcontext(ProcessGrades(draws, grades))),
                          machine=edge)
    _reset()
    assert summary.sandbox == "bwrap"
    assert summary.pass_at_k["1"] == 1.0, store.samples.commonest_detail(summary.run_id, "error")


def _settings_reads(tree: ast.AST, resolve) -> list[int]:
    """The lines of `tree` that read a machine or run setting's variable from the environment
    (`os.environ[...]`, `.get`, `os.getenv`), or hand the whole environment to a settings parser."""
    def environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found = []
    for node in ast.walk(tree):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Subscript) and environ(node.value):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (node.func.attr in ("get", "pop", "setdefault") and environ(node.func.value)) or node.func.attr == "getenv":
                keys = node.args[:1]
        if isinstance(node, ast.Call) and any(environ(arg) for arg in node.args):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("from_environ", "env_overrides", "_parsed"):
                found.append(node.lineno)
        for key in keys:
            value = key.value if isinstance(key, ast.Constant) else resolve(key.id) if isinstance(key, ast.Name) else None
            if value in SETTINGS_VARIABLES:
                found.append(node.lineno)
    return found


def test_no_code_under_tasks_reads_a_setting_from_the_environment():
    """Settings are read at the edge (the CLI's main, the flows, the Python API) and carried;
    under tasks/ only `tasks.settings.current`, for code entered by no edge, reads them."""
    import importlib

    planted = ast.parse("import os\nfrom tasks.sandbox.policy import MODE_ENV\nos.environ.get(MODE_ENV)\n"
                        "os.environ['EVALPIPE_HOME']\nos.getenv('EVALPIPE_PLUGINS')\nos.environ.get('PATH')\n"
                        "AgentSettings(**env_overrides(os.environ))\n")
    assert _settings_reads(planted, {"MODE_ENV": "EVALPIPE_SANDBOX"}.get) == [3, 4, 5, 7]  # the guard sees them
    found = []
    for path in sorted((ROOT / "tasks").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(name)
        lines = _settings_reads(ast.parse(path.read_text()), lambda n, m=module: getattr(m, n, None))
        if name == "tasks.settings":
            lines = lines[1:]  # `current`: code entered by no edge reads its own process's, once
        found += [f"{path.relative_to(ROOT)}:{line}" for line in lines]
    assert found == []


def test_bad_machine_settings_are_bad_input_naming_the_variable():
    from tasks.settings import MachineSettings

    assert MachineSettings.from_environ({}) == MachineSettings()
    read = MachineSettings.from_environ({MACHINE_ENV["sandbox"]: "rlimits", MACHINE_ENV["agent_env"]: "A, B_2",
                                         MACHINE_ENV["build_pass_env"]: "my_flag", MACHINE_ENV["plugins"]: "x.py,y"})
    assert (read.sandbox, read.agent_env, read.build_pass_env, read.plugins) == (
        "rlimits", ("A", "B_2"), frozenset({"MY_FLAG"}), ("x.py", "y"))
    for name, raw, message in (("sandbox", "bwrap", "expected auto or rlimits"),
                               ("agent_network", "none", "expected own or host"),
                               ("env_installer", "conda", "expected uv or pip"),
                               ("unsafe_no_sandbox", "yes", "expected 1 or 0"),
                               ("agent_env", "A-B", "'A-B' is not a variable name"),
                               ("judge_openai_max_attempts", "2.5", "is not a whole number")):
        with pytest.raises(InputError, match=MACHINE_ENV[name]) as raised:
            MachineSettings.from_environ({MACHINE_ENV[name]: raw})
        assert message in str(raised.value) and "\n" not in str(raised.value)
    done = subprocess.run([sys.executable, "-m", "flows.cli", "suite", "hash", "nothing.yaml"], cwd=ROOT,
                          env={**os.environ, MACHINE_ENV["agent_network"]: "none"}, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (2, "evalpipe: EVALPIPE_AGENT_NETWORK='none': expected own or host")
