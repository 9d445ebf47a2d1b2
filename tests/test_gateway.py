"""The model gateway's limits where the money is spent (issue #44, item 3): a sample's spending
cap refuses the call that would pass it, calls in flight across the run are capped, and an
upstream 429 or 5xx is retried after the pause it asks for, each attempt in the trajectory.
A real gateway, the real OpenAI SDK as the agent's client, a stdlib server as the endpoint."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
import yaml
from support.waiting import serve_in_background

import evalpipe
from storage.store import Store
from tasks.agents.gateway import Gateway
from tasks.run import RunConfig
from tasks.trace import SampleTrace

ROOT = Path(__file__).resolve().parent.parent
CODING = ROOT / "examples" / "coding" / "calc.yaml"
REPLY = {"id": "c", "object": "chat.completion", "model": "m", "created": 0,
         "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
         "usage": {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100}}


class Endpoint:
    """A chat completions endpoint that first answers each status of `failures` (with the
    `Retry-After` of `retry_after`), then REPLY after `delay_s`; it counts requests and the most
    it held at once."""

    def __init__(self, failures: tuple[int, ...] = (), retry_after: str | None = None, delay_s: float = 0.0):
        self.failures, self.retry_after, self.delay_s = list(failures), retry_after, delay_s
        self.requests, self.now, self.most = 0, 0, 0
        self.times: list[float] = []
        self.lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with endpoint.lock:
                    endpoint.requests += 1
                    endpoint.times.append(time.monotonic())
                    endpoint.now += 1
                    endpoint.most = max(endpoint.most, endpoint.now)
                    status = endpoint.failures.pop(0) if endpoint.failures else 200
                time.sleep(endpoint.delay_s)
                with endpoint.lock:  # done before it answers: the caller can free its slot only after
                    endpoint.now -= 1
                body = json.dumps(REPLY if status == 200 else {"error": {"message": "slow down"}}).encode()
                self.send_response(status)
                if status != 200 and endpoint.retry_after is not None:
                    self.send_header("Retry-After", endpoint.retry_after)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> Endpoint:
        serve_in_background(self.server)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _client(gateway: Gateway, token: str) -> openai.OpenAI:
    # No retries of the SDK's own: what is retried here is the gateway's doing.
    return openai.OpenAI(base_url=gateway.url, api_key=token, max_retries=0)


def _ask(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return reply.choices[0].message.content


def test_a_429_is_retried_after_the_pause_it_asks_for_and_each_attempt_is_in_the_trajectory():
    with Endpoint(failures=(429, 503), retry_after="0.3") as endpoint:
        gateway = Gateway(endpoint.url, "sk-real", timeout_s=10, max_attempts=3)
        try:
            token, tap = gateway.grant()
            assert _ask(_client(gateway, token)) == "ok"
        finally:
            gateway.close()
    assert endpoint.requests == 3
    assert all(b - a >= 0.3 for a, b in zip(endpoint.times, endpoint.times[1:], strict=False))  # Retry-After held
    notes = [e["note"] for e in tap.entries if "note" in e]
    assert notes == ["endpoint answered 429 on attempt 1 of 3; retried after 0.30 s",
                     "endpoint answered 503 on attempt 2 of 3; retried after 0.30 s"]
    assert (tap.calls, tap.input_tokens, tap.output_tokens) == (1, 1000, 100)


def test_a_status_not_worth_retrying_is_answered_at_once_and_attempts_end():
    with Endpoint(failures=(400,)) as endpoint:
        gateway = Gateway(endpoint.url, "sk-real", timeout_s=10, max_attempts=5)
        try:
            token, tap = gateway.grant()
            with pytest.raises(openai.BadRequestError):
                _ask(_client(gateway, token))
        finally:
            gateway.close()
    assert endpoint.requests == 1
    with Endpoint(failures=(500, 500, 500)) as endpoint:
        gateway = Gateway(endpoint.url, "sk-real", timeout_s=10, max_attempts=2)
        try:
            token, tap = gateway.grant()
            with pytest.raises(openai.InternalServerError):
                _ask(_client(gateway, token))
        finally:
            gateway.close()
    assert endpoint.requests == 2  # --openai-max-attempts 2: the first and one retry
    assert tap.entries[-1]["error"] == "HTTP 500 from the endpoint"


def test_model_concurrency_caps_the_calls_in_flight_across_samples():
    with Endpoint(delay_s=0.3) as endpoint:
        gateway = Gateway(endpoint.url, "sk-real", timeout_s=10, max_attempts=1, concurrency=2)
        try:
            clients = [_client(gateway, gateway.grant()[0]) for _ in range(6)]
            answers: list[str] = []
            threads = [threading.Thread(target=lambda c=c: answers.append(_ask(c))) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        finally:
            gateway.close()
    assert answers == ["ok"] * 6
    assert endpoint.most == 2 and gateway.most_in_flight == 2


def test_the_sample_cost_cap_refuses_the_call_that_would_pass_it():
    with Endpoint() as endpoint:
        gateway = Gateway(endpoint.url, "sk-real", timeout_s=10)
        try:
            token, tap = gateway.grant(max_cost_usd=0.025, cost_of=lambda model, i, o: 0.01)
            client = _client(gateway, token)
            assert [_ask(client), _ask(client)] == ["ok", "ok"]
            with pytest.raises(openai.PermissionDeniedError, match=r"--max-sample-cost \$0.025"):
                _ask(client)
        finally:
            gateway.close()
    assert endpoint.requests == 2
    assert tap.stop_reason() == ("stopped at --max-sample-cost $0.025 ($0.020000 spent): the agent asked for 1"
                                 " more model call(s), refused")


def test_an_unpriced_model_says_the_cost_cap_cannot_count_it():
    with Endpoint() as endpoint:
        gateway = Gateway(endpoint.url, "sk-real", timeout_s=10)
        try:
            token, tap = gateway.grant(max_cost_usd=0.01, cost_of=lambda model, i, o: None)
            client = _client(gateway, token)
            assert [_ask(client), _ask(client)] == ["ok", "ok"]
        finally:
            gateway.close()
    assert [e["note"] for e in tap.entries if "note" in e] == [
        "no price for model 'm': --max-sample-cost cannot count this sample's calls"]


def test_each_cap_is_a_run_option_with_its_documented_variable():
    given = RunConfig.build("run", suite="s", agent="reference", environ={}, max_sample_cost=0.5,
                            model_concurrency=3).agent_settings
    assert (given.max_sample_cost, given.model_concurrency) == (0.5, 3)
    env = {"EVALPIPE_MAX_SAMPLE_COST": "0.25", "EVALPIPE_MODEL_CONCURRENCY": "4", "EVALPIPE_MAX_MODEL_CALLS": "7"}
    built = RunConfig.build("run", suite="s", agent="reference", environ=env).agent_settings
    assert (built.max_sample_cost, built.model_concurrency, built.max_model_calls) == (0.25, 4, 7)


CALLING_AGENT = """
import json, os, sys
import openai
client = openai.OpenAI(max_retries=0)
for i in range(int(sys.argv[1])):  # calls to make
    try:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"call {i}"}])
    except openai.PermissionDeniedError as exc:
        print("refused:", exc.message, file=sys.stderr)
        sys.exit(1)
