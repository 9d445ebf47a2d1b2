"""Where evalpipe keeps its state: Parquet snapshots and the DuckDB file under EVALPIPE_HOME."""

from __future__ import annotations

import os
from pathlib import Path


def evalpipe_home() -> Path:
    """`EVALPIPE_HOME`, default `.evalpipe/` in the working directory (docs/contract.md §8)."""
    return Path(os.environ.get("EVALPIPE_HOME") or ".evalpipe").absolute()
