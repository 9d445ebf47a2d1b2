"""Replay of model calls (issue 44, item 4): with `--replay-model-calls`, a run after a change
to an agent's tool code pays only from the first changed request on.

Real parts: a `--workspace` `cmd:` agent on the OpenAI SDK in the sandbox, the run's gateway,
and a stdlib chat completions endpoint that counts what reaches it. The agent makes 3 calls
(the second streamed); the third request holds the result of its `scale` tool, whose code
changes between runs."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.waiting import serve_in_background

import evalpipe
from storage.store import Store
from tasks.agents.gateway import Gateway
from tasks.agents.model_calls import CallBook
from tasks.report.text import summary_text
from tasks.trace import SampleTrace

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

ROOT = Path(__file__).resolve().parent.parent
CODING = ROOT / "examples" / "coding" / "calc.yaml"

AGENT = """
import json
import openai

FACTOR = {factor}
REPEAT_FIRST = {repeat}
client = openai.OpenAI(max_retries=0)
TOOLS = [{{"type": "function", "function": {{"name": name, "parameters": {{"type": "object", "properties": {{}}}}}}}}
         for name in ("measure", "scale")]


def measure():
    return "41"


def scale(x):
    return str(int(x) * FACTOR)


def turn(message):
    calls = [{{"id": c.id, "type": "function", "function": {{"name": c.function.name, "arguments": c.function.arguments}}}}
             for c in message.tool_calls or []]
    return {{"role": "assistant", "content": message.content, **({{"tool_calls": calls}} if calls else {{}})}}


def streamed(messages):
    content, calls = "", {{}}
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                stream_options={{"include_usage": True}}):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {{"id": None, "type": "function",
                                                     "function": {{"name": "", "arguments": ""}}}})
                call["id"] = part.id or call["id"]
                call["function"]["name"] += part.function.name or ""
                call["function"]["arguments"] += part.function.arguments or ""
    return {{"role": "assistant", "content": content or None,
            **({{"tool_calls": [calls[i] for i in sorted(calls)]}} if calls else {{}})}}


def converse():
    messages = [{{"role": "user", "content": "measure, then scale it"}}]
    first = turn(client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message)
    if REPEAT_FIRST:  # the same request again: the second of its kind in this sample
        client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    messages += [first, {{"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": measure()}}]
    second = streamed(messages)
    x = json.loads(second["tool_calls"][0]["function"]["arguments"])["x"]
    messages += [second, {{"role": "tool", "tool_call_id": second["tool_calls"][0]["id"], "content": scale(x)}}]
    return client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message.content
"""
# Run as a command in a workspace: the answer goes into the checkout.
CMD_AGENT = AGENT + """
open("CHANGES.md", "w").write(converse() + "\\n")
"""
# Imported as a `python:` agent: its own client's calls, in evalpipe's process.
PY_AGENT = AGENT + """

def solve(inputs, ctx):
    return converse()