print(json.dumps({"key": os.environ["OPENAI_API_KEY"], "base": os.environ["OPENAI_BASE_URL"]}))
"""


def calling_agent(tmp_path: Path, calls: int) -> str:
    """A `cmd:` agent (its own OpenAI client) making `calls` calls; it prints the key and endpoint it held."""
    agent = tmp_path / "agents" / "calling.py"
    agent.parent.mkdir(exist_ok=True)
    agent.write_text(CALLING_AGENT)
    return f"cmd:{sys.executable} {agent} {calls}"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_runaway_workspace_agent_is_stopped_at_its_sample_cost(tmp_path, monkeypatch):
    """`--max-sample-cost` priced by the run's price file: 1,000 input and 100 output tokens
    at $4 and $20 per million are $0.006 a call, so a $0.015 cap lets two calls out of 50."""
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"m": {"input_per_mtok": 4.0, "output_per_mtok": 20.0}}))
    with Endpoint() as endpoint:
        monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-real")
        run = evalpipe.evaluate(str(CODING), calling_agent(tmp_path, 50), n=1, home=tmp_path / "home",
                                workspace=True, max_sample_cost=0.015, prices=str(prices))
    assert endpoint.requests == 2
    (row,) = Store(tmp_path / "home").samples.of_run(run.run_id).to_pylist()
    assert row["status"] == "agent_error"
    assert row["detail"] == ("agent failed: stopped at --max-sample-cost $0.015 ($0.012000 spent): the agent asked"
                             " for 1 more model call(s), refused")
    assert "--max-sample-cost $0.015 (" in SampleTrace.parse(row["trace"]).agent_run.stderr_tail
    assert row["cost_usd"] == pytest.approx(0.012)


def test_a_cmd_agent_s_calls_go_through_the_gateway_recorded_capped_and_without_the_key(tmp_path, monkeypatch):
    """Outside a workspace too (issue 44, item 2): a `cmd:` agent's environment names the
    gateway and a token of its sample's, its calls are its trajectory and its tokens the
    endpoint's, and `--max-model-calls` stops it with no more calls upstream."""
    cases = [{"id": "c", "inputs": {}, "reference": "evalpipe-sample-", "grader": {"kind": "contains"}}]
    with Endpoint() as endpoint:
        monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-real-key")
        run = evalpipe.evaluate(cases, calling_agent(tmp_path, 5), home=tmp_path / "home")
        assert endpoint.requests == 5
        (row,) = Store(tmp_path / "home").samples.of_run(run.run_id).to_pylist()
        seen = json.loads(row["output"])
        assert seen["key"].startswith("evalpipe-sample-") and seen["base"].startswith("http://127.0.0.1:")
        assert "sk-real-key" not in row["output"]
        turns = SampleTrace.parse(row["trace"]).trajectory.typed.turns
        assert [t.content for t in turns] == ["ok"] * 5
        assert (row["input_tokens"], row["output_tokens"]) == (5000, 500)

        capped_run = evalpipe.evaluate(cases, calling_agent(tmp_path, 5), home=tmp_path / "home",
                                       max_model_calls=2, seed=1)
        assert endpoint.requests == 5 + 2
    (row,) = Store(tmp_path / "home").samples.of_run(capped_run.run_id).to_pylist()
    assert row["status"] == "agent_error"
    assert row["detail"] == ("agent failed: stopped at --max-model-calls 2: the agent asked for 1 more model"
                             " call(s), refused")


