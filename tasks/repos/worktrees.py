"""Repositories for grading: one cached mirror per repository, one clean tree per sample.

Layout under `EVALPIPE_HOME/repos/`:

    <key>.git/             bare mirror of the source (a local path or a git URL)
    <key>.lock             flock held while the mirror is created, fetched or gets a worktree
    <key>.worktrees/<n>/   pooled worktrees of the mirror; <n>.lock is held while one is in use

The user's working copy is only ever read (cloned from). A pooled worktree is forced to
the wanted commit and cleaned of every untracked and ignored file before each use, so a
sample never sees what an earlier one left behind. Locks are `flock`s on files opened per
acquisition, which serialises threads of one process as well as separate processes.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import git

from tasks.files import atomic_path
from tasks.home import evalpipe_home
from tasks.models import EvalCase, InputError, sha256_hex

# No credential prompts: a URL that needs them fails instead of hanging a worker.
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "GIT_LFS_SKIP_SMUDGE": "1"}
_URL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*://|[\w.-]+@[\w.-]+:)")
FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
# Commits known to be in a mirror: a full sha names the same commit forever.
_known: dict[tuple[Path, str], str] = {}
# git on a pooled tree (checkout, clean, status) is bounded: a tree a sample could have
# touched must never hang the harness; over this, the slot is rebuilt instead.
TREE_GIT_TIMEOUT_S = 120.0
_PAGE = 4096
_CHUNK = 1 << 16


class RepoError(InputError):
    """A repository that cannot be mirrored, or a commit that is not in it."""


def run_git(cwd: Path | None, *args: str, timeout: float | None = None) -> str:
    """Run git, raising `RepoError` with git's last line of complaint (or its timeout)."""
    try:
        return git.Git(cwd).execute(["git", *args], env=_GIT_ENV, kill_after_timeout=timeout)
    except git.GitCommandError as exc:
        lines = [
            ln.strip() for ln in str(exc.stderr or "").strip(" '\n").splitlines() if ln.strip()
        ]
        # git's first fatal line names the problem; what follows is advice.
        fatal = [ln for ln in lines if ln.startswith(("fatal:", "error:"))]
        raise RepoError(f"git {args[0]}: {(fatal or lines or [exc])[0]}") from None


def git_capped(args: list[str], cwd: Path, cap: int, env: dict[str, str] | None = None) -> bytes | None:
    """git's output, streamed and read no further than `cap` bytes: None past it (git is
    killed then), so a huge diff never sits in this process's memory. `RepoError` when git
    fails or runs past `TREE_GIT_TIMEOUT_S`; `env` is its whole environment (default: ours,
    without prompts)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(["git", *args], cwd=cwd, env=env or {**os.environ, **_GIT_ENV},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
        timer = threading.Timer(TREE_GIT_TIMEOUT_S, proc.kill)
        timer.start()
        chunks, size = [], 0
        try:
            while size <= cap and (chunk := proc.stdout.read(min(_CHUNK, cap + 1 - size))):
                chunks.append(chunk)
                size += len(chunk)
        finally:
            timer.cancel()
            if size > cap:
                proc.kill()
            proc.stdout.close()
            returncode = proc.wait()
        if size > cap:
            return None
        if returncode != 0:
            err.seek(0)
            lines = err.read(4096).decode("utf-8", "replace").strip().splitlines()
            reason = "timed out" if returncode < 0 else (lines or [f"exit {returncode}"])[0]
            raise RepoError(f"git {args[0]}: {reason}")
    return b"".join(chunks)


def is_url(text: str) -> bool:
    """`scheme://...` or scp-style `user@host:path`."""
    return bool(_URL.match(text))


def case_repo(case: EvalCase, repo: str) -> str:
    """The repository `repo` a case names: a URL as written, a path resolved against the
    suite file's folder (`EvalCase.local_path`), whatever the working directory."""
    return repo if is_url(repo) else str(case.local_path(repo))


def missing_repo(case: EvalCase, repo: str) -> str | None:
    """The line naming the case and the path, when `repo` is a path where nothing is."""
    found = case_repo(case, repo)
    if is_url(found) or Path(found).exists():
        return None
    return f"case {case.id!r}: repository {repo!r}: no such repository (looked for {found})"


