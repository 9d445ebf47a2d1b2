"""Warm Python servers in the sandbox, pooled per OS process: the fork server that runs
python_tests programs (1-2 ms a program instead of a fresh interpreter's 20-70 ms), and a
suite's predicate loaded once and called per output."""

from __future__ import annotations

import atexit
import base64
import os
import secrets
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tasks.home import hidden_homes
from tasks.sandbox.forkserver import read_frame, write_frame
from tasks.sandbox.limits import Limits, SandboxError, SandboxResult, ServerDied
from tasks.sandbox.namespace import bwrap_argv, scrubbed_env
from tasks.sandbox.policy import MODE_ENV, UNSAFE_ENV, isolation
from tasks.sandbox.processes import PidsCgroup, kill_group, preexec

_FORKSERVER = Path(__file__).with_name("forkserver.py")


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
            argv = [*bwrap_argv(limits, None, False, visible=visible)[:-1], *pid_1, "--", *argv, "--pidns"]
        try:
            self.proc = subprocess.Popen(
                argv,
                env=scrubbed_env("/tmp", env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                # A server's CPU rlimit would add up over all the programs it runs.
                preexec_fn=preexec(own_limits, self.cgroup, cpu=False,  # noqa: PLW1509
                                   die_with_parent=self.isolation == "bwrap"),
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
            kill_group(proc.pid, self.cgroup)
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

    def __init__(self, ref: str, base: Path, visible: Iterable[str], host: str = "tasks.graders.predicate_host"):
        # Already inside the sandbox: code it runs through `run_python` gets layer 2 only.
        nested = {MODE_ENV: "rlimits", UNSAFE_ENV: "1"}
        super().__init__(
            ["-m", host, ref, str(base)],
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
    key = _hiding()
    server = pool.take(key, lambda: ForkServer(limits))
    result = server.run(program, limits, env)  # a dead server is closed, not returned
    pool.give(key, server)
    return result


def call_in_sandbox(ref: str, base: Path, visible: Iterable[str], request: Mapping,
                    host: str = "tasks.graders.predicate_host", timeout_s: float | None = None) -> dict:
    """Send `request` to the warm `CallServer` of `ref` (its `host` module: a suite's callable's,
    a registered tool's; started on demand) and return its reply. Raises `SandboxError` when none
    can start, `ServerDied` when it died or took longer than `timeout_s` (default
    `PREDICATE_LIMITS.timeout_s`)."""
    pool = _current_pool()
    key = f"call:{host}:{base}:{ref}:{_hiding()}"
    server = pool.take(key, lambda: CallServer(ref, base, visible, host))
    reply = server.exchange(request, PREDICATE_LIMITS.timeout_s if timeout_s is None else timeout_s)
    pool.give(key, server)
    return reply


def _hiding() -> str:
    """A server's sandbox hides the homes in use when it started: one started before another
    home was named (`tasks.home.hide_home`) is not handed out for it."""
    return "\0".join(hidden_homes())


def shutdown() -> None:
    """Stop the idle servers of this process (also run at exit)."""
    if _pool is not None and _pool.pid == os.getpid():
        _pool.close()


atexit.register(shutdown)
