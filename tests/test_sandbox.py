"""run_command: limits, isolation and cleanup, with real processes (and the fallback)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support.cli import wait_gone
from test_python_tests import _processes_with

from tasks.sandbox import (
    DiskCap,
    ForkServer,
    Limits,
    Mounts,
    SandboxError,
    SandboxResult,
    policy,
    run_command,
    run_python,
)
from tasks.sandbox import processes as sandbox

ROOT = Path(__file__).resolve().parent.parent
needs_bwrap = pytest.mark.skipif(not policy.bwrap_available(), reason="needs bubblewrap")


def _py(code: str, tmp_path: Path, **limits: float) -> SandboxResult:
    return run_command(
        [sys.executable, "-I", "-c", code], workdir=tmp_path, limits=Limits(**limits)
    )


def test_runs_in_workdir_and_reports_isolation(mode: str, tmp_path: Path) -> None:
    res = _py("import os; print(os.getcwd()); open('made', 'w').write('x')", tmp_path)
    assert res.returncode == 0 and not res.timed_out
    assert res.stdout.decode().strip() == str(tmp_path.resolve())
    assert (tmp_path / "made").read_text() == "x"
    assert res.isolation == mode


def test_venv_python_imports_the_project_read_only(mode: str, tmp_path: Path) -> None:
    res = _py("import tasks.models, pydantic; print('ok')", tmp_path)
    assert (res.returncode, res.stdout) == (0, b"ok\n")


def test_timeout_kills_the_group_and_setsid_escapees(mode: str, tmp_path: Path) -> None:
    marker = f"evalpipe-sbx-{uuid.uuid4().hex}"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['{marker}', '300'])\n"
        "time.sleep(300)\n"
    )
    res = _py(code, tmp_path, timeout_s=1.0)
    assert res.timed_out and res.returncode is None
    assert _processes_with(marker) == []


def test_escapee_is_killed_when_the_command_ends(mode: str, tmp_path: Path) -> None:
    if mode == "rlimits" and sandbox._pids_root() is None:
        pytest.skip("without namespaces, escapees are found through the pids cgroup only")
    marker = f"evalpipe-sbx-{uuid.uuid4().hex}"
    code = (
        "import os, subprocess\n"
        f"subprocess.Popen(['/bin/sh', '-c', 'exec -a {marker} sleep 300'],\n"
        "    start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    )
    res = _py(code, tmp_path)
    assert res.returncode == 0 and not res.timed_out
    assert _processes_with(marker) == []


def test_a_disk_cap_stops_the_whole_sandbox_while_it_writes(mode: str, tmp_path: Path) -> None:
    """`disk`: a `setsid` escapee writing files without end in a second writable directory
    (its parent only waits) is killed, and the whole sandbox with it, once the directories
    hold more than the cap; a command under it runs to its end untouched."""
    marker = f"evalpipe-sbx-{uuid.uuid4().hex}"
    work, other = tmp_path / "work", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    writer = f"import itertools\nfor n in itertools.count(): open(f'{other}/{{n}}.bin', 'wb').write(bytes(1 << 20))"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv({sys.executable!r}, ['{marker}', '-c', {writer!r}])\n"
        "time.sleep(300)\n"
    )
    mounts = Mounts(rw=(str(other),)) if mode == "bwrap" else None
    cap = DiskCap((str(work), str(other)), 16 << 20)
    res = run_command([sys.executable, "-I", "-c", code], workdir=work, limits=Limits(timeout_s=120), disk=cap,
                      mounts=mounts)
    assert not res.timed_out and res.returncode == -9, res
    assert res.disk_over is not None and res.disk_over > 16 << 20
    assert len(list(other.iterdir())) >= 16
    assert _processes_with(marker) == []
    quiet = run_command(["/bin/sh", "-c", "head -c 1048576 /dev/zero > one.bin"], workdir=work,
                        limits=Limits(timeout_s=60), disk=DiskCap((str(work),), 1 << 30))
    assert (quiet.returncode, quiet.disk_over) == (0, None)


def test_environment_is_scrubbed(mode: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EVALPIPE_TEST_SECRET", "hunter2")
    res = run_command(
        [sys.executable, "-I", "-c", "import os; print(sorted(os.environ.items()))"],
        workdir=tmp_path,
        limits=Limits(),
        env={"EXTRA": "given"},
    )
    assert b"hunter2" not in res.stdout
    assert b"('EXTRA', 'given')" in res.stdout
    assert f"('HOME', '{tmp_path.resolve()}')".encode() in res.stdout


def test_output_is_captured_with_a_cap(mode: str, tmp_path: Path) -> None:
    code = "import sys\nfor _ in range(50): sys.stdout.write('y' * (1 << 20))\nprint('e', file=sys.stderr)"
    res = _py(code, tmp_path)
    assert res.returncode == 0
    assert res.stdout_truncated and len(res.stdout) == Limits().output_cap_bytes
    assert (res.stderr, res.stderr_truncated) == (b"e\n", False)


def test_memory_limit_applies(mode: str, tmp_path: Path) -> None:
    res = _py("b = bytearray(6 * 1024**3)", tmp_path, memory_mb=512)
    assert res.returncode == 1 and b"MemoryError" in res.stderr


def test_cpu_limit_applies(mode: str, tmp_path: Path) -> None:
    res = run_command(
        [sys.executable, "-I", "-c", "while True: pass"],
        workdir=tmp_path,
        limits=Limits(timeout_s=30, cpu_s=1),
    )
    # Killed by SIGXCPU/SIGKILL: -N directly, 128+N as reported by bubblewrap's init.
    assert not res.timed_out and res.returncode not in (0, None)


@needs_bwrap
def test_fork_storm_is_capped(tmp_path: Path) -> None:
    if sandbox._pids_root() is None:
        pytest.skip("no pids cgroup")
    code = (
        "import os, time\nn = 0\nfor _ in range(1000):\n    try:\n"
        "        if os.fork() == 0:\n            time.sleep(5); os._exit(0)\n        n += 1\n"
        "    except OSError:\n        break\nprint(n)"
    )
    res = run_command(
        [sys.executable, "-I", "-c", code], workdir=tmp_path, limits=Limits(max_procs=20)
    )
    assert 0 < int(res.stdout) <= 20


def test_the_pids_cgroups_a_killed_process_left_neither_pile_up_nor_take_a_later_name() -> None:
    """A process killed before it removed its pids cgroups leaves them; the next process
    that makes one removes them, and a name already taken (a dead process had this pid)
    does not leave a sandbox without its process cap."""
    root = sandbox._pids_root()
    if root is None:
        pytest.skip("no pids cgroup")
    code = (f"import os, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
            "from tasks.sandbox.processes import PidsCgroup\n"
            "group = PidsCgroup.create(10)\nprint(group.path if group else '')\n")
    # Ended with no clean-up, as a killed process is.
    left = subprocess.run([sys.executable, "-c", code + "os._exit(0)\n"], capture_output=True, text=True, check=True)
    assert Path(left.stdout.strip()).is_dir()
    later = subprocess.run([sys.executable, "-c", code + "group.destroy()\n"], capture_output=True, text=True,
                           check=True)
    assert later.stdout.strip() and not Path(left.stdout.strip()).exists()
    taken = root / f"evalpipe-{os.getpid()}-{sandbox.PidsCgroup._counter + 1}"
    taken.mkdir()
    try:
        group = sandbox.PidsCgroup.create(10)
        assert group is not None and group.path != taken
        group.destroy()
    finally:
        taken.rmdir()


KILLED_WITH_A_MEMBER = """
import os, subprocess, sys
from tasks.sandbox.processes import PidsCgroup
group = PidsCgroup.create(10)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]], preexec_fn=group.join_self,
                 stdout=subprocess.DEVNULL, start_new_session=True)
