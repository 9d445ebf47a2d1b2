"""The samples of one home's runs (the `samples` table): the run loop's cache lookups and
writes, and what the commands read of a run's samples (docs/contract.md §8). Samples are
inserted with `ON CONFLICT DO NOTHING` on their primary key, so a sample is written once
however often a batch is retried."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage.db import (
    DERIVED_COLUMNS,
    FROM_THIS_HOME,
    NOT_CACHED_STATUS,
    OUTPUT_HEAD_CHARS,
    Database,
    insert_rows,
    with_whole_outputs,
)
from tasks.metrics.aggregate import RECORD_COLUMNS, sample_records
from tasks.metrics.diff import CaseResult
from tasks.metrics.graders import extra_grader_counts, must_pass_graders
from tasks.metrics.tallies import SampleRecord
from tasks.run.samples import SAMPLE_COLUMNS, SAMPLE_SCHEMA
from tasks.run.spec import RunStatus
from tasks.run.steps import CACHE_LOOKUP_COLUMNS, COPY_COLUMNS
from tasks.run.stored import StoredOutput, row_output
from tasks.run.usage import USAGE_SAMPLE_COLUMNS
from tasks.trace import SampleTrace


def _figures(turns: Any, calls: Mapping[str, int] | None, tokens: Any, cost: Any) -> dict[str, float]:
    """A case's summed figures (`CaseResult.figures`): those its samples reported. Tool calls
    count wherever there are model turns (none made is 0)."""
    found = {"turns": turns, "tool_calls": sum((calls or {}).values()) if turns is not None else None,
             "tokens": tokens, "cost": cost}
    return {name: float(value) for name, value in found.items() if value is not None}


@dataclass(frozen=True)
class Samples:
    """The samples of one home's runs (`storage.store.Store.samples`)."""

    db: Database

    def cached(self, planned: Sequence[tuple[str, str]]) -> pa.Table:
        """For each planned (output key, cache key): the stored sample that serves it best, one
        graded under the same cache key (and not by a failed grader) if there is one, else the
        newest with that output; as lookup rows (`CACHE_LOOKUP_COLUMNS`: never the output,
        which `copy` and `stored_outputs` read in the database). Two queries on one
        connection, the second only for what the first did not find: an unchanged re-run costs
        the one lookup it always did."""
        if not planned:
            return SAMPLE_SCHEMA.select(list(CACHE_LOOKUP_COLUMNS)).empty_table()
        out_keys, wanted = zip(*planned, strict=True)
        keys = pa.table({"cache_key": pa.array(wanted, pa.string()), "output_key": pa.array(out_keys, pa.string())})
        columns = ", ".join(f"samples.{c}" for c in CACHE_LOOKUP_COLUMNS)
        with self.db.connect() as con:
            whole = con.sql(
                f"""SELECT {columns} FROM samples JOIN keys USING (cache_key)
                    WHERE status NOT IN ('{NOT_CACHED_STATUS}', 'error') AND {FROM_THIS_HOME}
                    QUALIFY row_number() OVER (PARTITION BY samples.cache_key ORDER BY run_id DESC) = 1"""
            ).to_arrow_table()
            rest = keys.filter(pc.invert(pc.is_in(keys["output_key"], value_set=whole["output_key"])))  # noqa: F841
            if rest.num_rows == 0:
                return whole
            outputs = con.sql(
                f"""SELECT {columns} FROM samples JOIN rest USING (output_key)
                    WHERE status <> '{NOT_CACHED_STATUS}' AND {FROM_THIS_HOME}
                    QUALIFY row_number() OVER (PARTITION BY samples.output_key ORDER BY run_id DESC) = 1"""
            ).to_arrow_table()
        return pa.concat_tables([whole, outputs])

    def bought_unfinished(self, output_keys: Sequence[str]) -> pa.Table:
        """Of the stored outputs with these keys, those no run that finished (`completed` or
        `partial`) holds: bought by runs that were killed, stopped or failed, and counted by
        no budget yet. One row each, with what its call took (`USAGE_SAMPLE_COLUMNS`)."""
        keys = pa.table({"output_key": pa.array(list(output_keys), pa.string())})  # noqa: F841
        with self.db.connect(read_only=True) as con:
            return con.sql(
                f"""SELECT output_key, {', '.join(f'any_value(s.{c}) AS {c}' for c in USAGE_SAMPLE_COLUMNS)}
                    FROM samples s JOIN keys USING (output_key) JOIN runs r USING (run_id)
                    WHERE s.status <> '{NOT_CACHED_STATUS}' GROUP BY output_key
                    HAVING NOT bool_or(r.status IN ('{RunStatus.completed}', '{RunStatus.partial}'))"""
            ).to_arrow_table()

    def copy(self, run_id: str, copied: pa.Table) -> None:
        """Store the samples `copied` names (`COPY_COLUMNS`) as `run_id`'s cached ones, with the
        case hashes and costs it gives: row to row in the database, outputs and all, never through this
        process. Rows already present are left as they are."""
        if copied.num_rows == 0:
            return
        places = copied.select(list(COPY_COLUMNS)).rename_columns(  # noqa: F841
            ["src_run", "src_case", "src_index", "new_hash", "new_cost"])
        set_to = {"run_id": "?", "cached": "true", "case_hash": "places.new_hash", "cost_usd": "places.new_cost"}
        values = ", ".join(set_to.get(c, f"samples.{c}") for c in (*SAMPLE_COLUMNS, *DERIVED_COLUMNS))
        with self.db.connect() as con:
            con.execute(
                f"INSERT INTO samples ({', '.join([*SAMPLE_COLUMNS, *DERIVED_COLUMNS])}) SELECT {values}"
                " FROM samples JOIN places ON samples.run_id = places.src_run AND samples.case_id = places.src_case"
                " AND samples.sample_index = places.src_index ON CONFLICT DO NOTHING", [run_id])

    def stored_outputs(self, places: pa.Table) -> dict[str, tuple[str | StoredOutput, SampleTrace]]:
        """Output key → output of the stored samples `places` names (run id, case id, index):
        its text, or a long one as a `StoredOutput`, read when it is graded; with what its
        agent recorded (its trajectory: graded again with the output)."""
        if places.num_rows == 0:
            return {}
        with self.db.connect(read_only=True) as con:
            rows = con.sql("SELECT output_key, output, output_sha, trace FROM samples"
                           " JOIN places USING (run_id, case_id, sample_index)").to_arrow_table().to_pylist()
        return {row["output_key"]: (row_output(row, self.db), SampleTrace.parse(row["trace"]).agent_part())
                for row in rows}

    def insert(self, rows: pa.Table) -> None:
        """Write samples; rows already present (same run, case, index) are left as they are.
        The drawn outputs they grade leave the `outputs` table in the same transaction."""
        if rows.num_rows == 0:
            return
        with self.db.connect() as con:
            con.execute("BEGIN")
            insert_rows(con, rows.select(list(SAMPLE_COLUMNS)))
            graded = rows.select(["output_key"])  # noqa: F841 - read by DuckDB
            con.execute("DELETE FROM outputs WHERE output_key IN (SELECT output_key FROM graded)")
            con.execute("COMMIT")

    def of_run(self, run_id: str, columns: Sequence[str] | None = None, *,
                    whole_outputs: bool = True) -> pa.Table:
        """The run's samples in (case, index) order: every column, or only `columns` (the
        outputs and traces of thousands of samples are gigabytes a summary never reads).
        `whole_outputs=False`: each output as stored, a long one null beside its `output_sha`
        (`tasks.run.stored.row_output`)."""
        wanted = list(SAMPLE_COLUMNS if columns is None else columns)
        unknown = set(wanted) - set(SAMPLE_COLUMNS)
        if unknown:
            raise ValueError(f"not sample columns: {sorted(unknown)}")
        read = [*wanted, *(["output_sha"] if "output" in wanted and "output_sha" not in wanted else [])]
        with self.db.connect(read_only=True) as con:
            table = con.sql(
                f"SELECT {', '.join(read)} FROM samples WHERE run_id = ? ORDER BY case_id, sample_index",
                params=[run_id],
            ).to_arrow_table()
            if whole_outputs and "output" in wanted and table["output_sha"].null_count < table.num_rows:
                rows = with_whole_outputs(con, table.select(["output", "output_sha"]).to_pylist())
                table = table.set_column(read.index("output"), "output",
                                         pa.array([row["output"] for row in rows], pa.string()))
        return table.select(wanted)

    def case_counts(self, run_id: str) -> dict[str, tuple[int, int]]:
        """case_hash → (n, c) for one run: the gate's paired input."""
        with self.db.connect(read_only=True) as con:
            rows = con.execute(
                "SELECT case_hash, count(*), count(*) FILTER (WHERE passed) FROM samples"
                " WHERE run_id = ? GROUP BY case_hash", [run_id]
            ).fetchall()
        return {h: (int(n), int(c)) for h, n, c in rows}

    def commonest_detail(self, run_id: str, status: str) -> tuple[str, int] | None:
        """The detail most samples of the run with `status` share, and how many share it."""
        with self.db.connect(read_only=True) as con:
            return con.execute(
                "SELECT detail, count(*) AS n FROM samples WHERE run_id = ? AND status = ? "
                "GROUP BY detail ORDER BY n DESC, detail LIMIT 1", [run_id, status]).fetchone()

    def failing(self, run_id: str, per_case: int, chars: int) -> list[dict[str, Any]]:
        """The first `per_case` failing samples of each case of a run, in (case, index) order:
        `case_id`, `sample_index`, the first `chars` (at most OUTPUT_HEAD_CHARS) characters of
        `output`, and `trace`."""
        if chars > OUTPUT_HEAD_CHARS:
            raise ValueError(f"Samples.failing reads at most {OUTPUT_HEAD_CHARS} characters of an output")
        with self.db.connect(read_only=True) as con:
            cur = con.execute(
                "SELECT case_id, sample_index, left(output_head, ?) AS output, trace FROM samples"
                " WHERE run_id = ? AND NOT coalesce(passed, false)"
                " QUALIFY row_number() OVER (PARTITION BY case_id ORDER BY sample_index) <= ?"
                " ORDER BY case_id, sample_index", [chars, run_id, per_case])
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def safety_failed(self, run_id: str) -> bool:
        with self.db.connect(read_only=True) as con:
            (hits,) = con.execute(
                "SELECT count(*) FROM samples WHERE run_id = ? AND len(safety) > 0", [run_id]
            ).fetchone()
        return hits > 0

    def case_results(self, run_id: str, *, records: bool = False) -> list[CaseResult]:
        """One `CaseResult` per case of a run (counts, mean score, the case's slices in the run's
        suite, each sample's score for a registered metric): what `diff` and the gate's rules read.
        With `records`, each case's sample records too (`needs_records`: a registered metric
        computed on them)."""
        with self.db.connect(read_only=True) as con:
            rows = con.execute(
                "SELECT s.case_id, s.case_hash, count(*), count(*) FILTER (WHERE s.passed),"
                " coalesce(avg(s.score), 0), any_value(c.slices),"
                " list(coalesce(s.score, 0) ORDER BY s.sample_index),"
                " list(json_extract_string(s.trace, '$.extra_graders')) FILTER (WHERE s.trace LIKE '%\"extra_graders\"%'),"
                " count(*) FILTER (WHERE len(s.safety) > 0),"
                " sum(len(list_filter(coalesce(json_extract_string(s.trace, '$.trajectory.entries[*].role'), []),"
                " lambda r: r = 'assistant'))) FILTER (WHERE s.trace LIKE '%\"trajectory\"%'),"
                " sum(coalesce(s.input_tokens, 0) + coalesce(s.output_tokens, 0))"
                " FILTER (WHERE s.input_tokens IS NOT NULL OR s.output_tokens IS NOT NULL), sum(s.cost_usd)"
                " FROM samples s JOIN runs r ON r.run_id = s.run_id"
                " LEFT JOIN cases c ON c.suite_version = r.suite_version AND c.case_id = s.case_id"
                " WHERE s.run_id = ? GROUP BY s.case_id, s.case_hash ORDER BY s.case_id", [run_id]
            ).fetchall()
            calls: dict[str, dict[str, int]] = {}
            for cid, name, count in con.execute(
                    "SELECT case_id, name, count(*) FROM tool_calls WHERE run_id = ? GROUP BY ALL", [run_id]).fetchall():
                calls.setdefault(cid, {})[str(name)] = int(count)
            kept: dict[str, list[SampleRecord]] = {}
            if records:
                table = con.sql(f"SELECT case_id, {', '.join(RECORD_COLUMNS)} FROM samples WHERE run_id = $run"
                                " ORDER BY case_id, sample_index", params={"run": run_id}).to_arrow_table()
                for cid, record in zip(table["case_id"].to_pylist(), sample_records(table), strict=True):
                    kept.setdefault(cid, []).append(record)
        return [CaseResult(cid, h, int(n), int(c), float(score), tuple(slices or ()), tuple(map(float, scores)),
                           graders=extra_grader_counts(extras or ()), must_pass_graders=must_pass_graders(extras or ()),
                           tools=calls.get(cid, {}), unsafe=int(unsafe),
                           figures=_figures(turns, calls.get(cid), tokens, cost), records=tuple(kept.get(cid, ())))
                for cid, h, n, c, score, slices, scores, extras, unsafe, turns, tokens, cost in rows]

    def of_case(self, run_id: str, case_id: str) -> list[dict[str, Any]]:
        """Every stored sample of one case of a run, in index order (`runs show --case`), a long
        output as a `StoredOutput`, read when it is shown."""
        with self.db.connect(read_only=True) as con:
            cur = con.execute(
                f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE run_id = ? AND case_id = ? ORDER BY sample_index",
                [run_id, case_id])
            names = [d[0] for d in cur.description]
            rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        return [{**row, "output": row_output(row, self.db)} for row in rows]

    def of_cases(self, run_ids: Sequence[str], case_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The samples of some cases in some runs (the diff report's expanded cases), in
        (run, case, index) order."""
        if not case_ids:
            return []
        with self.db.connect(read_only=True) as con:
            cur = con.execute(
                f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE list_contains(?, run_id) AND list_contains(?, case_id) ORDER BY run_id, case_id, sample_index",
                [list(run_ids), list(case_ids)])
            names = [d[0] for d in cur.description]
            return with_whole_outputs(con, [dict(zip(names, row, strict=True)) for row in cur.fetchall()])
