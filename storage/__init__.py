"""Where evalpipe keeps its state: Parquet snapshots and the DuckDB file under EVALPIPE_HOME,
reached through one `Store(home)` (`storage.store`; `Store.default()` reads EVALPIPE_HOME),
made of parts with one job each, a module each (`runs`, `samples`, `snapshots`, `export`, ...)
over the DuckDB file (`db`).
This package itself holds only what they share: the disk-full report."""

from __future__ import annotations

import errno
from pathlib import Path

from tasks.models import PlatformError

# The errors a write gets when the disk (or the user's quota) is full.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

__all__ = ["DISK_FULL_ERRNOS", "disk_full"]


def disk_full(where: str | Path) -> PlatformError:
    """The one-line report of a write that found the disk full: evalpipe writes each piece
    whole or not at all, so what was stored before stays usable."""
    return PlatformError(f"disk full writing {where}: what was stored before is kept; free space and run"
                         " the same command again (finished samples are reused)")
