"""mini-swe-agent (PyPI, on litellm), unchanged and in its own venv, as a `--workspace` coding agent
on examples/coding (#47 item 1, #44 item 5): no wrapper script. Its model is a scripted
OpenAI-compatible endpoint on loopback that answers with the bash tool calls mini-swe-agent
expects, then its submit command; the agent reaches it only through the run's gateway.

The venv is built from PyPI once per pinned version and kept under the user's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import duckdb
import pytest

from tasks.sandbox import policy as sandbox

ROOT = Path(__file__).resolve().parent.parent
MINI_SWE_AGENT = "2.4.6"
REAL_KEY = "sk-real-key-never-in-the-sandbox"
# The scripted model's bash actions, one per turn: look, fix, submit.
ACTIONS = ("cat calc.py", "sed -i 's/return abs(a) + b/return a + b/' calc.py",
           "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
TOKENS = (100, 7)  # what each of its answers reports: in, out


@pytest.fixture(scope="module")
def mini_venv() -> Path:
    """mini-swe-agent's venv, built with uv from PyPI under a folder named by the pinned version."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = cache / "evalpipe-tests" / f"mini-swe-agent-{MINI_SWE_AGENT}"
    if not (venv / "bin" / "mini").is_file():
        subprocess.run([sys.executable, "-m", "uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)
        subprocess.run([sys.executable, "-m", "uv", "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                        f"mini-swe-agent=={MINI_SWE_AGENT}"], check=True, timeout=600)
    return venv


class BashModel:
    """A chat-completions endpoint answering each turn with the next of `ACTIONS` as a `bash`
    tool call (the tool mini-swe-agent gives its model); it keeps each request's headers."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        model = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                model.seen.append({"auth": self.headers.get("Authorization"), "tools": body.get("tools")})
                turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
                action = ACTIONS[min(turn, len(ACTIONS) - 1)]
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
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_mini_swe_agent_in_its_own_venv_passes_examples_coding_in_a_workspace(mini_venv, tmp_path, monkeypatch):
    import evalpipe

    monkeypatch.delenv(sandbox.MODE_ENV, raising=False)
    sandbox._bwrap_problem.cache_clear()
    if not sandbox.bwrap_available():
        pytest.skip("bubblewrap does not run here")
    model = BashModel()
    monkeypatch.setenv("OPENAI_BASE_URL", model.url)
    monkeypatch.setenv("OPENAI_API_KEY", REAL_KEY)
    # mini-swe-agent's own settings, passed into the sandbox by name: no first-run set-up
    # prompt, no price for a model litellm does not know, litellm's price map from its package.
    monkeypatch.setenv("MSWEA_CONFIGURED", "true")
    monkeypatch.setenv("MSWEA_COST_TRACKING", "ignore_errors")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("EVALPIPE_AGENT_ENV", "MSWEA_CONFIGURED,MSWEA_COST_TRACKING,LITELLM_LOCAL_MODEL_COST_MAP")
    monkeypatch.chdir(ROOT)
    home = tmp_path / "home"
    agent = f"cmd:{mini_venv}/bin/mini -y --exit-immediately -m openai/scripted-coder -t {{task}}"
    try:
        run = evalpipe.evaluate("examples/coding/calc.yaml", agent, n=1, workspace=True, home=home)
    finally:
        model.close()
    assert run.status_counts == {"passed": 1}, _detail(home, run.run_id)
    # Every call came through the gateway with the sample's token, never the real key.
    assert len(model.seen) == len(ACTIONS) and all(s["tools"][0]["function"]["name"] == "bash" for s in model.seen)
    assert all(s["auth"] == f"Bearer {REAL_KEY}" for s in model.seen)  # the gateway's, upstream
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        (inp, out, trace), = con.execute("SELECT input_tokens, output_tokens, trace FROM samples WHERE run_id = ?",
                                         [run.run_id]).fetchall()
    assert (inp, out) == (TOKENS[0] * len(ACTIONS), TOKENS[1] * len(ACTIONS))
    assert REAL_KEY not in trace
    shown = subprocess.run([sys.executable, "-m", "flows.cli", "runs", "show", run.run_id, "--case", "add-bug"],
                           cwd=ROOT, env={**os.environ, "EVALPIPE_HOME": str(home)}, capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    for action in ACTIONS:
        assert action in shown.stdout, shown.stdout


def _detail(home: Path, run_id: str) -> str:
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT status, detail, trace FROM samples WHERE run_id = ?", [run_id]).fetchall()
    return "\n".join(f"{s}: {d}\n{json.loads(t).get('agent_run')}" for s, d, t in rows)
