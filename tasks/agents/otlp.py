"""The spans an agent sends to the gateway itself (docs/agents.md "Spans an agent sends: OTLP"):
an OTLP/HTTP trace export, as OTLP JSON or protobuf (gzipped or not), read into typed spans,
and the tool runs among them that a sample's trajectory takes.

Only tool spans are taken (OpenInference `openinference.span.kind=TOOL`, the GenAI conventions'
`gen_ai.operation.name=execute_tool`): every model call of the agent already went through the
gateway and is recorded there with the endpoint's own usage, so a model span would count its
tokens twice. Standard library only, but for protobuf (`opentelemetry-proto`).
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

TRACES_PATH = "/v1/traces"  # what an exporter appends to OTEL_EXPORTER_OTLP_ENDPOINT
JSON = "application/json"
PROTOBUF = "application/x-protobuf"
PROTO_HINT = ("OTLP protobuf needs opentelemetry-proto (pip install 'evalpipe[agents]'),"
              " or send OTLP JSON (OTEL_EXPORTER_OTLP_PROTOCOL=http/json)")
MAX_DEPTH = 32  # nested attribute values (arrays, key-value lists): deeper is refused, not recursed into
STATUS_ERROR = 2  # OTLP's Status.code for a failed span

# Where each convention puts a tool run's parts, the GenAI conventions' first.
TOOL_NAME = ("gen_ai.tool.name", "tool.name")
CALL_ID = ("gen_ai.tool.call.id", "tool_call.id", "tool.id")
ARGUMENTS = ("gen_ai.tool.call.arguments", "input.value")
RESULT = ("gen_ai.tool.call.result", "output.value")


class Refused(ValueError):
    """An export not taken, with its HTTP status: nothing of it is recorded."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Span:
    """One span of an export, its attribute values as Python values."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    failed: bool
    status_message: str


@dataclass(frozen=True)
class ToolRun:
    """A tool's run as a span reports it: what the trajectory's tool result takes from it."""

    name: str
    call_id: str | None  # the model's tool call it answers, where the span names it
    arguments: Any  # as the span holds them (JSON text, or a structured value)
    content: str
    duration_s: float
    error: str | None

    def entry(self, call_id: str | None) -> dict[str, Any]:
        """The tool result entry, answering `call_id` (the span's, or the one the join found)."""
        entry = {"role": "tool", "tool_call_id": call_id, "name": self.name, "content": self.content,
                 "duration_s": round(self.duration_s, 6)}
        return {**entry, "error": self.error} if self.error is not None else entry

    def parsed_arguments(self) -> Any:
        return loads_or_none(self.arguments) if isinstance(self.arguments, str) else self.arguments


def loads_or_none(text: Any) -> Any:
    """`text` as JSON, or None when it is not JSON text."""
    try:
        return json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None


def read(body: bytes, content_type: str | None, encoding: str | None, max_bytes: int,
         max_value_bytes: int) -> list[Span]:
    """The spans of an export `body`; `Refused` for a body that is not one (400), too big once
    inflated (413), of a type or encoding not read (415), or with an attribute value over
    `max_value_bytes` (400: it could never be recorded)."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind not in (JSON, PROTOBUF):
        raise Refused(415, f"an OTLP export is {PROTOBUF} or {JSON}, not {kind or 'untyped'!r}")
    if kind == PROTOBUF and not _proto_installed():
        raise Refused(415, PROTO_HINT)
    body = _inflated(body, (encoding or "identity").strip().lower(), max_bytes)
    try:
        spans = list(_json_spans(body) if kind == JSON else _proto_spans(body))
    except RecursionError:
        raise Refused(400, "OTLP export nested deeper than can be read") from None
    for span in spans:
        for key, value in span.attributes.items():
            if (size := _size(value)) > max_value_bytes:
                raise Refused(400, f"span {span.name[:80]!r}: attribute {key[:80]!r} is {size:,} bytes,"
                                   f" over the sample's {max_value_bytes:,}-byte cap on spans")
    return spans


def tool_runs(spans: list[Span]) -> list[ToolRun]:
    """The tool spans, as tool runs; model, agent and other spans are left out."""
    runs = []
    for span in spans:
        attributes = span.attributes
        if (attributes.get("openinference.span.kind") != "TOOL"
                and attributes.get("gen_ai.operation.name") != "execute_tool"):
            continue
        name = _first(attributes, TOOL_NAME) or span.name.removeprefix("execute_tool ").strip() or span.name
        call_id = _first(attributes, CALL_ID)
        result = _first(attributes, RESULT)
        content = result if isinstance(result, str) else "" if result is None else json.dumps(result, default=str)
        error = None
        if span.failed:
            error = span.status_message or str(attributes.get("error.type") or "") or "the tool failed"
        runs.append(ToolRun(str(name), None if call_id is None else str(call_id), _first(attributes, ARGUMENTS),
                            content, max(span.end_ns - span.start_ns, 0) / 1e9, error))
    return runs


def answer(content_type: str | None) -> tuple[bytes, str]:
    """An empty ExportTraceServiceResponse (all spans taken), in the export's own encoding."""
    if (content_type or "").split(";", 1)[0].strip().lower() == PROTOBUF:
        return b"", PROTOBUF  # every field of the message unset: no bytes at all
    return b"{}", JSON


def _first(attributes: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((attributes[k] for k in keys if attributes.get(k) is not None), None)


def _size(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "replace"))
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, list):
        return sum(map(_size, value))
    if isinstance(value, dict):
        return sum(len(k) + _size(v) for k, v in value.items())
    return 8


