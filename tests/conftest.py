"""Shared fixtures. Fixtures specific to one area live in that area's test module."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
from support import durations

ROOT = Path(__file__).resolve().parent.parent

# Hypothesis lives outside site-packages, in the venv's test-only/ (the Makefile installs it;
# docs/architecture.md, "Testing on two workers"), so the repositories' tests graded with this
# interpreter do not each load its pytest plugin (~0.6 s of CPU a run): we register it. A venv
# without it there, or with it in site-packages too, stops here in one line.
TEST_ONLY = Path(sys.prefix) / "test-only"
_in_site = importlib.util.find_spec("_hypothesis_pytestplugin")
if _in_site is not None or not (TEST_ONLY / "_hypothesis_pytestplugin.py").is_file():
    fix = (f"hypothesis is importable from {Path(_in_site.origin).parent} already (site-packages or "
           f"PYTHONPATH), the tests take it from {TEST_ONLY} only: `{sys.executable} -m pip "
           f"uninstall -y hypothesis` or unset PYTHONPATH"
           if _in_site else
           f"{TEST_ONLY} has no hypothesis: run `make test` or `{sys.executable} -m pip install "
           f"--no-deps --upgrade --target {TEST_ONLY} -r tests/requirements-test-only.txt`")
    print(f"evalpipe tests: {fix}", file=sys.stderr)
    raise SystemExit(pytest.ExitCode.USAGE_ERROR)
sys.path.append(str(TEST_ONLY))

# pytest keeps a test module's rewritten asserts as bytecode only where bytecode may be
# written: with PYTHONDONTWRITEBYTECODE set (this machine), each worker rewrote every test
# module at each start, 3.5 s of its 9.5 s of collection. They are written while collecting;
# the tests then run under the flag as the environment set it (pytest_collection_finish).
_DONT_WRITE_BYTECODE = sys.dont_write_bytecode
sys.dont_write_bytecode = False

# `mode`: a test runs under bubblewrap and in the fallback (tasks/sandbox/policy.py).
pytest_plugins = ("support.sandbox_modes", "_hypothesis_pytestplugin")

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# A command that finds no server would start evalpipe's managed one, which outlives it: no
# test leaves one behind. Tests of the managed server ask for it in their commands' env and
# stop what they start (tests/test_server.py, tests/test_warm.py).
os.environ["EVALPIPE_SERVER"] = "temporary"

# A shell without job control starts a command in the background (`make test &` in a script,
# a launcher's `nohup ... &`) with SIGINT ignored, and every process a test starts inherits
# that: a test's SIGINT to the process running an agent is ignored, and it sleeps on
# (test_agents.py::test_a_real_signal_still_stops_the_process_running_an_agent[2] failed in 4
# of 4 runs started so, passes in a terminal). The tests run as from a terminal, however started.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Tests using these carry the `slow` marker (pyproject.toml; `make test-fast` leaves them
# out): a Prefect server for the session, and flow runs on it.
SLOW_FIXTURES = {"prefect_harness"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # The longest files first (the Makefile's --no-loadscope-reorder keeps this order;
    # xdist's own puts the files with the most tests first), each file's tests in their order.
    rank = {path: n for n, path in enumerate(durations.longest_first([item.nodeid for item in items], durations.load()))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh EVALPIPE_HOME for one test."""
    path = tmp_path / "evalpipe-home"
    monkeypatch.setenv("EVALPIPE_HOME", str(path))
    return path


@pytest.fixture(scope="session")
def calc_repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The calc example repository, built fresh for the session: (path, base commit)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_calc", ROOT / "examples/calc/build_repo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path_factory.mktemp("calc") / "repo"
    return path, module.build(path)


# The session's Prefect server is one for the whole run, however many xdist workers share it:
# an idle `prefect server start` spends ~0.1 of a core on its own loops (Prefect's background
# services and their scheduler), so a server per worker cost a core-minute and more a run. The
# first test that needs it starts it (under a lock, in this directory); the process that made
# the directory (pytest's controller, or the only process) stops it when the run ends, a
# SIGTERM's end included; the next run stops one a killed controller left.
SHARED_ENV = "EVALPIPE_TESTS_SHARED"


