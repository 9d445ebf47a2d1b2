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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import git

from storage import evalpipe_home
from tasks.models import InputError, sha256_hex

# No credential prompts: a URL that needs them fails instead of hanging a worker.
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "GIT_LFS_SKIP_SMUDGE": "1"}
_URL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*://|[\w.-]+@[\w.-]+:)")
FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
# Commits known to be in a mirror: a full sha names the same commit forever.
_known: dict[tuple[Path, str], str] = {}


class RepoError(InputError):
    """A repository that cannot be mirrored, or a commit that is not in it."""


def run_git(cwd: Path | None, *args: str) -> str:
    """Run git, raising `RepoError` with git's last line of complaint."""
    try:
        return git.Git(cwd).execute(["git", *args], env=_GIT_ENV)
    except git.GitCommandError as exc:
        lines = [ln.strip() for ln in str(exc.stderr or "").strip(" '\n").splitlines() if ln.strip()]
        # git's first fatal line names the problem; what follows is advice.
        fatal = [ln for ln in lines if ln.startswith(("fatal:", "error:"))]
        raise RepoError(f"git {args[0]}: {(fatal or lines or [exc])[0]}") from None


def is_url(text: str) -> bool:
    """`scheme://...` or scp-style `user@host:path`."""
    return bool(_URL.match(text))


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
            tmp = base / f".{dest.name}.{os.getpid()}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                run_git(None, "clone", "--mirror", "--quiet", "--", source, str(tmp))
            except RepoError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                raise RepoError(f"{repo}: cannot mirror: {exc}") from None
            os.replace(tmp, dest)
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
        run_git(mirror_path, "worktree", "add", "--detach", "--force", "--quiet", str(tree), sha)
    tree.with_suffix(".gitfile").write_bytes((tree / ".git").read_bytes())


def _force_remove(func, path, _exc) -> None:
    # A test run may leave read-only directories behind.
    os.chmod(os.path.dirname(path), 0o755)
    if os.path.isdir(path):
        os.chmod(path, 0o755)
    func(path)


def _reset(mirror_path: Path, tree: Path, sha: str) -> None:
    """Put `tree` at `sha` with nothing else in it; rebuild it if it cannot be reset."""
    gitfile = tree.with_suffix(".gitfile")
    if tree.is_dir() and gitfile.is_file():
        try:
            # Whatever ran in the tree may have rewritten its .git pointer: restore it.
            if (tree / ".git").is_dir() or (tree / ".git").is_symlink():
                raise OSError("tampered .git")
            (tree / ".git").write_bytes(gitfile.read_bytes())
            run_git(tree, "checkout", "--force", "--detach", "--quiet", sha)
            run_git(tree, "clean", "-ffdxq")
            return
        except (OSError, RepoError):
            pass
    _fresh_worktree(mirror_path, tree, sha)


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
    out = run_git(tree, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--ignored")
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
        run_git(tree, "checkout", "HEAD", "--", *tracked)
    for path in changed.keys() - set(tracked):
        (tree / path).unlink(missing_ok=True)