print(group.path, flush=True)
os._exit(0)
"""


def test_what_a_killed_process_left_in_its_pids_cgroups_is_killed_by_the_next_one() -> None:
    """A harness killed as bubblewrap's launcher starts leaves bubblewrap waiting for good,
    running nothing, in the harness's pids cgroup: the next process that makes a group
    kills what such a group holds and removes it. A group whose owner is in another pid
    namespace (it cannot be looked up here) is left alone."""
    root = sandbox._pids_root()
    if root is None:
        pytest.skip("no pids cgroup")
    marker = f"evalpipe-left-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.Popen([sys.executable, "-c", KILLED_WITH_A_MEMBER, marker], stdout=subprocess.PIPE,
                              text=True, env=env)
    left = Path(killed.communicate()[0].strip())
    # Named by the same (dead) owner in another pid namespace.
    elsewhere = root / f"evalpipe-{killed.pid}-1-{uuid.uuid4().hex[:8]}-{sandbox._pid_namespace()}0"
    elsewhere.mkdir()
    foreign = None
    try:
        foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker],
                                   preexec_fn=sandbox.PidsCgroup(elsewhere).join_self)
        assert left.is_dir() and len(_processes_with(marker)) == 2
        subprocess.run([sys.executable, "-c", "from tasks.sandbox.processes import PidsCgroup\n"
                        "PidsCgroup.create(10).destroy()"], check=True, env=env)
        assert not left.exists()
        assert _processes_with(marker) == [foreign.pid] and elsewhere.is_dir()
    finally:
        for pid in _processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if foreign is not None:
            foreign.wait()
        sandbox.PidsCgroup(elsewhere).destroy()


@needs_bwrap
def test_write_outside_workdir_does_not_appear(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    # Beside the work dir is the private /tmp (the write "succeeds" there, and vanishes);
    # elsewhere the file system is read-only.
    beside = tmp_path / "outside.txt"
    elsewhere = Path(__file__).resolve().parent / f".escaped-{uuid.uuid4().hex}"
    res = _py(f"open({str(beside)!r}, 'w').write('x')", work)
    assert res.returncode == 0 and not beside.exists()
    res = _py(f"open({str(elsewhere)!r}, 'w').write('x')", work)
    assert b"Read-only file system" in res.stderr and not elsewhere.exists()


@needs_bwrap
def test_no_network(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        res = _py(f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)", tmp_path)
    assert res.returncode == 1 and b"ConnectionRefusedError" in res.stderr


def test_missing_program(tmp_path: Path) -> None:
    # Under bubblewrap the sandbox starts and the exec fails inside it: a non-zero exit.
    try:
        res = run_command(["/nonexistent/prog"], workdir=tmp_path, limits=Limits())
    except SandboxError:
        return
    assert res.returncode not in (0, None)


def test_run_python_helper_for_predicates() -> None:
    res = run_python("print(6 * 7)")
    assert (res.returncode, res.stdout) == (0, b"42\n")


def test_fallback_fork_server_still_contains_programs(mode: str) -> None:
    server = ForkServer(Limits())
    try:
        assert server.isolation == mode
        looped = server.run("while True: pass", Limits(timeout_s=0.5))
        assert looped.result.timed_out and not looped.completed
        done = server.run("x = 1", Limits())
        assert done.completed and done.result.returncode == 0
    finally:
        server.close()


def tmp_venv(tmp_path: Path) -> Path:
    """A venv under /tmp (as CI checkouts often are) that imports evalpipe and its packages."""
    import subprocess
    import sysconfig

    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip("the test's tmp dir is not under /tmp, so it would not exercise the bind")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    root = Path(sandbox.__file__).resolve().parents[2]
    (site / "evalpipe-here.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{root}\n")
    return venv


@needs_bwrap
def test_an_interpreter_living_under_tmp_still_runs_in_the_sandbox(tmp_path: Path) -> None:
    """A clone or venv under /tmp (CI checkouts often are) is hidden by the sandbox's
    private /tmp unless it is bound back in; then every program would fail to start."""
    import subprocess

    venv = tmp_venv(tmp_path)
    (tmp_path / "secret").write_text("x")
    secret = str(tmp_path / "secret")
    code = (
        "from tasks.sandbox import Limits, run_python, run_python_program\n"
        f"r = run_python(\"import os, sys; print(sys.prefix, os.path.exists({secret!r}))\")\n"
        "print(r.isolation, r.returncode, r.stdout.decode().strip())\n"
        "f = run_python_program('import sys; print(sys.prefix)', Limits())\n"
        "print(f.completed, f.result.stdout.decode().strip())\n"
    )
    out = subprocess.run([str(venv / "bin/python"), "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # The program ran (command and fork server alike); the rest of /tmp stayed private.
    assert out.stdout.split() == ["bwrap", "0", str(venv), "False", "True", str(venv)]


def test_a_loopback_resolver_is_swapped_for_the_one_it_forwards_to(tmp_path: Path, monkeypatch) -> None:
    """systemd-resolved's 127.0.0.53 is out of reach of a network of its own: such a sandbox
    reads the resolvers systemd-resolved forwards to, as Docker does; a host file naming a
    resolver off the loopback is kept."""
    from tasks.sandbox import namespace

    host, upstream = tmp_path / "resolv.conf", tmp_path / "upstream.conf"
    monkeypatch.setattr(namespace, "RESOLV_CONF", str(host))
    monkeypatch.setattr(namespace, "RESOLVED_UPSTREAM", str(upstream))
    upstream.write_text("# from systemd-resolved\nnameserver 192.0.2.53\n")
    for text, expected in (("nameserver 127.0.0.53\noptions edns0\n", str(upstream)),
                           ("", str(upstream)),  # none named: glibc asks 127.0.0.1
                           ("nameserver 10.0.0.2\nnameserver 127.0.0.53\n", None)):
        host.write_text(text)
        assert namespace.upstream_resolvers() == expected, text
    upstream.write_text("nameserver 127.0.0.1\n")  # nothing better than the loopback
    host.write_text("nameserver 127.0.0.53\n")
    assert namespace.upstream_resolvers() is None
    argv = namespace.bwrap_argv(Limits(), tmp_path, False, sync_fds=(5, 6))
    assert str(host) not in argv
    upstream.write_text("nameserver 192.0.2.53\n")
    argv = namespace.bwrap_argv(Limits(), tmp_path, False, sync_fds=(5, 6))
    at = argv.index(str(upstream))
    assert argv[at - 1:at + 2] == ["--ro-bind", str(upstream), str(host)]
    assert str(upstream) not in namespace.bwrap_argv(Limits(), tmp_path, False)  # no network: no change


@needs_bwrap
@pytest.mark.skipif(shutil.which("pasta") is None, reason="needs pasta (passt)")
def test_a_sandbox_with_its_own_network_reads_the_upstream_resolvers(tmp_path: Path, monkeypatch) -> None:
    from tasks.sandbox import namespace
    from tasks.sandbox.network import OwnNetwork

    host, upstream, work = tmp_path / "etc" / "resolv.conf", tmp_path / "upstream.conf", tmp_path / "work"
    host.parent.mkdir()
    work.mkdir()
    host.write_text("nameserver 127.0.0.53\n")
    upstream.write_text("nameserver 192.0.2.53\n")
    monkeypatch.setattr(namespace, "RESOLV_CONF", str(host))
    monkeypatch.setattr(namespace, "RESOLVED_UPSTREAM", str(upstream))
    res = run_command(["cat", str(host)], workdir=work, limits=Limits(), network=OwnNetwork())
    assert (res.returncode, res.stdout) == (0, b"nameserver 192.0.2.53\n"), res.stderr


@needs_bwrap
@pytest.mark.skipif(shutil.which("pasta") is None, reason="needs pasta (passt)")
def test_a_start_that_loses_bubblewraps_loopback_race_while_its_network_is_joined_is_made_again(
        tmp_path: Path, monkeypatch) -> None:
    """bubblewrap reports its sandbox before it brings up the loopback; where that fails
    (pasta joining at the same moment), the sandbox is gone while its network is being
    joined. That start is made again, as one that failed after the join is. Seen as
    "cannot watch this host's addresses: No such process" in a test under load. The race
    cannot be made to happen on demand: the join fails here instead, and bubblewrap's
    message is what its stderr begins with."""
    from tasks.sandbox import network
    from tasks.sandbox.network import OwnNetwork

    joins, real, lost = [], network.connect, 1  # `lost`: how many joins, first to last, fail

    def lose(pid: int, own: OwnNetwork):
        joins.append(pid)
        if len(joins) <= lost:
            os.kill(pid, 9)
            raise SandboxError("cannot watch this host's addresses: [Errno 3] No such process")
        return real(pid, own)

    monkeypatch.setattr(network, "connect", lose)
    monkeypatch.setattr(sandbox, "_LOOPBACK_RACE", b"")  # what bubblewrap printed: nothing, its child was killed
    marker = tmp_path / "ran"
    # A real join may lose the race too (it did once under load, when one more try was all
    # there was): then more joins.
    res = run_command(["touch", str(marker)], workdir=tmp_path, limits=Limits(), network=OwnNetwork())
    assert (res.returncode, marker.exists()) == (0, True) and len(joins) >= 2, res.stderr

    # Lost every time: made again until the last try, whose error it is; the command never ran.
    joins.clear()
    marker.unlink()
    lost = sandbox.LOOPBACK_TRIES
    with pytest.raises(SandboxError, match="lost its loopback"):
        run_command(["touch", str(marker)], workdir=tmp_path, limits=Limits(), network=OwnNetwork())
    assert (len(joins), marker.exists()) == (sandbox.LOOPBACK_TRIES, False)

    # Any other failure of the join is the start's: not made again, and the command never ran.
    monkeypatch.setattr(sandbox, "_LOOPBACK_RACE", b"bwrap: loopback: Failed RTM_NEWADDR")
    joins.clear()
    with pytest.raises(SandboxError, match="No such process"):
        run_command(["touch", str(marker)], workdir=tmp_path, limits=Limits(), network=OwnNetwork())
    assert (len(joins), marker.exists()) == (1, False)


# A harness that forks a sandbox's process: that process arms its parent-death signal in
# `preexec`, says so, and execs a sleep. "late": the harness is gone before the child arms it.
FORKING_HARNESS = """
import os, sys, time
from tasks.sandbox.processes import preexec