WORKER_AGENT = """
import os
import openai

CLIENT = openai.OpenAI(max_retries=0)  # made once, at import: the worker's key for its whole life


def solve(inputs, ctx):
    for i in range(inputs["calls"]):
        CLIENT.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{ctx.case_id} {i}"}])
    return os.environ["OPENAI_API_KEY"][:16] + " " + str(os.getpid())
"""


def test_a_persistent_worker_s_calls_are_each_sample_s_through_its_lease(tmp_path, monkeypatch):
    """`pyworker:` (issue 44 item 2, #47 item 1): a worker's environment holds one gateway token
    for its life, granted to each sample it draws in turn, so every sample's calls are its own
    trajectory and tokens, caps included; never the real key."""
    (tmp_path / "agent.py").write_text(WORKER_AGENT)
    cases = [{"id": f"c{calls}", "inputs": {"calls": calls}, "reference": "evalpipe-sample-",
              "grader": {"kind": "contains"}} for calls in (1, 2, 3)]
    spec = f"pyworker:{tmp_path / 'agent.py'}:solve"
    with Endpoint() as endpoint:
        monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-real-key")
        run = evalpipe.evaluate(cases, spec, home=tmp_path / "home", agent_concurrency=1)
        capped_run = evalpipe.evaluate(cases, spec, home=tmp_path / "home", agent_concurrency=1, seed=1,
                                       max_model_calls=2)
    assert endpoint.requests == 6 + 1 + 2 + 2  # the capped run: c1's one, c2's two, c3's first two
    rows = {r["case_id"]: r for r in Store(tmp_path / "home").samples.of_run(run.run_id).to_pylist()}
    assert {r["status"] for r in rows.values()} == {"passed"}
    assert len({r["output"].split()[1] for r in rows.values()}) == 1  # one worker drew the three
    for calls, cid in enumerate(("c1", "c2", "c3"), start=1):
        turns = SampleTrace.parse(rows[cid]["trace"]).trajectory.typed.turns
        assert len(turns) == calls, cid
        assert (rows[cid]["input_tokens"], rows[cid]["output_tokens"]) == (1000 * calls, 100 * calls)
    capped = {r["case_id"]: r for r in Store(tmp_path / "home").samples.of_run(capped_run.run_id).to_pylist()}
    assert capped["c3"]["status"] == "agent_error"
    assert capped["c3"]["detail"].startswith("agent failed: stopped at --max-model-calls 2")
    assert capped["c2"]["status"] == "passed"


