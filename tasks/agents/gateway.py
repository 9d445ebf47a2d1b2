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
sample's token is a 401; nothing is forwarded. The same token lets the agent's OpenTelemetry
exporter send its spans to the gateway (`/v1/traces`, `tasks.agents.otlp`): its tool spans join
the sample's trajectory as tool results.

Where the money is spent, the gateway holds the run's limits: a sample's calls past
`--max-model-calls`, or past `--max-sample-cost` (the call that would pass it, at the dearest
call seen so far), are refused with a 403 that says which cap; at most `--model-concurrency`
calls are in flight across the run; an upstream 408, 409, 429 or 5xx (or no answer) is retried
up to `--openai-max-attempts` times, after the `Retry-After` it names or a growing pause, each
attempt recorded in the sample's trajectory.
"""

from __future__ import annotations

import json
import random
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tasks.agents.base import AgentContext, AgentError
from tasks.agents.model_calls import MODEL_PATHS, CallBook, RecordedCall, body_text, reply_of
from tasks.agents.openai_client import DEFAULT_BASE_URL
from tasks.agents.otlp import TRACES_PATH, Refused, ToolRun, answer, loads_or_none, read, tool_runs
from tasks.agents.purse import Purse
from tasks.agents.settings import AgentSettings
from tasks.agents.trajectory import capped
from tasks.redaction import redact
from tasks.trace import Trajectory
from tasks.trajectory import usage_counts

# The API paths forwarded (below the gateway's /v1): what the OpenAI SDKs and most agents use.
FORWARDED = (*MODEL_PATHS, "/models")  # the model calls, and the listing of models
MAX_REQUEST_BYTES = 8 << 20
MAX_RESPONSE_BYTES = 64 << 20
TOKEN_PREFIX = "evalpipe-sample-"
# An exporter's trace-only settings, which win over the general ones the agent is given.
OTLP_OVERRIDES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
# Upstream answers worth asking again (the OpenAI SDK's own list), and the longest pause taken.
RETRIED = frozenset({408, 409, 429, 500, 502, 503, 504})
MAX_PAUSE_S = 60.0
# How often the serving thread looks for close(): at the default 0.5 s, each close waited that long.
SHUTDOWN_POLL_S = 0.02

# (model, input tokens, output tokens) -> USD, or None where the price is not known.
CostOf = Callable[[str | None, int | None, int | None], float | None]


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
    max_cost_usd: float | None = None  # `--max-sample-cost`
    purse: Purse | None = field(default=None, repr=False)  # the run's `--max-cost`, across its samples
    cost_of: CostOf | None = field(default=None, repr=False)  # the run's prices
    cost_usd: float = 0.0  # what the answered calls cost, where priced
    dearest_usd: float = 0.0  # the dearest call so far: what the next one may cost
    unpriced: str | None = None  # a model answered with no price: the cost cap cannot hold
    refused: int = 0  # calls refused at a cap
    refusal: str | None = None  # the cap that refused them
    pending: int = 0  # admitted, not yet answered
    book: CallBook | None = None  # `--replay-model-calls`: the sample's calls kept, and answered from
    max_span_bytes: int | None = None  # what the agent's own spans may add to the trajectory
    span_bytes: int = 0
    spans_cut: int = 0  # tool runs left out past `max_span_bytes`
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def admit(self) -> str | None:
        """None when one more call may go out (counted as it is admitted: calls at once too),
        else why not (counted as refused)."""
        with self.lock:
            why = self._refused()
            if why is None:
                self.pending += 1
            return why

    def refuse_past_cap(self) -> str | None:
        """Why the next call must not go out (counted as refused), or None, admitting nothing:
        an in-process call is checked before its SDK sends it, and admitted as its span starts."""
        with self.lock:
            return self._refused()

    def _refused(self) -> str | None:
        why = self._cap_reached()
        if why is not None:
            self.refused += 1
            self.refusal = why
        return why

    def _cap_reached(self) -> str | None:
        if self.max_calls is not None and self.calls + self.pending >= self.max_calls:
            return f"--max-model-calls {self.max_calls}"
        if (self.max_cost_usd is not None and self.dearest_usd
                and self.cost_usd + (self.pending + 1) * self.dearest_usd > self.max_cost_usd):
            return f"--max-sample-cost ${self.max_cost_usd:g} (${self.cost_usd:.6f} spent)"
        return self.purse.refusal(self.pending) if self.purse is not None else None

    def stop_reason(self) -> str | None:
        """The agent error of a sample a cap stopped, naming the cap; None when none did."""
        if not self.refused:
            return None
        return f"stopped at {self.refusal}: the agent asked for {self.refused} more model call(s), refused"

    def attempt_failed(self, status: int | str, attempt: int, attempts: int, pause_s: float) -> None:
        """An upstream failure that was retried, in the trajectory as a note."""
        with self.lock:
            self.entries.append({"note": f"endpoint answered {status} on attempt {attempt} of {attempts};"
                                         f" retried after {pause_s:.2f} s"})

    def ran(self, runs: list[ToolRun]) -> None:
        """Tools' runs reported by spans, with their duration and error, each joined to the
        model's call it names (`call_id`), else to the earliest call of that tool with those
        arguments that no span has answered yet. A run adds them to the result already sent back
        to the model (the next request's tool message, as sent), else it is that call's result,
        placed after it, else it stands at the end. One pass over the trajectory per export: an
        agent's batch holds hundreds of spans."""
        with self.lock:
            turn_of: dict[Any, int] = {}  # call id -> the index of the model turn that made it
            sent: dict[Any, dict[str, Any]] = {}  # call id -> the result sent back to the model
            open_calls: list[tuple[Any, Any, Any]] = []  # (id, tool, arguments) of every call, in order
            for i, entry in enumerate(self.entries):
                for call in _calls(entry):
                    function = call.get("function") or {}
                    turn_of.setdefault(call.get("id"), i)
                    open_calls.append((call.get("id"), function.get("name"), loads_or_none(function.get("arguments"))))
                if entry.get("role") == "tool" and entry.get("tool_call_id"):
                    sent.setdefault(entry["tool_call_id"], entry)
            joined = {e.get("tool_call_id") for e in self.entries if e.get("role") == "tool" and "duration_s" in e}
            after: dict[int, list[dict[str, Any]]] = {}  # results placed after a turn, in the order they came
            for run in runs:
                if not self._room_for(run):
                    continue
                wanted = run.parsed_arguments() if run.call_id is None else None
                call_id = run.call_id or next((i for i, name, arguments in open_calls
                                               if i not in joined and name == run.name and arguments == wanted), None)
                joined.add(call_id)
                entry = run.entry(call_id)
                if call_id in sent:  # what the model saw stays; the span says how it ran
                    sent[call_id].update({k: v for k, v in entry.items() if sent[call_id].get(k) in (None, "")})
                elif call_id in turn_of:
                    after.setdefault(turn_of[call_id], []).append(entry)
                else:
                    self.entries.append(entry)
            for turn in sorted(after, reverse=True):  # from the end: the indexes before stay good
                at = turn + 1
                while at < len(self.entries) and self.entries[at].get("role") == "tool":
                    at += 1
                self.entries[at:at] = after[turn]

    def _room_for(self, run: ToolRun) -> bool:
        """Whether `run` fits under the sample's cap on what spans add (counted if it does); the
        first that does not leaves a note."""
        size = len(json.dumps(run.entry(run.call_id), ensure_ascii=False, default=str).encode("utf-8"))
        if self.max_span_bytes is None or self.span_bytes + size <= self.max_span_bytes:
            self.span_bytes += size
            return True
        if not self.spans_cut:
            self.entries.append({"note": f"the agent's spans passed {self.max_span_bytes:,} bytes"
                                         " (--max-trajectory-bytes): later tool runs not recorded"})
        self.spans_cut += 1
        return False

    def record(self, request: dict[str, Any], reply: dict[str, Any] | None, latency_s: float, status: int | str, *,
               digest: str | None = None, replayed: bool = False) -> None:
        """One answered call (`replayed`: from an earlier run's record, so its tokens are shown
        on its turn but not spent, nor priced); `digest`: its request's, on its turn."""
        messages = request.get("messages") if isinstance(request.get("messages"), list) else []
        with self.lock:
            self.calls += 1
            self.pending -= 1
            self.latency_s += latency_s
            # The conversation so far arrives whole each time: only what is new is recorded.
            fresh = messages[self.seen_messages:] if len(messages) > self.seen_messages else messages[-1:]
            self.entries += [m for m in fresh if isinstance(m, dict) and m.get("role") != "assistant"]
            if reply is None:  # `status`: an HTTP status, or what went wrong instead
                why = f"HTTP {status} from the endpoint" if isinstance(status, int) else status
                self.entries.append({"error": why, "model": request.get("model")})
                return
            turn = _turn(reply)
            inp, out = usage_counts(reply.get("usage"))
            marks = {"request_sha256": digest} if digest is not None else {}
            if replayed:
                # Nothing was bought: the sample's tokens are known, and none of them are these.
                self.input_tokens, self.output_tokens = self.input_tokens or 0, self.output_tokens or 0
                self.model = reply.get("model") if isinstance(reply.get("model"), str) else self.model
                self.entries.append({**turn, "usage": {"input_tokens": inp, "output_tokens": out}, "replayed": True,
                                     "latency_s": round(latency_s, 6), "model": self.model, **marks})
                self.seen_messages = len(messages) + 1
                return
            if (note := self._bought(reply.get("model"), inp, out)) is not None:
                self.entries.append(note)
            self.entries.append({**turn, "usage": {"input_tokens": inp, "output_tokens": out},
                                 "latency_s": round(latency_s, 6), "model": self.model, **marks})
            self.seen_messages = len(messages) + 1

    def paid(self, model: str | None, input_tokens: int | None, output_tokens: int | None, *,
             replayed: bool = False) -> dict[str, Any] | None:
        """One answered call of an agent that records its own turns (`openai:`'s loop): counted,
        and unless `replayed` its tokens priced and spent, as `record` does; the note its
        trajectory gets when the model has no price and a cost cap is on, else None."""
        with self.lock:
            self.calls += 1
            self.pending -= 1
            if replayed:
                self.input_tokens, self.output_tokens = self.input_tokens or 0, self.output_tokens or 0
                return None
            return self._bought(model, input_tokens, output_tokens)

    def _bought(self, model: Any, inp: int | None, out: int | None) -> dict[str, Any] | None:
        """A call's tokens added, priced and spent from the caps (the lock held); a note when
        its model has no price and a cost cap cannot count it (once per sample)."""
        if inp is not None:
            self.input_tokens = (self.input_tokens or 0) + inp
        if out is not None:
            self.output_tokens = (self.output_tokens or 0) + out
        self.model = model if isinstance(model, str) else self.model
        if self.cost_of is None or (inp is None and out is None):
            return None
        cost = self.cost_of(self.model, inp, out)
        if cost is not None:
            self.cost_usd += cost
            self.dearest_usd = max(self.dearest_usd, cost)
            if self.purse is not None:
                self.purse.spend(cost)
            return None
        caps = [name for name, on in (("--max-sample-cost", self.max_cost_usd is not None),
                                      ("--max-cost", self.purse is not None)) if on]
        first = caps and self.unpriced is None
        self.unpriced = self.model
        return {"note": f"no price for model {self.model!r}: {' and '.join(caps)} cannot count this sample's"
                        " calls"} if first else None


def _calls(entry: dict[str, Any]) -> list[dict[str, Any]]:
    calls = entry.get("tool_calls") if entry.get("role") == "assistant" else None
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the listen backlog: agents at once, each with a call in flight (default 5)


class Gateway:
    """The gateway for one endpoint and key, on 127.0.0.1 (a free port) until `close()`: each
    request waits `timeout_s` at most, is tried `max_attempts` times at most, and at most
    `concurrency` are in flight upstream at once (None: no cap)."""

    def __init__(self, upstream: str, api_key: str | None, timeout_s: float = 60.0, max_attempts: int = 1,
                 concurrency: int | None = None):
        self.upstream, self._key, self.timeout_s = upstream.rstrip("/"), api_key, timeout_s
        self.max_attempts = max_attempts
        self._slots = threading.BoundedSemaphore(concurrency) if concurrency else None
        self.in_flight = self.most_in_flight = 0  # upstream calls now, and the most at once
        self._taps: dict[str, Tap] = {}
        # A long-lived worker's token: the tap of the sample it is drawing, None between samples.
        self._leases: dict[str, Tap | None] = {}
        self._lock = threading.Lock()
        self.refused = 0  # requests with no valid token
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                         name="evalpipe-gateway", daemon=True).start()

    def grant(self, max_calls: int | None = None, max_cost_usd: float | None = None,
              cost_of: CostOf | None = None, book: CallBook | None = None,
              lease: str | None = None, purse: Purse | None = None,
              max_span_bytes: int | None = None) -> tuple[str, Tap]:
        """A token good for one sample (at most `max_calls` model calls and `max_cost_usd` spent,
        priced by `cost_of`), and the tap its calls are recorded in (and `book`, with
        `--replay-model-calls`, kept in and answered from). `lease`: a worker's token (`lease`),
        given to this sample until it is revoked. `purse`: the run's `--max-cost`, which its calls
        spend from. `max_span_bytes`: what the agent's own spans may add to its trajectory."""
        tap = Tap(max_calls=max_calls, max_cost_usd=max_cost_usd, cost_of=cost_of, book=book, purse=purse,
                  max_span_bytes=max_span_bytes)
        with self._lock:
            if lease is not None:
                if lease not in self._leases:
                    raise KeyError("an ended lease")
                self._leases[lease] = tap
                return lease, tap
            token = TOKEN_PREFIX + secrets.token_urlsafe(24)
            self._taps[token] = tap
        return token, tap

    def revoke(self, token: str) -> None:
        """The sample holding `token` has ended: a sample's token is no longer good; a worker's
        lease is good for no sample until its next grant."""
        with self._lock:
            self._taps.pop(token, None)
            if token in self._leases:
                self._leases[token] = None

    def lease(self) -> str:
        """A token for a worker that draws many samples one at a time (`pyworker:`, `cmdworker:`):
        its environment holds it for its life, and its calls are the sample's it was granted to."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(24)
        with self._lock:
            self._leases[token] = None
        return token

    def environ(self, passed: Mapping[str, str], token: str) -> dict[str, str]:
        """`passed` with the endpoint and key replaced by the gateway's address and `token`, and
        an OpenTelemetry exporter's endpoint and headers (the standard variables) naming the
        gateway and `token` too: a trace-only endpoint or header of `passed` would send the
        sample's spans, and its token, elsewhere, so it is dropped."""
        kept = {k: v for k, v in passed.items() if k not in OTLP_OVERRIDES}
        otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": self.url.removesuffix("/v1"),
                "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{token}"}  # percent-encoded, as specified
        if passed.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").startswith("grpc"):
            otlp["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"  # the gateway speaks OTLP/HTTP only
        return {**kept, "OPENAI_BASE_URL": self.url, "OPENAI_API_BASE": self.url, "OPENAI_API_KEY": token, **otlp}

    def end_lease(self, token: str) -> None:
        with self._lock:
            self._leases.pop(token, None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def send(self, request: urllib.request.Request, tap: Tap) -> Any:
        """The endpoint's answer to `request` (an HTTP error's too, once retrying is over),
        holding one of the run's upstream slots until it is closed; `OSError` when it never
        answered. A retried failure is noted in `tap`."""
        for attempt in range(1, self.max_attempts + 1):
            slot = self._slots if self._slots is not None else nullcontext()
            slot.__enter__()
            with self._lock:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                return _Held(urllib.request.urlopen(request, timeout=self.timeout_s), self, slot)  # noqa: S310 - the configured endpoint
            except urllib.error.HTTPError as exc:
                failed, status, headers = exc, exc.code, exc.headers
            except OSError as exc:
                failed, status, headers = exc, "no answer", None
            self._release(slot)
            last = attempt == self.max_attempts
            if isinstance(failed, urllib.error.HTTPError) and (last or status not in RETRIED):
                return _Held(failed, self, None)
            if last:
                raise failed
            pause = _pause(headers, attempt)
            if isinstance(failed, urllib.error.HTTPError):
                failed.close()
            tap.attempt_failed(status, attempt, self.max_attempts, pause)
            time.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _release(self, slot: Any) -> None:
        with self._lock:
            self.in_flight -= 1
        slot.__exit__(None, None, None)

    def _tap(self, header: str | None) -> Tap | None:
        token = (header or "").removeprefix("Bearer ").strip()
        with self._lock:
            return self._taps.get(token) or self._leases.get(token)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if (tap := self._sample()) is not None:
                    self._forward(tap, b"")

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not 0 <= length <= MAX_REQUEST_BYTES:
                    self.close_connection = True  # the body is left unread: nothing more is read from it
                    status = 400 if length < 0 else 413
                    self._fail(status, "Content-Length is not a length" if length < 0
                               else f"request body over {MAX_REQUEST_BYTES} bytes")
                    return
                body = self.rfile.read(length)
                if (tap := self._sample()) is None:
                    return
                if self.path.split("?", 1)[0] == TRACES_PATH:
                    self._traces(tap, body)
                else:
                    self._forward(tap, body)

            def _sample(self) -> Tap | None:
                """The sample the request's token is good for; None, answered 401, when none is."""
                tap = gateway._tap(self.headers.get("Authorization"))
                if tap is None:
                    gateway.refused += 1
                    self._fail(401, "evalpipe gateway: unknown, expired or another sample's token")
                return tap

            def _traces(self, tap: Tap, body: bytes) -> None:
                """An OTLP trace export of the agent's: its tool spans are the sample's tool runs."""
                content_type = self.headers.get("Content-Type")
                try:
                    spans = read(body, content_type, self.headers.get("Content-Encoding"), MAX_REQUEST_BYTES,
                                 tap.max_span_bytes or MAX_REQUEST_BYTES)
                except Refused as exc:
                    self._fail(exc.status, f"evalpipe gateway: {exc}")
                    return
                tap.ran(tool_runs(spans))
                self._send(200, *answer(content_type))

            def _forward(self, tap: Tap, body: bytes) -> None:
                suffix = self.path.split("?", 1)[0].removeprefix("/v1")
                if suffix not in FORWARDED:
                    self._fail(404, f"evalpipe gateway: {suffix!r} is not forwarded")
                    return
                try:
                    request = json.loads(body) if body else {}
                except ValueError:
                    self._fail(400, "request body is not JSON")
                    return
                if suffix != "/models" and (why := tap.admit()) is not None:
                    self._fail(403, f"evalpipe: {why} reached for this sample: no more model calls")
                    return
                digest = ordinal = recorded = None
                if tap.book is not None and suffix != "/models":
                    digest, ordinal, recorded = tap.book.ask(suffix, request if isinstance(request, dict) else {})
                if recorded is not None:
                    self._replay(tap, request, recorded)
                    return
                headers = {"Content-Type": "application/json", "Accept": self.headers.get("Accept") or "*/*"}
                if gateway._key:
                    headers["Authorization"] = f"Bearer {gateway._key}"
                upstream = urllib.request.Request(gateway.upstream + suffix, data=body or None, headers=headers,
                                                  method=self.command)
                started = time.perf_counter()
                try:
                    answer = gateway.send(upstream, tap)
                except OSError as exc:
                    self._fail(502, f"evalpipe gateway: the endpoint did not answer: {exc}")
                    tap.record(request, None, time.perf_counter() - started, 502)
                    if tap.book is not None:
                        tap.book.forwarded_unkept()
                    return
                with answer:
                    self.send_response(answer.status)
                    self.send_header("Content-Type", answer.headers.get("Content-Type") or "application/json")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    got, size, cut, broken = [], 0, False, None
                    try:
                        while chunk := answer.read1(65536) if hasattr(answer, "read1") else answer.read(65536):
                            size += len(chunk)
                            if size > MAX_RESPONSE_BYTES:
                                cut = True
                                break
                            self.wfile.write(chunk)
                            self.wfile.flush()  # a stream reaches the agent as it arrives
                            got.append(chunk)
                    except TimeoutError:
                        broken = (f"the endpoint's answer stalled past --openai-timeout {gateway.timeout_s:g} s"
                                  f" after {size:,} bytes: cut")
                        if request.get("stream"):  # an error event: the SDKs raise it, not a short answer
                            error = {"error": {"message": f"evalpipe gateway: {broken}", "type": "evalpipe_gateway"}}
                            self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
                    except OSError as exc:  # the agent hung up, or the endpoint's connection broke
                        broken = f"the answer broke off after {size:,} bytes: {exc.strerror or exc}"
                    self.close_connection = True
                data = b"".join(got)
                if suffix == "/models":
                    return
                if answer.status >= 400 or broken is not None:
                    tap.record(request, None, time.perf_counter() - started, broken or answer.status)
                    if tap.book is not None:
                        tap.book.forwarded_unkept()
                    return
                tap.record(request, reply_of(data, bool(request.get("stream"))), time.perf_counter() - started,
                           answer.status, digest=digest)
                if tap.book is not None:
                    # Kept as the endpoint sent it, to be sent again as it was; one cut at the cap is not.
                    kept = None if cut else body_text(data)
                    if kept is None or digest is None or ordinal is None:
                        tap.book.forwarded_unkept()
                    else:
                        tap.book.keep(RecordedCall(suffix, digest, ordinal, answer.headers.get("Content-Type")
                                                   or "application/json", kept), replayed=False)

            def _replay(self, tap: Tap, request: Any, recorded: RecordedCall) -> None:
                """Answer from an earlier run's record, as the endpoint sent it: a stream event by event."""
                started = time.perf_counter()
                data = recorded.body.encode("utf-8")
                self.send_response(200)
                self.send_header("Content-Type", recorded.content_type)
                if recorded.streamed:
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for line in data.splitlines(keepends=True):
                        self.wfile.write(line)
                        if not line.strip():  # an event ends at a blank line: sent as it ends
                            self.wfile.flush()
                    self.wfile.flush()
                    self.close_connection = True
                else:
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                reply = recorded.reply()
                tap.record(request, reply, time.perf_counter() - started, 200, digest=recorded.request_sha256,
                           replayed=True)
                assert tap.book is not None  # a record comes from the book
                tap.book.keep(recorded, replayed=True, tokens=usage_counts(reply.get("usage")))

            def _fail(self, status: int, message: str) -> None:
                self._send(status, json.dumps({"error": {"message": message, "type": "evalpipe_gateway"}}).encode(),
                           "application/json")

            def _send(self, status: int, data: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


class _Held:
    """An upstream answer that holds its slot (None: none) until it is closed."""

    def __init__(self, answer: Any, gateway: Gateway, slot: Any):
        self.answer, self._gateway, self._slot = answer, gateway, slot

    def __getattr__(self, name: str) -> Any:
        return getattr(self.answer, name)

    def __enter__(self) -> Any:
        return self.answer

    def __exit__(self, *exc: object) -> None:
        self.answer.close()
        if self._slot is not None:
            slot, self._slot = self._slot, None
            self._gateway._release(slot)


def _pause(headers: Any, attempt: int) -> float:
    """How long to wait before attempt `attempt + 1`: what the endpoint asked (`retry-after-ms`,
    `Retry-After` in seconds), else 0.5 s doubled each time, with jitter; at most MAX_PAUSE_S."""
    for name, scale in (("retry-after-ms", 1e-3), ("Retry-After", 1.0)):
        raw = headers.get(name) if headers is not None else None
        try:
            asked = float(raw) * scale if raw is not None else None
        except ValueError:
            asked = None  # an HTTP date: the growing pause instead
        if asked is not None and asked >= 0:
            return min(asked, MAX_PAUSE_S)
    return min(0.5 * 2 ** (attempt - 1) * random.uniform(0.75, 1.25), MAX_PAUSE_S)


_GATEWAYS: dict[tuple[str, str | None, float, int, int | None], Gateway] = {}
_MADE = threading.Lock()


def gateway_for(upstream: str, api_key: str | None, settings: AgentSettings) -> Gateway:
    """The process's gateway for this endpoint, key and the run's limits, started on first use."""
    key = (upstream, api_key, settings.openai_timeout, settings.openai_max_attempts, settings.model_concurrency)
    with _MADE:
        made = _GATEWAYS.get(key)
        if made is None:
            made = _GATEWAYS[key] = Gateway(upstream, api_key, settings.openai_timeout, settings.openai_max_attempts,
                                            settings.model_concurrency)
        return made


@dataclass(frozen=True)
class Grant:
    """One sample's passage through the gateway: its token, where its calls are recorded, and
    what the agent's environment says instead of the real endpoint and key."""

    gateway: Gateway
    token: str
    tap: Tap

    def environ(self, passed: Mapping[str, str]) -> dict[str, str]:
        return self.gateway.environ(passed, self.token)

    def revoke(self) -> None:
        self.gateway.revoke(self.token)  # good for this sample only, and only while it runs

    def masked(self, text: str) -> str:
        """`text` with the secrets and the sample's token masked, wherever the agent wrote them."""
        return redact(text, also=[self.token])

    def settle(self, ctx: AgentContext, own: Trajectory | None, cap: int) -> Trajectory | None:
        """What the sample used is what the gateway saw. Its trajectory is the one the agent
        recorded itself (`own`) when that holds its model turns (it knows its tools' results),
        else the gateway's calls followed by what it wrote. `AgentError` naming the cap that
        stopped it, if one did."""
        tap = self.tap
        own = tapped(tap, ctx, own, cap)
        if own is not None:  # the calls' messages hold what the agent's tools printed: the token too
            own = Trajectory.model_validate(json.loads(self.masked(own.model_dump_json())))
        if (stopped := tap.stop_reason()) is not None:
            if own is not None:
                ctx.trace.trajectory = own
            raise AgentError(stopped)
        return own


def tapped(tap: Tap, ctx: AgentContext, own: Trajectory | None, cap: int) -> Trajectory | None:
    """The one rule for a sample whose model calls were tapped (by the gateway, or captured in
    process): its usage is what the tap saw; its trajectory the one the agent recorded itself
    (`own`) when that holds its model turns (it knows its tools' results), else the tapped calls
    (each tool call's first result only) followed by what it wrote, up to `cap` bytes."""
    if not tap.calls:
        if tap.refused:  # it asked, and a cap refused every call: it used nothing, which is known
            ctx.report_usage(input_tokens=0, output_tokens=0)
        return own
    ctx.report_usage(input_tokens=tap.input_tokens, output_tokens=tap.output_tokens, model=tap.model)
    ctx.report_latency(tap.latency_s)
    if own is not None and own.typed.turns:
        return own
    with tap.lock:
        entries = _answered_once(tap.entries)
    return capped([*entries, *(own.entries if own is not None else [])], cap)


def _answered_once(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tool call's first result only: a tool's result recorded as it ran (an Agents SDK
    tool's span, with its duration and error) comes again in the next request's messages."""
    seen: set[str] = set()
    kept = []
    for entry in entries:
        call_id = entry.get("tool_call_id") if entry.get("role") == "tool" else None
        if call_id:
            if call_id in seen:
                continue
            seen.add(call_id)
        kept.append(entry)
    return kept


def grant_for(passed: Mapping[str, str], settings: AgentSettings, ctx: AgentContext,
              lease: str | None = None) -> Grant | None:
    """The sample's grant when its environment (`passed`) names an OpenAI-compatible endpoint
    or key, on the process's gateway for them; None when it names neither. `lease`: the token
    of the worker that draws the sample, granted to it instead of a token of its own."""
    gateway = gateway_of(passed, settings)
    if gateway is None:
        return None
    token, tap = gateway.grant(settings.max_model_calls, settings.max_sample_cost, ctx.cost_of, ctx.calls, lease,
                               ctx.purse, settings.max_trajectory_bytes)
    return Grant(gateway, token, tap)


def gateway_of(passed: Mapping[str, str], settings: AgentSettings) -> Gateway | None:
    """The process's gateway for the endpoint and key `passed` names; None when it names neither."""
    if "OPENAI_API_KEY" not in passed and "OPENAI_BASE_URL" not in passed:
        return None
    return gateway_for(passed.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL, passed.get("OPENAI_API_KEY"), settings)