setup = preexec(None, None, die_with_parent=True)  # built in the parent, as Popen's caller does
mode, flag = sys.argv[1], sys.argv[2]
harness = os.getpid()
child = os.fork()
if child == 0:
    while mode == "late" and os.getppid() == harness:
        time.sleep(0.01)
    setup()
    open(flag, "w").write("armed")
    os.execv("/bin/sleep", ["sleep", "60"])
print(child, flush=True)
if mode == "late":
    os._exit(0)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["late", "armed"])
def test_a_sandboxs_process_never_outlives_a_killed_harness(tmp_path: Path, mode: str) -> None:
    """bubblewrap's --die-with-parent takes hold after its exec: a harness killed between its
    fork and then left the sandbox running, orphaned, for as long as its agent ran."""
    flag = tmp_path / "flag"
    harness = subprocess.Popen([sys.executable, "-c", FORKING_HARNESS, mode, str(flag)], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = int(harness.stdout.readline())
    try:
        if mode == "armed":
            deadline = time.monotonic() + 30
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert flag.exists()
            harness.kill()
        harness.wait(30)
        assert wait_gone([child], 10)
        assert flag.exists() == (mode == "armed")  # "late": it never got to run
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


# A harness whose sandbox waits for its own network to be joined, and the join never ends:
# it is killed while bubblewrap's init has not armed its --die-with-parent yet.
JOINING_HARNESS = """
import os, sys, threading, time
from tasks.sandbox import network
from tasks.sandbox.limits import Limits
from tasks.sandbox.network import OwnNetwork
from tasks.sandbox.processes import run_command

def join_forever(pid, own):
    # Killed before this, the harness leaves bubblewrap waiting for good on its launcher
    # (an eventfd), running nothing: the next sandbox start kills that (the test above).
    # Here the kill lands where the command is let go: bubblewrap reads its block fd.
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            ours.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            fd = int(open(f"/proc/{pid}/syscall").read().split()[1], 16)
            if os.readlink(f"/proc/{pid}/fd/{fd}") in ours:
                break
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(0.005)
    print(pid, flush=True)
    threading.Event().wait()

network.connect = join_forever
run_command(["/bin/sh", "-c", "sleep 600 & wait", sys.argv[1]], workdir=sys.argv[2],
            limits=Limits(timeout_s=120), network=OwnNetwork())
"""


@needs_bwrap
def test_a_sandbox_never_outlives_a_harness_killed_as_it_starts(tmp_path: Path) -> None:
    """bubblewrap arms its init's --die-with-parent only once the sandbox is set up and, with
    a network of its own, joined: a harness killed before that left the command running to
    its end, unwatched (3 kills in 4 as a workspace agent started; a CI run's failure). The
    watch beside the command ends it."""
    marker = f"evalpipe-watched-{uuid.uuid4().hex}"
    harness = subprocess.Popen([sys.executable, "-c", JOINING_HARNESS, marker, str(tmp_path)],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert int(harness.stdout.readline()) > 0  # the sandbox is up, waiting for its network
        harness.kill()
        harness.wait(30)
        # Its wait ends with the harness, and the command would run to its end (600 s):
        # its watch ends it, and bubblewrap's processes with it (their argv names it too).
        # 30 s: under a full suite's load one run still had a process at 10 s (the message says which).
        deadline = time.monotonic() + 30
        while (left := _processes_with(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == [], [_described(pid) for pid in left]
    finally:
        for pid in _processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _described(pid: int) -> str:
    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: gone"
    return f"{pid} ({status['State']}, parent {status['PPid']}, NSpid {status.get('NSpid')}): {argv[:300]}"
