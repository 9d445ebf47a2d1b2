"""What a mine has derived, one file per candidate, so that a killed or repeated mine does
not run a finished candidate's tests again: `EVALPIPE_HOME/mining/<key>.json`, written
atomically once the candidate is done (kept or dropped). The key covers what the result
depends on (`flows.mining`): the repository, the commit, its environment and the runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.files import atomic_write


@dataclass(frozen=True)
class MinedCandidates:
    """One home's mined candidates (`storage.store.Store.mined`)."""

    home: Path

    def path(self, key: str) -> Path:
        return self.home / "mining" / f"{key}.json"

    def read(self, key: str) -> dict[str, Any] | None:
        """The stored result, or None (never stored, or a file that does not read back)."""
        try:
            return json.loads(self.path(key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def write(self, key: str, doc: dict[str, Any]) -> None:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(doc, indent=1))
