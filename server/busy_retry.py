"""`prefect server start` as evalpipe launches it (server/local.py: the managed server, the
tests' servers): Prefect's own command and app, retrying in the server a request that met
its SQLite database busy, before the client ever sees a 503.

A write transaction that has read first fails at once when another connection is writing,
without SQLite's busy wait (a run's flow run created while the server records the last
run's task runs from their events), and Prefect answers 503. Its client retries a 503 after
2, 4, 8, 16 and 32 s, where the busy moment passes in milliseconds: two runs in a row on one
server met it every few runs, 2-4 s each, and one full test run on two workers stalled 62 s
(five retries) on it. Retried here after 0.05 s, doubling up to 1 s, for at most
BUSY_WAIT_S; then the 503 goes to the client, which backs off as before.

Run as `python -P -m server.busy_retry server start --host H --port P` (`-P`: the working
directory, a user's project, is not searched before evalpipe's modules)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.05, 1.0
BUSY_WAIT_S = 10.0


def sqlite_busy(exc: BaseException) -> bool:
    """The error Prefect's server answers with a 503 when SQLite was busy (its
    `is_client_retryable_exception`, SQLite's part)."""
    orig = getattr(exc, "orig", None)
    return isinstance(orig, sqlite3.OperationalError) and (
        getattr(orig, "sqlite_errorname", None) in {"SQLITE_BUSY", "SQLITE_BUSY_SNAPSHOT"}
        or "database is locked" in orig.args)


async def _attempt(app: ASGIApp, scope: MutableMapping[str, Any], request: list[Message], receive: Receive,
                   send: Send) -> tuple[list[Message], Exception | None]:
    """One run of the request: what the app sends passes on unless it is a 503, which is held
    back and returned, with the error the app raised after it (Starlette sends the error's
    response, then raises the error)."""
    held: list[Message] = []
    replay = iter(request)

    async def receive_again() -> Message:
        return next(replay, None) or await receive()

    async def send_unless_503(message: Message) -> None:
        if held or (message["type"] == "http.response.start" and message["status"] == 503):
            held.append(message)
        else:
            await send(message)

    try:
        await app(dict(scope), receive_again, send_unless_503)
    except Exception as exc:
        return held, exc
    return held, None


def with_busy_retry(app: ASGIApp, busy_wait_s: float = BUSY_WAIT_S) -> ASGIApp:
    """`app`, running an HTTP request again while it fails on a busy SQLite database. The
    request's body is kept to replay."""

    async def serve(scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan, websockets: Prefect's own
            await app(scope, receive, send)
            return
        request = [await receive()]
        while request[-1]["type"] == "http.request" and request[-1].get("more_body"):
            request.append(await receive())
        pause, waited = FIRST_PAUSE_S, 0.0
        while True:
            held, exc = await _attempt(app, scope, request, receive, send)
            busy = bool(held) and exc is not None and sqlite_busy(exc)
            if busy and waited < busy_wait_s:
                await asyncio.sleep(pause)
                waited, pause = waited + pause, min(2 * pause, LONGEST_PAUSE_S)
                continue
            for message in held:  # a 503 of Prefect's own making, or busy past the wait
                await send(message)
            if exc is not None and not busy:
                raise exc
            return

    return serve


def main() -> None:
    import prefect.server.api.server as api
    from prefect.cli import app

    create_app = api.create_app

    # `prefect server start` imports create_app from this module when it serves.
    def create_app_with_busy_retry(*args: Any, **kwargs: Any) -> ASGIApp:
        return with_busy_retry(create_app(*args, **kwargs))

    api.create_app = create_app_with_busy_retry
    raise SystemExit(app())


if __name__ == "__main__":
    main()
