"""Mining a repository's history: the first-parent commits that change both code and tests,
each split into the fix (`patch`, the non-test files) and its tests (`test_patch`).

Pure git on the repository's mirror. Which test files are tests is the caller's rule (the
grader's `test_files`, passed in); which of their tests a case grades is derived by running
them (`tasks.graders.derivation`), never guessed from the diff.

A history is not trusted to be small: a commit's message and its diffs are read streamed,
no further than their caps, and a commit that changes a file over the patch cap is not
diffed at all (git would hold the file whole); either is skipped with the reason.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tasks.repos.issues import issue_refs
from tasks.repos.workspaces import DEFAULT_CHANGE_BYTES
from tasks.repos.worktrees import RepoError, git_capped, run_git

# What a commit's code files are by default: Python sources (documentation, changelogs and
# data change alongside fixes, and go into the patch, but do not make a commit a fix).
DEFAULT_CODE_PATHS = ("*.py",)
# Modes `repo_tests`' patches cannot carry: symbolic links and submodules.
_SYMLINK, _GITLINK = "120000", "160000"
# A mined patch (and test patch) is at most what a workspace agent's change may be; a message
# is a problem statement, not a file.
MAX_PATCH_BYTES = DEFAULT_CHANGE_BYTES
MAX_MESSAGE_BYTES = 1 << 20
_DIFF_OPTIONS = ("--no-color", "--no-ext-diff", "--no-textconv", "--no-renames",
                 "--src-prefix=a/", "--dst-prefix=b/")


@dataclass(frozen=True)
class Candidate:
    """A commit that changes code and tests, split into the fix and its tests."""

    commit: str
    parent: str  # the first parent: the case's base commit
    date: str  # committer date, ISO 8601
    message: str
    code_files: tuple[str, ...]  # the non-test files the patch changes (code and the rest)
    test_files: tuple[str, ...]  # the test files the test patch changes
    patch: str
    test_patch: str

    @property
    def issues(self) -> tuple[str, ...]:
        """The issues the message links (`#12`, `org/repo#12`), in order of appearance."""
        return tuple(ref.label for ref in issue_refs(self.message))

    def provenance(self) -> dict:
        return {"commit": self.commit, "parent": self.parent, "date": self.date,
                "files": {"code": list(self.code_files), "tests": list(self.test_files)},
                "issues": list(self.issues)}


@dataclass(frozen=True)
class Skipped:
    """A walked commit that is not a candidate, and why."""

    commit: str
    reason: str


def first_parent_commits(mirror_path: Path, *, since: str | None = None, until: str | None = None,
                         max_commits: int | None = None) -> list[str]:
    """The first-parent chain from `until` (default HEAD) back to, not including, `since`,
    newest first, at most `max_commits` of them. Raises `RepoError` for an unknown revision."""
    tip = until or "HEAD"
    args = ["rev-list", "--first-parent"]
    if max_commits is not None:
        args.append(f"--max-count={max_commits}")
    for rev in (tip, since):
        if rev is not None and (rev.startswith("-") or not rev.strip()):
            raise RepoError(f"{rev!r} is not a revision")
    args += [tip] if since is None else [f"^{since}", tip]
    return run_git(mirror_path, *args, "--").split()


def _changes(mirror_path: Path, parent: str, commit: str) -> list[tuple[str, str, str, str]]:
    """(old mode, new mode, status, path) of every path the commit changes."""
    out = run_git(mirror_path, "diff-tree", "-r", "-z", "--no-renames", "--raw", parent, commit)
    fields = out.split("\0")
    changes = []
    for meta, path in zip(fields[0::2], fields[1::2], strict=False):
        old_mode, new_mode, _old, _new, status = meta.lstrip(":").split(" ")
        changes.append((old_mode, new_mode, status, path))
    return changes


def _largest_blob(mirror_path: Path, revs: Sequence[str], paths: Sequence[str]) -> tuple[int, str]:
    """The largest of `paths`' blobs in `revs` (size, path), from git's object headers only."""
    largest = (0, "")
    for rev in revs:
        out = run_git(mirror_path, "--literal-pathspecs", "ls-tree", "-r", "-l", "-z", rev, "--", *paths)
        for entry in filter(None, out.split("\0")):
            meta, path = entry.split("\t", 1)
            size = meta.split()[-1]
            if size.isdigit():
                largest = max(largest, (int(size), path))
    return largest


def _binary(mirror_path: Path, parent: str, commit: str) -> set[str]:
    out = run_git(mirror_path, "diff", "--numstat", "-z", "--no-renames", parent, commit)
    return {line.split("\t", 2)[2] for line in out.split("\0") if line.startswith("-\t-\t")}


def split_commit(mirror_path: Path, commit: str, *, is_test: Callable[[str], bool],
                 code_paths: Sequence[str] = DEFAULT_CODE_PATHS) -> Candidate | Skipped:
    """The commit as a candidate, or why it is not one."""
    info = git_capped(["show", "-s", "--format=%P%x00%cI%x00%B", commit], mirror_path, MAX_MESSAGE_BYTES)
    if info is None:
        return Skipped(commit, f"its message is over the {MAX_MESSAGE_BYTES:,}-byte cap")
    parents, date, message = info.decode("utf-8", "surrogateescape").split("\0", 2)
    if not parents.split():
        return Skipped(commit, "the root commit (no parent to start from)")
    parent = parents.split()[0]
    changes = _changes(mirror_path, parent, commit)
    paths = [path for *_, path in changes]
    tests = tuple(p for p in paths if is_test(p))
    rest = tuple(p for p in paths if not is_test(p))
    if not tests:
        return Skipped(commit, "changes no test file")
    if not any(fnmatch.fnmatchcase(p, glob) for p in rest for glob in code_paths):
        return Skipped(commit, f"changes no code file matching {', '.join(code_paths)}")
    special = [path for old, new, _s, path in changes if {old, new} & {_SYMLINK, _GITLINK}]
    if special:
        return Skipped(commit, f"changes a symbolic link or submodule ({special[0]}), which a patch cannot carry")
    size, big = _largest_blob(mirror_path, (parent, commit), paths)
    if size > MAX_PATCH_BYTES:
        return Skipped(commit, f"changes {big} ({size:,} bytes), over the {MAX_PATCH_BYTES:,}-byte cap on a"
                               " mined patch: not read")
    binary = sorted(_binary(mirror_path, parent, commit))
    if binary:
        return Skipped(commit, f"changes a binary file ({binary[0]}), which a patch cannot carry")
    patch, test_patch = _diff(mirror_path, parent, commit, rest), _diff(mirror_path, parent, commit, tests)
    if patch is None or test_patch is None:
        return Skipped(commit, f"its {'patch' if patch is None else 'test patch'} is over the"
                               f" {MAX_PATCH_BYTES:,}-byte cap on a mined patch")
    return Candidate(
        commit=commit, parent=parent, date=date, message=message.strip(),
        code_files=rest, test_files=tests, patch=patch, test_patch=test_patch,
    )


def _diff(mirror_path: Path, parent: str, commit: str, paths: Sequence[str]) -> str | None:
    """The diff of `paths`, None over `MAX_PATCH_BYTES`. Literal pathspecs: a file named
    `*.py` or `:x` is that file, not a pattern."""
    raw = git_capped(["--literal-pathspecs", "diff", *_DIFF_OPTIONS, parent, commit, "--", *paths], mirror_path,
                     MAX_PATCH_BYTES)
    return None if raw is None else raw.decode("utf-8", "surrogateescape").removesuffix("\n") + "\n"


def mine_history(mirror_path: Path, *, is_test: Callable[[str], bool], since: str | None = None,
                 until: str | None = None, max_commits: int | None = None,
                 code_paths: Sequence[str] = DEFAULT_CODE_PATHS) -> tuple[list[Candidate], list[Skipped]]:
    """Walk the first-parent history and split every commit: the candidates and the rest,
    newest first."""
    candidates: list[Candidate] = []
    skipped: list[Skipped] = []
    for commit in first_parent_commits(mirror_path, since=since, until=until, max_commits=max_commits):
        found = split_commit(mirror_path, commit, is_test=is_test, code_paths=code_paths)
        (candidates if isinstance(found, Candidate) else skipped).append(found)  # type: ignore[arg-type]
    return candidates, skipped
