"""mini-swe-agent (PyPI, on litellm), unchanged and in its own venv, as a `--workspace` coding agent
on examples/coding and on a suite mined from a repository built here (#47 item 1, #44 item 5):
no wrapper script. Its model is a scripted OpenAI-compatible endpoint on loopback that answers
with the bash tool calls mini-swe-agent expects, then its submit command; the agent reaches it
only through the run's gateway.

The venv is built from PyPI once per pinned version and kept under the user's cache."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import duckdb
import git
import pytest
import yaml
from support.cli import in_process
from support.git_repos import commit
from support.waiting import serve_in_background

from tasks.agents.gateway import TOKEN_PREFIX
from tasks.sandbox import policy as sandbox
from tasks.suites.dataset import load_suite

ROOT = Path(__file__).resolve().parent.parent
MINI_SWE_AGENT = "2.4.6"
REAL_KEY = "sk-real-key-never-in-the-sandbox"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# The scripted model's bash actions on examples/coding, one per turn: look, fix, submit.
ACTIONS = ("cat calc.py", "sed -i 's/return abs(a) + b/return a + b/' calc.py", SUBMIT)
TOKENS = (100, 7)  # what each of its answers reports: in, out
AGENT = "cmd:{venv}/bin/mini -y --exit-immediately -m openai/scripted-coder -t {{task}}"

# The mined repository: `sub` is right, a later commit breaks it (no test: not a candidate),
# the next fixes it with the test that shows it: the one case the miner keeps.
CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
CALC_BROKEN = CALC.replace("return a - b", "return b - a")
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
TESTS_SUB = TESTS.replace("import add", "import add, sub") + "\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"
# On the mined case the agent also prints the key it was given: the endpoint, which sees every
# observation, must see the sample's token there, never the real key.
MINED_ACTIONS = ("cat calc.py", "printenv OPENAI_API_KEY", "sed -i 's/return b - a/return a - b/' calc.py", SUBMIT)


@pytest.fixture(scope="module")
def mini_venv() -> Path:
    """mini-swe-agent's venv, built with uv from PyPI under a folder named by the pinned version,
    its modules compiled as the recipe says (docs/agents.md): the workspace mounts the venv
    read-only, where each run compiled litellm afresh (9.5 s of CPU a run, 4.5 s of it that)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = cache / "evalpipe-tests" / f"mini-swe-agent-{MINI_SWE_AGENT}-compiled"
    if not (venv / "bin" / "mini").is_file():
        subprocess.run([sys.executable, "-m", "uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)
        subprocess.run([sys.executable, "-m", "uv", "pip", "install", "-q", "--compile-bytecode", "--python",
                        str(venv / "bin" / "python"), f"mini-swe-agent=={MINI_SWE_AGENT}"], check=True, timeout=600)
    return venv


@pytest.fixture
def workspace_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workspace runs in bubblewrap, as a user's does; mini-swe-agent's own settings are
    passed into it by name: no first-run set-up prompt, no price for a model litellm does not
    know, litellm's price map from its package."""
    monkeypatch.delenv(sandbox.MODE_ENV, raising=False)
    sandbox._bwrap_problem.cache_clear()
    if not sandbox.bwrap_available():
        pytest.skip("bubblewrap does not run here")
    monkeypatch.setenv("OPENAI_API_KEY", REAL_KEY)
    monkeypatch.setenv("MSWEA_CONFIGURED", "true")
    monkeypatch.setenv("MSWEA_COST_TRACKING", "ignore_errors")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("EVALPIPE_AGENT_ENV", "MSWEA_CONFIGURED,MSWEA_COST_TRACKING,LITELLM_LOCAL_MODEL_COST_MAP")
    monkeypatch.chdir(ROOT)


class BashModel:
    """A chat-completions endpoint answering each turn with the next of `actions` as a `bash`
    tool call (the tool mini-swe-agent gives its model), the last one again once they run out;
    it keeps each request's Authorization header, tools and raw body."""

    def __init__(self, actions: tuple[str, ...]) -> None:
        self.seen: list[dict] = []
        model = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                body = json.loads(raw)
                model.seen.append({"auth": self.headers.get("Authorization"), "tools": body.get("tools"),
                                   "body": raw.decode()})
                turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
                action = actions[min(turn, len(actions) - 1)]
                reply = {
                    "id": f"c{turn}", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                        "role": "assistant", "content": f"Step {turn + 1}: I run `{action}`.",
                        "tool_calls": [{"id": f"call{turn}", "type": "function",
                                        "function": {"name": "bash", "arguments": json.dumps({"command": action})}}],
                    }}],
                    "usage": {"prompt_tokens": TOKENS[0], "completion_tokens": TOKENS[1],
                              "total_tokens": sum(TOKENS)},
                }
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        serve_in_background(self.server)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _run(suite: str, actions: tuple[str, ...], venv: Path, home: Path, monkeypatch: pytest.MonkeyPatch,
         seed: int = 0):
    """One sample of mini-swe-agent on `suite` in a workspace, its model answering `actions`:
    (the run's summary, the model's record of what it was sent)."""
    import evalpipe

    model = BashModel(actions)
    monkeypatch.setenv("OPENAI_BASE_URL", model.url)
    try:
        run = evalpipe.evaluate(suite, AGENT.format(venv=venv), n=1, seed=seed, workspace=True, home=home)
    finally:
        model.close()
    return run, model