"""


class Endpoint(ThreadingHTTPServer):
    """Chat completions by the conversation's length: a `measure` call, then (streamed when
    asked) a `scale` call of what it measured, then the answer, naming the last tool result.
    Each tool call's id is the request's number here, so an answer says which request made it."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Scripted)
        self.requests = 0
        self.fail_answers = False  # a 500 instead of the final answer
        self.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Scripted(BaseHTTPRequestHandler):
    server: Endpoint

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        with self.server.lock:
            self.server.requests += 1
            number = self.server.requests
        if self.path.endswith("/responses"):
            self._responses_stream(number)
            return
        messages = body["messages"]
        usage = {"prompt_tokens": 100 * len(messages), "completion_tokens": 10, "total_tokens": 100 * len(messages) + 10}
        if len(messages) == 1:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{number}", "type": "function", "function": {"name": "measure", "arguments": "{}"}}]}
        elif len(messages) == 3:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{number}", "type": "function",
                 "function": {"name": "scale", "arguments": json.dumps({"x": messages[-1]["content"]})}}]}
        elif self.server.fail_answers:
            self.send_error(500)
            return
        else:
            message = {"role": "assistant", "content": f"the answer is {messages[-1]['content']}"}
        if body.get("stream"):
            self._stream(message, usage)
            return
        data = json.dumps({"id": f"r{number}", "object": "chat.completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                           "usage": usage}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, message: dict, usage: dict) -> None:
        """The tool call as server-sent events, in two deltas, then the usage and [DONE]."""
        def event(choices: list, **extra: object) -> bytes:
            doc = {"id": "s", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices,
                   **extra}
            return f"data: {json.dumps(doc)}\n\n".encode()

        call = message["tool_calls"][0]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for delta, finish in (
            ({"role": "assistant", "tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                                   "function": {"name": call["function"]["name"], "arguments": ""}}]},
             None),
            ({"tool_calls": [{"index": 0, "function": {"arguments": call["function"]["arguments"]}}]}, None),
            ({}, "tool_calls"),
        ):
            self.wfile.write(event([{"index": 0, "delta": delta, "finish_reason": finish}]))
        self.wfile.write(event([], usage=usage) + b"data: [DONE]\n\n")
        self.close_connection = True

    def _responses_stream(self, number: int) -> None:
        """A Responses API stream whose text names this request's number."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for kind, doc in (("response.output_text.delta", {"delta": f"reply {number}"}),
                          ("response.completed", {"response": {"usage": {"input_tokens": 7, "output_tokens": 2}}})):
            self.wfile.write(f"event: {kind}\r\ndata: {json.dumps({'type': kind, **doc})}\r\n\r\n".encode())
            self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the agent's file is in the tree its fingerprint covers
    served = Endpoint()
    serve_in_background(served)
    monkeypatch.setenv("OPENAI_BASE_URL", served.url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-real-key")
    try:
        yield served
    finally:
        served.shutdown()
        served.server_close()


def _run(tmp_path: Path, factor: int, *, replay: bool, repeat: bool = False, in_process: bool = False):
    """One run of the agent whose `scale` multiplies by `factor` (the same spec every time:
    only its file's content, and so its fingerprint, changes), and its one sample's row: a
    `--workspace` `cmd:` agent, or (`in_process`) a `python:` one on a case of its own."""
    agent = tmp_path / "agents" / "tools.py"
    agent.parent.mkdir(exist_ok=True)
    agent.write_text((PY_AGENT if in_process else CMD_AGENT).format(factor=factor, repeat=repeat))
    if in_process:
        cases = [{"id": "scale", "inputs": {}, "reference": "the answer", "grader": {"kind": "contains"}}]
        run = evalpipe.evaluate(cases, "python:agents/tools.py:solve", home=tmp_path / "home",
                                replay_model_calls=replay)
    else:
        run = evalpipe.evaluate(str(CODING), f"cmd:{sys.executable} agents/tools.py", home=tmp_path / "home",
                                workspace=True, replay_model_calls=replay)
    (row,) = Store(tmp_path / "home").samples.of_run(run.run_id).to_pylist()
    assert row["status"] != "agent_error", row["detail"]
    return run, row


def _turns(row: dict) -> list[dict]:
    return [e for e in SampleTrace.parse(row["trace"]).trajectory.entries if e.get("role") == "assistant"]


@pytest.mark.parametrize("in_process", [pytest.param(False, marks=needs_bwrap), True],
                         ids=["workspace-cmd", "in-process-python"])
def test_after_a_tool_change_only_the_changed_request_goes_upstream(tmp_path, endpoint, in_process):
    """The same for an agent in the sandbox (through the gateway) and for a `python:` agent's
    own OpenAI client in evalpipe's process (its SDK's requests answered before they leave)."""
    first, row = _run(tmp_path, 2, replay=True, in_process=in_process)
    assert endpoint.requests == 3
    assert "the answer is 82" in row["output"]
    assert first.to_json()["model_calls"] == {"replayed": 0, "forwarded": 3, "replayed_input_tokens": None,
                                              "replayed_output_tokens": None, "unseen_samples": 0, "note": None}

    second, row = _run(tmp_path, 3, replay=True, in_process=in_process)  # the tool's code changed: its result enters call 3
    assert endpoint.requests == 3 + 1
    assert "the answer is 123" in row["output"]
    turns = _turns(row)
    assert [t.get("replayed", False) for t in turns] == [True, True, False]
    assert [t["tool_calls"][0]["function"]["name"] for t in turns[:2]] == ["measure", "scale"]
    assert turns[2]["content"] == "the answer is 123"
    assert all(len(t["request_sha256"]) == 64 for t in turns)
    # What was spent is the forwarded call's; the replayed calls' tokens are shown, not spent.
    assert (row["input_tokens"], row["output_tokens"]) == (500, 10)
    assert [t["usage"] for t in turns[:2]] == [{"input_tokens": 100, "output_tokens": 10},
                                               {"input_tokens": 300, "output_tokens": 10}]
    doc = second.to_json()
    assert doc["model_calls"] == {"replayed": 2, "forwarded": 1, "replayed_input_tokens": 400,
                                  "replayed_output_tokens": 20, "unseen_samples": 0, "note": None}
    assert doc["usage"]["input_tokens"] == 500

    third, _ = _run(tmp_path, 4, replay=False, in_process=in_process)  # without the option: every call goes upstream
    assert endpoint.requests == 4 + 3
    assert "model_calls" not in third.to_json()


@needs_bwrap
def test_a_request_at_another_ordinal_is_forwarded_not_answered_from_the_record(tmp_path, endpoint):
    _run(tmp_path, 2, replay=True)
    assert endpoint.requests == 3
    # The first request twice: the second of its kind was never recorded, so it goes upstream
    # and its answer is the endpoint's own (a tool call id of this request's number).
    run, row = _run(tmp_path, 2, replay=True, repeat=True)
    assert endpoint.requests == 3 + 1
    turns = _turns(row)
    assert [t.get("replayed", False) for t in turns] == [True, False, True, True]
    assert turns[0]["tool_calls"][0]["id"] == "call_1"
    assert turns[1]["tool_calls"][0]["id"] == "call_4"
    assert turns[0]["request_sha256"] == turns[1]["request_sha256"]
    assert run.to_json()["model_calls"]["forwarded"] == 1


TOOL_CASE = {"id": "scale", "reference": "the answer is 82", "grader": {"kind": "contains"},
             "inputs": {"prompt": "measure, then scale it",
                        "tools": [{"name": "measure", "parameters": {"type": "object", "properties": {}}},
                                  {"name": "scale", "parameters": {"type": "object",
                                                                   "properties": {"x": {"type": "string"}}}}],
                        "world": {"measure": [{"result": "41"}], "scale": [{"result": "82"}]}}}


def test_an_openai_agent_s_tool_loop_failed_at_its_last_call_pays_only_for_that_call_again(tmp_path, endpoint):
    """`openai:`'s own loop: its third call fails (HTTP 500), so the sample is an agent error
    and is drawn again by the next run, whose first two requests are answered from the record."""
    home = tmp_path / "home"
    endpoint.fail_answers = True
    first = evalpipe.evaluate([TOOL_CASE], "openai:m", home=home, replay_model_calls=True, openai_max_attempts=1)
    (row,) = Store(home).samples.of_run(first.run_id).to_pylist()
    assert row["status"] == "agent_error" and "HTTP 500" in row["detail"]
    assert (endpoint.requests, first.to_json()["model_calls"]["forwarded"]) == (3, 3)

    endpoint.fail_answers = False
    second = evalpipe.evaluate([TOOL_CASE], "openai:m", home=home, replay_model_calls=True, openai_max_attempts=1)
    assert endpoint.requests == 3 + 1
    (row,) = Store(home).samples.of_run(second.run_id).to_pylist()
    assert row["status"] == "passed" and row["output"] == "the answer is 82"
    turns = _turns(row)
    assert [t.get("replayed", False) for t in turns] == [True, True, False]
    assert all(len(t["request_sha256"]) == 64 for t in turns)
    assert (row["input_tokens"], row["output_tokens"]) == (500, 10)
    assert second.to_json()["model_calls"] == {"replayed": 2, "forwarded": 1, "replayed_input_tokens": 400,
                                               "replayed_output_tokens": 20, "unseen_samples": 0, "note": None}


def test_an_agent_calling_its_endpoint_by_other_means_is_counted_unseen_and_the_summary_says_why(tmp_path, endpoint):
    """A `python:` agent that posts to its endpoint with urllib, not the SDK: its call goes
    upstream, and the summary counts the sample as one evalpipe could not answer, never as 0 of 0."""
    def agent(inputs, ctx):
        request = urllib.request.Request(endpoint.url + "/chat/completions", method="POST", data=json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "measure"}]}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.load(answer)["choices"][0]["message"]["tool_calls"][0]["function"]["name"]

    cases = [{"id": "c", "inputs": {}, "reference": "measure", "grader": {"kind": "exact"}}]
    run = evalpipe.evaluate(cases, agent, home=tmp_path / "home", replay_model_calls=True)
    assert endpoint.requests == 1 and run.pass_at_k["1"] == 1.0
    counts = run.to_json()["model_calls"]
    assert (counts["replayed"], counts["forwarded"], counts["unseen_samples"]) == (0, 0, 1)
    assert "by other means" in counts["note"]
    assert "model calls: 0 replayed, 0 forwarded upstream; 1 drawn sample(s)" in summary_text(run.to_json())


def test_a_streamed_responses_call_is_sent_again_byte_for_byte(endpoint):
    """The gateway alone: a Responses API stream (CRLF-framed events) kept by one sample's book
    is what a later sample with that record gets for the same request, with no upstream call;
    another request body is forwarded."""
    gateway = Gateway(endpoint.url, "sk-real-key", timeout_s=10)
    try:
        def ask(book: CallBook, text: str) -> bytes:
            token, _ = gateway.grant(book=book)
            body = json.dumps({"model": "m", "input": text, "stream": True}).encode()
            request = urllib.request.Request(gateway.url + "/responses", data=body, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.headers["Content-Type"] == "text/event-stream"
                return answer.read()

        first = CallBook()
        sent = ask(first, "hi")
        assert b"reply 1" in sent and first.forwarded == 1
        again = CallBook(first.kept)
        assert ask(again, "hi") == sent
        assert (again.replayed, endpoint.requests) == (1, 1)
        assert b"reply 2" in ask(again, "hello")
        assert (again.forwarded, endpoint.requests) == (1, 2)
    finally:
        gateway.close()
