"""Model calls an SDK makes in evalpipe's own process, on their way out: the run's
`--model-concurrency` slots, and under `--replay-model-calls` the sample's `CallBook`, as the
gateway applies them to an agent in another process (docs/agents.md "Replay", "Limits").

Two kinds of agent call the endpoint from this process: `openai:` (evalpipe's own tool loop,
whose client sends through `Routed`) and a `python:` agent's own OpenAI SDK clients (reached
by in-process capture, `tasks.agents.capture`, which wraps httpx's transports). Either way a
request is routed only while its sample is drawn (`routing`) and only while the SDK sends one
of its requests (`calling`): the agent's other HTTP (a tool's own API) is never held nor
replayed. A replayed call is answered here with the recorded body, so the SDK parses it as it
parsed the original; `CallMark.replayed` tells whoever records the call's tokens that none of
them were bought.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import httpx2 as httpx  # the OpenAI SDK's HTTP library (an httpx of its own)

from tasks.agents.model_calls import MODEL_PATHS, CallBook, RecordedCall, body_text
from tasks.trajectory import usage_counts

# How often an async call waiting for a slot looks again (a thread would hold a worker of the
# event loop's executor for the whole wait).
_SLOT_POLL_S = 0.002
# The last event of a chat completions stream, and of a Responses API one.
_STREAM_ENDS = re.compile(rb"data: \[DONE\]|\"type\": ?\"response\.completed\"")
_ROUTED = "evalpipe_routed"  # a request's extension: routed once, by the outermost transport


@dataclass
class CallMark:
    """One SDK request as it is being sent: whether the answer came from the record."""

    replayed: bool = False
    request_sha256: str | None = None  # under `--replay-model-calls`: its request's digest


@dataclass(frozen=True)
class SampleCalls:
    """What a sample's in-process calls pass through: its replay book, the run's slots."""

    book: CallBook | None = None
    slots: threading.Semaphore | None = None


_SAMPLE: ContextVar[SampleCalls | None] = ContextVar("evalpipe_sample_calls", default=None)
_CALL: ContextVar[CallMark | None] = ContextVar("evalpipe_sdk_call", default=None)


@cache
def model_slots(concurrency: int) -> threading.BoundedSemaphore:
    """The process's slots for `--model-concurrency N`: one set per N, shared by the runs of
    this process that ask for the same N (as the gateway is)."""
    return threading.BoundedSemaphore(concurrency)


def sample_calls(book: CallBook | None, concurrency: int | None) -> SampleCalls | None:
    """The routing of a sample with `book` under `concurrency` slots; None when neither applies."""
    if book is None and concurrency is None:
        return None
    return SampleCalls(book, None if concurrency is None else model_slots(concurrency))


@contextmanager
def routing(calls: SampleCalls | None) -> Iterator[None]:
    """Inside (this thread or task, and what it starts with a copy of its context), the SDK's
    model calls go through `calls`."""
    token = _SAMPLE.set(calls)
    try:
        yield
    finally:
        _SAMPLE.reset(token)


@contextmanager
def calling() -> Iterator[CallMark]:
    """Around one SDK request: the mark its routing sets (the outer one's, when the request
    is already marked: `openai:`'s client, seen again by in-process capture)."""
    mark = _CALL.get()
    if mark is not None:
        yield mark
        return
    mark = CallMark()
    token = _CALL.set(mark)
    try:
        yield mark
    finally:
        _CALL.reset(token)


def current_mark() -> CallMark | None:
    """The mark of the SDK request being sent in this context, if one is."""
    return _CALL.get()


class Routed(httpx.BaseTransport):
    """A transport that routes the SDK's requests (`route`) before `inner` sends them."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return route(request, self.inner.handle_request)

    def close(self) -> None:
        self.inner.close()


@dataclass
class _Routing:
    """One routed request: where its answer is kept, and the slot it holds until it is over."""

    calls: SampleCalls
    path: str
    digest: str | None = None
    ordinal: int | None = None
    got: list[bytes] | None = None  # the answer's bytes so far, when the book keeps them
    whole: bool = False
    over: bool = False

    def answered(self, request: httpx.Request, response: httpx.Response,
                 stream: type[_Tee] | type[_AsyncTee]) -> httpx.Response:
        """`response` passed on as it arrives, through `stream`, which ends the routing when closed."""
        self.got = [] if self.calls.book is not None else None
        return httpx.Response(response.status_code, headers=response.headers, extensions=response.extensions,
                              request=request, stream=stream(response.stream, self, response))

    def end(self, response: httpx.Response | None) -> None:
        """The answer is over (None: none came): the slot freed, the answer kept if it arrived whole."""
        if self.over:
            return
        self.over = True
        if self.calls.slots is not None:
            self.calls.slots.release()
        book = self.calls.book
        if book is None:
            return
        text = None
        if response is not None and response.status_code < 400 and self.got is not None:
            data = b"".join(self.got)
            # The SDK closes a stream at its last event, before the connection ends.
            if self.whole or (_STREAM_ENDS.search(data) and "event-stream" in
                              response.headers.get("content-type", "")):
                text = body_text(data)
        if text is None or self.digest is None or self.ordinal is None:
            book.forwarded_unkept()
            return
        assert response is not None  # text comes from an answer
        book.keep(RecordedCall(self.path, self.digest, self.ordinal,
                               response.headers.get("content-type") or "application/json", text), replayed=False)


def _begin(request: httpx.Request) -> tuple[_Routing | None, httpx.Response | None]:
    """The request's routing (None: not a sample's model call), or the recorded answer to it."""
    calls, mark = _SAMPLE.get(), _CALL.get()
    path = _model_path(request.url.path)
    if calls is None or mark is None or path is None or request.extensions.get(_ROUTED):
        return None, None
    request.extensions[_ROUTED] = True
    routing_ = _Routing(calls, path)
    book = calls.book
    if book is None:
        return routing_, None
    try:
        body = json.loads(request.content or b"{}")
    except ValueError:
        body = {}
    routing_.digest, routing_.ordinal, recorded = book.ask(path, body if isinstance(body, dict) else {})
    mark.request_sha256 = routing_.digest
    if recorded is None:
        # Kept as sent, to be sent again as it was: not compressed.
        request.headers["Accept-Encoding"] = "identity"
        return routing_, None
    book.keep(recorded, replayed=True, tokens=usage_counts(recorded.reply().get("usage")))
    mark.replayed = True
    return None, httpx.Response(200, headers={"content-type": recorded.content_type},
                                content=recorded.body.encode("utf-8"), request=request)


def route(request: httpx.Request, send: Callable[[httpx.Request], httpx.Response]) -> httpx.Response:
    """`request` sent by `send`: answered from the sample's record where it holds it, else
    holding one of the run's slots until its answer is read or closed (a stream's too)."""
    routing_, answered = _begin(request)
    if answered is not None:
        return answered
    if routing_ is None:
        return send(request)
    if routing_.calls.slots is not None:
        routing_.calls.slots.acquire()
    try:
        return routing_.answered(request, send(request), _Tee)
    except BaseException:
        routing_.end(None)
        raise


async def route_async(request: httpx.Request,
                      send: Callable[[httpx.Request], Awaitable[httpx.Response]]) -> httpx.Response:
    """`route` for the async SDK: a wait for a slot yields to the event loop."""
    routing_, answered = _begin(request)
    if answered is not None:
        return answered
    if routing_ is None:
        return await send(request)
    if routing_.calls.slots is not None:
        while not routing_.calls.slots.acquire(blocking=False):
            await asyncio.sleep(_SLOT_POLL_S)
    try:
        return routing_.answered(request, await send(request), _AsyncTee)
    except BaseException:
        routing_.end(None)
        raise


class _Tee(httpx.SyncByteStream):
    """An answer's bytes passed on as they arrive (kept where the book keeps them); closing it
    ends its routing."""

    def __init__(self, inner: httpx.SyncByteStream, routing_: _Routing, response: httpx.Response) -> None:
        self.inner, self.routing, self.response = inner, routing_, response

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            if self.routing.got is not None:
                self.routing.got.append(chunk)
            yield chunk
        self.routing.whole = True

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.routing.end(self.response)

    def __del__(self) -> None:  # an answer dropped unread (a stream left early) frees its slot too
        self.routing.end(None)


class _AsyncTee(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, routing_: _Routing, response: httpx.Response) -> None:
        self.inner, self.routing, self.response = inner, routing_, response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            if self.routing.got is not None:
                self.routing.got.append(chunk)
            yield chunk
        self.routing.whole = True

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            self.routing.end(self.response)

    def __del__(self) -> None:
        self.routing.end(None)


def _model_path(path: str) -> str | None:
    """The model call a URL path asks for (`/v1/chat/completions` → `/chat/completions`)."""
    return next((p for p in MODEL_PATHS if path.endswith(p)), None)
