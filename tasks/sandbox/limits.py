"""What a sandboxed program may use (`Limits`), what its run returns (`SandboxResult`), and
how the sandbox itself fails."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.models import InputError


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
    disk_over: int | None = None  # bytes its writable directories held when killed over `run_command`'s `disk`


class SandboxError(RuntimeError):
    """The sandbox itself could not start (graders report `error`)."""


class SandboxUnavailable(SandboxError, InputError):
    """bubblewrap cannot run here and the run did not allow running without it."""


class ServerDied(SandboxError):
    """A fork server died or stopped answering mid-run: the program most likely killed
    it (graders report `failed`); the server is closed and replaced on the next run."""
