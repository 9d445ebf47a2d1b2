"""An agent's own OpenTelemetry spans sent to the run (issue #44 item 2): the gateway's OTLP/HTTP
endpoint (`/v1/traces`, tasks/agents/otlp.py) takes an export carrying the sample's token, and
its tool spans become the sample's tool results, joined to the model's calls; model spans add
nothing (the gateway counted those calls). Against the scripted model on loopback
(examples/tools/scripted_model.py)."""

from __future__ import annotations

import gzip
import http.client
import importlib.util
import json
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

import evalpipe
from flows.cli import main
from storage.store import Store
from tasks.agents.gateway import Gateway
from tasks.trace import SampleTrace

ROOT = Path(__file__).resolve().parents[1]
AGENT = f"cmd:{sys.executable} {ROOT / 'tests/support/otel_agent.py'}"
spec = importlib.util.spec_from_file_location("scripted_model", ROOT / "examples/tools/scripted_model.py")
scripted = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scripted)


@pytest.fixture
def model():
    with scripted.ScriptedModel() as served:
        yield served


@pytest.fixture
def gateway(model):
    made = Gateway(model.url, "sk-real")
    yield made
    made.close()


def _export(gateway: Gateway, body: bytes, token: str, content_type: str = "application/json",
            encoding: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": content_type, "Authorization": f"Bearer {token}"}
    if encoding:
        headers["Content-Encoding"] = encoding
    request = urllib.request.Request(gateway.url.removesuffix("/v1") + "/v1/traces", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def _span(name: str, attributes: dict, error: str | None = None, start: int = 1_000_000_000,
          end: int = 1_250_000_000) -> dict:
    """One span in OTLP JSON (integers as strings, as the JSON mapping has them)."""
    span = {"traceId": "0" * 31 + "1", "spanId": "0" * 15 + "2", "name": name,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
            "attributes": [{"key": k, "value": {"intValue": str(v)} if isinstance(v, int) else {"stringValue": v}}
                           for k, v in attributes.items()]}
    if error is not None:
        span["status"] = {"code": 2, "message": error}
    return span


def _otlp_json(*spans: dict) -> bytes:
    return json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [{"scope": {"name": "t"},
                                                                           "spans": list(spans)}]}]}).encode()


