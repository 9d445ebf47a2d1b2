"""The model gateway (docs/agents.md "The model gateway"): an OpenAI-compatible endpoint on
this machine's loopback that an out-of-process agent (a `--workspace` one) is pointed at
instead of the real one, so that its model calls are recorded and the real key never enters
its sandbox.

Each sample is granted a token of its own (`grant`), valid until the sample ends (`revoke`).
The agent's environment gets the gateway's URL as `OPENAI_BASE_URL` (and `OPENAI_API_BASE`)
and its token as `OPENAI_API_KEY`. The gateway checks the token, forwards the request body to
the configured endpoint (never a URL the agent names) with the real key and no header of the
agent's, passes the answer back (a streamed one as it arrives), and records the call into the
sample's tap: the new messages of the request and the model's turn, with its usage and
latency, in the trajectory's OpenAI shape (`tasks.trajectory`). A forged, revoked or another
sample's token is a 401; nothing is forwarded.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tasks.trajectory import usage_counts

# The API paths forwarded (below the gateway's /v1): what the OpenAI SDKs and most agents use.
FORWARDED = ("/chat/completions", "/responses", "/models", "/embeddings", "/completions")
MAX_REQUEST_BYTES = 8 << 20
MAX_RESPONSE_BYTES = 64 << 20
TOKEN_PREFIX = "evalpipe-sample-"


@dataclass
class Tap:
    """What one sample's agent asked through the gateway."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    latency_s: float = 0.0
    model: str | None = None
    seen_messages: int = 0  # how many of the conversation's messages are recorded
    max_calls: int | None = None  # `--max-model-calls`: the call past it is refused
    refused: int = 0  # calls refused at the cap
    pending: int = 0  # admitted, not yet answered
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def admit(self) -> bool:
        """Whether one more call may go out (counted as it is admitted: calls at once too)."""
        with self.lock:
            if self.max_calls is not None and self.calls + self.pending >= self.max_calls:
                self.refused += 1
                return False
            self.pending += 1
            return True

    def record(self, request: dict[str, Any], reply: dict[str, Any] | None, latency_s: float, status: int) -> None:
        messages = request.get("messages") if isinstance(request.get("messages"), list) else []
        with self.lock:
            self.calls += 1
            self.pending -= 1
            self.latency_s += latency_s
            # The conversation so far arrives whole each time: only what is new is recorded.
            fresh = messages[self.seen_messages:] if len(messages) > self.seen_messages else messages[-1:]
            self.entries += [m for m in fresh if isinstance(m, dict) and m.get("role") != "assistant"]
            if reply is None:
                self.entries.append({"error": f"HTTP {status} from the endpoint", "model": request.get("model")})
                return
            turn = _turn(reply)
            inp, out = usage_counts(reply.get("usage"))
            if inp is not None:
                self.input_tokens = (self.input_tokens or 0) + inp
            if out is not None:
                self.output_tokens = (self.output_tokens or 0) + out
            self.model = reply.get("model") if isinstance(reply.get("model"), str) else self.model
            self.entries.append({**turn, "usage": {"input_tokens": inp, "output_tokens": out},
                                 "latency_s": round(latency_s, 6), "model": self.model})
            self.seen_messages = len(messages) + 1


