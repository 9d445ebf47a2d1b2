"""Suite references: a file, a suite in git (`URL[@REF]#PATH`), or a stored version."""

from __future__ import annotations

from pathlib import Path

from storage.snapshots import find_snapshot, read_snapshot
from tasks.models import EvalSuite
from tasks.suites.dataset import SUITE_SUFFIXES, SuiteError, load_suite
from tasks.suites.git_suite import load_git_suite, parse_git_ref


def load_suite_ref(ref: str) -> EvalSuite:
    """The suite `ref` names (see `resolve_suite`)."""
    return resolve_suite(ref)[0]


def resolve_suite(ref: str) -> tuple[EvalSuite, str]:
    """The suite `ref` names, and where it was found, pinned so that it names the same
    suite again: a file's absolute path, a git URL with the commit it was read at, or the
    full version of a stored suite."""
    git_ref = parse_git_ref(ref)
    if git_ref is not None:
        return load_git_suite(git_ref)
    if not Path(ref).exists():
        snapshot = find_snapshot(ref)
        if snapshot is not None:
            suite = read_snapshot(snapshot)
            return suite, suite.version
        if Path(ref).suffix.lower() not in SUITE_SUFFIXES:
            raise SuiteError(f"{ref}: neither a suite file, a git URL#PATH nor a stored suite version")
    return load_suite(ref), str(Path(ref).resolve())
