"""What of the host a sandboxed process sees under bubblewrap: the system's programs and
libraries, the runtimes and our code, read-only; its own work directory; a private /tmp;
nothing of EVALPIPE_HOME, home directories or /etc's secrets. And the environment it gets."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tasks.home import CODE_ROOT, hidden_homes
from tasks.sandbox.limits import Limits

BWRAP = "bwrap"


_PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


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


def scrubbed_env(home: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Only PATH/locale from the parent (no tokens, no keys), HOME set to the work dir."""
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(HOME=home, TMPDIR="/tmp", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


# Where a scratch run (`scratch_mb`) sees the real work directory, read-only, to copy it.
SCRATCH_SOURCE = "/tmp/.evalpipe-source"


def bwrap_argv(
    limits: Limits,
    workdir: Path | None,
    network: bool,
    scratch_mb: int | None = None,
    mounts: Mounts | None = None,
    visible: Iterable[str] = (),
    sync_fds: tuple[int, int] | None = None,
) -> list[str]:
    """`network`: the host's network shared; else a namespace of its own, empty unless
    `sync_fds` (info, block): bubblewrap reports the sandbox's pid on the first and waits
    for a byte on the second before it runs the command, meanwhile its network is joined to
    the outside (`tasks.sandbox.network`)."""
    argv = [BWRAP, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if network:
        argv.append("--share-net")
    elif sync_fds is not None:
        argv += ["--info-fd", str(sync_fds[0]), "--block-fd", str(sync_fds[1])]
    size = str(limits.file_size_mb << 20)
    argv += [*_system_argv(), "--size", size, "--tmpfs", "/tmp"]
    if sync_fds is not None and (upstream := upstream_resolvers()) is not None:
        argv += ["--ro-bind", upstream, os.path.realpath(RESOLV_CONF)]
    for path in _outermost((*_runtime_dirs(), *visible)):
        argv += ["--ro-bind", path, path]
    mounts = mounts or Mounts()
    # EVALPIPE_HOME (the database, mirrors, other samples' trees) and any other home in use
    # (`tasks.home.hide_home`) are hidden even where a bound directory holds them (a
    # project's .evalpipe beside our code); the mounts below bring back exactly the parts
    # of it a command needs.
    hidden = _outermost_of(p for p in (*mounts.hide, *hidden_homes()) if os.path.isdir(p))
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
        argv += ["--ro-bind", str(workdir), SCRATCH_SOURCE]
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


# Name lookups in a namespace of its own: a resolver on the host's loopback (systemd-resolved's
# 127.0.0.53) is out of its reach (tasks.sandbox.network), so, as Docker does, the sandbox
# reads the resolvers systemd-resolved itself forwards to, where the host's file names
# only loopback ones and that list exists.
RESOLV_CONF = "/etc/resolv.conf"
RESOLVED_UPSTREAM = "/run/systemd/resolve/resolv.conf"


def upstream_resolvers() -> str | None:
    """The file to show as /etc/resolv.conf in a sandbox with a network of its own: None to
    keep the host's (it names a resolver off the loopback, or there is nothing better)."""
    def nameservers(path: str) -> list[str]:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                return [words[1] for words in map(str.split, fh) if words[:1] == ["nameserver"] and len(words) > 1]
        except OSError:
            return []

    def loopback(address: str) -> bool:
        return address.startswith("127.") or address == "::1"

    if not all(map(loopback, nameservers(RESOLV_CONF) or ["127.0.0.1"])):
        return None
    upstream = nameservers(RESOLVED_UPSTREAM)
    return RESOLVED_UPSTREAM if upstream and not all(map(loopback, upstream)) else None


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


def _outermost_of(paths: Iterable[str]) -> list[str]:
    """`paths` without those inside another of them (its tmpfs would cover theirs)."""
    found: list[str] = []
    for path in sorted({os.path.abspath(p) for p in paths}):
        if not any(path.startswith(f"{top}/") for top in found):
            found.append(path)
    return found


def runtime_dirs() -> list[str]:
    """The directories every sandbox shows beside the system's: the interpreter, its
    packages, our code, `sys.path`."""
    return _outermost(_runtime_dirs())


def _outermost(paths: Iterable[str]) -> list[str]:
    """The existing directories among `paths` not already shown (by `_SYSTEM_DIRS` or
    another of them)."""
    shown = [os.path.realpath(d) + "/" for d in _SYSTEM_DIRS if os.path.isdir(d)]
    return _outermost_of(p for p in {os.path.abspath(p) for p in paths} - {"/", "/tmp"}  # /tmp is the private one
                         if os.path.isdir(p) and not any(f"{p}/".startswith(top) for top in shown))
