"""Replay of model calls (`--replay-model-calls`, docs/agents.md "Replay").

With the option, every model call a sample makes through the gateway is kept with its
sample (the trace's `model_calls` section): the request's digest (sha256 of its canonical
JSON body, keys sorted, nothing left out), its ordinal among the identical requests of the
sample, and the reply body as the endpoint sent it (a streamed one as its server-sent
events). A later run of the same agent spec draws the same case, sample index and seed
with the latest such record (`CallBook`): a request identical to a recorded one, at the
same ordinal, is answered from it and goes nowhere; any other is forwarded. Once a tool's
changed result enters the conversation, every later request differs: a run pays only from
the first changed request on.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.models import canonical_json, sha256_hex

# The API paths of model calls (what replay answers and `--model-concurrency` holds), the
# longest first where one ends another.
MODEL_PATHS = ("/chat/completions", "/responses", "/embeddings", "/completions")
# The trace key the section is stored under.
TRACE_KEY = "model_calls"
# The reply bodies kept per sample: past it a call is still answered and counted, but not
# kept, so a later run forwards it (the section says how many were left out).
RECORDED_BYTES_CAP = 8 << 20


def request_digest(request: Mapping[str, Any]) -> str:
    """The sha256 of a request body's canonical JSON (`canonical_json`: keys sorted, no
    whitespace), nothing left out: a reordered key is the same request, a changed
    `temperature` or `stream_options` another."""
    return sha256_hex(canonical_json(dict(request)))


@dataclass(frozen=True)
class RecordedCall:
    """One answered call: what asked it (the API path, the request's digest and ordinal),
    and the endpoint's reply as it sent it."""

    path: str
    request_sha256: str
    ordinal: int
    content_type: str
    body: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "request_sha256": self.request_sha256, "ordinal": self.ordinal,
                "content_type": self.content_type, "body": self.body}

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    def reply(self) -> dict[str, Any]:
        """The reply the recorded body holds (`reply_of`)."""
        return reply_of(self.body.encode("utf-8"), self.streamed)


def reply_of(body: bytes, streamed: bool) -> dict[str, Any]:
    """The reply a model call's body holds: its JSON object, or (`streamed`) the one its
    server-sent events rebuild; {} when it holds neither."""
    try:
        reply = streamed_reply(body) if streamed else json.loads(body)
    except ValueError:
        return {}
    return reply if isinstance(reply, dict) else {}


def streamed_reply(body: bytes) -> dict[str, Any]:
    """A chat completion rebuilt from its server-sent events: content, tool calls, usage; or a
    streamed Responses API answer, whose last event (`response.completed`) holds it whole."""
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
        if not isinstance(event, dict):
            continue
        if event.get("type") == "response.completed" and isinstance(event.get("response"), dict):
            return event["response"]
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


def body_text(data: bytes) -> str | None:
    """A reply body as text to keep; None when it is not UTF-8 (it could not be sent again as it was)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def recorded_calls(section: Any) -> tuple[RecordedCall, ...]:
    """The calls a stored `model_calls` section holds; what does not read as one is left
    out (a later evalpipe's extra keys are ignored)."""
    calls = section.get("calls") if isinstance(section, Mapping) else None
    found = []
    for doc in calls if isinstance(calls, list) else []:
        try:
            found.append(RecordedCall(str(doc["path"]), str(doc["request_sha256"]), int(doc["ordinal"]),
                                      str(doc["content_type"]), str(doc["body"])))
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(found)


@dataclass
class CallBook:
    """One sample's model calls under `--replay-model-calls`: the earlier run's, to answer
    from, and this draw's, kept for the next. Shared by the gateway's threads."""

    earlier: Sequence[RecordedCall] = ()
    kept: list[RecordedCall] = field(default_factory=list)
    replayed: int = 0
    forwarded: int = 0
    # Tokens of the replayed calls, as recorded: shown, never spent (None: none reported).
    replayed_input_tokens: int | None = None
    replayed_output_tokens: int | None = None
    left_out: int = 0  # calls not kept: past RECORDED_BYTES_CAP
    _kept_bytes: int = 0
    _seen: Counter[tuple[str, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._answers = {(c.path, c.request_sha256, c.ordinal): c for c in self.earlier}

    def ask(self, path: str, request: Mapping[str, Any]) -> tuple[str, int, RecordedCall | None]:
        """The request's digest, its ordinal among the identical requests of the sample so
        far (counted as it arrives), and the recorded answer to it, if any."""
        digest = request_digest(request)
        with self._lock:
            ordinal = self._seen[(path, digest)]
            self._seen[(path, digest)] += 1
        return digest, ordinal, self._answers.get((path, digest, ordinal))

    def keep(self, call: RecordedCall, *, replayed: bool, tokens: tuple[int | None, int | None] = (None, None)) -> None:
        """An answered call (`replayed`: from the record; its `tokens` then counted apart)."""
        size = len(call.body.encode("utf-8"))
        with self._lock:
            if replayed:
                self.replayed += 1
                inp, out = tokens
                if inp is not None:
                    self.replayed_input_tokens = (self.replayed_input_tokens or 0) + inp
                if out is not None:
                    self.replayed_output_tokens = (self.replayed_output_tokens or 0) + out
            else:
                self.forwarded += 1
            if self._kept_bytes + size > RECORDED_BYTES_CAP:
                self.left_out += 1
                return
            self._kept_bytes += size
            self.kept.append(call)

    def forwarded_unkept(self) -> None:
        """A call forwarded and not answered (an error status, no answer): counted, not kept."""
        with self._lock:
            self.forwarded += 1

    def section(self) -> dict[str, Any]:
        """The trace's `model_calls` section."""
        with self._lock:
            doc: dict[str, Any] = {"replayed": self.replayed, "forwarded": self.forwarded}
            if self.replayed:
                doc["replayed_tokens"] = {"input": self.replayed_input_tokens, "output": self.replayed_output_tokens}
            if self.left_out:
                doc["left_out"] = self.left_out
            doc["calls"] = [c.to_json() for c in self.kept]
            return doc