def test_an_agent_s_own_tool_spans_join_its_sample_s_trajectory_and_its_tokens_are_the_gateway_s(
        model, home, monkeypatch, capsys):
    """A real agent process with the OpenTelemetry SDK and the OTLP/HTTP protobuf exporter,
    configured by its environment only: each tool span is the result of the model's call it
    names, with its duration and error; its chat spans, which carry the same usage, add none."""
    monkeypatch.setenv("OPENAI_BASE_URL", model.url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-real")
    cases = [{"id": "paris", "inputs": {"question": "What's the weather in Paris?"}, "reference": "sunny",
              "grader": {"kind": "contains"}},
             {"id": "atlantis", "inputs": {"question": "And the weather in Atlantis?"}, "reference": "Sorry",
              "grader": {"kind": "contains"}}]
    run = evalpipe.evaluate(cases, AGENT, home=home)
    rows = {r["case_id"]: r for r in Store(home).samples.of_run(run.run_id).to_pylist()}
    assert {r["status"] for r in rows.values()} == {"passed"}, [r["detail"] for r in rows.values()]

    entries = SampleTrace.parse(rows["paris"]["trace"]).trajectory.entries
    (call,) = [e for e in entries if e.get("tool_calls")]
    (result,) = [e for e in entries if e.get("role") == "tool"]
    assert entries.index(result) == entries.index(call) + 1  # the call's result, where it belongs
    assert result["tool_call_id"] == call["tool_calls"][0]["id"] and result["name"] == "get_weather"
    assert json.loads(result["content"]) == {"sky": "sunny"} and result["duration_s"] > 0
    assert "error" not in result
    steps = SampleTrace.parse(rows["atlantis"]["trace"]).trajectory.typed
    (action,) = steps.actions()
    assert action.name == "get_weather" and action.result.error == "no weather for Atlantis"
    assert action.result.duration_s > 0

    # The tokens are the endpoint's, summed once: the agent's chat spans held them too.
    for case_id, row in rows.items():
        told = [scripted.reply(b)["usage"] for b in model.requests if case_id.capitalize() in json.dumps(b)]
        assert len(told) == 2, case_id
        assert row["input_tokens"] == sum(u["prompt_tokens"] for u in told), case_id
        assert row["output_tokens"] == sum(u["completion_tokens"] for u in told), case_id

    assert main(["runs", "show", run.run_id, "--case", "atlantis"]) == 0
    shown = capsys.readouterr().out
    assert "get_weather" in shown and "no weather for Atlantis" in shown


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_sandboxed_workspace_agent_s_spans_reach_the_gateway_through_its_own_network(model, tmp_path, monkeypatch):
    """A workspace agent's exporter reaches the gateway the way its model calls do: the
    endpoint its environment names on the loopback is the one port forwarded into the sandbox."""
    monkeypatch.setenv("OPENAI_BASE_URL", model.url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-real")
    run = evalpipe.evaluate(str(ROOT / "examples/coding/calc.yaml"), AGENT, n=1, home=tmp_path, workspace=True)
    (row,) = Store(tmp_path).samples.of_run(run.run_id).to_pylist()
    trace = SampleTrace.parse(row["trace"])
    assert trace.agent_run.returncode == 0, trace.agent_run.stderr_tail
    assert trace.agent_run.isolation == "bwrap"
    (action,) = trace.trajectory.typed.actions()
    assert action.name == "get_weather" and action.result.duration_s > 0
    assert json.loads(action.result.content) == {"sky": "sunny"}


def test_otlp_json_gzipped_or_not_is_taken_and_a_span_without_a_call_id_joins_by_tool_and_arguments(model, gateway):
    """OTLP JSON (an OpenInference TOOL span, no call id): joined to the earliest call of that
    tool with those arguments that no span answered yet; a GenAI chat span adds nothing."""
    token, tap = gateway.grant()
    client = openai.OpenAI(base_url=gateway.url, api_key=token, max_retries=0)
    reply = client.chat.completions.create(model="support-good",
                                           messages=[{"role": "user", "content": "weather in Paris and Rome?"}])
    paris, rome = reply.choices[0].message.tool_calls
    tokens = (tap.input_tokens, tap.output_tokens)

    rome_span = _span("get_weather", {"openinference.span.kind": "TOOL", "tool.name": "get_weather",
                                      "input.value": '{"city": "Rome"}', "output.value": '{"sky": "cloudy"}'})
    chat = _span("chat", {"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 999})
    assert _export(gateway, _otlp_json(rome_span, chat), token) == (200, b"{}")
    paris_span = _span("execute_tool", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather",
                                        "gen_ai.tool.call.arguments": '{"city":"Paris"}'}, error="timed out")
    status, _ = _export(gateway, gzip.compress(_otlp_json(paris_span)), token, encoding="gzip")
    assert status == 200

    results = {e["tool_call_id"]: e for e in tap.entries if e.get("role") == "tool"}
    assert set(results) == {paris.id, rome.id}
    assert results[rome.id]["content"] == '{"sky": "cloudy"}' and results[rome.id]["duration_s"] == 0.25
    assert results[paris.id]["error"] == "timed out"
    assert (tap.input_tokens, tap.output_tokens) == tokens and tap.calls == 1

    # The next request sends the results back: what the model saw is kept once, with the span's timing.
    client.chat.completions.create(model="support-good", messages=[
        {"role": "user", "content": "weather in Paris and Rome?"}, reply.choices[0].message.model_dump(),
        {"role": "tool", "tool_call_id": paris.id, "content": '{"sky": "unknown"}'},
        {"role": "tool", "tool_call_id": rome.id, "content": '{"sky": "cloudy"}'}])
    rome_again = _span("get_weather", {"openinference.span.kind": "TOOL", "tool.name": "get_weather",
                                       "input.value": '{"city": "Rome"}', "output.value": "x"})
    assert _export(gateway, _otlp_json(rome_again), token)[0] == 200  # no call left unanswered: at the end
    assert [e.get("tool_call_id") for e in tap.entries if e.get("role") == "tool"][-1] is None


def test_a_forged_revoked_or_another_sample_s_token_is_refused_and_nothing_recorded(model, gateway):
    token, tap = gateway.grant()
    other, other_tap = gateway.grant()
    body = _otlp_json(_span("t", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t"}))
    assert _export(gateway, body, "evalpipe-sample-forged")[0] == 401
    assert _export(gateway, body, "")[0] == 401
    gateway.revoke(other)  # the other sample ended: its late spans are refused, not given to anyone
    status, said = _export(gateway, body, other)
    assert status == 401 and b"token" in said
    assert tap.entries == [] and other_tap.entries == []

    lease = gateway.lease()  # a worker's token: between samples it is no sample's
    assert _export(gateway, body, lease)[0] == 401
    _, drawn = gateway.grant(lease=lease)
    assert _export(gateway, body, lease)[0] == 200 and drawn.entries[-1]["name"] == "t"


# The ids are the expected messages: bytes in an id would differ between xdist workers
# wherever they hold a time (a gzip header's mtime), and xdist refuses the run.
MALFORMED = [
    (b"{not json", "application/json", None, 400, "not JSON"),
    (b'{"resourceSpans": "x"}', "application/json", None, 400, "resourceSpans: expected a JSON array"),
    (b"[" * 100_000, "application/json", None, 400, "nested deeper"),
    (b"\xff\xff\xff\xff", "application/x-protobuf", None, 400, "not an ExportTraceServiceRequest"),
    (b"plain", "text/plain", None, 415, "not 'text/plain'"),
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xff\xff", "application/json", "gzip", 400, "does not inflate"),
    (gzip.compress(b"{}", mtime=0)[:-6], "application/json", "gzip", 400, "cut short"),
    (gzip.compress(b" " * (9 << 20), mtime=0), "application/json", "gzip", 413, "once inflated"),
    (b"{}", "application/json", "br", 415, "plain or gzip"),
]


@pytest.mark.parametrize(("body", "content_type", "encoding", "status", "said"), MALFORMED,
                         ids=[row[-1] for row in MALFORMED])
def test_a_malformed_export_is_refused_in_one_line_and_nothing_recorded(gateway, body, content_type, encoding,
                                                                         status, said):
    token, tap = gateway.grant()
    got, answer = _export(gateway, body, token, content_type, encoding)
    message = json.loads(answer)["error"]["message"]
    assert got == status and said in message and "\n" not in message
    assert tap.entries == []


@pytest.mark.parametrize("length", ["-5", "lots"])
def test_a_content_length_that_is_not_one_is_refused_without_waiting_for_a_body(gateway, length):
    token, tap = gateway.grant()
    connection = http.client.HTTPConnection("127.0.0.1", gateway.server.server_address[1], timeout=10)
    try:
        connection.putrequest("POST", "/v1/traces")
        for name, value in (("Content-Length", length), ("Content-Type", "application/json"),
                            ("Authorization", f"Bearer {token}")):
            connection.putheader(name, value)
        connection.endheaders(b"{}")
        answer = connection.getresponse()
        assert answer.status == 400 and b"Content-Length is not a length" in answer.read()
    finally:
        connection.close()
    assert tap.entries == []


def test_a_huge_attribute_is_refused_and_a_sample_s_spans_are_capped_with_a_note(gateway):
    token, tap = gateway.grant(max_span_bytes=2000)
    huge = _span("t", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t",
                       "gen_ai.tool.call.result": "x" * 5000})
    status, answer = _export(gateway, _otlp_json(huge), token)
    assert status == 400 and "over the sample's 2,000-byte cap" in json.loads(answer)["error"]["message"]
    assert tap.entries == []

    runs = [_span("t", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t",
                        "gen_ai.tool.call.result": "y" * 600}) for _ in range(5)]
    assert _export(gateway, _otlp_json(*runs), token)[0] == 200
    kept = [e for e in tap.entries if e.get("role") == "tool"]
    assert 1 <= len(kept) < 5 and tap.spans_cut == 5 - len(kept)
    assert "later tool runs not recorded" in tap.entries[-1]["note"]


def test_without_opentelemetry_proto_a_protobuf_export_is_told_what_to_install(gateway, monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.proto.collector.trace.v1.trace_service_pb2", None)
    token, _ = gateway.grant()
    status, answer = _export(gateway, b"", token, "application/x-protobuf")
    assert status == 415 and "pip install 'evalpipe[agents]'" in json.loads(answer)["error"]["message"]


def test_the_agent_s_environment_names_the_gateway_for_its_exporter_and_drops_a_trace_only_one(gateway):
    env = gateway.environ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector.example/v1/traces",
                           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "evalpipe-sample-t")
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] + "/v1" == env["OPENAI_BASE_URL"] == gateway.url
    assert env["OTEL_EXPORTER_OTLP_HEADERS"] == "authorization=Bearer%20evalpipe-sample-t"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" not in env
