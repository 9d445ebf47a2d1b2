"""Judge calibrations in the DuckDB file, keyed by judge fingerprint.

A calibration belongs to the instrument (judge code or model, rubric, params, J), not to
a run: any run graded by a judge with that fingerprint can show it. The table is created
here, beside the core schema, so the core tables stay as SPEC §8 lists them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from storage.db import connect, now

SCHEMA = """
CREATE TABLE IF NOT EXISTS calibrations (
    judge_fingerprint VARCHAR, judge VARCHAR, suite_version VARCHAR, truth VARCHAR,
    created_at TIMESTAMPTZ, result JSON);
"""


def record_calibration(doc: dict[str, Any], home: Path | None = None) -> None:
    with connect(home) as con:
        con.execute(SCHEMA)
        con.execute(
            "INSERT INTO calibrations VALUES (?, ?, ?, ?, ?, ?)",
            [
                doc["judge_fingerprint"],
                doc["judge"],
                doc["suite_version"],
                doc["truth"],
                now(),
                json.dumps(doc),
            ],
        )


def latest_calibrations(
    fingerprints: list[str], home: Path | None = None
) -> dict[str, dict[str, Any]]:
    """fingerprint → its newest calibration document, for those that have one."""
    if not fingerprints:
        return {}
    with connect(home) as con:
        con.execute(SCHEMA)
        rows = con.execute(
            "SELECT judge_fingerprint, result FROM calibrations WHERE judge_fingerprint IN"
            f" ({', '.join('?' * len(fingerprints))})"
            " QUALIFY row_number() OVER (PARTITION BY judge_fingerprint ORDER BY created_at DESC) = 1",
            fingerprints,
        ).fetchall()
    return {fp: json.loads(result) for fp, result in rows}


def run_judges(run_id: str, home: Path | None = None) -> dict[str, str]:
    """fingerprint → judge spec of every judge that graded a sample of the run."""
    with connect(home, read_only=True) as con:
        rows = con.execute(
            "SELECT DISTINCT json_extract_string(trace, '$.judge.fingerprint'),"
            " json_extract_string(trace, '$.judge.spec') FROM samples"
            " WHERE run_id = ? AND json_extract_string(trace, '$.judge.fingerprint') IS NOT NULL",
            [run_id],
        ).fetchall()
    return dict(sorted(rows))
