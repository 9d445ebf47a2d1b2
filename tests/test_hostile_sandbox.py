"""Hostile outputs, round two: host sockets, traces between programs, the fallback,
suite-named predicates, and a runtime under /tmp. Real sandboxes, real sockets, real CLI."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from support.cli import in_process
from support.sandbox_modes import bwrap_only
from test_python_tests import _case, _hostile
from test_sandbox import tmp_venv

from tasks.graders import grade, grader_fingerprint
from tasks.graders.python_tests import build_program
from tasks.models import EvalCase, Status
from tasks.report import summary_markdown
from tasks.report.text import summary_text
from tasks.sandbox import ForkServer, Limits, SandboxUnavailable, run_command, servers, shutdown
from tasks.sandbox import policy as sandbox

ROOT = Path(__file__).resolve().parent.parent


# --- 1. no unix socket of the host is reachable ------------------------------------------


@pytest.fixture
def host_socket(request: pytest.FixtureRequest):
    """A listening unix socket of the host that answers b"1": in a directory the sandbox
    can see (/var/tmp, read-only inside), or abstract. Yields (address, accepted list)."""
    kind = request.param
    folder = Path(os.environ.get("EVALPIPE_TEST_SOCKET_DIR", "/var/tmp")) / f"evalpipe-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    address = str(folder / "s.sock") if kind == "path" else f"\0evalpipe-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()
    listener.settimeout(0.05)  # closing a socket does not wake a thread blocked in accept()
    accepted: list[bool] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(True)
            conn.sendall(b"1")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield address, accepted
    done.set()
    thread.join(5)
    listener.close()
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


@pytest.mark.parametrize("host_socket", ["path", "abstract"], indirect=True)
def test_no_host_unix_socket_is_reachable(host_socket, mode: str, tmp_path: Path) -> None:
    address, accepted = host_socket
    program, expect = _hostile("unix_socket_connect", address=repr(address))
    verdict = grade(program, _case())
    assert verdict.status is expect, verdict.detail
    res = run_command([sys.executable, "-I", "-c", f"{program}\nf(1)"], workdir=tmp_path, limits=Limits())
    assert res.returncode != 0
    assert accepted == []


def test_unix_socketpairs_still_work(mode: str) -> None:
    # asyncio and multiprocessing queues need them; they reach nobody outside.
    program = "import socket\na, b = socket.socketpair()\na.send(b'1')\ndef f(x):\n    return x + int(b.recv(1))\n"
    assert grade(program, _case()).status is Status.passed


# --- 2. /dev is capped, and nothing survives into the next program ------------------------


def test_dev_is_read_only_and_dev_shm_is_capped(mode: str, tmp_path: Path) -> None:
    bwrap_only(mode, "a private /dev")
    code = (
        "import os\n"
        "try:\n    open('/dev/evalpipe-x', 'w')\nexcept OSError as e:\n    print(e.errno)\n"
        "st = os.statvfs('/dev/shm')\nprint(st.f_blocks * st.f_frsize)\n"
        "open('/dev/null', 'w').write('fine')\n"
    )
    res = run_command([sys.executable, "-I", "-c", code], workdir=tmp_path, limits=Limits(file_size_mb=8))
    erofs, shm_bytes = res.stdout.split()
    assert res.returncode == 0, res.stderr
    assert int(erofs) == 30  # EROFS
    assert int(shm_bytes) <= 8 << 20


STATE_OUTSIDE_FILES = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def refused(result):
    return result == -1 and ctypes.get_errno() == 1  # EPERM
print(refused(libc.shmget(0, 4096, 0o1600)), refused(libc.semget(0, 1, 0o1600)),
      refused(libc.msgget(0, 0o1600)), refused(libc.mq_open(b"/evalpipe", 0o102, 0o600, None)),
      refused(libc.syscall(425, 8, ctypes.create_string_buffer(120))),
      refused(libc.syscall({add_key}, b"user", b"k", b"v", 1, -3)))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(status["NoNewPrivs"].strip(), status["CapEff"].strip())
"""


def test_state_outside_files_and_privileges_are_refused(mode: str, tmp_path: Path) -> None:
    """SysV IPC, io_uring and keyrings would outlive a program unseen by any wipe (and
    io_uring could open sockets past the filter); no new privileges in either mode."""
    import platform

    add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
    code = STATE_OUTSIDE_FILES.replace("{add_key}", str(add_key))
    res = run_command([sys.executable, "-I", "-c", code], workdir=tmp_path, limits=Limits())
    refusals, privileges = res.stdout.decode().splitlines()
    assert refusals == "True True True True True True", res.stderr
    no_new_privs, capabilities = privileges.split()
    assert no_new_privs == "1"
    if mode == "bwrap":
        assert int(capabilities, 16) == 0


