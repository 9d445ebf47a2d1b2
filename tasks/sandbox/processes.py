"""One sandboxed command (`run_command`): its process group, pids cgroup, rlimits and
seccomp filter, its output read with a cap, its wall-clock limit, and its end: nothing of
it outlives the call."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from tasks.sandbox import network as own_network
from tasks.sandbox import seccomp
from tasks.sandbox.disk import DiskCap, DiskWatch
from tasks.sandbox.forkserver import capture, die_with, set_limits
from tasks.sandbox.limits import Limits, SandboxError, SandboxResult
from tasks.sandbox.namespace import SCRATCH_SOURCE, Mounts, bwrap_argv, scrubbed_env
from tasks.sandbox.network import Connection, OwnNetwork
from tasks.sandbox.policy import isolation, log_once


class PidsCgroup:
    """A pids cgroup for one sandbox: caps the process count (which rlimits cannot for
    root) and lists every member, setsid or not, so all of them can be killed."""

    _counter = 0
    _lock = threading.Lock()

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, max_procs: int) -> PidsCgroup | None:
        root = _pids_root()
        if root is None:
            return None
        with cls._lock:
            if not cls._counter:
                _sweep_stale(root)
            cls._counter += 1
            # The token: a process that died without destroying its groups (killed) leaves
            # them, and a later process given its pid would find the name taken. The pid
            # namespace: only a process in its owner's can tell whether the owner is gone.
            path = root / f"evalpipe-{os.getpid()}-{cls._counter}-{secrets.token_hex(4)}-{_pid_namespace()}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(max_procs))
        except OSError as exc:
            log_once("cgroup", "sandbox: cannot create a pids cgroup (%s); no process cap", exc)
            try:
                path.rmdir()
            except OSError:
                pass
            return None
        return cls(path)

    def set_max(self, max_procs: int) -> None:
        (self.path / "pids.max").write_text(str(max_procs))

    def join_self(self) -> None:
        """For preexec: move the calling (new) process into the cgroup."""
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def members(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def kill_all(self) -> None:
        kill_until_gone(self.members)

    def destroy(self) -> None:
        try:
            self.kill_all()
            for _ in range(1000):
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.002)  # members still exiting
        except OSError:
            pass


def _sweep_stale(root: Path) -> None:
    """Remove the pids cgroups of evalpipe processes that are gone (killed before they
    could remove their own), killing what is left in them first: nobody waits for those
    processes' results. One a killed harness left can hold a bubblewrap that never runs
    its command (the harness died before bubblewrap's launcher let it go on, so it waits
    for good). A group whose owner is in another pid namespace, or whose name predates
    the namespace in it, is removed only when empty: its owner cannot be looked up here."""
    here = _pid_namespace()
    for group in root.glob("evalpipe-*"):
        parts = group.name.split("-")
        owner = parts[1]
        if not owner.isdigit() or os.path.exists(f"/proc/{owner}"):
            continue
        if here is not None and len(parts) == 5 and parts[4] == here:
            PidsCgroup(group).destroy()
            continue
        try:
            group.rmdir()
        except OSError:
            pass


@lru_cache(maxsize=1)
def _pid_namespace() -> str | None:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def kill_until_gone(members: Callable[[], list[int]], rounds: int = 1000) -> None:
    """SIGKILL every pid `members()` lists until it lists none (a member may fork while
    the others are killed). Also used for the leftovers of `cmd:` agents."""
    for _ in range(rounds):
        pids = members()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)


@lru_cache(maxsize=1)
def _pids_root() -> Path | None:
    v1, v2 = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")
    if (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK):
        return v1
    control = v2 / "cgroup.subtree_control"
    if control.exists() and "pids" in control.read_text().split() and os.access(v2, os.W_OK):
        return v2
    log_once("cgroup", "sandbox: no writable pids cgroup; process count is not capped")
    return None


def preexec(
    limits: Limits | None, cgroup: PidsCgroup | None, cpu: bool = True, die_with_parent: bool = False
) -> Callable[[], None]:
    install = seccomp.installer()
    parent = os.getpid()

    def setup() -> None:
        if die_with_parent:
            die_with(parent)
        if cgroup is not None:
            cgroup.join_self()
        if limits is not None:
            cpu_s = limits.cpu_limit_s if cpu else None
            set_limits(limits.memory_mb, cpu_s, limits.file_size_mb)
        if install is not None:  # last: it forbids nothing the steps above need
            install()

    return setup


def _own_network(proc: subprocess.Popen, info: int, block: int, own: OwnNetwork) -> Connection | None:
    """Join the started sandbox's network namespace to the outside, then let it run its
    command; pasta and the watch of the host's addresses. None when bubblewrap failed
    before reporting its sandbox (its result says why)."""
    try:
        report = b""
        with os.fdopen(info, "rb", buffering=0) as reader:
            while not report.rstrip().endswith(b"}") and (chunk := reader.read(4096)):
                report += chunk  # one JSON object, written at once
        try:
            child = json.loads(report)["child-pid"]
        except (ValueError, KeyError, TypeError):
            return None
        return own_network.connect(child, own)
    finally:
        try:
            os.write(block, b"1")
        except BrokenPipeError:
            pass  # bubblewrap is gone already: its result says why
        os.close(block)


# bubblewrap sometimes fails to bring up the loopback of a namespace that pasta is joining
# (about 3 starts in 100 under load, seen with and without the address filter): it exits
# before running anything, so that start is made again. It reports its sandbox before it
# sets up the loopback, so the exit may come while pasta is still joining: the join then
# fails for want of a sandbox (`_LoopbackRace`), and that start is made again too. With one
# retry, two losses in a row failed ~1 start in 1,000 under load (a full test run met it);
# three tries leave ~3 in 100,000.
_LOOPBACK_RACE = b"bwrap: loopback: Failed RTM_NEWADDR"
LOOPBACK_TRIES = 3


class _LoopbackRace(SandboxError):
    """bubblewrap lost the loopback race while its network was being joined."""


def run_command(
    argv: Sequence[str],
    *,
    workdir: Path,
    limits: Limits,
    env: Mapping[str, str] | None = None,
    network: bool | OwnNetwork = False,
    scratch_mb: int | None = None,
    pass_fds: Sequence[int] = (),
    mounts: Mounts | None = None,
    visible: Iterable[str] = (),
    disk: DiskCap | None = None,
) -> SandboxResult:
    """Run `argv` in `workdir` (the only writable place besides a private /tmp and
    `mounts.rw`). `visible`: directories under /tmp to show read-only, bound before
    `mounts.hide` is (what is hidden stays hidden even inside them). `network`: none,
    the host's (True), or an `OwnNetwork` (bubblewrap only). `disk`: a cap on what the
    directories it writes (`workdir`, `mounts.rw`) hold while it runs; over it, the whole
    sandbox is killed and the result's `disk_over` says how much they held.

    With `scratch_mb` (bubblewrap only; check `isolation`), the program runs on a copy of
    `workdir` in a tmpfs holding at most that many MB: it cannot fill the disk, and
    nothing it writes reaches `workdir`. `pass_fds` stay open in the program.
    Never leaves a process behind. Raises `SandboxError` only when nothing could be
    started (e.g. `argv[0]` does not exist), or when an own network's filter failed while
    the program ran (it was killed); everything the program does is a result.
    """
    options = {"workdir": workdir, "limits": limits, "env": env, "network": network, "scratch_mb": scratch_mb,
               "pass_fds": pass_fds, "mounts": mounts, "visible": tuple(visible), "disk": disk}
    for _ in range(LOOPBACK_TRIES - 1):
        try:
            result = _run_once(argv, **options)
        except _LoopbackRace:
            continue
        lost = isinstance(network, OwnNetwork) and result.returncode == 1 and result.stderr.startswith(_LOOPBACK_RACE)
        if not lost:
            return result
    return _run_once(argv, **options)  # the last try: what it gives, or raises, is the result


def _run_once(
    argv: Sequence[str],
    *,
    workdir: Path,
    limits: Limits,
    env: Mapping[str, str] | None,
    network: bool | OwnNetwork,
    scratch_mb: int | None,
    pass_fds: Sequence[int],
    mounts: Mounts | None,
    visible: Iterable[str],
    disk: DiskCap | None,
) -> SandboxResult:
    workdir = Path(workdir).resolve()
    protection = isolation()
    if (mounts is not None or isinstance(network, OwnNetwork)) and protection != "bwrap":
        raise SandboxError("this needs bubblewrap (mounts, an own network), which is not available here")
    own = network if isinstance(network, OwnNetwork) else None
    sync = (os.pipe(), os.pipe()) if own is not None else None  # (info r, w), (block r, w)
    sync_fds = (sync[0][1], sync[1][0]) if sync else None
    if protection == "bwrap" and scratch_mb is not None:
        copy = 'cp -a "$0"/. . && exec "$@"'
        argv = ["/bin/sh", "-c", copy, SCRATCH_SOURCE, *argv]
    else:
        scratch_mb = None
    if protection == "bwrap":
        argv = _watched(argv, (*pass_fds, *(sync_fds or ())))
    full = (
        [*bwrap_argv(limits, workdir, own is None and bool(network), scratch_mb, mounts, visible, sync_fds), *argv]
        if protection == "bwrap"
        else list(argv)
    )
    cgroup = PidsCgroup.create(limits.max_procs + 3)  # bubblewrap's two processes and the watch
    # The watch's pipe (bubblewrap's stdin): only this process holds its write end.
    watch_pipe = os.pipe() if protection == "bwrap" else None
    start = time.monotonic()
    connection = None
    try:
        try:
            proc = subprocess.Popen(
                full,
                cwd=workdir,
                env=scrubbed_env((mounts and mounts.workdir_at) or str(workdir), env),
                stdin=watch_pipe[0] if watch_pipe else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(*pass_fds, *(sync_fds or ())),
                # bubblewrap's --die-with-parent, from the fork on.
                preexec_fn=preexec(limits, cgroup, die_with_parent=protection == "bwrap"),  # noqa: PLW1509
            )
        except (OSError, subprocess.SubprocessError) as exc:
            for fd in (sync[0][0], sync[1][1]) if sync else ():
                os.close(fd)
            raise SandboxError(f"cannot start {argv[0]!r}: {exc}") from exc
        finally:
            for fd in (*(sync_fds or ()), *(watch_pipe or ())[:1]):
                os.close(fd)
        pidfd = os.pidfd_open(proc.pid)
        if sync is not None:
            try:
                connection = _own_network(proc, sync[0][0], sync[1][1], own)
            except BaseException as exc:
                kill_group(proc.pid, cgroup)
                proc.wait()
                if isinstance(exc, SandboxError) and proc.stderr.read(len(_LOOPBACK_RACE)) == _LOOPBACK_RACE:
                    raise _LoopbackRace(f"the sandbox lost its loopback as its network was joined: {exc}") from None
                raise

        reaping = threading.Lock()  # the watcher kills no pid once it is reaped (and reusable)

        def stop_sandbox() -> None:
            with reaping:
                if proc.returncode is None:
                    kill_group(proc.pid, cgroup)

        def on_exit() -> None:
            with reaping:
                proc.wait()
            kill_group(proc.pid, cgroup)

        watch = (DiskWatch(disk, stop_sandbox, lambda: sandbox_processes(proc.pid, cgroup)).start()
                 if disk is not None else None)
        try:
            cap = limits.output_cap_bytes
            data, truncated, timed_out = capture(
                {"stdout": (proc.stdout.fileno(), cap), "stderr": (proc.stderr.fileno(), cap)},
                start + limits.timeout_s,
                pidfd,
                on_exit,
            )
        finally:
            if watch is not None:
                watch.stop()
            kill_group(proc.pid, cgroup)
            proc.wait()
            os.close(pidfd)
            proc.stdout.close()
            proc.stderr.close()
    finally:
        if watch_pipe:
            os.close(watch_pipe[1])  # after the wait: the sandbox is gone, its watch with it
        try:
            if connection is not None:
                own_network.disconnect(connection)  # raises when its filter failed while the command ran
        finally:
            if cgroup is not None:
                cgroup.destroy()
    return SandboxResult(
        returncode=None if timed_out else proc.returncode,
        stdout=data["stdout"],
        stderr=data["stderr"],
        stdout_truncated=truncated["stdout"],
        stderr_truncated=truncated["stderr"],
        timed_out=timed_out,
        duration_s=time.monotonic() - start,
        isolation=protection,
        disk_over=watch.over if watch is not None else None,
    )


def _watched(argv: Sequence[str], taken: Iterable[int]) -> list[str]:
    """`argv` with a watch beside it in the sandbox, for a harness killed as it starts one.
    bubblewrap arms the --die-with-parent of its sandbox's init only once the sandbox is set
    up (and, with a network of its own, joined): a harness killed before that left the
    command running to its end, unwatched. The watch reads the pipe on its stdin, whose
    write end only the harness holds, and at its end kills every process of the sandbox's
    pid namespace. It does so only as the namespace's pid 2 (bubblewrap's init forks it):
    `kill -1` anywhere else would reach the host's processes. The command gets /dev/null
    for stdin, as before; dash names file descriptors 0-9 only."""
    fd = next(n for n in range(3, 10) if n not in set(taken))
    watch = (f'exec {fd}<&0 </dev/null; (read -r _ <&{fd}; [ "$$" = 2 ] && kill -9 -1) & '
             f'exec {fd}<&- "$@"')
    return ["/bin/sh", "-c", watch, "sh", *argv]


def sandbox_processes(pgid: int, cgroup: PidsCgroup | None) -> list[int]:
    """The processes of a sandbox: its pids cgroup's members, else its process group's."""
    if cgroup is not None:
        try:
            return cgroup.members()
        except OSError:
            return []
    found = []
    for entry in os.listdir("/proc"):
        try:
            # After the command's name, which may hold spaces: state, ppid, pgrp.
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found


def kill_group(pgid: int, cgroup: PidsCgroup | None) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if cgroup is not None:
        cgroup.kill_all()


def run_python(source: str, *, limits: Limits | None = None) -> SandboxResult:
    """Run a Python program (as `python -I program.py`) in a fresh work directory.

    The helper a `predicate` calls to run candidate code in the sandbox.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="evalpipe-py-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(source, encoding="utf-8")
        return run_command(
            [sys.executable, "-I", str(path)], workdir=Path(tmp), limits=limits or Limits()
        )
