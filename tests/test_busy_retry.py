"""A request that meets SQLite busy is run again in the server (server/busy_retry.py), on a
Starlette app answering errors with Prefect's own handler, as Prefect's API does: the busy
error is SQLite's own (a transaction that read, then writes after another connection wrote),
and the client sees the answer of the attempt that got through."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import httpx
import pytest
import sqlalchemy.exc
from prefect.server.api.server import custom_internal_exception_handler
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from server.busy_retry import sqlite_busy, with_busy_retry


def busy_app(database: Path, busy_times: float) -> tuple[Starlette, list[int]]:
    """An app whose POST /runs inserts a row, the first `busy_times` attempts meeting SQLite
    busy; and the list of its attempts' statuses."""
    with sqlite3.connect(database) as db:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("CREATE TABLE IF NOT EXISTS runs (body TEXT)")
    attempts: list[int] = []

    async def create(request):
        body = (await request.body()).decode()  # each attempt reads the whole body again
        db = sqlite3.connect(database, isolation_level=None)
        try:
            db.execute("BEGIN DEFERRED")
            db.execute("SELECT count(*) FROM runs").fetchone()
            if len(attempts) < busy_times:  # another connection writes between the read and the write
                with sqlite3.connect(database, isolation_level=None) as other:
                    other.execute("INSERT INTO runs VALUES ('other')")
            try:
                db.execute("INSERT INTO runs VALUES (?)", (body,))
            except sqlite3.OperationalError as exc:
                attempts.append(503)
                raise sqlalchemy.exc.OperationalError("INSERT INTO runs", (body,), exc) from exc
            db.execute("COMMIT")
        finally:
            db.close()
        attempts.append(201)
        return JSONResponse({"body": body}, status_code=201)

    async def not_ready(request):
        attempts.append(503)
        return JSONResponse({"message": "Database is not available"}, status_code=503)

    async def broken(request):
        attempts.append(500)
        raise RuntimeError("not SQLite's")

    app = Starlette(routes=[Route("/runs", create, methods=["POST"]), Route("/ready", not_ready),
                            Route("/broken", broken)],
                    exception_handlers={Exception: custom_internal_exception_handler})
    return app, attempts


def post(app, path: str = "/runs", method: str = "POST") -> httpx.Response:
    async def call():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, content=b'{"flow_id": "f"}')
    return asyncio.run(call())


def test_the_busy_error_is_sqlites_own_and_prefect_answers_it_503(tmp_path: Path) -> None:
    app, attempts = busy_app(tmp_path / "busy.db", busy_times=1)
    assert post(app).status_code == 503 and attempts == [503]  # what Prefect's client backs off 2 s from


def test_a_request_that_met_sqlite_busy_is_run_again_with_its_body(tmp_path: Path) -> None:
    app, attempts = busy_app(tmp_path / "busy.db", busy_times=3)
    response = post(with_busy_retry(app))
    assert (response.status_code, response.json()) == (201, {"body": '{"flow_id": "f"}'})
    assert attempts == [503, 503, 503, 201]
    with sqlite3.connect(tmp_path / "busy.db") as db:  # written once, by the attempt that got through
        assert db.execute("SELECT count(*) FROM runs WHERE body != 'other'").fetchone() == (1,)


def test_busy_past_the_wait_reaches_the_client_as_prefects_503(tmp_path: Path) -> None:
    app, attempts = busy_app(tmp_path / "busy.db", busy_times=float("inf"))
    response = post(with_busy_retry(app, busy_wait_s=0.1))
    assert response.status_code == 503 and response.json() == {"exception_message": "Service Unavailable"}
    assert attempts == [503, 503, 503]  # pauses of 0.05 and 0.1 s, then past the 0.1 s wait


@pytest.mark.parametrize(("path", "method", "status"), [("/ready", "GET", 503), ("/broken", "GET", 500)])
def test_other_answers_are_sent_once_as_they_were(tmp_path: Path, path: str, method: str, status: int) -> None:
    app, attempts = busy_app(tmp_path / "busy.db", busy_times=0)
    assert post(with_busy_retry(app), path, method).status_code == status
    assert attempts == [status]


def test_only_sqlites_busy_counts_as_busy() -> None:
    locked = sqlite3.OperationalError("database is locked")
    assert sqlite_busy(sqlalchemy.exc.OperationalError("INSERT", (), locked))
    assert not sqlite_busy(sqlalchemy.exc.OperationalError("INSERT", (), sqlite3.OperationalError("disk I/O error")))
    assert not sqlite_busy(locked)  # not through SQLAlchemy: not an error Prefect's API answers 503