def test_nothing_one_program_wrote_is_seen_by_the_next(mode: str) -> None:
    bwrap_only(mode, "private /tmp, /dev/shm and /dev (the fallback shares the machine's)")
    marker = f"evalpipe-trace-{uuid.uuid4().hex}"
    server = ForkServer(Limits())
    try:
        for name in ("leave_traces", "see_traces"):
            program, expect = _hostile(name, marker=marker)
            run = server.run(build_program(program, _case()), Limits())
            assert run.completed is (expect is Status.passed), run.result.stderr.decode()
    finally:
        server.close()


# --- 3. without bubblewrap a run refuses, unless told otherwise ---------------------------


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "rlimits")
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    sandbox._bwrap_problem.cache_clear()
    shutdown()
    yield
    sandbox._bwrap_problem.cache_clear()
    shutdown()


def test_without_bwrap_untrusted_code_does_not_run(no_bwrap, tmp_path: Path) -> None:
    with pytest.raises(SandboxUnavailable, match="--unsafe-no-sandbox"):
        run_command(["/bin/true"], workdir=tmp_path, limits=Limits())
    verdict = grade("def f(x):\n    return x + 1\n", _case())
    assert verdict.status is Status.error and "--unsafe-no-sandbox" in verdict.detail
    predicate = EvalCase(id="p", grader={"kind": "predicate", "function": "os:getcwd"})
    assert grade("x", predicate).status is Status.error


def test_the_run_mode_is_decided_before_drawing(no_bwrap) -> None:
    assert sandbox.run_sandbox_mode(["exact", "regex"], unsafe=False) == "not-needed"
    for kind in ("python_tests", "repo_tests", "predicate"):
        with pytest.raises(SandboxUnavailable, match=f"the suite has {kind} cases"):
            sandbox.run_sandbox_mode(["exact", kind], unsafe=False)
        assert sandbox.run_sandbox_mode([kind], unsafe=True) == "unsafe-no-sandbox"


def test_in_the_sandbox_the_harness_environment_is_out_of_reach(mode: str, monkeypatch) -> None:
    bwrap_only(mode, "a pid namespace (the fallback can read /proc/<harness>/environ)")
    monkeypatch.setenv("EVALPIPE_TEST_SECRET", "hunter2")
    program, expect = _hostile("read_harness_environ")
    assert grade(program, _case()).status is expect


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`evalpipe ARGS` in this process (support.cli.in_process)."""
    return in_process(args, env)


def test_cli_refuses_without_bwrap_and_states_unsafe_runs(prefect_harness, tmp_path: Path, home: Path) -> None:
    import duckdb

    suite = tmp_path / "code.yaml"
    suite.write_text(
        "name: code\ncases:\n  - id: add\n    inputs: {prompt: ''}\n"
        "    reference: \"def f(x):\\n    return x + 1\\n\"\n"
        "    grader: {kind: python_tests, entry_point: f, test: \"def check(c):\\n    assert c(1) == 2\\n\"}\n"
    )
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT),
           sandbox.MODE_ENV: "rlimits"}
    env.pop(sandbox.UNSAFE_ENV, None)
    for args in (["run", str(suite), "--agent", "reference", "--json"], ["suite", "validate", str(suite)]):
        refused = _cli(args, env)
        assert refused.returncode == 2, refused.stderr
        assert refused.stdout == "" and len(refused.stderr.strip().splitlines()) == 1
        assert "--unsafe-no-sandbox" in refused.stderr and "Traceback" not in refused.stderr
    assert not (home / "evalpipe.duckdb").exists()  # nothing half-written
    if sandbox.bwrap_available():  # this process does not force the fallback
        assert sandbox.run_sandbox_mode(["python_tests"], unsafe=False) == "bwrap"

    unsafe = _cli(["run", str(suite), "--agent", "reference", "--json", "--unsafe-no-sandbox"], env)
    assert unsafe.returncode == 0, unsafe.stderr
    summary = json.loads(unsafe.stdout)
    assert summary["sandbox"] == "unsafe-no-sandbox" and summary["status_counts"] == {"passed": 1}
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        (config,) = con.execute("SELECT config FROM runs WHERE run_id = ?", [summary["run_id"]]).fetchone()
    assert json.loads(config)["sandbox"] == "unsafe-no-sandbox"
    assert "NO SANDBOX" in summary_markdown(summary) and summary_text(summary).startswith("UNSAFE: ")
    report = tmp_path / "report.html"
    assert _cli(["report", summary["run_id"], "--out", str(report)], env).returncode == 0
    assert "No sandbox" in report.read_text()
    validated = _cli(["suite", "validate", str(suite), "--json", "--unsafe-no-sandbox"], env)
    assert validated.returncode == 0 and json.loads(validated.stdout)["sandbox"] == "unsafe-no-sandbox"


# --- 4. a suite's predicate runs in the sandbox, never in the harness ---------------------

HOSTILE_PREDICATES = """
import os
os.environ["EVALPIPE_PREDICATE_RAN_HERE"] = "1"  # at import: in whichever process loads it

