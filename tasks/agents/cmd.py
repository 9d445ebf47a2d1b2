"""The `cmd:` agent: a command run once per sample, the case as JSON on its stdin and its
output read from stdout, with everything it starts killed when it exits."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.agents.base import (
    AgentContext,
    AgentError,
    Reloadable,
    declared_dependencies,
    spec_fingerprint,
)
from tasks.agents.gateway import grant_for
from tasks.models import EvalCase, InputError, sha256_hex
from tasks.redaction import redact
from tasks.registry import agent_kind
from tasks.sandbox import PidsCgroup, kill_until_gone
from tasks.sandbox.forkserver import capture, die_with

STDERR_TAIL = 2000  # characters of a failed command's stderr kept in the error
# The pids cgroup of a `cmd:` agent is there to find every process it leaves, not to
# confine trusted code: a cap no honest agent meets.
CMD_MAX_PROCS = 32768
# The side channel for usage: the agent may write {"input_tokens", "output_tokens", "model"}
# as JSON to the file this variable names (docs/agents.md). Read up to USAGE_FILE_CAP bytes.
USAGE_FILE_ENV = "EVALPIPE_USAGE_FILE"
USAGE_FILE_CAP = 64 << 10


@agent_kind("cmd", runs_code=True)
@dataclass(frozen=True)
class CmdAgent(Reloadable):
    """A process per sample, no shell: the case JSON on stdin, the output on stdout.

    It runs in the directory `load_agent` was called from, in its own session and process
    group. The moment it exits, everything it started is killed (see `_Descendants`), so
    a leftover holding its stdout cannot make it wait out its timeout, and nothing stays
    behind. Its output is read as it comes with a cap: past the run's `max_output_bytes` it
    is read and dropped, never held. It may take the run's `cmd_timeout` seconds.
    """

    argv: tuple[str, ...] = ()

    @classmethod
    def load(cls, spec: str, rest: str, base: Path) -> CmdAgent:
        try:
            argv = tuple(shlex.split(rest))
        except ValueError as exc:
            raise InputError(f"agent {spec!r}: cannot split the command: {exc}") from None
        if not argv:
            raise InputError(f"agent {spec!r}: empty command")
        program = argv[0]
        if "/" in program:
            if not (base / program).is_file() or not os.access(base / program, os.X_OK):
                raise InputError(f"agent {spec!r}: {program} is not an executable file")
        elif shutil.which(program) is None:
            raise InputError(f"agent {spec!r}: command {program!r} not found on PATH")
        files = _tree_files(argv, base)
        # Declared beside the script (the first word naming a file of the tree), else here.
        beside = (base / next(iter(files))).resolve().parent if files else base
        fingerprint = spec_fingerprint(spec, files, declared_dependencies(spec, beside))
        return cls(spec, fingerprint, base, argv)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        payload = {
            "id": case.id,
            "inputs": case.inputs,
            "index": ctx.index,
            "seed": ctx.seed,
            "n": ctx.n,
        }
        descendants = _Descendants()
        scratch = tempfile.TemporaryDirectory(prefix="evalpipe-agent-")
        usage_file = Path(scratch.name) / "usage.json"
        env = {**descendants.env(), USAGE_FILE_ENV: str(usage_file)}
        # Its OpenAI-compatible calls go through the gateway: recorded, capped, and retried.
        grant = grant_for(env, self.settings, ctx)
        if grant is not None:
            env = grant.environ(env)
        try:
            # From a file, not a pipe: no writer to deadlock with the reader of stdout.
            with tempfile.TemporaryFile() as stdin:
                stdin.write(json.dumps(payload).encode())
                stdin.seek(0)
                try:
                    proc = subprocess.Popen(
                        self.argv,
                        stdin=stdin,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=self.base,
                        env=env,
                        start_new_session=True,
                        preexec_fn=descendants.join,  # noqa: PLW1509 - before the agent runs
                    )
                except (OSError, subprocess.SubprocessError) as exc:
                    reason = getattr(exc, "strerror", None) or exc
                    raise AgentError(f"cannot start {self.argv[0]!r}: {reason}") from None
            # One byte over the cap tells the sampler to truncate (and say so).
            out, err, timed_out = _collect(
                proc, descendants, self.settings.max_output_bytes + 1, self.settings.cmd_timeout
            )
            problem = _report_usage(usage_file, ctx)
        finally:
            descendants.close()
            scratch.cleanup()
            if grant is not None:
                grant.revoke()
        mask = grant.masked if grant is not None else redact
        if grant is not None and (tapped := grant.settle(ctx, None, self.settings.max_trajectory_bytes)) is not None:
            ctx.trace.trajectory = tapped
        if timed_out:
            raise AgentError(f"timed out after {self.settings.cmd_timeout:g} s")
        if proc.returncode != 0:
            how = (
                f"killed by signal {-proc.returncode}"
                if proc.returncode < 0
                else f"exited with status {proc.returncode}"
            )
            # Masked before it is cut: a secret cut in half would escape the mask.
            tail = mask(err.decode("utf-8", errors="replace")).strip()[-STDERR_TAIL:]
            raise AgentError(f"{how}: {tail}" if tail else how)
        if problem:
            raise AgentError(problem)
        return out.decode("utf-8", errors="replace")


def _report_usage(path: Path, ctx: AgentContext) -> str | None:
    """Report what the agent wrote to its usage file, if it wrote one; else why it cannot
    be read (a failure of the call it describes: a cost that cannot be counted is not 0)."""
    try:
        with path.open("rb") as fh:
            data = fh.read(USAGE_FILE_CAP + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"${USAGE_FILE_ENV}: cannot read it: {exc.strerror or exc}"
    try:
        if len(data) > USAGE_FILE_CAP:
            raise ValueError(f"over {USAGE_FILE_CAP} bytes")
        doc = json.loads(data)
        if not isinstance(doc, dict) or set(doc) - {"input_tokens", "output_tokens", "model"}:
            raise ValueError("expected an object with input_tokens, output_tokens, model")
        ctx.report_usage(**doc)
    except (ValueError, AgentError) as exc:  # json's errors are ValueErrors
        return f"${USAGE_FILE_ENV}: {' '.join(str(exc).split())[:300]}"
    return None


class _Descendants:
    """Every process one `cmd:` agent starts, however it detaches itself, found to be
    killed: through a pids cgroup of its own where the machine has a writable one, else by
    a mark in the environment they inherit (only a process that clears its environment
    escapes that). The process group is killed in any case."""

    MARK = "EVALPIPE_AGENT_RUN"

    def __init__(self) -> None:
        self.cgroup = PidsCgroup.create(CMD_MAX_PROCS)
        self.mark = secrets.token_hex(8)
        self.harness = os.getpid()

    def env(self) -> dict[str, str]:
        return {**os.environ, self.MARK: self.mark}

    def join(self) -> None:
        """In the new process, before it runs the agent. It dies with the harness (`kill -9`
        leaves no one to kill its group): its own children do not, unless they exit on it."""
        die_with(self.harness)
        if self.cgroup is not None:
            self.cgroup.join_self()

    def kill(self, pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is not None:
            self.cgroup.kill_all()
            return
        needle = f"{self.MARK}={self.mark}".encode()
        kill_until_gone(lambda: [pid for pid in _pids() if needle in _environ(pid)], rounds=100)

    def close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.destroy()


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return []


def _collect(
    proc: subprocess.Popen[bytes], descendants: _Descendants, cap: int, timeout_s: float
) -> tuple[bytes, bytes, bool]:
    """(stdout, stderr, timed out), each stream's first `cap` bytes; whatever the process
    leaves is killed when it exits, and everything on the way out."""
    pidfd = os.pidfd_open(proc.pid)

    def on_exit() -> None:
        proc.wait()
        descendants.kill(proc.pid)

    try:
        data, _, timed_out = capture(
            {"stdout": (proc.stdout.fileno(), cap), "stderr": (proc.stderr.fileno(), cap)},
            time.monotonic() + timeout_s,
            pidfd,
            on_exit,
        )
    finally:
        descendants.kill(proc.pid)
        proc.wait()
        os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
    return data["stdout"], data["stderr"], timed_out


def _tree_files(argv: tuple[str, ...], base: Path) -> dict[str, str]:
    """sha256 of every word that names a file under `base` (the script, its config...).

    Files outside the tree (the Python interpreter, system tools) are the environment, not
    the agent's code, and hashing them would cost more than the run.
    """
    root = base.resolve()
    hashes: dict[str, str] = {}
    for word in argv:
        path = (base / word).resolve()
        if path.is_relative_to(root) and path.is_file():
            hashes[word] = sha256_hex(path.read_bytes())
    return hashes
