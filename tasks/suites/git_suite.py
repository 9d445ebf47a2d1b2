"""Suite files kept in git: `URL#PATH`, or `URL@REF#PATH` for a branch, tag or commit.

    https://github.com/acme/evals.git#suites/qa.yaml
    git@github.com:acme/evals.git@v1.4#suites/qa.yaml
    file:///srv/evals@3f2c9a1e...#suites/humaneval.jsonl

The file is read from the repository's mirror (`tasks/repos/worktrees.py`), never from a checkout.
A branch or the default HEAD moves, so the mirror is fetched every time one is named; a
full commit sha never moves, so it is fetched only if the mirror lacks it. The suite's
version is its content hash as always; the commit it came from is its provenance
(`pinned`), which a run records so the exact file can be found again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tasks.models import EvalSuite
from tasks.repos import worktrees
from tasks.suites.dataset import SUITE_SUFFIXES, SuiteError, parse_suite_text


@dataclass(frozen=True)
class GitSuiteRef:
    url: str
    rev: str  # a branch, tag or commit; HEAD is the repository's default branch
    path: str

    def pinned(self, sha: str) -> str:
        return f"{self.url}@{sha}#{self.path}"


def parse_git_ref(text: str) -> GitSuiteRef | None:
    """`URL[@REF]#PATH` parsed, None when `text` is not a URL at all."""
    if not worktrees.is_url(text):
        return None
    location, sep, path = text.rpartition("#")
    if not sep or not path:
        raise SuiteError(f"{text}: name the suite file in the repository: URL#path/to/suite.yaml"
                         " (URL@REF#path for a branch, tag or commit)")
    url, at, rev = location.rpartition("@")
    if not at or not _names_a_repository(url):  # that '@' was a user@host
        url, rev = location, "HEAD"
    if not rev or rev.startswith("-"):
        raise SuiteError(f"{text}: {rev!r} is not a branch, tag or commit")
    clean = PurePosixPath(path)
    if clean.is_absolute() or ".." in clean.parts:
        raise SuiteError(f"{text}: the suite path must be relative to the repository root")
    if clean.suffix.lower() not in SUITE_SUFFIXES:
        raise SuiteError(f"{text}: unknown suite format {clean.suffix!r} (expected .yaml, .yml or .jsonl)")
    return GitSuiteRef(url=url, rev=rev, path=str(clean))


def _names_a_repository(url: str) -> bool:
    """A URL with a path after its host: `scheme://host/path` or `user@host:path`."""
    if "://" in url:
        return "/" in url.split("://", 1)[1].strip("/")
    return worktrees.is_url(url) and not url.endswith(":")


def load_git_suite(ref: GitSuiteRef, home: Path | None = None) -> tuple[EvalSuite, str]:
    """The suite at `ref` and the pinned `URL@SHA#PATH` it was read from."""
    mirror = worktrees.mirror(ref.url, home)
    if not worktrees.FULL_SHA.match(ref.rev):
        worktrees.fetch(mirror, ref.url)
    sha = worktrees.ensure_commit(mirror, ref.rev, ref.url)
    source = ref.pinned(sha)
    try:
        text = worktrees.run_git(mirror, "show", f"{sha}:{ref.path}")
    except worktrees.RepoError:
        raise SuiteError(f"{source}: no such file in the repository") from None
    path = PurePosixPath(ref.path)
    return parse_suite_text(path.stem, text, SUITE_SUFFIXES[path.suffix.lower()], source), source
