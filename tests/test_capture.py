"""In-process capture (issue #44 items 1 and 5): a `python:` agent's own OpenAI SDK calls and an
OpenAI Agents SDK agent's tool calls recorded as its sample's trajectory and usage, with no
recording code in the agent, against scripted endpoints on loopback (examples/tools/scripted_model.py
for chat completions, examples/agents_sdk/scripted_responses.py for the Responses API)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import duckdb
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from support.waiting import serve_in_background

import evalpipe
from storage.store import Store
from tasks.agents.base import AgentContext
from tasks.agents.capture import captured
from tasks.report.case_view import case_doc, case_text
from tasks.trace import SampleTrace

ROOT = Path(__file__).resolve().parents[1]
OWN_CLIENT = f"python:{ROOT / 'tests/support/own_client_agent.py'}:answer"
SDK_SUITE = ROOT / "examples/agents_sdk/support.yaml"
SDK_AGENT = f"python:{ROOT / 'examples/agents_sdk/support_agent.py'}:answer"


def _module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scripted = _module("scripted_model", "examples/tools/scripted_model.py")
responses_api = _module("scripted_responses", "examples/agents_sdk/scripted_responses.py")


@pytest.fixture
def endpoints(monkeypatch):
    with scripted.ScriptedModel() as chat, responses_api.ScriptedResponses() as responses:
        monkeypatch.setenv("CHAT_URL", chat.url)
        monkeypatch.setenv("RESPONSES_URL", responses.url)
        yield chat, responses


def _samples(home: Path, run_id: str) -> dict[str, dict]:
    rows = Store(home).samples.of_run(run_id).to_pylist()
    return {r["case_id"]: dict(r, trace=SampleTrace.parse(r["trace"])) for r in rows}


def _question(body: dict) -> str:
    first = (body.get("messages") or body.get("input"))[0]
    return first["content"]


# Each loop asks one question whose script is one tool call, then the answer.
QUESTIONS = {"weather in Paris": "get_weather", "order 1042?": "get_order",
             "reset my password": "search_kb", "convert 100 USD to EUR": "convert_currency"}


def test_an_agents_own_client_calls_are_its_trajectory_and_its_tokens_to_the_token(endpoints, tmp_path):
    chat, responses = endpoints
    cases = []
    for api in ("chat", "responses"):
        for (client, stream), question in zip(
                [("sync", False), ("sync", True), ("async", False), ("async", True)], QUESTIONS, strict=True):
            cases.append({"id": f"{api}-{client}-{'stream' if stream else 'whole'}",
                          "inputs": {"api": api, "client": client, "stream": stream, "question": question},
                          "reference": "", "grader": {"kind": "contains"}})
    run = evalpipe.evaluate(cases, OWN_CLIENT, n=1, home=tmp_path)
    samples = _samples(tmp_path, run.run_id)
    assert {c: s["status"] for c, s in samples.items()} == {c["id"]: "passed" for c in cases}, [s["detail"] for s in samples.values()]

    # What each endpoint reported, by the question asked.
    told: dict[tuple[str, str], Counter] = {}
    for body in chat.requests:
        u = scripted.reply(body)["usage"]
        told.setdefault(("chat", _question(body)), Counter()).update(
            {"in": u["prompt_tokens"], "out": u["completion_tokens"], "calls": 1})
    for body, u in zip(responses.requests, responses.usage, strict=True):
        told.setdefault(("responses", _question(body)), Counter()).update(
            {"in": u["input_tokens"], "out": u["output_tokens"], "calls": 1})
    for case in cases:
        sample, inputs = samples[case["id"]], case["inputs"]
        steps = sample["trace"].trajectory.typed
        want = told[(inputs["api"], inputs["question"])]
        assert want["calls"] == 2 and len(steps.turns) == 2, case["id"]
        assert (sample["input_tokens"], sample["output_tokens"]) == (want["in"], want["out"]), case["id"]
        assert sum(t.input_tokens for t in steps.turns) == want["in"]
        assert sample["usage_model"] == "support-good" and all(t.latency_s > 0 for t in steps.turns)
        (action,) = steps.actions()
        assert action.name == QUESTIONS[inputs["question"]] and action.result is not None, case["id"]
        assert action.result.content == sample["trace"].trajectory.entries[-2]["content"]
        assert steps.turns[-1].content == sample["output"] and sample["output"]

    # The run's usage is the endpoints' figures summed; `runs show --case` and `tool_calls` read them.
    assert run.usage.input_tokens == sum(c["in"] for c in told.values())
    assert run.usage.output_tokens == sum(c["out"] for c in told.values())
    text = case_text(case_doc(run.run_id, "responses-async-stream",
                              Store(tmp_path).samples.of_case(run.run_id, "responses-async-stream")))
    assert 'model: calls convert_currency({"amount": 100, "from": "USD", "to": "EUR"})' in text
    with duckdb.connect(str(tmp_path / "evalpipe.duckdb"), read_only=True) as con:
        calls = dict(con.execute("SELECT case_id, name FROM tool_calls WHERE run_id = ?", [run.run_id]).fetchall())
    assert calls == {c["id"]: QUESTIONS[c["inputs"]["question"]] for c in cases}


def test_samples_drawn_at_once_on_threads_are_not_mixed(endpoints, tmp_path):
    chat, _ = endpoints
    together = threading.Barrier(2, timeout=30)
    agent = _module("own_client_agent", "tests/support/own_client_agent.py")

    def both_in_flight(inputs, ctx):
        together.wait()  # both samples' calls are made while the other's are
        answer = agent.answer(inputs, ctx)
        together.wait()
        return answer

    cases = [{"id": f"q{i}", "inputs": {"api": "chat", "client": "sync", "stream": False, "question": q},
              "reference": "", "grader": {"kind": "contains"}} for i, q in enumerate(list(QUESTIONS)[:2])]
    run = evalpipe.evaluate(cases, both_in_flight, n=1, home=tmp_path, agent_concurrency=2)
    samples = _samples(tmp_path, run.run_id)
    for case in cases:
        entries = samples[case["id"]]["trace"].trajectory.entries
        asked = [e["content"] for e in entries if e.get("role") == "user"]
        assert asked == [case["inputs"]["question"]]
        assert [a.name for a in samples[case["id"]]["trace"].trajectory.typed.actions()] == [
            QUESTIONS[case["inputs"]["question"]]]
        told = [scripted.reply(b)["usage"]["prompt_tokens"] for b in chat.requests
                if _question(b) == case["inputs"]["question"]]
        assert samples[case["id"]]["input_tokens"] == sum(told)


def test_samples_on_asyncio_tasks_of_one_loop_are_not_mixed(endpoints):
    chat, _ = endpoints
    client = AsyncOpenAI(base_url=chat.url, api_key="sk-own-client")
    contexts = [AgentContext(case_id=f"q{i}", index=0, seed=0, n=1) for i in range(2)]
    gate = asyncio.Event()

    async def sample(ctx, question, calls):
        with captured(ctx):
            for _ in range(calls):
                await client.chat.completions.create(model="support-good",
                                                     messages=[{"role": "user", "content": question}])
                await gate.wait()

    async def main():
        tasks = [asyncio.create_task(sample(contexts[0], "weather in Paris", 1)),
                 asyncio.create_task(sample(contexts[1], "order 1042?", 3))]
        await asyncio.sleep(0.2)
        gate.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert [len(c.trace.trajectory.typed.turns) for c in contexts] == [1, 3]
    assert [c.trace.trajectory.entries[0]["content"] for c in contexts] == ["weather in Paris", "order 1042?"]


def test_an_agents_own_recorded_turns_win_and_the_capture_gives_its_usage(endpoints):
    chat, _ = endpoints
    ctx = AgentContext(case_id="c", index=0, seed=0, n=1)
    with captured(ctx):
        reply = OpenAI(base_url=chat.url, api_key="sk").chat.completions.create(
            model="support-good", messages=[{"role": "user", "content": "Say hello"}])
        ctx.record({"role": "assistant", "content": reply.choices[0].message.content})
    assert ctx.trace.trajectory.entries == [{"role": "assistant", "content": "Hello!"}]
    assert ctx.reported["input_tokens"] == reply.usage.prompt_tokens and ctx.reported["model"] == "support-good"


def test_an_agents_sdk_agent_with_two_function_tools_is_captured_and_graded_on_its_calls(monkeypatch, tmp_path):
    with responses_api.ScriptedResponses() as served:
        monkeypatch.setenv("OPENAI_BASE_URL", served.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-agents-sdk")
        run = evalpipe.evaluate(str(SDK_SUITE), SDK_AGENT, n=2, home=tmp_path)
    assert run.pass_at_k["1"] == 1.0
    rows = Store(tmp_path).samples.of_run(run.run_id).to_pylist()
    assert len(rows) == 6
    graders = Counter()
    for row in rows:
        trace = SampleTrace.parse(row["trace"])
        graders.update(g.label for g in trace.extra_graders if g.verdict.status.value == "passed")
        steps = trace.trajectory.typed
        assert len(steps.turns) == 2
        # Each function tool's span is a tool result answering its call, timed, once.
        for action in steps.actions():
            assert action.result is not None and action.result.duration_s is not None
            assert action.result.name == action.name
        answered = [e["tool_call_id"] for e in trace.trajectory.entries if e.get("role") == "tool"]
        assert len(answered) == len(set(answered)) == len(steps.actions())
    assert graders == {"asked-weather": 2, "weather-only": 2, "both-cities": 2, "looked-up": 2}
    # The Agents SDK's own spans of the same model calls are not counted twice.
    assert run.usage.input_tokens == sum(u["input_tokens"] for u in served.usage)
    assert run.usage.output_tokens == sum(u["output_tokens"] for u in served.usage)
    text = case_text(case_doc(run.run_id, "weather-two-cities",
                              Store(tmp_path).samples.of_case(run.run_id, "weather-two-cities")))
    assert 'calls get_weather({"city": "Paris"}), get_weather({"city": "Rome"})' in text
    assert '-> get_weather: {"city": "Rome", "sky": "cloudy", "celsius": 18}' in text


def test_without_its_packages_the_summary_says_capture_is_unavailable_and_how_to_install_it(monkeypatch, tmp_path):
    from tasks.agents.capture import INSTALL_HINT, unavailable

    for name in ("openinference", "openinference.instrumentation", "openinference.instrumentation.openai"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed (an import would fail)
    assert "openinference.instrumentation.openai not installed" in unavailable()
    run = evalpipe.evaluate([{"id": "a", "inputs": {}, "reference": "x", "grader": {"kind": "contains"}}],
                            lambda inputs, ctx: "x", n=1, home=tmp_path)
    note = run.usage.cost_note
    assert note.startswith("no sample reported token counts: the agent does not report usage")
    assert "in-process capture of model calls is unavailable" in note and INSTALL_HINT in note


def test_a_call_the_endpoint_refuses_is_counted_and_says_what_failed():
    class Refusing(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"error": {"message": "overloaded", "type": "server_error"}}).encode()
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    serve_in_background(server)
    ctx = AgentContext(case_id="c", index=0, seed=0, n=1)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="sk", max_retries=0)
        with pytest.raises(openai.InternalServerError), captured(ctx):
            client.chat.completions.create(model="support-good", messages=[{"role": "user", "content": "hi"}])
    finally:
        server.shutdown()
        server.server_close()
    user, failed = ctx.trace.trajectory.entries
    assert user == {"role": "user", "content": "hi"} and failed["model"] == "support-good"
    assert failed["error"].startswith("InternalServerError: Error code: 500") and "overloaded" in failed["error"]
    assert ctx.reported["latency_s"] > 0 and "input_tokens" not in ctx.reported  # unknown, not 0


@pytest.mark.parametrize("cap", [2, None])
def test_model_concurrency_holds_in_process_calls_across_the_run_s_samples(monkeypatch, tmp_path, cap):
    """`--model-concurrency 2`: six samples drawn at once (sync and async clients, streamed or
    not) never have more than 2 calls at the endpoint; without the cap they have more."""
    with scripted.ScriptedModel(delay_s=0.3) as chat:
        monkeypatch.setenv("CHAT_URL", chat.url)
        cases = [{"id": f"q{i}", "inputs": {"api": "chat", "client": ("sync", "async")[i % 2], "stream": i % 3 == 0,
                                            "question": q},
                  "reference": "", "grader": {"kind": "contains"}} for i, q in enumerate([*QUESTIONS, *QUESTIONS][:6])]
        run = evalpipe.evaluate(cases, OWN_CLIENT, n=1, home=tmp_path, agent_concurrency=6, model_concurrency=cap)
    samples = _samples(tmp_path, run.run_id)
    assert [s["status"] for s in samples.values()] == ["passed"] * 6
    assert len(chat.requests) == 12  # a tool call and the answer, each
    if cap is None:
        assert chat.most_in_flight > 2
    else:
        assert chat.most_in_flight == cap