def sees_secret(output, case):
    return os.environ.get("EVALPIPE_TEST_SECRET") == "hunter2"

def writes(output, case):
    with open(output, "w") as fh:
        fh.write("escaped")
    return True
"""


@pytest.fixture
def hostile_predicates(tmp_path: Path) -> Path:
    path = tmp_path / "hostile_preds.py"
    path.write_text(HOSTILE_PREDICATES)
    return path


def _predicate(function: str) -> EvalCase:
    return EvalCase(id="p", grader={"kind": "predicate", "function": function})


def test_a_suite_predicate_never_runs_in_the_harness(mode: str, hostile_predicates: Path, monkeypatch) -> None:
    monkeypatch.setenv("EVALPIPE_TEST_SECRET", "hunter2")
    monkeypatch.delenv("EVALPIPE_PREDICATE_RAN_HERE", raising=False)
    case = _predicate(f"{hostile_predicates}:sees_secret")
    assert len(grader_fingerprint(case)) == 64
    verdict = grade("x", case)
    assert verdict.status is Status.failed, verdict.detail
    assert "EVALPIPE_PREDICATE_RAN_HERE" not in os.environ
    assert not [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(hostile_predicates)]


def test_a_suite_cannot_turn_a_library_function_on_the_host(mode: str, hostile_predicates: Path) -> None:
    bwrap_only(mode, "a read-only file system")
    victim = ROOT / f".victim-{uuid.uuid4().hex}"
    victim.mkdir()
    (victim / "data").write_text("keep")
    try:
        # rmtree(output, case): the case is truthy, so errors are ignored and it returns None.
        assert grade(str(victim), _predicate("shutil:rmtree")).status is Status.failed
        writes = _predicate(f"{hostile_predicates}:writes")
        escaped = [ROOT / f".escaped-{uuid.uuid4().hex}", hostile_predicates.parent / "escaped"]
        assert [grade(str(path), writes).status for path in escaped] == [Status.error] * 2
        assert (victim / "data").read_text() == "keep" and not any(p.exists() for p in escaped)
    finally:
        (victim / "data").unlink()
        victim.rmdir()


def test_module_predicates_resolve_from_the_working_directory(mode: str, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "suite_preds.py").write_text("def loud(output, case):\n    return output.isupper()\n")
    monkeypatch.chdir(tmp_path)
    assert grade("LOUD", _predicate("suite_preds:loud")).status is Status.passed
    assert grade("quiet", _predicate("suite_preds:loud")).status is Status.failed
    # Edited, same size: the edited code is what runs, on the same warm server.
    (tmp_path / "suite_preds.py").write_text("def loud(output, case):\n    return output.islower()\n")
    assert grade("quiet", _predicate("suite_preds:loud")).status is Status.passed


def test_a_hanging_predicate_is_an_error_not_a_hang(mode: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(servers, "PREDICATE_LIMITS", Limits(timeout_s=1.0, memory_mb=4096))
    (tmp_path / "slow.py").write_text("import time\ndef wait(output, case):\n    time.sleep(60)\n")
    verdict = grade("x", _predicate(f"{tmp_path}/slow.py:wait"))
    assert verdict.status is Status.error and "no reply within 1 s" in verdict.detail


# --- 5. a runtime under /tmp is not walked after every program ---------------------------

_IN_OPEN, _IN_NONBLOCK = 0x20, os.O_NONBLOCK


def test_the_cleanup_does_not_walk_a_runtime_bound_in_from_tmp(mode: str, tmp_path: Path) -> None:
    """A clone or venv under /tmp is bound into the sandbox; wiping the private /tmp after
    each program must skip it (walking a venv cost 150-250 ms a program). inotify sees
    every directory opened in it, through the bind mount too."""
    bwrap_only(mode, "a private /tmp to wipe")
    venv = tmp_venv(tmp_path)
    untouched = venv / "untouched" / "deeper"
    untouched.mkdir(parents=True)
    (untouched / "file").write_text("x")
    libc = ctypes.CDLL(None, use_errno=True)
    watch = libc.inotify_init1(_IN_NONBLOCK)
    assert watch >= 0 and libc.inotify_add_watch(watch, str(untouched).encode(), _IN_OPEN) >= 0
    code = (
        "from tasks.sandbox import Limits, ForkServer\n"
        "s = ForkServer(Limits())\n"
        "print([s.run('open(\"/tmp/beside\", \"w\").write(\"x\")', Limits()).completed,"
        " s.run('import os; assert not os.path.exists(\"/tmp/beside\")', Limits()).completed])\n"
        "s.close()\n"
    )
    try:
        out = subprocess.run([str(venv / "bin/python"), "-c", code], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[True, True]"  # still wiped beside the bound venv
        with pytest.raises(BlockingIOError):
            os.read(watch, 4096)
    finally:
        os.close(watch)
