"""The sandbox every piece of candidate code runs in (docs/sandbox.md): one command
(`run_command`), Python programs on a warm fork server (`run_python_program`), a suite's
callable on a call server (`call_in_sandbox`), and whether a run may go without
bubblewrap. By concern, bottom-up:

- `limits`: what a sandboxed program may use and what its run returns;
- `namespace`: what of the host it sees under bubblewrap, and its environment;
- `policy`: whether code may run here, and what protects it;
- `processes`: one command, its process group, cgroup and end (`run_command`);
- `disk`: a cap on what a command's writable directories hold, held while it runs;
- `servers`: the warm fork and call servers, pooled per process;
- `forkserver` (the servers' own program and protocol) and `seccomp` (the filter).

Layers, reported in `SandboxResult.isolation`:
1. bubblewrap: new pid/net/mount/user/ipc/uts namespaces, `/` and `/dev` read-only, a
   private size-capped `/tmp` and `/dev/shm`, no capabilities, killed with its parent;
   ending the namespace's init kills every process in it, `setsid` escapees included.
2. always: a seccomp filter (no unix sockets, no io_uring, no SysV/POSIX IPC or keyrings),
   own session and process group, rlimits (address space, CPU, file size, no core), a
   scrubbed environment, output read with a cap, wall-clock timeout that kills the whole
   group; a pids cgroup (when writable) caps the process count and finds escapees even
   without namespaces.

Without bubblewrap, layer 2 alone (`isolation="rlimits"`) does not contain hostile code
(it can read the harness's environment through /proc and signal it), so it runs only when
the run allowed it (`--unsafe-no-sandbox`); otherwise `SandboxUnavailable` is raised.
"""

from tasks.sandbox.disk import DiskCap
from tasks.sandbox.limits import Limits, SandboxError, SandboxResult, SandboxUnavailable, ServerDied
from tasks.sandbox.namespace import Mounts
from tasks.sandbox.policy import (
    UNSAFE_NOTE,
    allowing_unsafe,
    bwrap_available,
    run_sandbox_mode,
)
from tasks.sandbox.processes import PidsCgroup, kill_until_gone, run_command, run_python
from tasks.sandbox.servers import (
    ForkServer,
    SplitProgram,
    call_in_sandbox,
    run_python_program,
    shutdown,
)

__all__ = [
    "DiskCap", "ForkServer", "Limits", "Mounts", "PidsCgroup", "SandboxError", "SandboxResult",
    "SandboxUnavailable", "ServerDied", "SplitProgram", "UNSAFE_NOTE", "allowing_unsafe", "bwrap_available",
    "call_in_sandbox", "kill_until_gone", "run_command", "run_python", "run_python_program", "run_sandbox_mode",
    "shutdown",
]