def test_a_streamed_responses_call_through_the_gateway_counts_its_tokens():
    """The Responses API streamed (the Agents SDK's default): the last event holds the whole
    answer, its usage and its function calls, which the sample's tap records."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scripted_responses",
                                                  ROOT / "examples/agents_sdk/scripted_responses.py")
    scripted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scripted)
    with scripted.ScriptedResponses() as endpoint:
        gateway = Gateway(endpoint.url, "sk-real", timeout_s=10)
        try:
            token, tap = gateway.grant()
            client = _client(gateway, token)
            events = list(client.responses.create(model="support-good", input="Where is my order 1234?",
                                                  stream=True))
            final = events[-1].response
        finally:
            gateway.close()
    (used,) = endpoint.usage
    assert (tap.calls, tap.input_tokens, tap.output_tokens) == (1, used["input_tokens"], used["output_tokens"])
    (turn,) = [e for e in tap.entries if e.get("role") == "assistant"]
    assert [c["function"]["name"] for c in turn.get("tool_calls", [])] == [
        item.name for item in final.output if item.type == "function_call"]


IN_PROCESS_RUNAWAY = """
import asyncio
import openai


def solve(inputs, ctx):
    client = openai.OpenAI(max_retries=0)
    for i in range(50):
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"again {i}"}])
        except openai.PermissionDeniedError as exc:
            return "refused: " + exc.message
    return "never refused"


def solve_async(inputs, ctx):
    async def loop():
        client = openai.AsyncOpenAI(max_retries=0)
        for i in range(50):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"again {i}"}])
    asyncio.run(loop())  # raises the refusal: the sample fails as it would
    return "never refused"
"""


@pytest.mark.parametrize(("func", "caps", "calls", "cap"), [
    ("solve", {"max_model_calls": 3}, 3, "--max-model-calls 3"),
    ("solve_async", {"max_model_calls": 2}, 2, "--max-model-calls 2"),
    ("solve", {"max_sample_cost": 0.015}, 2, "--max-sample-cost $0.015 ($0.012000 spent)"),
])
def test_an_in_process_agent_s_call_past_a_cap_raises_before_anything_is_sent(tmp_path, monkeypatch, func, caps,
                                                                              calls, cap):
    """(issue 44, item 3) A python: agent's own SDK client, captured in process: the call past
    `--max-model-calls` or `--max-sample-cost` raises the SDK's 403 error and is never sent; the
    sample is agent_error naming the cap."""
    pytest.importorskip("openinference.instrumentation.openai")
    (tmp_path / "runaway.py").write_text(IN_PROCESS_RUNAWAY)
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"m": {"input_per_mtok": 4.0, "output_per_mtok": 20.0}}))
    cases = [{"id": "c", "inputs": {}, "reference": "x", "grader": {"kind": "contains"}}]
    with Endpoint() as endpoint:
        monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-real")
        run = evalpipe.evaluate(cases, f"python:{tmp_path / 'runaway.py'}:{func}", home=tmp_path / "home",
                                prices=str(prices), **caps)
    assert endpoint.requests == calls
    (row,) = Store(tmp_path / "home").samples.of_run(run.run_id).to_pylist()
    assert row["status"] == "agent_error"
    assert row["detail"].startswith(f"agent failed: stopped at {cap}: the agent asked for 1 more model call(s)")
    assert len(SampleTrace.parse(row["trace"]).trajectory.typed.turns) == calls
    assert (row["input_tokens"], row["output_tokens"]) == (1000 * calls, 100 * calls)


def test_the_run_s_max_cost_refuses_the_call_that_would_pass_it_and_no_sample_starts_after(tmp_path, monkeypatch):
    """`--max-cost` where the money is spent (issue 44, item 3): the run's priced calls, all its
    samples', are counted as they are answered; the call that would pass the budget (at the
    dearest call so far) is refused, and no new sample starts. $0.006 a call, $0.015: the first
    sample's third call is refused; the other two samples are left undrawn (the run partial)."""
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"m": {"input_per_mtok": 4.0, "output_per_mtok": 20.0}}))
    cases = [{"id": f"c{i}", "inputs": {}, "reference": "evalpipe-sample-", "grader": {"kind": "contains"}}
             for i in range(3)]
    with Endpoint() as endpoint:
        monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-real")
        run = evalpipe.evaluate(cases, calling_agent(tmp_path, 3), home=tmp_path / "home",
                                agent_concurrency=1, max_cost=0.015, prices=str(prices))
    assert endpoint.requests == 2
    (row,) = Store(tmp_path / "home").samples.of_run(run.run_id).to_pylist()
    assert row["status"] == "agent_error"
    assert row["detail"] == ("agent failed: stopped at --max-cost $0.015 ($0.012000 spent by the run's calls): the"
                             " agent asked for 1 more model call(s), refused")
    assert run.partial and run.undrawn_samples == 2
    assert run.budget.stopped == "--max-cost $0.015 ($0.012000 spent by the run's calls)"
    assert run.budget.spent_usd == pytest.approx(0.012)