def _inflated(body: bytes, encoding: str, max_bytes: int) -> bytes:
    if encoding == "identity":
        return body
    if encoding != "gzip":
        raise Refused(415, f"Content-Encoding {encoding!r}: an OTLP export is sent plain or gzip")
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        data = inflate.decompress(body, max_bytes + 1)  # a small bomb stops here
    except zlib.error as exc:
        raise Refused(400, f"the gzip body does not inflate: {exc}") from None
    if len(data) > max_bytes:
        raise Refused(413, f"OTLP export over {max_bytes:,} bytes once inflated")
    if not inflate.eof:
        raise Refused(400, "the gzip body is cut short")
    return data


def _proto_installed() -> bool:
    try:
        import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
    except ImportError:
        return False
    return True


# --- OTLP JSON (the protobuf's JSON mapping: camelCase names, hex ids, 64-bit integers as strings)


def _json_spans(body: bytes) -> Iterator[Span]:
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise Refused(400, f"OTLP export is not JSON: {exc}") from None
    for r, resource in enumerate(_list(_dict(doc, "the export"), "resourceSpans", "the export")):
        where = f"resourceSpans[{r}]"
        for s, scope in enumerate(_list(_dict(resource, where), "scopeSpans", where)):
            where_scope = f"{where}.scopeSpans[{s}]"
            for i, span in enumerate(_list(_dict(scope, where_scope), "spans", where_scope)):
                yield _json_span(_dict(span, f"{where_scope}.spans[{i}]"), f"{where_scope}.spans[{i}]")


def _json_span(span: dict[str, Any], where: str) -> Span:
    attributes = {}
    for a, pair in enumerate(_list(span, "attributes", where)):
        pair = _dict(pair, f"{where}.attributes[{a}]")
        attributes[str(pair.get("key"))] = _json_value(pair.get("value"), f"{where}.attributes[{a}]", 0)
    status = _dict(span.get("status") or {}, f"{where}.status")
    code = status.get("code")
    return Span(str(span.get("name") or ""), _nanos(span.get("startTimeUnixNano"), where),
                _nanos(span.get("endTimeUnixNano"), where), attributes,
                code in (STATUS_ERROR, str(STATUS_ERROR), "STATUS_CODE_ERROR"), str(status.get("message") or ""))


def _json_value(value: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise Refused(400, f"{where}: an attribute value nested deeper than {MAX_DEPTH} levels")
    if value is None:
        return None
    value = _dict(value, where)
    if "stringValue" in value:
        return str(value["stringValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return _integer(value["intValue"], where)
    if "doubleValue" in value:
        try:
            return float(value["doubleValue"])
        except (TypeError, ValueError):
            raise Refused(400, f"{where}: doubleValue {str(value['doubleValue'])[:40]!r} is not a number") from None
    if "arrayValue" in value:
        items = _list(_dict(value["arrayValue"], where), "values", where)
        return [_json_value(v, where, depth + 1) for v in items]
    if "kvlistValue" in value:
        pairs = [_dict(p, where) for p in _list(_dict(value["kvlistValue"], where), "values", where)]
        return {str(p.get("key")): _json_value(p.get("value"), where, depth + 1) for p in pairs}
    if "bytesValue" in value:
        try:
            return base64.b64decode(str(value["bytesValue"]), validate=True)
        except (binascii.Error, ValueError):
            raise Refused(400, f"{where}: bytesValue is not base64") from None
    return None  # an empty AnyValue


def _dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Refused(400, f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _list(value: dict[str, Any], key: str, where: str) -> list[Any]:
    items = value.get(key)
    if items is None:
        return []
    if not isinstance(items, list):
        raise Refused(400, f"{where}.{key}: expected a JSON array, got {type(items).__name__}")
    return items


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise Refused(400, f"{where}: {str(value)[:40]!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise Refused(400, f"{where}: {value[:40]!r} is not an integer") from None


def _nanos(value: Any, where: str) -> int:
    return 0 if value is None else _integer(value, f"{where} time")


# --- OTLP protobuf


def _proto_spans(body: bytes) -> Iterator[Span]:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    try:
        request = ExportTraceServiceRequest.FromString(body)
    except DecodeError as exc:
        raise Refused(400, f"OTLP export is not an ExportTraceServiceRequest: {exc}") from None
    for resource in request.resource_spans:
        for scope in resource.scope_spans:
            for span in scope.spans:
                attributes = {pair.key: _proto_value(pair.value, span.name, 0) for pair in span.attributes}
                yield Span(span.name, span.start_time_unix_nano, span.end_time_unix_nano, attributes,
                           span.status.code == STATUS_ERROR, span.status.message)


def _proto_value(value: Any, name: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise Refused(400, f"span {name[:80]!r}: an attribute value nested deeper than {MAX_DEPTH} levels")
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_proto_value(v, name, depth + 1) for v in value.array_value.values]
    if which == "kvlist_value":
        return {p.key: _proto_value(p.value, name, depth + 1) for p in value.kvlist_value.values}
    return None if which is None else getattr(value, which)
