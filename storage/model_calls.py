"""The model calls earlier runs kept for replay (`--replay-model-calls`, docs/agents.md
"Replay"): read from the stored samples' traces (their `model_calls` section), so they are
stored, exported and masked as the traces are, with no table of their own."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from storage.db import FROM_THIS_HOME, Database
from tasks.agents.model_calls import TRACE_KEY, RecordedCall, recorded_calls

SampleAt = tuple[str, int, int]  # (case id, sample index, seed)


@dataclass(frozen=True)
class ModelCalls:
    """One home's kept model calls (`storage.store.Store.model_calls`)."""

    db: Database

    def recorded(self, agent: str, samples: Sequence[SampleAt]) -> dict[SampleAt, tuple[RecordedCall, ...]]:
        """For each (case id, sample index, seed) of `samples`: the calls kept by the latest
        run of this home (not an imported one) with the agent spec `agent` that kept any for
        it, whatever that run's status; a sample with none kept is absent."""
        if not samples:
            return {}
        case_ids, indexes, seeds = zip(*samples, strict=True)
        # Read by the query (DuckDB finds a local Arrow table by its name).
        wanted = pa.table({"case_id": pa.array(case_ids, pa.string()),  # noqa: F841
                           "sample_index": pa.array(indexes, pa.int32()), "seed": pa.array(seeds, pa.int64())})
        with self.db.connect(read_only=True) as con:
            rows = con.execute(
                f"""SELECT samples.case_id, samples.sample_index, samples.seed,
                           json_extract(samples.trace, '$.{TRACE_KEY}') FROM samples
                    JOIN wanted USING (case_id, sample_index, seed) JOIN runs USING (run_id)
                    WHERE runs.agent = ? AND samples.trace LIKE '%"{TRACE_KEY}"%' AND {FROM_THIS_HOME}
                    QUALIFY row_number() OVER (PARTITION BY samples.case_id, samples.sample_index, samples.seed
                                               ORDER BY runs.started_at DESC, samples.run_id DESC) = 1""",
                [agent]).fetchall()
        return {(case_id, index, seed): recorded_calls(json.loads(section) if section else None)
                for case_id, index, seed, section in rows}
