"""A coding agent's workspace: a fresh checkout of a case's base commit for one sample, and
the change the agent left in it.

The tree is a pooled worktree (`tasks.repos.worktrees.checkout`), reset to the base commit,
so a workspace costs what a grading checkout costs, not a clone. The agent gets a git
repository of its own in it: `.git` points to a private git directory under the sample's
scratch directory, whose only history is the base commit (a shallow root; its objects come
from a per-commit store holding nothing else), so `git log --all` or a scan of the object
store cannot reach later commits of the mirror, where a fix and its tests may live.

The change is read from the disk, not from the agent's git: what the tree holds against
the base commit, whatever the agent staged, committed, left unstaged, created or deleted.
It is computed with a git directory the agent never saw (its config, hooks and index
cannot run or hide anything) and the repository's own `.gitignore` files, so ignored files
are not part of it.

Layout under `EVALPIPE_HOME/`:

    repos/<key>.bases/<sha>/objects/   the base commit and its tree, nothing else
    workspaces/<host>-<pid>-<token>/agent/    the agent's: git/ (its git dir), home/ (HOME)
    workspaces/<host>-<pid>-<token>/harness/  the harness's: the git dir the change is read with

A scratch directory is removed when its sample ends, and, if the process died first, by
the next workspace made under the same home.

Both are capped (`Caps`, the run's `workspace_tree_mb` and `workspace_change_bytes`): the tree
the agent left at 4096 MB by default in all, counted before git reads it (the runner holds
the same cap on the tree and the scratch directory while the agent writes), and the change at
4 MB by default (the output cap's default: a longer patch would be cut, and a cut patch does
not apply), read from git's output no further than that; over either, `ChangeTooLarge` says
which and by how much.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks.files import atomic_path
from tasks.home import evalpipe_home
from tasks.repos.worktrees import (
    TREE_GIT_TIMEOUT_S,
    RepoError,
    checkout,
    ensure_commit,
    git_capped,
    mirror,
)

DEFAULT_TREE_MB = 4096
DEFAULT_CHANGE_BYTES = 4 << 20

AGENT_NAME = "evalpipe agent"
AGENT_EMAIL = "agent@evalpipe.invalid"


@dataclass(frozen=True)
class Workspace:
    tree: Path  # the checkout, the agent's working directory
    sha: str  # the base commit
    store: Path  # objects of the base commit only (read-only for the agent)
    agent_dir: Path  # writable by the agent: git/, home/ and its trajectory file
    harness_dir: Path  # never shown to the agent

    @property
    def home(self) -> Path:
        return self.agent_dir / "home"

    @property
    def trajectory(self) -> Path:
        return self.agent_dir / "trajectory.jsonl"


@dataclass(frozen=True)
class Change:
    patch: str  # a git diff against the base commit ("" when nothing changed)
    files: tuple[str, ...]  # every path it adds, edits or deletes
    binary: tuple[str, ...]  # those among them git sees as binary
    removed: tuple[str, ...]  # special files and nested .git entries, removed before reading


class ChangeTooLarge(RepoError):
    """The tree or the change is over its cap (`Caps`); the message says which."""


@dataclass(frozen=True)
class Caps:
    tree_bytes: int
    change_bytes: int


DEFAULT_CAPS = Caps(DEFAULT_TREE_MB << 20, DEFAULT_CHANGE_BYTES)


def _git(args: list[str], env: dict[str, str], cwd: Path | None = None, stdin: bytes | None = None) -> bytes:
    """git with the user's and the system's configuration left out: nothing in them (an
    excludes file, a pager, a diff driver) changes what is read or run."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, env=_git_env(env), input=stdin, capture_output=True,
            timeout=TREE_GIT_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RepoError(f"git {args[0]}: timed out after {TREE_GIT_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise RepoError(f"git {args[0]}: {(lines or ['exit ' + str(done.returncode)])[0]}")
    return done.stdout


def _git_env(env: dict[str, str]) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", **env,
    }  # fmt: skip


def base_store(mirror_path: Path, sha: str) -> Path:
    """The object directory holding `sha` and its tree and nothing else, packed once per
    commit (`<mirror>.bases/<sha>/objects`)."""
    dest = mirror_path.with_suffix(".bases") / sha
    done = dest / "objects" / "info" / "packed"  # written last, renamed whole
    if done.exists():
        return dest / "objects"
    listing = _git(["rev-list", "--objects", "--no-walk", sha], {"GIT_DIR": str(mirror_path)})
    names = b"".join(line.split(b" ", 1)[0] + b"\n" for line in listing.splitlines() if line)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(dest) as tmp:
            pack = tmp / "objects" / "pack"
            pack.mkdir(parents=True)
            _git(["pack-objects", "-q", str(pack / "pack")], {"GIT_DIR": str(mirror_path)}, stdin=names)
            (tmp / "objects" / "info").mkdir()
            (tmp / "objects" / "info" / "packed").write_text(sha + "\n")
    except OSError:
        if not done.exists():  # not a sample beside this one that packed it first
            raise
    return dest / "objects"


def _git_dir(path: Path, sha: str, store: Path, *, user: bool) -> None:
    """A git directory at `path` whose HEAD is `sha` (detached, a shallow root), borrowing
    the objects of `store`."""
    for sub in ("objects/info", "objects/pack", "refs/heads", "refs/tags"):
        (path / sub).mkdir(parents=True, exist_ok=True)
    (path / "HEAD").write_text(sha + "\n")
    (path / "shallow").write_text(sha + "\n")
    (path / "objects" / "info" / "alternates").write_text(f"{store}\n")
    config = "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"
    if user:
        config += f"[user]\n\tname = {AGENT_NAME}\n\temail = {AGENT_EMAIL}\n"
    (path / "config").write_text(config)


