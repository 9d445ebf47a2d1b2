"""The sandbox for every piece of candidate code (docs/contract.md §4, last paragraph).

Two entry points with the same guarantees (see docs/sandbox.md for exactly which):
- `run_command(argv, ...)`: one command in a work directory (repo_tests runs pytest so).
- `ForkServer` / `run_python_program`: Python programs forked from a warm server that
  itself lives in the sandbox (python_tests: 1-2 ms per program instead of 20-70 ms).

Layers, reported in `SandboxResult.isolation`:
1. bubblewrap: new pid/net/mount/user/ipc/uts namespaces, `/` and `/dev` read-only, a
   private size-capped `/tmp` and `/dev/shm`, no capabilities, killed with its parent;
   ending the namespace's init kills every process in it, `setsid` escapees included.
2. always: a seccomp filter (`tasks.sandbox.seccomp`: no unix sockets, no io_uring, no SysV/POSIX
   IPC or keyrings), own session and process group, rlimits (address space, CPU, file
   size, no core), a scrubbed environment, output read with a cap, wall-clock timeout
   that kills the whole group; a pids cgroup (when writable) caps the process count and
   finds escapees even without namespaces.

Without bubblewrap, layer 2 alone (`isolation="rlimits"`) does not contain hostile code
(it can read the harness's environment through /proc and signal it), so it runs only when
the run allowed it (`--unsafe-no-sandbox`, i.e. `EVALPIPE_UNSAFE_NO_SANDBOX=1` in the
environment, which worker processes inherit); otherwise `SandboxUnavailable` is raised.
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tasks.home import CODE_ROOT, evalpipe_home
from tasks.models import InputError
from tasks.registry import runs_code
from tasks.sandbox import seccomp
from tasks.sandbox.forkserver import capture, read_frame, set_limits, write_frame

log = logging.getLogger(__name__)

BWRAP = "bwrap"
# "auto" uses bubblewrap when it works; "rlimits" forces the fallback (for tests, or
# machines where user namespaces are forbidden and the probe would be noisy).
MODE_ENV = "EVALPIPE_SANDBOX"
# "1": a run given --unsafe-no-sandbox; in the environment so process/Dask workers see it.
UNSAFE_ENV = "EVALPIPE_UNSAFE_NO_SANDBOX"
# What every summary, report and artifact of such a run says about it.
UNSAFE_NOTE = ("run with --unsafe-no-sandbox and no bubblewrap: the suite's code ran unprotected "
               "(it could read the harness's environment and files, and signal it)")

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
    an empty read-only tmpfs (the harness's own venv and code), binds inside them kept;
    `blank`: files shown empty (/dev/null bound over them, read-only).
    Needs bubblewrap: without it `run_command` refuses with `SandboxError`.
    """

    workdir_at: str | None = None
    ro: tuple[str, ...] = ()
    rw: tuple[str, ...] = ()
    hide: tuple[str, ...] = ()
    blank: tuple[str, ...] = ()


class SandboxError(RuntimeError):
    """The sandbox itself could not start (graders report `error`)."""


