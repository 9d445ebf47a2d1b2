"""The sandbox every piece of candidate code runs in (docs/sandbox.md): one command
(`run_command`), Python programs on a warm fork server (`run_python_program`), a suite's
callable on a call server (`call_in_sandbox`), and whether a run may go without
bubblewrap. The implementation is `tasks.sandbox.runner`, over the fork server's own
protocol (`tasks.sandbox.forkserver`) and the seccomp filter (`tasks.sandbox.seccomp`).
"""

from tasks.sandbox.runner import (
    UNSAFE_NOTE,
    Limits,
    Mounts,
    PidsCgroup,
    SandboxError,
    SandboxResult,
    SandboxUnavailable,
    ServerDied,
    SplitProgram,
    allowing_unsafe,
    bwrap_available,
    call_in_sandbox,
    kill_until_gone,
    run_command,
    run_python,
    run_python_program,
    run_sandbox_mode,
    shutdown,
)

__all__ = [
    "Limits", "Mounts", "PidsCgroup", "SandboxError", "SandboxResult", "SandboxUnavailable",
    "ServerDied", "SplitProgram", "UNSAFE_NOTE", "allowing_unsafe", "bwrap_available", "call_in_sandbox", "kill_until_gone", "run_command",
    "run_python", "run_python_program", "run_sandbox_mode", "shutdown",
]
