"""Suite references: a file, a suite in git (`URL[@REF]#PATH`), or a stored version."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from storage.snapshots import read_snapshot_file
from tasks.models import EvalSuite
from tasks.suites.dataset import SUITE_SUFFIXES, SuiteError, load_suite
from tasks.suites.git_suite import load_git_suite, parse_git_ref


class SnapshotFinder(Protocol):
    def find(self, prefix: str) -> Path | None: ...


def load_suite_ref(ref: str, snapshots: SnapshotFinder) -> EvalSuite:
    """The suite `ref` names (see `resolve_suite`)."""
    return resolve_suite(ref, snapshots)[0]


def resolve_suite(ref: str, snapshots: SnapshotFinder) -> tuple[EvalSuite, str]:
    """The suite `ref` names, and where it was found, pinned so that it names the same
    suite again: a file's absolute path, a git URL with the commit it was read at, or the
    full version of a suite stored in `snapshots`."""
    git_ref = parse_git_ref(ref)
    if git_ref is not None:
        return load_git_suite(git_ref)
    if not Path(ref).exists():
        snapshot = snapshots.find(ref)
        if snapshot is not None:
            suite = read_snapshot_file(snapshot)
            return suite, suite.version
        if Path(ref).suffix.lower() not in SUITE_SUFFIXES:
            raise SuiteError(f"{ref}: neither a suite file, a git URL#PATH nor a stored suite version")
    return load_suite(ref), str(Path(ref).resolve())