KEY_HUNTER = """
import json, os, pathlib, time
KEY = ("sk-real-" + "secret").encode()  # not the key's bytes in this file
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            if KEY in pathlib.Path(f"/proc/{pid}/environ").read_bytes():
                found.append(f"/proc/{pid}/environ")
        except OSError:
            pass
for root in (pathlib.Path.cwd(), pathlib.Path.home(), pathlib.Path("/tmp")):
    for path in root.rglob("*"):
        try:
            if path.is_file() and KEY in path.read_bytes():
                found.append(str(path))
        except OSError:
            pass
pathlib.Path("FOUND.md").write_text(json.dumps(found) + "\\n")
time.sleep(3)  # while the test reads this process's environment from outside
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_no_sandboxed_process_holds_the_real_key(tmp_path, monkeypatch):
    """(issue 44 target) The real key is in no environment of a process in the agent's sandbox
    (read from /proc outside, while it runs, and inside), nor in the files it sees."""
    import threading

    agent = tmp_path / "agents" / "hunter.py"
    agent.parent.mkdir()
    agent.write_text(KEY_HUNTER)
    seen: list[bytes] = []
    done = threading.Event()

    def watch() -> None:  # the sample's processes, found by the case id evalpipe gives them
        while not done.is_set():
            for entry in Path("/proc").iterdir():
                try:
                    environ = (entry / "environ").read_bytes()
                except OSError:
                    continue
                if b"EVALPIPE_CASE_ID=" in environ and b"EVALPIPE_WORKSPACE=" in environ:
                    seen.append(environ)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with Endpoint() as endpoint:
        monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-real-secret")
        try:
            run = evalpipe.evaluate(str(CODING), f"cmd:{sys.executable} {agent}", n=1, home=tmp_path / "home",
                                    workspace=True)
        finally:
            done.set()
            watcher.join(10)
    (row,) = Store(tmp_path / "home").samples.of_run(run.run_id).to_pylist()
    assert '+[]' in row["output"], row["output"][:500]  # FOUND.md, as the agent wrote it: nothing found inside
    assert seen, "the sample's processes were never seen from outside"
    assert not [e for e in seen if b"sk-real-secret" in e]
    assert all(b"OPENAI_API_KEY=evalpipe-sample-" in e for e in seen)


def test_a_stream_that_stalls_past_the_timeout_is_cut_and_recorded():
    """(issue 44, hostile agents and endpoints) An answer that stops arriving is cut at
    `--openai-timeout`: the agent's connection ends, and the sample's trajectory says so."""
    release = threading.Event()

    class Stalling(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunk = {"model": "m", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            release.wait(10)  # then nothing more

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    server.daemon_threads = True
    serve_in_background(server)
    gateway = Gateway(f"http://127.0.0.1:{server.server_address[1]}/v1", "sk-real", timeout_s=1.0)
    try:
        token, tap = gateway.grant()
        started = time.monotonic()
        with pytest.raises(openai.APIError):
            stream = _client(gateway, token).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
            for _ in stream:
                pass
        assert time.monotonic() - started < 8
        deadline = time.monotonic() + 5
        while not tap.calls and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        release.set()
        gateway.close()
        server.shutdown()
        server.server_close()
    assert tap.entries[-1]["error"].startswith("the endpoint's answer stalled past --openai-timeout 1 s after ")
    assert tap.pending == 0 and tap.calls == 1


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_an_agent_in_another_language_needs_only_the_endpoint_its_environment_names(tmp_path, monkeypatch):
    """(issue 44, item 5) examples/agents/node_agent.mjs: Node.js, no package, no evalpipe code.
    Its call goes through the run's gateway: its turn and tokens are the sample's, the key stays out."""
    cases = [{"id": "q", "inputs": {"question": "Say ok"}, "reference": "ok", "grader": {"kind": "exact"}}]
    with Endpoint() as endpoint:
        monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-real")
        run = evalpipe.evaluate(cases, f"cmd:node {ROOT / 'examples/agents/node_agent.mjs'}", home=tmp_path / "home")
    assert endpoint.requests == 1
    (row,) = Store(tmp_path / "home").samples.of_run(run.run_id).to_pylist()
    assert (row["status"], row["output"]) == ("passed", "ok")
    (turn,) = SampleTrace.parse(row["trace"]).trajectory.typed.turns
    assert turn.content == "ok"
    assert (row["input_tokens"], row["output_tokens"]) == (1000, 100)
