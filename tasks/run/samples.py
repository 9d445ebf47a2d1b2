"""The sample row (docs/contract.md §8): one Arrow schema, from which the stored table's columns and
its DDL are derived, and the conversion of graded `Sample`s into such rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa

from tasks.metrics.cost import PriceTable
from tasks.models import Sample, Usage
from tasks.run.sampling import Drawn, PlannedSample
from tasks.run.stored import StoredOutput
from tasks.run.usage import priced
from tasks.trace import SampleTrace

SAMPLE_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()), ("case_id", pa.string()), ("sample_index", pa.int32()),
        ("seed", pa.int64()), ("output", pa.string()), ("status", pa.string()),
        ("passed", pa.bool_()), ("score", pa.float64()), ("detail", pa.string()),
        ("safety", pa.list_(pa.string())), ("trace", pa.string()), ("duration_s", pa.float64()),
        ("cache_key", pa.string()), ("cached", pa.bool_()), ("case_hash", pa.string()),
        # Added by schema step 4 (storage/db.py), in this order: older rows hold nulls.
        ("output_key", pa.string()), ("latency_s", pa.float64()), ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()), ("usage_model", pa.string()), ("cost_usd", pa.float64()),
        # Added by schema step 8: an output longer than a chunk is stored once, in chunks, by
        # the sha256 of its text, and `output` is null (storage/db.py, `output_chunks`).
        ("output_sha", pa.string()),
    ]
)
SAMPLE_COLUMNS: tuple[str, ...] = tuple(SAMPLE_SCHEMA.names)
SAMPLE_KEY = ("run_id", "case_id", "sample_index")
# `trace` is JSON text in Arrow and a JSON column in DuckDB.
JSON_COLUMNS = frozenset({"trace"})

_SQL_TYPES = {
    pa.string(): "VARCHAR", pa.int32(): "INTEGER", pa.int64(): "BIGINT", pa.bool_(): "BOOLEAN",
    pa.float64(): "DOUBLE", pa.list_(pa.string()): "VARCHAR[]",
}


def sample_ddl(table: str = "samples") -> str:
    """`CREATE TABLE` for the sample rows, derived from `SAMPLE_SCHEMA`."""
    columns = ", ".join(
        f"{f.name} {'JSON' if f.name in JSON_COLUMNS else _SQL_TYPES[f.type]}" for f in SAMPLE_SCHEMA
    )
    return f"CREATE TABLE IF NOT EXISTS {table} ({columns}, PRIMARY KEY ({', '.join(SAMPLE_KEY)}))"


def samples_table(run_id: str, samples: Sequence[Sample], planned: Sequence[PlannedSample]) -> pa.Table:
    """`Sample`s (with their `PlannedSample`s, for keys and case hashes) as sample rows. A
    sample graded from a `StoredOutput` refers to it (`output_sha`) instead of holding it."""
    stored = [p.output if isinstance(p.output, StoredOutput) else None for p in planned]
    verdicts = [s.verdict for s in samples]
    usages = [s.usage for s in samples]
    n = len(samples)
    # Column by column: a table of cheap samples is built for each chunk the run stores.
    cols = {
        "run_id": [run_id] * n, "case_id": [s.case_id for s in samples],
        "sample_index": [s.index for s in samples], "seed": [s.seed for s in samples],
        "output": [None if o else s.output for s, o in zip(samples, stored, strict=True)],
        "status": [v.status.value for v in verdicts], "passed": [v.passed for v in verdicts],
        "score": [v.score for v in verdicts], "detail": [v.detail for v in verdicts],
        "safety": [list(v.safety) for v in verdicts], "trace": [s.trace.to_json() for s in samples],
        "duration_s": [s.duration_s for s in samples], "cache_key": [p.cache_key for p in planned],
        "cached": [s.cached for s in samples], "case_hash": [p.case_hash for p in planned],
        "output_key": [p.output_key or None for p in planned],
        "latency_s": [u.latency_s for u in usages], "input_tokens": [u.input_tokens for u in usages],
        "output_tokens": [u.output_tokens for u in usages], "usage_model": [u.model for u in usages],
        "cost_usd": [u.cost_usd for u in usages], "output_sha": [o and o.sha for o in stored],
    }
    return pa.table(cols, schema=SAMPLE_SCHEMA)


# A drawn output not yet graded (the `outputs` table, docs/storage.md "Nothing bought is
# lost"): stored as the agent returns it, removed once its sample is stored.
OUTPUT_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()), ("case_id", pa.string()), ("sample_index", pa.int32()),
        ("output_key", pa.string()), ("output", pa.string()), ("trace", pa.string()),
        ("draw_s", pa.float64()), ("error", pa.string()), ("latency_s", pa.float64()),
        ("input_tokens", pa.int64()), ("output_tokens", pa.int64()), ("usage_model", pa.string()),
        ("cost_usd", pa.float64()),
        ("output_sha", pa.string()),  # schema step 8, as the samples'
    ]
)


def output_ddl(table: str = "outputs") -> str:
    """`CREATE TABLE` for the drawn outputs, derived from `OUTPUT_SCHEMA`."""
    columns = ", ".join(f"{f.name} {'JSON' if f.name in JSON_COLUMNS else _SQL_TYPES[f.type]}" for f in OUTPUT_SCHEMA)
    return f"CREATE TABLE IF NOT EXISTS {table} ({columns}, PRIMARY KEY ({', '.join(SAMPLE_KEY)}))"


def output_record(run_id: str, drawn: Drawn) -> dict[str, Any]:
    """A drawn output as one row of `OUTPUT_SCHEMA` (also a log record: JSON-ready)."""
    p, u = drawn.planned, drawn.usage
    return {"run_id": run_id, "case_id": p.case_id, "sample_index": p.index, "output_key": p.output_key,
            "output": drawn.output, "trace": drawn.trace.to_json(), "draw_s": drawn.draw_s, "error": drawn.error,
            "latency_s": u.latency_s, "input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
            "usage_model": u.model, "cost_usd": u.cost_usd}


def outputs_table(records: Sequence[Mapping[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(records), schema=OUTPUT_SCHEMA)


def stored_drawn(planned: PlannedSample, row: Mapping[str, Any], prices: PriceTable) -> PlannedSample:
    """`planned` with the output a stored row of `OUTPUT_SCHEMA` holds for it (its text or a
    `StoredOutput`: `tasks.run.stored.row_output`), its usage (priced, as a draw is) and the
    trace the agent wrote (a trajectory, a workspace change): graded, not drawn again."""
    drawn = logged_drawn(planned, row)
    return replace(planned, output=drawn.output, usage=priced(drawn.usage, prices), trace=drawn.trace,
                   draw_s=drawn.draw_s)


def logged_drawn(planned: PlannedSample, record: Mapping[str, Any]) -> Drawn:
    """The draw of `planned` that a row of `OUTPUT_SCHEMA` (a log record) holds, as the draw
    task returned it (unpriced)."""
    trace = SampleTrace.model_validate_json(record["trace"]) if record["trace"] else SampleTrace()
    return Drawn(planned, record["output"], row_usage(record), trace, record["draw_s"] or 0.0, record["error"])


def row_usage(row: Mapping[str, Any]) -> Usage:
    """What a stored sample's agent call took and cost, from its row."""
    return Usage(latency_s=row["latency_s"], input_tokens=row["input_tokens"], output_tokens=row["output_tokens"],
                 model=row["usage_model"], cost_usd=row["cost_usd"])
