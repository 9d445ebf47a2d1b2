"""Where evalpipe lives: `EVALPIPE_HOME`, the one directory it keeps state under
(docs/contract.md §8; `MachineSettings.home`, read at the edge), and `CODE_ROOT`, the directory
holding its own packages."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from tasks.settings import current

# The parent of tasks/, storage/ and flows/: bound into the sandbox where the fork server
# needs our code, hidden from a repository's own environment where it must not see it.
CODE_ROOT = Path(__file__).resolve().parent.parent


HOME_DIR = ".evalpipe"


def evalpipe_home() -> Path:
    """`EVALPIPE_HOME`; else the nearest `.evalpipe/` in the working directory or one above it
    (found the way git finds its repository, so a command run from a project's
    subdirectory reads the project's runs); else `.evalpipe/` in the working directory."""
    if (home := current().home) is not None:
        return home.absolute()
    # With strings, not Paths: pathlib's walk cost ~0.1 ms a call.
    cwd = directory = os.getcwd()
    while True:
        if os.path.isdir(found := os.path.join(directory, HOME_DIR)):
            return Path(found)
        if (parent := os.path.dirname(directory)) == directory:
            return Path(cwd, HOME_DIR)
        directory = parent


# Homes named in code (`evaluate(home=...)`) besides EVALPIPE_HOME: they hold references and
# outputs as much as it does, so every sandbox this process starts hides them too.
_NAMED_HOMES: set[Path] = set()


def hide_home(path: Path) -> None:
    """Hide `path` from every sandbox this process starts from now on, as EVALPIPE_HOME is."""
    _NAMED_HOMES.add(Path(path).absolute())


def hidden_homes() -> tuple[str, ...]:
    """EVALPIPE_HOME and every home `hide_home` named: what a sandbox must not show."""
    return _hidden(current().home, os.getcwd(), frozenset(_NAMED_HOMES))


@lru_cache(maxsize=16)
def _hidden(_home: Path | None, _cwd: str, named: frozenset[Path]) -> tuple[str, ...]:
    # Keyed on what `evalpipe_home` reads: every sandboxed program asks, and without
    # EVALPIPE_HOME its walk up the directories cost a HumanEval program ~40 µs.
    return tuple(sorted({str(evalpipe_home()), *map(str, named)}))