class SandboxUnavailable(SandboxError, InputError):
    """bubblewrap cannot run here and the run did not allow running without it."""


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
    visible: Iterable[str] = (),
) -> list[str]:
    argv = [BWRAP, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if network:
        argv.append("--share-net")
    size = str(limits.file_size_mb << 20)
    argv += [*_system_argv(), "--size", size, "--tmpfs", "/tmp"]
    for path in _outermost((*_runtime_dirs(), *visible)):
        argv += ["--ro-bind", path, path]
    mounts = mounts or Mounts()
    # EVALPIPE_HOME (the database, mirrors, other samples' trees) is hidden even where a
    # bound directory holds it (a project's .evalpipe beside our code); the mounts below
    # bring back exactly the parts of it a command needs.
    hidden = [p for p in (*mounts.hide, str(evalpipe_home())) if os.path.isdir(p)]
    for path in hidden:
        argv += ["--tmpfs", path]
    for flag, paths in (("--ro-bind", mounts.ro), ("--bind", mounts.rw)):
        for path in paths:
            argv += [flag, path, path]
    for path in mounts.blank:
        argv += ["--ro-bind", "/dev/null", path]
    # /dev's own tmpfs has no size cap: read-only, with a capped /dev/shm on top.
    argv += ["--dev", "/dev", "--remount-ro", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
    argv += ["--proc", "/proc"]
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
    # Read-only once every mount point in them is made: the hidden directories' empty
    # tmpfs, and the root itself (bubblewrap's own tmpfs).
    for path in hidden:
        argv += ["--remount-ro", path]
    return argv + ["--remount-ro", "/", "--"]


# What of the host the sandbox shows besides the runtimes: the system's programs, libraries
# and configuration, read-only. Not home directories (SSH keys, cloud credentials), not
# EVALPIPE_HOME, not other projects, nor /etc's password hashes and host keys.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_SYSTEM_SECRETS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers")
_SYSTEM_SECRET_DIRS = ("/etc/ssh", "/etc/sudoers.d", "/etc/ssl/private")


@lru_cache(maxsize=1)
def _system_argv() -> tuple[str, ...]:
    argv: list[str] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    resolv = os.path.realpath("/etc/resolv.conf")  # may point into /run (systemd-resolved)
    if not resolv.startswith("/etc/") and os.path.isfile(resolv):
        argv += ["--ro-bind", resolv, resolv]
    for path in _SYSTEM_SECRETS:
        if os.path.isfile(path):
            argv += ["--ro-bind", "/dev/null", path]
    for path in _SYSTEM_SECRET_DIRS:
        if os.path.isdir(path):
            argv += ["--tmpfs", path, "--remount-ro", path]
    return tuple(argv)


@lru_cache(maxsize=1)
def _runtime_dirs() -> tuple[str, ...]:
    """The interpreter, its packages and our code, bound in read-only wherever they live (a
    pyenv Python under /root, a venv under /tmp)."""
    return (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable),
            os.path.dirname(os.path.realpath(sys.executable)), str(CODE_ROOT),
            *(p for p in sys.path if p))


def _outermost(paths: Iterable[str]) -> list[str]:
    """The existing directories among `paths` not already shown (by `_SYSTEM_DIRS` or
    another of them)."""
    shown = [os.path.realpath(d) + "/" for d in _SYSTEM_DIRS if os.path.isdir(d)]
    found: list[str] = []
    for path in sorted({os.path.abspath(p) for p in paths} - {"/", "/tmp"}):  # /tmp is the private one
        if os.path.isdir(path) and not any(f"{path}/".startswith(top) for top in shown) and not any(
            path.startswith(f"{top}/") for top in found
        ):
            found.append(path)
    return found


def bwrap_available() -> bool:
    """Whether bubblewrap (with our seccomp filter) starts here."""
    return _bwrap_problem() is None


@lru_cache(maxsize=1)
def _bwrap_problem() -> str | None:
    """Why bubblewrap cannot be used, or None; probed once per process."""
    return _probe_bwrap()


def _probe_bwrap() -> str | None:
    if os.environ.get(MODE_ENV, "auto") == "rlimits":
        return f"{MODE_ENV}=rlimits: not using bubblewrap"
    if shutil.which(BWRAP) is None:
        return "bwrap not found"
    if seccomp.installer() is None:
        return "no seccomp filter for this architecture (unix sockets would be reachable)"
    try:
        probe = subprocess.run(
            [*_bwrap_argv(Limits(), None, False), "/bin/true"],
            capture_output=True,
            timeout=10,
            check=False,
            preexec_fn=seccomp.installer(),  # noqa: PLW1509
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap failed to start ({exc})"
    if probe.returncode != 0:
        reason = probe.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        return f"bwrap failed ({reason[0]})"
    return None


def unsafe_allowed() -> bool:
    return os.environ.get(UNSAFE_ENV) == "1"


@contextmanager
def allowing_unsafe(allowed: bool) -> Iterator[None]:
    """For a run's duration: whether code may run without bubblewrap (rlimits only)."""
    before = os.environ.get(UNSAFE_ENV)
    if allowed:
        os.environ[UNSAFE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(UNSAFE_ENV, None)
        else:
            os.environ[UNSAFE_ENV] = before


def isolation() -> str:
    """What will protect the next sandboxed run: "bwrap", or "rlimits" when allowed."""
    if bwrap_available():
        return "bwrap"
    if unsafe_allowed():
        _log_once("unsafe", "sandbox: %s; running code UNPROTECTED (allowed)", _bwrap_problem())
        return "rlimits"
    raise SandboxUnavailable(_refusal())


def _refusal() -> str:
    return (
        f"no sandbox ({_bwrap_problem()}); untrusted code runs only under bubblewrap: "
        "install it, or pass --unsafe-no-sandbox to run it unprotected"
    )


def run_sandbox_mode(kinds: Iterable[str], unsafe: bool) -> str:
    """Checked before a run draws anything: "bwrap", "unsafe-no-sandbox", or
    "not-needed" (no case runs code); raises `SandboxUnavailable` if the run must refuse."""
    if bwrap_available():
        return "bwrap"
    if unsafe or unsafe_allowed():
        return "unsafe-no-sandbox"
    # Kinds registered with runs_code (they run code a run does not trust) need the sandbox.
    needing = sorted(kind for kind in set(kinds) if runs_code(kind))
    if not needing:
        return "not-needed"
    raise SandboxUnavailable(f"the suite has {'/'.join(needing)} cases, but {_refusal()}")


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
        kill_until_gone(lambda: [int(p) for p in (self.path / "cgroup.procs").read_text().split()])

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
    _log_once("cgroup", "sandbox: no writable pids cgroup; process count is not capped")
    return None


_logged: set[str] = set()


def _log_once(key: str, msg: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(msg, *args)


def _preexec(
    limits: Limits | None, cgroup: PidsCgroup | None, cpu: bool = True
) -> Callable[[], None]:
    install = seccomp.installer()

    def setup() -> None:
        if cgroup is not None:
            cgroup.join_self()
        if limits is not None:
            cpu_s = limits.cpu_limit_s if cpu else None
            set_limits(limits.memory_mb, cpu_s, limits.file_size_mb)
        if install is not None:  # last: it forbids nothing the steps above need
            install()

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
    visible: Iterable[str] = (),
) -> SandboxResult:
    """Run `argv` in `workdir` (the only writable place besides a private /tmp and
    `mounts.rw`). `visible`: directories under /tmp to show read-only, bound before
    `mounts.hide` is (what is hidden stays hidden even inside them).

    With `scratch_mb` (bubblewrap only; check `isolation`), the program runs on a copy of
    `workdir` in a tmpfs holding at most that many MB: it cannot fill the disk, and
    nothing it writes reaches `workdir`. `pass_fds` stay open in the program.
    Never leaves a process behind. Raises `SandboxError` only when nothing could be
    started (e.g. `argv[0]` does not exist); everything the program does is a result.
    """
    workdir = Path(workdir).resolve()
    protection = isolation()
    if mounts is not None and protection != "bwrap":
        raise SandboxError("this needs bubblewrap (mounts), which is not available here")
    if protection == "bwrap" and scratch_mb is not None:
        copy = 'cp -a "$0"/. . && exec "$@"'
        argv = ["/bin/sh", "-c", copy, _SCRATCH_SOURCE, *argv]
    else:
        scratch_mb = None
    full = (
        [*_bwrap_argv(limits, workdir, network, scratch_mb, mounts, visible), *argv]
        if protection == "bwrap"
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
        isolation=protection,
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
class SplitProgram:
    """A program whose tests the candidate cannot touch (forkserver: "a split program"): the
    candidate's code runs in a process of its own; `prelude` (the prompt) and `oracle` (the
    tests and `check`) in another, calling the candidate's `entry_point` with plain values."""

    candidate: str
    prelude: str
    oracle: str
    entry_point: str

    def to_json(self) -> dict[str, str]:
        return {"candidate": self.candidate, "prelude": self.prelude, "oracle": self.oracle,
                "entry_point": self.entry_point}


@dataclass(frozen=True)
class ProgramResult:
    """A fork-server run: the sandbox result and whether the completion nonce came back."""

    result: SandboxResult
    completed: bool


class _Server:
    """A warm Python process in the sandbox that answers framed JSON requests one at a time."""

    def __init__(
        self,
        args: Sequence[str],
        limits: Limits,
        *,
        own_limits: Limits | None = None,
        visible: Iterable[str] = (),
        as_pid_1: bool = False,
        env: Mapping[str, str] | None = None,
    ):
        self.isolation = isolation()
        self.max_procs = limits.max_procs
        self.cgroup = PidsCgroup.create(limits.max_procs + 3)
        argv = [sys.executable, "-I", *args]
        if self.isolation == "bwrap":
            pid_1 = ["--as-pid-1"] if as_pid_1 else []
            argv = [*_bwrap_argv(limits, None, False, visible=visible)[:-1], *pid_1, "--", *argv, "--pidns"]
        try:
            self.proc = subprocess.Popen(
                argv,
                env=scrubbed_env("/tmp", env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                # A server's CPU rlimit would add up over all the programs it runs.
                preexec_fn=_preexec(own_limits, self.cgroup, cpu=False),  # noqa: PLW1509
            )
            hello = self._read(30.0)
        except (OSError, subprocess.SubprocessError) as exc:
            self.close()
            raise SandboxError(f"cannot start a sandboxed server: {exc}") from exc
        if not hello or not hello.get("ready"):
            self.close()
            raise SandboxError("a sandboxed server did not start")

    def _read(self, timeout: float) -> dict | None:
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        return read_frame(fd) if ready else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exchange(self, request: Mapping, timeout: float) -> dict:
        """Send one request, return the reply. Raises `ServerDied` (and closes the server)
        if it dies, fails, or does not answer within `timeout` seconds."""
        try:
            write_frame(self.proc.stdin.fileno(), request)
            reply = self._read(timeout)
        except (OSError, ValueError) as exc:
            reply, reason = None, str(exc)
        else:
            reason = f"no reply within {timeout:g} s"
        if reply is None or "error" in reply:
            self.close()
            why = reply["error"] if reply else reason
            raise ServerDied(f"the sandboxed server died or failed ({why})")
        return reply

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


class ForkServer(_Server):
    """One warm Python server in the sandbox, running one program at a time."""

    def __init__(self, limits: Limits):
        super().__init__([str(_FORKSERVER)], limits)

    def run(
        self, program: str | SplitProgram, limits: Limits, env: Mapping[str, str] | None = None
    ) -> ProgramResult:
        """Run one program. Raises `ServerDied` if the server dies or stops answering."""
        split = program.to_json() if isinstance(program, SplitProgram) else None
        nonce = secrets.token_hex(16)
        if self.cgroup is not None and limits.max_procs != self.max_procs:
            self.cgroup.set_max(limits.max_procs + 3)
            self.max_procs = limits.max_procs
        request = {
            "program": "" if split else program,
            "split": split,
            "nonce": nonce,
            "timeout_s": limits.timeout_s,
            "cpu_s": limits.cpu_limit_s,
            "memory_mb": limits.memory_mb,
            "file_size_mb": limits.file_size_mb,
            "output_cap_bytes": limits.output_cap_bytes,
            "env": scrubbed_env("/tmp", env),
        }
        start = time.monotonic()
        reply = self.exchange(request, limits.timeout_s + 10.0)
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


# A predicate gets more room than a test program (it may load a model or a data set) and
# no CPU limit of its own: its wall clock per call is what bounds it.
PREDICATE_LIMITS = Limits(timeout_s=60.0, memory_mb=4096)


class CallServer(_Server):
    """A suite's callable (`predicate`), loaded and called in the sandbox by
    `tasks.graders.predicate_host`. It runs as the pid namespace's init, which its children
    cannot kill; `visible` are directories under /tmp it must read (the suite's code)."""

    def __init__(self, ref: str, base: Path, visible: Iterable[str]):
        # Already inside the sandbox: code it runs through `run_python` gets layer 2 only.
        nested = {MODE_ENV: "rlimits", UNSAFE_ENV: "1"}
        super().__init__(
            ["-m", "tasks.graders.predicate_host", ref, str(base)],
            PREDICATE_LIMITS,
            own_limits=PREDICATE_LIMITS,
            visible=visible,
            as_pid_1=True,
            env=nested,
        )


# Idle servers kept per OS process; beyond this the least recently used one is stopped.
_MAX_IDLE = 32


class _Pool:
    """Idle servers by key, one per concurrent caller at most; per OS process (a forked
    runner process gets its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[tuple[str, _Server]] = []  # least recently used first
        self.pid = os.getpid()

    def take(self, key: str, start: Callable[[], _Server]) -> _Server:
        with self.lock:
            mine = [entry for entry in self.idle if entry[0] == key]
            for entry in reversed(mine):
                self.idle.remove(entry)
                if entry[1].alive():
                    server = entry[1]
                    break
                entry[1].close()
            else:
                server = None
        return server or start()

    def give(self, key: str, server: _Server) -> None:
        with self.lock:
            self.idle.append((key, server))
            evicted = self.idle[:-_MAX_IDLE]
            del self.idle[:-_MAX_IDLE]
        for _key, old in evicted:
            old.close()

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for _key, server in idle:
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
    program: str | SplitProgram, limits: Limits, env: Mapping[str, str] | None = None
) -> ProgramResult:
    """Run a Python program on a warm fork server from the pool (started on demand).

    `completed` is True only if the program ran to its end and then handed back the
    per-run nonce over a channel separate from its output. Raises `SandboxError` when
    no server can be started, `ServerDied` when it died mid-run (replaced next time).
    """
    pool = _current_pool()
    server = pool.take("", lambda: ForkServer(limits))
    result = server.run(program, limits, env)  # a dead server is closed, not returned
    pool.give("", server)
    return result


def call_in_sandbox(ref: str, base: Path, visible: Iterable[str], request: Mapping) -> dict:
    """Send `request` to the warm `CallServer` of `ref` (started on demand) and return its
    reply. Raises `SandboxError` when none can start, `ServerDied` when it died or took
    longer than `PREDICATE_LIMITS.timeout_s`."""
    pool = _current_pool()
    key = f"call:{base}:{ref}"
    server = pool.take(key, lambda: CallServer(ref, base, visible))
    reply = server.exchange(request, PREDICATE_LIMITS.timeout_s)
    pool.give(key, server)
    return reply


def shutdown() -> None:
    """Stop the idle servers of this process (also run at exit)."""
    if _pool is not None and _pool.pid == os.getpid():
        _pool.close()


atexit.register(shutdown)
