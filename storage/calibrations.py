"""Judge calibrations in the DuckDB file, keyed by judge fingerprint.

A calibration belongs to the instrument (judge code or model, rubric, params, J), not to
a run: any run graded by a judge with that fingerprint can show it. The table is a step of
`storage.db.MIGRATIONS`, like every other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from storage.db import Database, now


@dataclass(frozen=True)
class Calibrations:
    """Judge calibrations, and the judges that graded a run (`storage.store.Store.calibrations`)."""

    db: Database

    def record(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Store a calibration; returns it as stored, stamped with its `created_at` (so a
        report can say when the judge was measured)."""
        created = now()
        stored = {**doc, "created_at": created.isoformat()}
        with self.db.connect() as con:
            con.execute(
                "INSERT INTO calibrations VALUES (?, ?, ?, ?, ?, ?)",
                [
                    doc["judge_fingerprint"],
                    doc["judge"],
                    doc["suite_version"],
                    doc["truth"],
                    created,
                    json.dumps(stored),
                ],
            )
        return stored

    def latest(self, fingerprints: list[str]) -> dict[str, dict[str, Any]]:
        """fingerprint → its newest calibration document, for those that have one."""
        if not fingerprints:
            return {}
        with self.db.connect() as con:
            rows = con.execute(
                "SELECT judge_fingerprint, result FROM calibrations WHERE judge_fingerprint IN"
                f" ({', '.join('?' * len(fingerprints))})"
                " QUALIFY row_number() OVER (PARTITION BY judge_fingerprint ORDER BY created_at DESC) = 1",
                fingerprints,
            ).fetchall()
        return {fp: json.loads(result) for fp, result in rows}

    def run_judges(self, run_id: str) -> list[dict[str, Any]]:
        """Every judge that graded a sample of the run, as its deciding grader or an extra one
        (a `trajectory_judge`): its spec and fingerprint, how many samples it judged (an empty
        output is not put to the judge) and how many of those errored (the instrument broke:
        docs/contract.md §4 makes that `error`, not `failed`)."""
        with self.db.connect(read_only=True) as con:
            rows = con.execute(
                "WITH run AS (SELECT trace, status FROM samples WHERE run_id = ?),"
                " judged AS (SELECT json_extract_string(trace, '$.judge.fingerprint') AS fp,"
                "  json_extract_string(trace, '$.judge.spec') AS spec, status FROM run"
                " UNION ALL SELECT json_extract_string(g, '$.trace.judge.fingerprint'),"
                "  json_extract_string(g, '$.trace.judge.spec'), json_extract_string(g, '$.status')"
                "  FROM (SELECT unnest(json_extract(trace, '$.extra_graders[*]')) AS g FROM run"
                "        WHERE trace LIKE '%\"extra_graders\"%'))"
                " SELECT fp, any_value(spec), count(*) FILTER (WHERE status <> 'empty'),"
                " count(*) FILTER (WHERE status = 'error') FROM judged WHERE fp IS NOT NULL GROUP BY fp ORDER BY fp",
                [run_id],
            ).fetchall()
        return [
            {"judge": spec, "judge_fingerprint": fp, "judged": judged, "errors": errors}
            for fp, spec, judged, errors in rows
        ]

    def of_run(self, run_id: str) -> list[dict[str, Any]]:
        """For the report: each judge that graded the run (as `run_judges`), with its newest
        calibration under `calibration`, or None when it has never been calibrated."""
        judges = self.run_judges(run_id)
        found = self.latest([j["judge_fingerprint"] for j in judges])
        return [{**j, "calibration": found.get(j["judge_fingerprint"])} for j in judges]

