"""Where evalpipe lives: `EVALPIPE_HOME`, the one directory it keeps state under
(docs/contract.md §8), and `CODE_ROOT`, the directory holding its own packages."""

from __future__ import annotations

import os
from pathlib import Path

# The parent of tasks/, storage/ and flows/: bound into the sandbox where the fork server
# needs our code, hidden from a repository's own environment where it must not see it.
CODE_ROOT = Path(__file__).resolve().parent.parent


def evalpipe_home() -> Path:
    """`EVALPIPE_HOME`, default `.evalpipe/` in the working directory."""
    return Path(os.environ.get("EVALPIPE_HOME") or ".evalpipe").absolute()
