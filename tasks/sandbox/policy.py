"""Whether a run may run the suite's code, and what protects it: bubblewrap when it starts
here (probed once per process) and the machine's settings do not force the fallback
(`EVALPIPE_SANDBOX=rlimits`), else the rlimits fallback only where the run allowed it
(`--unsafe-no-sandbox`: carried by each of the run's tasks, which enter `allowing_unsafe`, so two
runs in one process each keep their own) or the machine does (`EVALPIPE_UNSAFE_NO_SANDBOX=1`).
The machine's two are `tasks.settings.MachineSettings`, read at the edge and carried with the run."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache

from tasks.registry import runs_code
from tasks.sandbox import seccomp
from tasks.sandbox.limits import Limits, SandboxUnavailable
from tasks.sandbox.namespace import BWRAP, bwrap_argv
from tasks.settings import ENV, current

log = logging.getLogger("tasks.sandbox")

# The machine's variables (`MachineSettings.sandbox`, `.unsafe_no_sandbox`): named where a
# child process is handed them. A run's own --unsafe-no-sandbox is `_run_allows`, set where its tasks run.
MODE_ENV = ENV["sandbox"]
UNSAFE_ENV = ENV["unsafe_no_sandbox"]
_run_allows: ContextVar[bool] = ContextVar("unsafe_no_sandbox", default=False)
# What every summary, report and artifact of such a run says about it.
UNSAFE_NOTE = ("run with --unsafe-no-sandbox and no bubblewrap: the suite's code ran unprotected "
               "(it could read the harness's environment and files, and signal it)")


def bwrap_available() -> bool:
    """Whether bubblewrap (with our seccomp filter) starts here."""
    return _problem() is None


def _problem() -> str | None:
    """Why bubblewrap cannot be used by the run here (its machine's sandbox mode), or None."""
    return _bwrap_problem(current().sandbox)


@lru_cache(maxsize=2)
def _bwrap_problem(mode: str) -> str | None:
    """Why bubblewrap cannot be used in sandbox `mode`, or None; probed once per process."""
    if mode == "rlimits":
        return f"{MODE_ENV}=rlimits: not using bubblewrap"
    return _probe_bwrap()


def _probe_bwrap() -> str | None:
    if shutil.which(BWRAP) is None:
        return "bwrap not found"
    if seccomp.installer() is None:
        return "no seccomp filter for this architecture (unix sockets would be reachable)"
    try:
        probe = subprocess.run(
            [*bwrap_argv(Limits(), None, False), "/bin/true"],
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
    return _run_allows.get() or current().unsafe_no_sandbox


@contextmanager
def allowing_unsafe(allowed: bool) -> Iterator[None]:
    """Inside (this thread or task, and what it starts with a copy of its context): whether
    code may run without bubblewrap (rlimits only), as the run that entered it says."""
    token = _run_allows.set(allowed)
    try:
        yield
    finally:
        _run_allows.reset(token)


def isolation() -> str:
    """What will protect the next sandboxed run: "bwrap", or "rlimits" when allowed."""
    if bwrap_available():
        return "bwrap"
    if unsafe_allowed():
        log_once("unsafe", "sandbox: %s; running code UNPROTECTED (allowed)", _problem())
        return "rlimits"
    raise SandboxUnavailable(_refusal())


def _refusal() -> str:
    return (
        f"no sandbox ({_problem()}); untrusted code runs only under bubblewrap: "
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


logged_once: set[str] = set()


def log_once(key: str, msg: str, *args: object) -> None:
    if key not in logged_once:
        logged_once.add(key)
        log.warning(msg, *args)
