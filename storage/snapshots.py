"""Immutable suite snapshots: `snapshots/<version>.parquet`, written once, atomically, and
the suite's rows in the DuckDB file's `suites` and `cases` tables (`Snapshots.save`).

Free-form fields (inputs, reference, grader, safety) are stored as Arrow JSON columns, so
DuckDB reads them as its JSON type (`inputs->>'prompt'`) and pandas as strings; slices and
tags are lists of strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from storage import DISK_FULL_ERRNOS, disk_full
from storage.db import Database, now
from tasks.files import atomic_path
from tasks.models import STORED, EvalCase, EvalSuite, canonical_json

SCHEMA = pa.schema(
    [
        ("case_id", pa.string()),
        ("case_hash", pa.string()),
        ("inputs", pa.json_()),
        ("reference", pa.json_()),
        ("grader", pa.json_()),
        ("slices", pa.list_(pa.string())),
        ("tags", pa.list_(pa.string())),
        ("safety", pa.json_()),
        ("must_pass", pa.bool_()),
        ("extra_graders", pa.json_()),  # null without them
        ("metadata", pa.json_()),  # null without it
    ]
)


def _json(value: object) -> str:
    return canonical_json(value).decode("utf-8")


def read_snapshot_file(path: Path) -> EvalSuite:
    """Load a snapshot file back into a suite; its version is checked against the file's."""
    table = pq.read_table(path)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    cases = []
    for row in table.to_pylist():
        data = {
            "id": row["case_id"],
            "inputs": json.loads(row["inputs"]),
            "reference": json.loads(row["reference"]),
            "grader": json.loads(row["grader"]),
            "slices": row["slices"],
            "tags": row["tags"],
        }
        if row["safety"] is not None:
            data["safety"] = json.loads(row["safety"])
        if row.get("must_pass"):  # snapshots written before must-pass have no such column
            data["must_pass"] = True
        if row.get("extra_graders") is not None:  # nor an extra_graders column
            data["extra_graders"] = json.loads(row["extra_graders"])
        if row.get("metadata") is not None:  # nor a metadata column
            data["metadata"] = json.loads(row["metadata"])
        cases.append(EvalCase.model_validate(data, context=STORED))
    suite = EvalSuite(name=meta["evalpipe.suite_name"], cases=tuple(cases))
    if suite.version != meta["evalpipe.version"]:
        raise ValueError(f"{path}: snapshot content does not match its version")
    return suite


@dataclass(frozen=True)
class Snapshots:
    """One home's stored suites (`storage.store.Store.snapshots`): their snapshot files and
    their rows in the `suites` and `cases` tables."""

    db: Database

    @property
    def dir(self) -> Path:
        return self.db.home / "snapshots"

    def path(self, version: str) -> Path:
        return self.dir / f"{version}.parquet"

    def has(self, suite: EvalSuite) -> bool:
        return self.path(suite.version).exists()

    def save(self, suite: EvalSuite) -> Path:
        """Write the suite's snapshot (once per version) and record the suite."""
        path = self.write(suite)
        self.record(suite, path)
        return path

    def write(self, suite: EvalSuite) -> Path:
        """Write the suite's snapshot file unless it exists; return its path. Never rewrites."""
        path = self.path(suite.version)
        if path.exists():
            return path
        cases = sorted(suite.cases, key=lambda c: c.id)
        table = pa.table(
            {
                "case_id": [c.id for c in cases],
                "case_hash": [c.case_hash for c in cases],
                "inputs": [_json(c.inputs) for c in cases],
                "reference": [_json(c.reference) for c in cases],
                "grader": [_json(c.grader) for c in cases],
                "slices": [list(c.slices) for c in cases],
                "tags": [list(c.tags) for c in cases],
                "safety": [None if c.safety is None else _json(c.safety) for c in cases],
                "must_pass": [c.must_pass for c in cases],
                "extra_graders": [_json(list(c.extra_graders)) if c.extra_graders else None for c in cases],
                "metadata": [None if c.metadata is None else _json(c.metadata) for c in cases],
            },
            schema=SCHEMA.with_metadata({"evalpipe.suite_name": suite.name, "evalpipe.version": suite.version}),
        )
        try:
            with atomic_path(path) as tmp:
                pq.write_table(table, str(tmp))
        except OSError as exc:
            if exc.errno in DISK_FULL_ERRNOS:
                raise disk_full(path) from None
            raise
        return path

    def read(self, version: str) -> EvalSuite:
        """The stored suite `version` (its snapshot in this home)."""
        return read_snapshot_file(self.path(version))

    def must_pass_cases(self, version: str) -> frozenset[str] | None:
        """The ids of the suite version's must-pass cases, read from its snapshot (one column,
        not the whole suite); None when the snapshot is not in this home."""
        path = self.path(version)
        if not path.exists():
            return None
        if "must_pass" not in pq.read_schema(path).names:
            return frozenset()
        table = pq.read_table(path, columns=["case_id", "must_pass"])
        return frozenset(cid for cid, flag in zip(table["case_id"].to_pylist(), table["must_pass"].to_pylist(),
                                                   strict=True) if flag)

    def case_contents(self, version: str, case_ids: list[str]) -> dict[str, dict]:
        """case id → {inputs, reference} for some cases of a stored suite version (read with a
        filter, not the whole suite); cases or a snapshot not found are simply absent."""
        path = self.path(version)
        if not case_ids or not path.exists():
            return {}
        table = pq.read_table(path, columns=["case_id", "inputs", "reference"], filters=[("case_id", "in", case_ids)])
        return {row["case_id"]: {"inputs": json.loads(row["inputs"]), "reference": json.loads(row["reference"])}
                for row in table.to_pylist()}

    def find(self, prefix: str) -> Path | None:
        """The snapshot whose version starts with `prefix` (a full or abbreviated version)."""
        if len(prefix) < 6 or any(ch not in "0123456789abcdef" for ch in prefix):
            return None
        matches = sorted(self.dir.glob(f"{prefix}*.parquet"))
        return matches[0] if len(matches) == 1 else None

    def record(self, suite: EvalSuite, snapshot_path: Path) -> None:
        with self.db.connect() as con:
            con.execute(
                "INSERT INTO suites VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [suite.version, suite.name, len(suite.cases), str(snapshot_path), now()],
            )
            # One statement over an Arrow table: executemany is a statement a case (seconds at 2,000).
            new_cases = pa.table({  # noqa: F841 - read by DuckDB
                "suite_version": pa.array([suite.version] * len(suite.cases), pa.string()),
                "case_id": pa.array([c.id for c in suite.cases], pa.string()),
                "case_hash": pa.array([c.case_hash for c in suite.cases], pa.string()),
                "slices": pa.array([list(c.slices) for c in suite.cases], pa.list_(pa.string())),
                "tags": pa.array([list(c.tags) for c in suite.cases], pa.list_(pa.string())),
            })
            con.execute("INSERT INTO cases SELECT * FROM new_cases ON CONFLICT DO NOTHING")

    def cases(self, suite_version: str) -> dict[str, tuple[str, list[str]]]:
        """case_id → (case_hash, slices) for a stored suite version."""
        with self.db.connect(read_only=True) as con:
            rows = con.execute(
                "SELECT case_id, case_hash, slices FROM cases WHERE suite_version = ?", [suite_version]
            ).fetchall()
        return {cid: (h, list(s)) for cid, h, s in rows}