def source_of(repo: str) -> str:
    """A git URL as given; a local path made absolute (relative to the working directory)."""
    if is_url(repo):
        return repo
    path = Path(repo).expanduser()
    if not path.exists():
        raise RepoError(f"{repo}: no such repository")
    return str(path.resolve())


def _key(source: str) -> str:
    stem = re.sub(r"[^\w.-]", "_", source.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"))
    return f"{stem[:40] or 'repo'}-{sha256_hex(source.encode())[:12]}"


@contextmanager
def _flock(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on `path`; yields False when non-blocking and it is taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def mirror(repo: str, home: Path | None = None) -> Path:
    """The bare mirror of `repo` (path or git URL), cloned on first use. Raises `RepoError`."""
    source = source_of(repo)
    base = (home or evalpipe_home()) / "repos"
    dest = base / f"{_key(source)}.git"
    if (dest / "HEAD").exists():  # created by an atomic rename: present means complete
        return dest
    with _flock(base / f"{_key(source)}.lock"):
        if not (dest / "HEAD").exists():
            with atomic_path(dest) as tmp:
                try:
                    run_git(None, "clone", "--mirror", "--quiet", "--", source, str(tmp))
                except RepoError as exc:
                    raise RepoError(f"{repo}: cannot mirror: {exc}") from None
    return dest


def fetch(mirror_path: Path, repo: str) -> None:
    """Bring the mirror's branches and tags up to date with the source."""
    with _flock(mirror_path.with_suffix(".lock")):
        try:
            run_git(mirror_path, "fetch", "--quiet", "--prune", "origin")
        except RepoError as exc:
            raise RepoError(f"{repo}: cannot fetch: {exc}") from None


def _resolve(mirror_path: Path, commit: str) -> str | None:
    try:
        return run_git(mirror_path, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    except RepoError:
        return None


def ensure_commit(mirror_path: Path, commit: str, repo: str) -> str:
    """The full sha of `commit`, fetching the mirror only when it does not have it yet."""
    if not commit or commit.startswith("-") or any(c.isspace() for c in commit):
        raise RepoError(f"{repo}: {commit!r} is not a commit")
    if (mirror_path, commit) in _known:
        return _known[(mirror_path, commit)]
    sha = _resolve(mirror_path, commit)
    if sha is None:
        with _flock(mirror_path.with_suffix(".lock")):
            sha = _resolve(mirror_path, commit)
            for refspec in ([], [commit]):  # all refs; then the commit itself, if unadvertised
                if sha is not None:
                    break
                try:
                    run_git(mirror_path, "fetch", "--quiet", "--prune", "origin", *refspec)
                except RepoError:
                    pass
                sha = _resolve(mirror_path, commit)
    if sha is None:
        raise RepoError(f"{repo}: commit {commit} not found")
    if FULL_SHA.match(commit):
        _known[(mirror_path, commit)] = sha
    return sha


def _fresh_worktree(mirror_path: Path, tree: Path, sha: str) -> None:
    with _flock(mirror_path.with_suffix(".lock")):
        if tree.exists():
            shutil.rmtree(tree, onerror=_force_remove)
        run_git(mirror_path, "worktree", "prune")
        run_git(
            mirror_path, "worktree", "add", "--detach", "--force", "--quiet", str(tree), sha,
            timeout=TREE_GIT_TIMEOUT_S,
        )  # fmt: skip
    tree.with_suffix(".gitfile").write_bytes((tree / ".git").read_bytes())


def _force_remove(func, path, _exc) -> None:
    # A test run may leave read-only directories behind.
    os.chmod(os.path.dirname(path), 0o755)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o755)
    func(path)


@dataclass(frozen=True)
class TreeScan:
    bytes: int  # room the tree takes on a tmpfs: every entry rounded up to whole pages
    special: tuple[str, ...]  # FIFOs, sockets, devices, and directories that cannot be listed


def scan_tree(tree: Path) -> TreeScan:
    """Walk `tree` without following links or opening anything. git would block on or
    trip over a special file, so a tree that has one is rebuilt, never handed to git."""
    size, special = 0, []

    def unreadable(exc: OSError) -> None:
        special.append(str(exc.filename))

    for directory, dirs, files in os.walk(tree, onerror=unreadable):
        size += _PAGE * (1 + len(dirs))
        for name in files:  # os.walk lists symlinks to directories under `dirs`
            info = os.lstat(os.path.join(directory, name))
            size += -(-info.st_size // _PAGE) * _PAGE + _PAGE
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
                special.append(os.path.relpath(os.path.join(directory, name), tree))
    return TreeScan(bytes=size, special=tuple(special))


def _reset(mirror_path: Path, tree: Path, sha: str) -> None:
    """Put `tree` at `sha` with nothing else in it; rebuild it if it cannot be reset.

    Whatever ran in the tree may have left a trap for git: `.git` turned into a FIFO,
    a directory or a symlink (to a gitdir whose config runs commands), a FIFO where git
    reads (`.gitattributes`, `.gitignore`). Such a tree is removed and made again, and
    every git command on it is bounded by `TREE_GIT_TIMEOUT_S`."""
    gitfile = tree.with_suffix(".gitfile")
    try:
        if (
            stat.S_ISDIR(os.lstat(tree).st_mode)
            and gitfile.is_file()
            and stat.S_ISREG(os.lstat(tree / ".git").st_mode)
            and not scan_tree(tree).special
        ):
            # Restore the .git pointer as a new file: never written through (it could be
            # a hard link to a file elsewhere).
            os.unlink(tree / ".git")
            fd = os.open(tree / ".git", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as fh:
                fh.write(gitfile.read_bytes())
            # Cleaned first: git reads a path's attributes from the index, then from the
            # tree, so an untracked `.gitattributes` a sample left would shape the checkout
            # (`working-tree-encoding=UTF-16LE`: the next sample's calc.py in UTF-16).
            run_git(tree, "clean", "-ffdxq", timeout=TREE_GIT_TIMEOUT_S)
            run_git(
                tree, "checkout", "--force", "--detach", "--quiet", sha, timeout=TREE_GIT_TIMEOUT_S
            )
            return
    except (OSError, RepoError):
        pass
    _fresh_worktree(mirror_path, tree, sha)


def discard(tree: Path) -> None:
    """Remove a checked-out tree now (e.g. it holds too much); its slot is rebuilt on
    next use."""
    shutil.rmtree(tree, onerror=_force_remove)


@contextmanager
def checkout(repo: str, commit: str, home: Path | None = None) -> Iterator[Path]:
    """A clean work tree of `repo` at `commit`, reserved for the caller until the block ends."""
    mirror_path = mirror(repo, home)
    sha = ensure_commit(mirror_path, commit, repo)
    pool = mirror_path.with_suffix(".worktrees")
    for slot in itertools.count():
        with _flock(pool / f"{slot}.lock", blocking=False) as mine:
            if not mine:
                continue
            tree = pool / str(slot)
            _reset(mirror_path, tree, sha)
            yield tree
            return


def changed_paths(tree: Path) -> dict[str, str]:
    """Every path that differs from the checked-out commit, with its `git status` code.

    Read from the disk (tracked, untracked and ignored files alike), not from what a
    patch claims to touch: `??` untracked, `!!` ignored, anything else tracked.
    """
    out = run_git(
        tree, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--ignored",
        timeout=TREE_GIT_TIMEOUT_S,
    )  # fmt: skip
    entries = out.split("\0")
    changed: dict[str, str] = {}
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        changed[entry[3:]] = entry[:2]
        if entry[0] in "RC":  # a staged rename or copy is followed by its source path
            changed[entries[i]] = "D "
            i += 1
    return changed


def restore_paths(tree: Path, changed: dict[str, str]) -> None:
    """Put the given changed paths back as the commit has them (deleting added ones)."""
    tracked = sorted(p for p, code in changed.items() if code not in ("??", "!!"))
    if tracked:
        run_git(tree, "checkout", "HEAD", "--", *tracked, timeout=TREE_GIT_TIMEOUT_S)
    for path in changed.keys() - set(tracked):
        (tree / path).unlink(missing_ok=True)