def pytest_collection_finish(session: pytest.Session) -> None:
    sys.dont_write_bytecode = _DONT_WRITE_BYTECODE


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        _stop_what_killed_runs_left()
        config.stash[_SHARED] = Path(tempfile.mkdtemp(prefix=f"evalpipe-tests-{os.getpid()}-"))
        os.environ[SHARED_ENV] = str(config.stash[_SHARED])
        # `timeout`, a CI job's cancel: stop as on Ctrl-C, so the server is stopped below.
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop_what_killed_runs_left() -> None:
    """The session servers of runs whose controller is gone (killed: SIGKILL, an OOM),
    with their directories."""
    for shared in Path(tempfile.gettempdir()).glob("evalpipe-tests-*-*"):
        controller = shared.name.split("-")[2]
        if not controller.isdigit() or Path(f"/proc/{controller}").exists():
            continue
        try:
            pid = json.loads((shared / "server.json").read_text())["pid"]
            if b"server\0start" in Path(f"/proc/{pid}/cmdline").read_bytes():  # not a reused pid
                _stop_group(pid)
        except (OSError, ValueError, KeyError):
            pass
        shutil.rmtree(shared, ignore_errors=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    shared = config.stash.get(_SHARED, None)
    if shared is None:
        return
    record = shared / "server.json"
    if record.exists():
        _stop_group(json.loads(record.read_text())["pid"])
    shutil.rmtree(shared, ignore_errors=True)


_SHARED = pytest.StashKey[Path]()


def _stop_group(pid: int, timeout_s: float = 10.0) -> None:
    """Stop a server another process started (its own process group): TERM, then KILL."""
    from support.cli import wait_gone

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        if wait_gone([pid], timeout_s):
            return


# Prefect's services that look for late, paused, cancelled or lost runs and expired leases,
# run automations, log events and vacuum the database: none has anything to do for a test
# (no schedules, pauses, leases or automations on this server), and together they kept an
# idle server busy 2% of a core (0.87 s of CPU in 40 s of 2.35 s), ~13 s of CPU a run. The
# services the tests read stay on: events, task runs, the scheduler.
SESSION_SERVICES_OFF = {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in (
    "CANCELLATION_CLEANUP", "CLEANUP_RECONCILER", "DB_VACUUM", "EVENT_LOGGER", "FOREMAN", "LATE_RUNS",
    "PAUSE_EXPIRATIONS", "REPOSSESSOR", "TRIGGERS")}


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory):
    """A real Prefect API shared by the run's flow runs: `prefect server start` on a fresh
    PREFECT_HOME (without the services of SESSION_SERVICES_OFF), whose database is a copy of
    the template (server/db_template.py), so it is up in ~5 s where Prefect's test harness,
    migrating a database of its own, took ~11 s.
    This process's flow runs use it; yields the API URL, so subprocesses (the CLI) can too.
    Flows called here send no heartbeats, as the CLI's do not (flows/prefect_api.py): the
    engine joins their thread at every flow run's end, 0.36 s a run on average."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        temporary_settings,
    )

    from server.local import start_server

    shared = Path(os.environ[SHARED_ENV])
    with (shared / "server.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = shared / "server.json"
        if not record.exists():
            where = tmp_path_factory.mktemp("prefect-harness")
            with (where / "server.log").open("ab") as log, pytest.MonkeyPatch.context() as env:
                for name, value in SESSION_SERVICES_OFF.items():
                    env.setenv(name, value)  # the server's environment is this process's
                server = start_server(prefect_home=where / "prefect-home", log=log, timeout_s=240)
            record.write_text(json.dumps({"api_url": server.api_url, "pid": server.process.pid}))
        api_url = json.loads(record.read_text())["api_url"]
    with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield api_url
        # What this process's flow runs still have on the way reaches the server before it stops.
        APILogWorker.drain_all(timeout=5)
        EventsWorker.drain_all()


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch):
    """`endpoint(reply)`: a local OpenAI-compatible chat endpoint answering `reply(body)`,
    with the client pointed at it (judges' tests)."""
    from support.judges import ChatServer

    def start(reply):
        server = ChatServer(reply)
        monkeypatch.setenv("OPENAI_BASE_URL", server.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-judge")
        monkeypatch.setenv("EVALPIPE_OPENAI_MAX_ATTEMPTS", "2")
        return server

    return start
