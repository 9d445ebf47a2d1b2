"""`evalpipe`: the command line. Parsing and printing only; the work is in `tasks/` and `flows/`.

The commands live by group (`flows/cli/running.py`: run, rescore; `gating.py`: gate, report;
`runs.py`, `suite.py`, `server.py`, `env.py`; diff, plan, judge, labels and compare in
`flows/diffing.py`, `planning.py`, `judging.py`); this module mounts them, in the order
`evalpipe --help` lists them, and holds `main`.

Exit status: 0 success, 1 gate blocked, 2 bad input, 3 platform failure (both one line on
stderr, no traceback), 4 a run whose agent failed on too many samples, 5 one whose grader
did, 6 a run a budget left `partial`, 130 interrupted (docs/contract.md §10).
Heavy imports (Prefect) happen inside the commands that need them, so `suite hash` is fast.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
from concurrent.futures import BrokenExecutor

import typer
from typer._click.exceptions import (  # typer's own click: not exported by name
    NoArgsIsHelpError,
    UsageError,
)

from flows.cli.env import env_app
from flows.cli.gating import gate_cmd, report_cmd
from flows.cli.run_options import mount
from flows.cli.running import rescore_cmd, rescore_flow, run
from flows.cli.runs import runs_app
from flows.cli.server import server_app
from flows.cli.suite import suite_app
from flows.diffing import diff
from flows.interrupt import INTERRUPTED, INTERRUPTED_LINE, stop_on_signals, stop_requested
from flows.judging import compare, judge_app, labels_app
from flows.planning import plan
from flows.prefect_api import loading_heap
from tasks.models import InputError, PlatformError
from tasks.registry import load_plugins
from tasks.settings import MachineSettings, using

__all__ = ["app", "main", "rescore_flow", "run"]

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Eval harness for eval-driven development of LLM agents and code models.",
)
mount(app, "run", run)
mount(app, "rescore", rescore_cmd)
mount(app, "gate", gate_cmd)
mount(app, "report", report_cmd)
app.command("diff")(diff)
app.command("plan")(plan)
app.command("compare")(compare)
app.add_typer(suite_app, name="suite")
app.add_typer(runs_app, name="runs")
app.add_typer(server_app, name="server")
app.add_typer(env_app, name="env")
app.add_typer(judge_app, name="judge")
app.add_typer(labels_app, name="labels")


def _platform_error(exc: BaseException) -> PlatformError | None:
    from storage import DISK_FULL_ERRNOS, disk_full

    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return disk_full(exc.filename or "a file")
    if isinstance(exc, BrokenExecutor):  # `--runner processes`: a worker killed, or out of memory
        return PlatformError("a worker process of the run died (killed, or out of memory): run the same command"
                             " again to resume; every output the agent returned is kept")
    return None


class _DropReportedFailures(logging.Filter):
    """Prefect logs a failed task or flow run with its exception and traceback, then closes
    the run with a line naming its final state. When the failure is one `main` reports as its
    one line, neither record passes: the first is known by its exception (`exc_info`), the
    closing one by the run id the first carried, never by their text.

    Sibling task runs of a failed run are not logged at all: the mapping winds them down
    before the runner stops (`tasks.run.loop`, `_wind_down`). A filter remains because Prefect's task
    engine logs a failed task run at ERROR however the task ends (raising, or returning a
    Failed state). Once a signal stopped the process, no error of a run passes: Prefect calls
    the stop a crash ("Crash detected! Execution was aborted by an interrupt signal"), and
    `main` reports it as the interrupted line."""

    def __init__(self) -> None:
        super().__init__()
        self.reported: set[str] = set()  # the runs whose failure `main` reports

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and stop_requested():
            return False
        run_id = str(getattr(record, "task_run_id", None) or getattr(record, "flow_run_id", None) or "")
        if record.exc_info and _platform_error(record.exc_info[1]) is not None:
            self.reported.add(run_id)
            return False
        return not run_id or run_id not in self.reported


_DROP_REPORTED_FAILURES = _DropReportedFailures()


def main(argv: list[str] | None = None) -> int:
    # Standalone click handles usage errors (exit 2) and --help; bad input found by our own
    # code surfaces as InputError, a failure of the machine as PlatformError (or a full
    # disk's OSError), each becoming the one-line message.
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logging.getLogger(name).addFilter(_DROP_REPORTED_FAILURES)
    # Last thing at exit (atexit runs the earliest registered last): freeze the heap. Python's
    # finalization otherwise collects the whole of it several times over, ~0.6 s a command
    # with Prefect and pydantic loaded; frozen objects are still freed as modules go.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    loading_heap()  # a slow collector until Prefect is loaded (flows.prefect_api)
    restore_signals = stop_on_signals()  # Ctrl-C and SIGTERM: exit 130 within seconds, the run resumable
    try:
        # This machine's settings (the sandbox, EVALPIPE_HOME, the plugins, ...), read once here
        # for the whole command; a run carries them on to its tasks (`tasks.settings`).
        with using(MachineSettings.from_environ(os.environ)):
            # Plugins register their graders and metrics before any suite is read (tasks.registry).
            load_plugins()
            code = app(args=argv, prog_name="evalpipe", standalone_mode=False) or 0
    except UsageError as exc:
        # A bad flag or value is bad input like any other: one line, exit 2 (click's own
        # form is a usage block and a boxed message).
        if not isinstance(exc, NoArgsIsHelpError):  # that one printed the help
            command = exc.ctx.command_path.partition(" ")[2] if exc.ctx else ""
            typer.echo(f"evalpipe: {command + ': ' if command else ''}{exc.format_message()}", err=True)
        return 2
    except InputError as exc:
        typer.echo(f"evalpipe: {exc}", err=True)
        return 2
    except (PlatformError, OSError, BrokenExecutor) as exc:
        failure = _platform_error(exc)
        if failure is None:
            raise
        typer.echo(f"evalpipe: {failure}", err=True)
        return 3
    finally:
        restore_signals()
    if code == INTERRUPTED:
        typer.echo(INTERRUPTED_LINE, err=True)
    return code
