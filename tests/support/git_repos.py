"""Real git repositories built by the tests."""

from __future__ import annotations

from pathlib import Path

import git

ACTOR = git.Actor("t", "t@t.invalid")


def commit(repo: git.Repo, files: dict[str, str], message: str) -> str:
    """Write `files` (path → text) into the work tree, commit them, return the sha."""
    root = Path(repo.working_tree_dir)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    repo.index.add(sorted(files))
    return repo.index.commit(message, author=ACTOR, committer=ACTOR).hexsha
