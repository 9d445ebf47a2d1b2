"""What a Prefect server's SQLite database holds, read as the tests of the database template
see it (server/db_template.py)."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path


def block_types(database: Path) -> list[tuple[str, str]]:
    """Each block type and when it was last registered: a server that registers them again
    (an upsert) moves every `updated`."""
    with closing(sqlite3.connect(database)) as db:
        return db.execute("SELECT slug, updated FROM block_type ORDER BY slug").fetchall()
