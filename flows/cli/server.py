"""`evalpipe server`: the local Prefect server, in the foreground or managed in the background."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from flows.cli.common import JsonFlag, emit
from tasks.models import PlatformError

server_app = typer.Typer()
PortOpt = Annotated[int | None, typer.Option("--port", min=1, max=65535)]


@server_app.callback(invoke_without_command=True)
def server_cmd(ctx: typer.Context, port: PortOpt = None) -> None:
    """A local Prefect server with its UI on 127.0.0.1. Without a command: in the foreground
    until Ctrl-C (default port 4200).
    The first run in an EVALPIPE_HOME starts its managed server in the background (it stops
    after EVALPIPE_SERVER_IDLE_S unused); `start` starts it by hand, kept until `stop`."""
    if ctx.invoked_subcommand is None:
        from server.local import DEFAULT_PORT, serve

        serve(port or DEFAULT_PORT)


@server_app.command("start")
def server_start(port: PortOpt = None, as_json: JsonFlag = False) -> None:
    """Start the managed server in the background (port 4200, or a free one if taken), kept
    until `stop`."""
    from server.managed import start_managed

    server, started = start_managed(port)
    doc = {"started": started, **server.to_json()}
    verb = "started" if started else "already running (kept until stopped)"
    emit(doc, as_json, f"evalpipe server {verb}: Prefect UI {server.ui_url} (pid {server.pid})\n"
                       "runs in this EVALPIPE_HOME report to it; stop it with `evalpipe server stop`")


@server_app.command("stop")
def server_stop(as_json: JsonFlag = False) -> None:
    """Stop the managed server."""
    from server.managed import stop_managed

    stopped, stale = stop_managed()
    doc = {"stopped": stopped is not None, "pid": stopped.pid if stopped else None,
           "stale_pid": stale.pid if stale else None}
    emit(doc, as_json, f"stopped the evalpipe server (pid {stopped.pid})" if stopped
         else _not_running(doc["stale_pid"]))


@server_app.command("status")
def server_status(as_json: JsonFlag = False) -> None:
    """Whether the managed server is up, and where (exit 0 either way)."""
    from server.managed import status

    doc = status()
    human = (f"running: Prefect UI {doc['ui_url']} (pid {doc['pid']}, {'healthy' if doc['healthy'] else 'not answering'})"
             f"; log {doc['log']}" if doc["running"] else _not_running(doc.get("stale_pid")))
    emit(doc, as_json, human)


@server_app.command("env")
def server_env(as_json: JsonFlag = False) -> None:
    """The exports that point a worker, `prefect deploy` or a script at the managed server:
    its API URL and the credentials it requires (`eval "$(evalpipe server env)"`)."""
    from server.managed import running

    server = running()
    if server is None:  # exports of a server that is not up would point nowhere
        raise PlatformError("no evalpipe server running for this EVALPIPE_HOME: start it with `evalpipe server start`")
    doc = {"PREFECT_API_URL": server.api_url, "PREFECT_API_AUTH_STRING": server.auth}
    emit(doc, as_json, "\n".join(f"export {name}={shlex.quote(value)}" for name, value in doc.items()))


def _not_running(stale_pid: int | None) -> str:
    return "no evalpipe server running" + (
        f" (removed the record of pid {stale_pid}, which is gone)" if stale_pid else "")
