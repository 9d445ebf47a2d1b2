"""EVALPIPE_HOME: the one directory evalpipe keeps state under (docs/contract.md §8)."""

from __future__ import annotations

import os
from pathlib import Path


def evalpipe_home() -> Path:
    """`EVALPIPE_HOME`, default `.evalpipe/` in the working directory."""
    return Path(os.environ.get("EVALPIPE_HOME") or ".evalpipe").absolute()