def _replace_file(path: Path, text: str) -> None:
    """Write `path` as a new file (never through what is there: it could be a link)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


@contextmanager
def workspace(repo: str, commit: str, home: Path | None = None) -> Iterator[Workspace]:
    """A fresh checkout of `repo` at `commit` with a git repository of the agent's own,
    reserved for the caller until the block ends; its scratch directory is removed then
    (the tree goes back to the pool, reset before its next use)."""
    home = home or evalpipe_home()
    mirror_path = mirror(repo, home)
    sha = ensure_commit(mirror_path, commit, repo)
    store = base_store(mirror_path, sha)
    _sweep(home / "workspaces")
    scratch = home / "workspaces" / f"{_HOST}-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        with checkout(repo, sha, home) as tree:
            agent_dir, harness_dir = scratch / "agent", scratch / "harness"
            (agent_dir / "home").mkdir(parents=True)
            harness_dir.mkdir()
            _git_dir(agent_dir / "git", sha, store, user=True)
            pooled = (tree / ".git").read_text().removeprefix("gitdir:").strip()
            # The pooled tree's index: its stat data matches the files just checked out, so
            # neither the agent's first `git status` nor `read_change` reads the whole tree.
            shutil.copyfile(Path(pooled) / "index", agent_dir / "git" / "index")
            shutil.copyfile(Path(pooled) / "index", harness_dir / "index")
            _replace_file(tree / ".git", f"gitdir: {agent_dir / 'git'}\n")
            yield Workspace(tree, sha, store, agent_dir, harness_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# Scratch directories are named for their host and process: only this host's are swept
# (another machine's or container's pids mean nothing here).
_HOST = re.sub(r"[^\w.]", "_", socket.gethostname()) or "host"


def _sweep(parent: Path) -> None:
    """Remove this host's scratch directories of processes that are gone (a harness killed
    mid-sample leaves its own behind): named `<host>-<pid>-<token>`."""
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return
    for name in entries:
        host, _, rest = name.rpartition("-")[0].rpartition("-")
        if host == _HOST and rest.isdigit() and not _alive(int(rest)):
            shutil.rmtree(parent / name, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_change(ws: Workspace, caps: Caps = DEFAULT_CAPS) -> Change:
    """What the tree holds against the base commit, as a git diff; `RepoError` when git
    cannot read it, `ChangeTooLarge` over `caps`. What git
    must not meet is removed first and named: special files (FIFOs, sockets, devices: git
    would block on them) and nested `.git` entries (git would take the directory for
    another repository and record a commit id, not files)."""
    removed, size = _remove_unreadable(ws.tree)
    if size > caps.tree_bytes:
        raise ChangeTooLarge(f"the workspace holds {size:,} bytes of files, over the {caps.tree_bytes:,}-byte cap"
                             " (--workspace-tree-mb)")
    git_dir = ws.harness_dir / "git"
    if git_dir.exists():
        shutil.rmtree(git_dir)
    _git_dir(git_dir, ws.sha, ws.store, user=False)
    env = {
        "GIT_DIR": str(git_dir), "GIT_WORK_TREE": str(ws.tree),
        "GIT_INDEX_FILE": str(ws.harness_dir / "index"), "HOME": str(ws.harness_dir),
        "XDG_CONFIG_HOME": str(ws.harness_dir),
    }  # fmt: skip
    _git(["add", "--all"], env, cwd=ws.tree)  # on the base commit's index (see `workspace`)
    diff = ["diff", "--cached", "--no-renames", "--no-ext-diff", "--no-textconv", "--no-color"]
    stats = _git([*diff, "--numstat", "-z", ws.sha], env, cwd=ws.tree).decode("utf-8", "surrogateescape")
    files, binary = [], []
    for entry in filter(None, stats.split("\0")):
        added, deleted, path = entry.split("\t", 2)
        files.append(path)
        if added == deleted == "-":
            binary.append(path)
    patch = git_capped([*diff, "--full-index", ws.sha], ws.tree, caps.change_bytes, _git_env(env))
    if patch is None:
        raise ChangeTooLarge(f"the change is over the {caps.change_bytes:,}-byte cap (--workspace-change-bytes)")
    return Change(patch.decode("utf-8", "replace"), tuple(files), tuple(binary), removed)


def _remove_unreadable(tree: Path) -> tuple[tuple[str, ...], int]:
    """Remove the special files and nested `.git` entries below `tree`; their paths, and the
    size of the regular files left (the tree's own `.git` aside)."""
    removed: list[str] = []
    size = 0
    for directory, dirs, files in os.walk(tree):
        top = Path(directory) == tree
        for name in [*dirs, *files]:
            path = Path(directory) / name
            info = os.lstat(path)
            nested_git = name == ".git" and not top
            if nested_git or not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)
                                  or stat.S_ISDIR(info.st_mode)):
                shutil.rmtree(path) if stat.S_ISDIR(info.st_mode) else path.unlink()
                removed.append(path.relative_to(tree).as_posix())
            elif stat.S_ISREG(info.st_mode) and not (top and name == ".git"):
                size += info.st_size
        dirs[:] = [d for d in dirs if not (top and d == ".git") and (Path(directory) / d).is_dir()
                   and not (Path(directory) / d).is_symlink()]
    return tuple(sorted(removed)), size
