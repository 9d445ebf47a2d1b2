"""The sandbox for every piece of candidate code (docs/contract.md §4, last paragraph).

Two entry points with the same guarantees (see docs/sandbox.md for exactly which):
- `run_command(argv, ...)`: one command in a work directory (repo_tests runs pytest so).
- `ForkServer` / `run_python_program`: Python programs forked from a warm server that
  itself lives in the sandbox (python_tests: 1-2 ms per program instead of 20-70 ms).

Layers, each applied where the machine allows and reported in `SandboxResult.isolation`:
1. bubblewrap: new pid/net/mount/user/ipc/uts namespaces, `/` read-only, a private
   `/tmp`, no capabilities, killed with its parent; ending the namespace's init kills
   every process in it, `setsid` escapees included. Missing or broken → logged once,
   and we fall back to layer 2 alone (`isolation="rlimits"`).
2. always: own session and process group, rlimits (address space, CPU, file size, no
   core), a scrubbed environment, output read with a cap, wall-clock timeout that kills
   the whole group; a pids cgroup (when writable) caps the process count and finds
   escapees even without namespaces.
"""

from __future__ import annotations

import atexit
import base64
import logging
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tasks.forkserver import capture, read_frame, set_limits, write_frame

log = logging.getLogger(__name__)

BWRAP = "bwrap"
# "auto" uses bubblewrap when it works; "rlimits" forces the fallback (for tests, or
# machines where user namespaces are forbidden and the probe would be noisy).
MODE_ENV = "EVALPIPE_SANDBOX"
_FORKSERVER = Path(__file__).with_name("forkserver.py")
_PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 2048
    cpu_s: float | None = None  # default: derived from timeout_s
    file_size_mb: int = 256
    max_procs: int = 256
    output_cap_bytes: int = 1 << 20

    @property
    def cpu_limit_s(self) -> float:
        # A little over the wall clock: the timer is what should normally fire.
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None if killed; -N when ended by signal N
    stdout: bytes  # capped at output_cap_bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    duration_s: float
    isolation: str  # "bwrap" or "rlimits" (fallback): what protected this run


@dataclass(frozen=True)
class Mounts:
    """Extra bubblewrap mounts for `run_command` (repository environments use them).

    `workdir_at`: where the work directory appears inside (a fixed path such as
    /tmp/testbed, so an editable install made against it serves every worktree);
    `ro`/`rw`: host directories bound at their own path; `hide`: directories replaced by
    an empty read-only tmpfs (the harness's own venv and code), binds inside them kept.
    Needs bubblewrap: without it `run_command` refuses with `SandboxError`.
    """

    workdir_at: str | None = None
    ro: tuple[str, ...] = ()
    rw: tuple[str, ...] = ()
    hide: tuple[str, ...] = ()


class SandboxError(RuntimeError):
    """The sandbox itself could not start (graders report `error`)."""


class ServerDied(SandboxError):
    """A fork server died or stopped answering mid-run: the program most likely killed
    it (graders report `failed`); the server is closed and replaced on the next run."""