def _turn(reply: dict[str, Any]) -> dict[str, Any]:
    """The model's turn of a chat completion (its first choice's message) or of a Responses
    API answer (its output text and function calls), as an assistant message."""
    choices = reply.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message") or {}
        turn = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            turn["tool_calls"] = message["tool_calls"]
        return turn
    texts, calls = [], []
    for item in reply.get("output") or []:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call":
            calls.append({"id": item.get("call_id"), "type": "function",
                          "function": {"name": item.get("name"), "arguments": item.get("arguments")}})
        for part in item.get("content") or []:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
    return {"role": "assistant", "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {})}


def _streamed(body: bytes) -> dict[str, Any]:
    """A chat completion rebuilt from its server-sent events: content, tool calls, usage."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    reply: dict[str, Any] = {}
    for line in body.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        reply["model"] = event.get("model", reply.get("model"))
        if isinstance(event.get("usage"), dict):
            reply["usage"] = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            for part in delta.get("tool_calls") or []:
                call = calls.setdefault(part.get("index", 0), {"id": None, "type": "function",
                                                               "function": {"name": "", "arguments": ""}})
                call["id"] = part.get("id") or call["id"]
                function = part.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
    message = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {**reply, "choices": [{"message": message}]}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the listen backlog: agents at once, each with a call in flight (default 5)


class Gateway:
    """The gateway for one endpoint and key, on 127.0.0.1 (a free port) until `close()`."""

    def __init__(self, upstream: str, api_key: str | None, timeout_s: float = 60.0):
        self.upstream, self._key, self.timeout_s = upstream.rstrip("/"), api_key, timeout_s
        self._taps: dict[str, Tap] = {}
        self._lock = threading.Lock()
        self.refused = 0  # requests with no valid token
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, name="evalpipe-gateway", daemon=True).start()

    def grant(self, max_calls: int | None = None) -> tuple[str, Tap]:
        """A token good for one sample (at most `max_calls` model calls), and the tap its calls
        are recorded in."""
        token, tap = TOKEN_PREFIX + secrets.token_urlsafe(24), Tap(max_calls=max_calls)
        with self._lock:
            self._taps[token] = tap
        return token, tap

    def revoke(self, token: str) -> None:
        with self._lock:
            self._taps.pop(token, None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _tap(self, header: str | None) -> Tap | None:
        token = (header or "").removeprefix("Bearer ").strip()
        with self._lock:
            return self._taps.get(token)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._forward(b"")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_REQUEST_BYTES:
                    self._fail(413, f"request body over {MAX_REQUEST_BYTES} bytes")
                    return
                self._forward(self.rfile.read(length))

            def _forward(self, body: bytes) -> None:
                tap = gateway._tap(self.headers.get("Authorization"))
                if tap is None:
                    gateway.refused += 1
                    self._fail(401, "evalpipe gateway: unknown, expired or another sample's token")
                    return
                suffix = self.path.split("?", 1)[0].removeprefix("/v1")
                if suffix not in FORWARDED:
                    self._fail(404, f"evalpipe gateway: {suffix!r} is not forwarded")
                    return
                try:
                    request = json.loads(body) if body else {}
                except ValueError:
                    self._fail(400, "request body is not JSON")
                    return
                if suffix != "/models" and not tap.admit():
                    self._fail(403, f"evalpipe: --max-model-calls {tap.max_calls} reached for this sample:"
                                    " no more model calls")
                    return
                headers = {"Content-Type": "application/json", "Accept": self.headers.get("Accept") or "*/*"}
                if gateway._key:
                    headers["Authorization"] = f"Bearer {gateway._key}"
                upstream = urllib.request.Request(gateway.upstream + suffix, data=body or None, headers=headers,
                                                  method=self.command)
                started = time.perf_counter()
                try:
                    answer = urllib.request.urlopen(upstream, timeout=gateway.timeout_s)  # noqa: S310 - the configured endpoint
                except urllib.error.HTTPError as exc:
                    answer = exc
                except OSError as exc:
                    self._fail(502, f"evalpipe gateway: the endpoint did not answer: {exc}")
                    tap.record(request, None, time.perf_counter() - started, 502)
                    return
                with answer:
                    self.send_response(answer.status)
                    self.send_header("Content-Type", answer.headers.get("Content-Type") or "application/json")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    got, size = [], 0
                    while chunk := answer.read1(65536) if hasattr(answer, "read1") else answer.read(65536):
                        size += len(chunk)
                        if size > MAX_RESPONSE_BYTES:
                            break
                        self.wfile.write(chunk)
                        self.wfile.flush()  # a stream reaches the agent as it arrives
                        got.append(chunk)
                    self.close_connection = True
                data = b"".join(got)
                if suffix == "/models":
                    return
                if answer.status >= 400:
                    tap.record(request, None, time.perf_counter() - started, answer.status)
                    return
                try:
                    reply = _streamed(data) if request.get("stream") else json.loads(data)
                except ValueError:
                    reply = {}
                tap.record(request, reply if isinstance(reply, dict) else {}, time.perf_counter() - started,
                           answer.status)

            def _fail(self, status: int, message: str) -> None:
                data = json.dumps({"error": {"message": message, "type": "evalpipe_gateway"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


_GATEWAYS: dict[tuple[str, str | None], Gateway] = {}
_MADE = threading.Lock()


def gateway_for(upstream: str, api_key: str | None, timeout_s: float) -> Gateway:
    """The process's gateway for this endpoint and key, started on first use."""
    with _MADE:
        made = _GATEWAYS.get((upstream, api_key))
        if made is None:
            made = _GATEWAYS[(upstream, api_key)] = Gateway(upstream, api_key, timeout_s)
        return made
