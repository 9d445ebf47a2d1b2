"""Where evalpipe keeps its state: Parquet snapshots and the DuckDB file under EVALPIPE_HOME."""

from __future__ import annotations

from tasks.home import evalpipe_home

__all__ = ["evalpipe_home"]