def scrubbed_env(home: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Only PATH/locale from the parent (no tokens, no keys), HOME set to the work dir."""
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(HOME=home, TMPDIR="/tmp", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


# Where a scratch run (`scratch_mb`) sees the real work directory, read-only, to copy it.
_SCRATCH_SOURCE = "/tmp/.evalpipe-source"


def _bwrap_argv(
    limits: Limits,
    workdir: Path | None,
    network: bool,
    scratch_mb: int | None = None,
    mounts: Mounts | None = None,
) -> list[str]:
    argv = [BWRAP, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if network:
        argv.append("--share-net")
    argv += ["--ro-bind", "/", "/", "--size", str(limits.file_size_mb << 20), "--tmpfs", "/tmp"]
    for path in _runtime_under_tmp():
        argv += ["--ro-bind", path, path]
    mounts = mounts or Mounts()
    hidden = [p for p in mounts.hide if os.path.isdir(p)]
    for path in hidden:
        argv += ["--tmpfs", path]
    for flag, paths in (("--ro-bind", mounts.ro), ("--bind", mounts.rw)):
        for path in paths:
            argv += [flag, path, path]
    for path in hidden:
        argv += ["--remount-ro", path]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    inside = mounts.workdir_at or str(workdir)
    if workdir is not None and scratch_mb is not None:
        # A tmpfs of that size at the work directory's (inside) path, filled with a copy
        # of it: writes are capped by the kernel and never reach the real directory.
        argv += ["--ro-bind", str(workdir), _SCRATCH_SOURCE]
        argv += ["--size", str(scratch_mb << 20), "--tmpfs", inside]
    elif workdir is not None:
        argv += ["--bind", str(workdir), inside]
    if workdir is not None:
        argv += ["--chdir", inside]
    return argv + ["--"]


@lru_cache(maxsize=1)
def _runtime_under_tmp() -> tuple[str, ...]:
    """The interpreter, its packages and our code where they live under /tmp (a clone or
    a venv made there): the sandbox's private /tmp would hide them, so they are bound
    back in, read-only. Nothing else of the host's /tmp is visible."""
    candidates = {sys.prefix, sys.base_prefix, os.path.dirname(sys.executable),
                  str(_FORKSERVER.parent.parent), *(p for p in sys.path if p)}
    found: list[str] = []
    for path in sorted(os.path.abspath(p) for p in candidates):
        if path.startswith("/tmp/") and os.path.isdir(path) and not any(
            path.startswith(f"{top}/") for top in found
        ):
            found.append(path)
    return tuple(found)


@lru_cache(maxsize=1)
def bwrap_available() -> bool:
    """Whether bubblewrap starts here; probed once per process, fallback logged once."""
    if os.environ.get(MODE_ENV, "auto") == "rlimits":
        log.info("sandbox: %s=rlimits, not using bubblewrap", MODE_ENV)
        return False
    if shutil.which(BWRAP) is None:
        log.warning("sandbox: bwrap not found; falling back to rlimits only (no namespaces)")
        return False
    try:
        probe = subprocess.run(
            [*_bwrap_argv(Limits(), None, False), "/bin/true"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("sandbox: bwrap failed to start (%s); falling back to rlimits only", exc)
        return False
    if probe.returncode != 0:
        reason = probe.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        log.warning("sandbox: bwrap failed (%s); falling back to rlimits only", reason[0])
        return False
    return True


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
            cls._counter += 1
            path = root / f"evalpipe-{os.getpid()}-{cls._counter}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(max_procs))
        except OSError as exc:
            _log_once("cgroup", "sandbox: cannot create a pids cgroup (%s); no process cap", exc)
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

    def kill_all(self) -> None:
        for _ in range(1000):
            pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.001)

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


@lru_cache(maxsize=1)
def _pids_root() -> Path | None:
    v1, v2 = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")
    if (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK):
        return v1
    control = v2 / "cgroup.subtree_control"
    if control.exists() and "pids" in control.read_text().split() and os.access(v2, os.W_OK):
        return v2
    _log_once("cgroup", "sandbox: no writable pids cgroup; process count is not capped")
    return None


_logged: set[str] = set()


def _log_once(key: str, msg: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(msg, *args)


def _preexec(limits: Limits | None, cgroup: PidsCgroup | None) -> Callable[[], None]:
    def setup() -> None:
        if cgroup is not None:
            cgroup.join_self()
        if limits is not None:
            set_limits(limits.memory_mb, limits.cpu_limit_s, limits.file_size_mb)

    return setup


def run_command(
    argv: Sequence[str],
    *,
    workdir: Path,
    limits: Limits,
    env: Mapping[str, str] | None = None,
    network: bool = False,
    scratch_mb: int | None = None,
    pass_fds: Sequence[int] = (),
    mounts: Mounts | None = None,
) -> SandboxResult:
    """Run `argv` in `workdir` (the only writable place besides a private /tmp and
    `mounts.rw`).

    With `scratch_mb` (bubblewrap only; check `isolation`), the program runs on a copy of
    `workdir` in a tmpfs holding at most that many MB: it cannot fill the disk, and
    nothing it writes reaches `workdir`. `pass_fds` stay open in the program.
    Never leaves a process behind. Raises `SandboxError` only when nothing could be
    started (e.g. `argv[0]` does not exist); everything the program does is a result.
    """
    workdir = Path(workdir).resolve()
    isolation = "bwrap" if bwrap_available() else "rlimits"
    if mounts is not None and isolation != "bwrap":
        raise SandboxError("this needs bubblewrap (mounts), which is not available here")
    if isolation == "bwrap" and scratch_mb is not None:
        copy = 'cp -a "$0"/. . && exec "$@"'
        argv = ["/bin/sh", "-c", copy, _SCRATCH_SOURCE, *argv]
    else:
        scratch_mb = None
    full = (
        [*_bwrap_argv(limits, workdir, network, scratch_mb, mounts), *argv]
        if isolation == "bwrap"
        else list(argv)
    )
    cgroup = PidsCgroup.create(limits.max_procs + 2)
    start = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(
                full,
                cwd=workdir,
                env=scrubbed_env((mounts and mounts.workdir_at) or str(workdir), env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=tuple(pass_fds),
                preexec_fn=_preexec(limits, cgroup),  # noqa: PLW1509 - rlimits need it
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxError(f"cannot start {argv[0]!r}: {exc}") from exc
        pidfd = os.pidfd_open(proc.pid)

        def on_exit() -> None:
            proc.wait()
            _kill_group(proc.pid, cgroup)

        try:
            cap = limits.output_cap_bytes
            data, truncated, timed_out = capture(
                {"stdout": (proc.stdout.fileno(), cap), "stderr": (proc.stderr.fileno(), cap)},
                start + limits.timeout_s,
                pidfd,
                on_exit,
            )
        finally:
            _kill_group(proc.pid, cgroup)
            proc.wait()
            os.close(pidfd)
            proc.stdout.close()
            proc.stderr.close()
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
        isolation=isolation,
    )


def _kill_group(pgid: int, cgroup: PidsCgroup | None) -> None:
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


@dataclass(frozen=True)
class ProgramResult:
    """A fork-server run: the sandbox result and whether the completion nonce came back."""

    result: SandboxResult
    completed: bool


class ForkServer:
    """One warm Python server in the sandbox, running one program at a time."""

    def __init__(self, limits: Limits):
        self.isolation = "bwrap" if bwrap_available() else "rlimits"
        self.max_procs = limits.max_procs
        self.cgroup = PidsCgroup.create(limits.max_procs + 3)
        argv = [sys.executable, "-I", str(_FORKSERVER)]
        if self.isolation == "bwrap":
            argv = [*_bwrap_argv(limits, None, False), *argv, "--pidns"]
        try:
            self.proc = subprocess.Popen(
                argv,
                env=scrubbed_env("/tmp"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_preexec(None, self.cgroup),  # noqa: PLW1509
            )
            hello = self._read(30.0)
        except (OSError, subprocess.SubprocessError) as exc:
            self.close()
            raise SandboxError(f"cannot start the fork server: {exc}") from exc
        if not hello or not hello.get("ready"):
            self.close()
            raise SandboxError("the fork server did not start")

    def _read(self, timeout: float) -> dict | None:
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        return read_frame(fd) if ready else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(
        self, program: str, limits: Limits, env: Mapping[str, str] | None = None
    ) -> ProgramResult:
        """Run one program. Raises `ServerDied` if the server dies or stops answering."""
        nonce = secrets.token_hex(16)
        if self.cgroup is not None and limits.max_procs != self.max_procs:
            self.cgroup.set_max(limits.max_procs + 3)
            self.max_procs = limits.max_procs
        request = {
            "program": program,
            "nonce": nonce,
            "timeout_s": limits.timeout_s,
            "cpu_s": limits.cpu_limit_s,
            "memory_mb": limits.memory_mb,
            "file_size_mb": limits.file_size_mb,
            "output_cap_bytes": limits.output_cap_bytes,
            "env": scrubbed_env("/tmp", env),
        }
        start = time.monotonic()
        try:
            write_frame(self.proc.stdin.fileno(), request)
            reply = self._read(limits.timeout_s + 10.0)
        except (OSError, ValueError) as exc:
            reply, reason = None, str(exc)
        else:
            reason = "no reply"
        if reply is None or "error" in reply:
            self.close()
            why = reply["error"] if reply else reason
            raise ServerDied(f"the fork server died or failed ({why})")
        result = SandboxResult(
            returncode=reply["returncode"],
            stdout=base64.b64decode(reply["stdout"]),
            stderr=base64.b64decode(reply["stderr"]),
            stdout_truncated=reply["stdout_truncated"],
            stderr_truncated=reply["stderr_truncated"],
            timed_out=reply["timed_out"],
            duration_s=time.monotonic() - start,
            isolation=self.isolation,
        )
        completed = secrets.compare_digest(reply["result"].encode(), nonce.encode())
        return ProgramResult(result=result, completed=completed)

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None:
            _kill_group(proc.pid, self.cgroup)
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                stream.close()
        if self.cgroup is not None:
            self.cgroup.destroy()
            self.cgroup = None


class _Pool:
    """Idle fork servers, one per concurrent caller at most; per OS process (a forked
    runner process gets its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[ForkServer] = []
        self.pid = os.getpid()

    def take(self, limits: Limits) -> ForkServer:
        with self.lock:
            while self.idle:
                server = self.idle.pop()
                if server.alive():
                    return server
                server.close()
        return ForkServer(limits)

    def give(self, server: ForkServer) -> None:
        with self.lock:
            self.idle.append(server)

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for server in idle:
            server.close()


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _current_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = _Pool()
        return _pool


def run_python_program(
    program: str, limits: Limits, env: Mapping[str, str] | None = None
) -> ProgramResult:
    """Run a Python program on a warm fork server from the pool (started on demand).

    `completed` is True only if the program ran to its end and then handed back the
    per-run nonce over a channel separate from its output. Raises `SandboxError` when
    no server can be started, `ServerDied` when it died mid-run (replaced next time).
    """
    pool = _current_pool()
    server = pool.take(limits)
    result = server.run(program, limits, env)  # a dead server is closed, not returned
    pool.give(server)
    return result


def shutdown() -> None:
    """Stop the idle fork servers of this process (also run at exit)."""
    if _pool is not None and _pool.pid == os.getpid():
        _pool.close()


atexit.register(shutdown)
