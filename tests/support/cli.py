"""evalpipe's command line as a user's shell runs it, and the processes it leaves: shared by
the tests of the servers evalpipe starts (tests/test_server.py, tests/test_warm.py); and
`in_process`, the same command run in the test's own process."""

from __future__ import annotations

import gc
import io
import logging
import os
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
EVALPIPE = Path(sys.executable).with_name("evalpipe")
ONE_CASE = '{"id": "c0", "inputs": {}, "reference": "yes", "grader": {"kind": "exact"}}\n'
# The agent of `run_args`: says yes; with MARK set, writes its pid there and hangs.
AGENT = (
    "import os, pathlib, time\n"
    "def answer(inputs, ctx):\n"
    "    if os.environ.get('MARK'):  # the slow agent: say it started, then hang\n"
    "        pathlib.Path(os.environ['MARK']).write_text(str(os.getpid()))\n"
    "        time.sleep(600)\n"
    "    return 'yes'\n")


def write_work(work: Path) -> Path:
    """A one-case suite and the agent beside it."""
    (work / "one.jsonl").write_text(ONE_CASE)
    (work / "agent.py").write_text(AGENT)
    return work


def client_env(work: Path, home: Path, **extra: str) -> dict[str, str]:
    """A user's shell: no Prefect or evalpipe settings but its own homes; a temporary server
    unless the managed one is up (`extra` may ask for EVALPIPE_SERVER=managed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "EVALPIPE_")) and k != "CI"}
    return env | {"EVALPIPE_HOME": str(home), "PREFECT_HOME": str(work / "prefect-home"), "EVALPIPE_SERVER": "temporary",
                  "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "EVALPIPE_SERVER_START_TIMEOUT": "240"} | extra


def evalpipe(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(EVALPIPE), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def as_process(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m flows.cli ARGS` as a process of its own: for what only a process shows (its
    stderr whole, Prefect's log lines included; its exit; what it flushes as it ends)."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def in_process(args: list[str], env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m flows.cli ARGS` with environment `env` in `cwd`, run by `flows.cli.main` in
    this process: the same parser, code, output and exit status, without the ~2 s (CPU) a
    fresh interpreter spends importing evalpipe and Prefect. What a command leaves set in its
    process for the rest of its life is put back: the collector's pace and the heap it froze
    (flows/prefect_api.py), the silence a flow-running command leaves for its exit (`main`
    puts back its own signal handlers). Tests of what a process does (signals, exit on a
    hostile file, a full disk, a temporary server started and stopped with the command) run
    it as a process of its own."""
    from flows.cli import main

    saved_env, saved_cwd, saved_gc = dict(os.environ), os.getcwd(), gc.get_threshold()
    out, err = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # click's own exits (--help)
                code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        gc.unfreeze()
        gc.set_threshold(*saved_gc)  # main slows the collector for a command's imports
        logging.disable(logging.NOTSET)
    return subprocess.CompletedProcess(["evalpipe", *args], code, out.getvalue(), err.getvalue())


def run_args(work: Path, *extra: str) -> list[str]:
    return ["run", str(work / "one.jsonl"), "--agent", f"python:{work / 'agent.py'}:answer", *extra]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def processes_with(key: str, value: str) -> list[int]:
    """Live processes whose environment has key=value: what a command left behind."""
    found = []
    needle = f"{key}={value}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0") and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