def _assert_recorded(model: BashModel, home: Path, run_id: str, case: str, actions: tuple[str, ...]) -> None:
    """Every call came through the gateway with the sample's token: the endpoint got the real
    key only in the gateway's own header, never in what the agent sent; the sample's tokens
    are what the endpoint reported; the stored trace holds no key; `runs show --case` shows
    each bash step."""
    assert len(model.seen) == len(actions) and all(s["tools"][0]["function"]["name"] == "bash" for s in model.seen)
    assert all(s["auth"] == f"Bearer {REAL_KEY}" for s in model.seen)  # the gateway's, upstream
    assert not any(REAL_KEY in s["body"] for s in model.seen)
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        (inp, out), = con.execute("SELECT input_tokens, output_tokens FROM samples WHERE run_id = ?",
                                  [run_id]).fetchall()
    assert (inp, out) == (TOKENS[0] * len(actions), TOKENS[1] * len(actions))
    assert REAL_KEY not in _trace(home, run_id)
    shown = in_process(["runs", "show", run_id, "--case", case], {**os.environ, "EVALPIPE_HOME": str(home)})
    assert shown.returncode == 0, shown.stderr
    for action in actions:
        assert action in shown.stdout, shown.stdout


@pytest.mark.slow
def test_mini_swe_agent_in_its_own_venv_passes_examples_coding_in_a_workspace(
        mini_venv, workspace_sandbox, tmp_path, monkeypatch):
    home = tmp_path / "home"
    run, model = _run("examples/coding/calc.yaml", ACTIONS, mini_venv, home, monkeypatch)
    assert run.status_counts == {"passed": 1}, _detail(home, run.run_id)
    _assert_recorded(model, home, run.run_id, "add-bug", ACTIONS)


