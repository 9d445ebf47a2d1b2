"""The first hour of a new user (issue 34): every message the CLI prints is true and says
what went wrong — exit 4 quotes the agent's error, an agent that never answered is not said
to "not report usage", a partial run counts the samples it has, a patch reads as a diff."""

from __future__ import annotations

import json
import socket

import test_cache_levels
from test_cache_levels import cli
from test_usage import suite

env = test_cache_levels.env  # the fixture: a Prefect API, a fresh home, no price file


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