@pytest.fixture(scope="module")
def mined(tmp_path_factory: pytest.TempPathFactory, prefect_harness) -> tuple[Path, Path]:
    """A repository whose history breaks `sub` and then fixes it with a test, mined into a
    suite by `evalpipe suite mine` (the environment from pytest's wheels in the repository, so
    it builds offline): (the suite file, the home that built its environment)."""
    spec = importlib.util.spec_from_file_location("build_pricing", ROOT / "examples/pricing/build_repo.py")
    pricing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pricing)
    work = tmp_path_factory.mktemp("mined-for-mini")
    repo = git.Repo.init(work / "calc", initial_branch="main")
    wheels = {f"vendor/{name}": data for name, data in map(pricing.wheel_of_installed, pricing.PYTEST_DISTS)}
    for name, data in wheels.items():
        (work / "calc" / name).parent.mkdir(exist_ok=True)
        (work / "calc" / name).write_bytes(data)
    repo.index.add(sorted(wheels))
    commit(repo, {"calc.py": CALC, "tests/test_calc.py": TESTS}, "calc")
    commit(repo, {"calc.py": CALC_BROKEN}, "Tidy sub")
    commit(repo, {"calc.py": CALC, "tests/test_calc.py": TESTS_SUB}, "Fix sub: sub(5, 3) returned -2, not 2")
    environment = work / "env.yaml"
    environment.write_text(yaml.safe_dump({"install": [
        "pip install --no-index --find-links vendor " + " ".join(pricing.PYTEST_DISTS)]}))
    suite, home = work / "mined.yaml", work / "home"
    done = in_process(["suite", "mine", str(work / "calc"), "--out", str(suite), "--environment", str(environment)],
                      {**os.environ, "PREFECT_API_URL": prefect_harness, "EVALPIPE_HOME": str(home)})
    assert done.returncode == 0, done.stderr
    return suite, home


@pytest.mark.slow
def test_mini_swe_agent_fixes_a_case_mined_from_a_repository_s_history(
        mini_venv, workspace_sandbox, mined, monkeypatch):
    suite, home = mined
    (case,) = load_suite(suite).cases
    assert case.grader["fail_to_pass"] == ["tests/test_calc.py::test_sub"]  # the miner's own grader
    run, model = _run(str(suite), MINED_ACTIONS, mini_venv, home, monkeypatch)
    assert run.status_counts == {"passed": 1}, _detail(home, run.run_id)
    assert _detail(home, run.run_id).startswith("passed: 1 FAIL_TO_PASS and 1 PASS_TO_PASS tests passed")
    _assert_recorded(model, home, run.run_id, case.id, MINED_ACTIONS)
    # The agent printed the key in its environment: the endpoint saw the sample's token there,
    # and the stored trace holds neither.
    printed = json.loads(model.seen[2]["body"])["messages"][-1]["content"]
    (token,) = re.findall(re.escape(TOKEN_PREFIX) + r"[\w-]+", printed)
    assert token not in _trace(home, run.run_id)


@pytest.mark.slow
def test_mini_swe_agent_that_does_not_fix_the_mined_case_fails_it(mini_venv, workspace_sandbox, mined, monkeypatch):
    """The same agent, its model scripted not to fix the bug. New seeds: a stored sample of the
    same agent would be reused, its scripted model never asked."""
    suite, home = mined
    # An edit that leaves the bug: the repository's own test fails it.
    wrong = ("cat calc.py", "sed -i 's/return b - a/return -(a - b)/' calc.py", SUBMIT)
    run, model = _run(str(suite), wrong, mini_venv, home, monkeypatch, seed=1)
    assert run.status_counts == {"failed": 1}, _detail(home, run.run_id)
    assert _detail(home, run.run_id).startswith("failed: FAIL_TO_PASS failed: tests/test_calc.py::test_sub (failed)")
    assert len(model.seen) == len(wrong)
    # Submitting at once changes nothing: an empty patch, a failure too.
    run, model = _run(str(suite), (SUBMIT,), mini_venv, home, monkeypatch, seed=2)
    assert run.status_counts == {"empty": 1}, _detail(home, run.run_id)
    assert len(model.seen) == 1


def _trace(home: Path, run_id: str) -> str:
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        (trace,), = con.execute("SELECT trace FROM samples WHERE run_id = ?", [run_id]).fetchall()
    return trace


def _detail(home: Path, run_id: str) -> str:
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT status, detail, trace FROM samples WHERE run_id = ?", [run_id]).fetchall()
    return "\n".join(f"{s}: {d}\n{json.loads(t).get('agent_run')}" for s, d, t in rows)
