"""The sample schema is defined once, and database files upgrade in place."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

from storage import db
from storage.store import Store
from tasks.run.samples import SAMPLE_COLUMNS, SAMPLE_SCHEMA, sample_ddl

# The schema of files written before there was a schema_version table.
UNVERSIONED = """
CREATE TABLE runs (
    run_id VARCHAR PRIMARY KEY, suite_version VARCHAR, suite_name VARCHAR, agent VARCHAR,
    agent_fingerprint VARCHAR, n INTEGER, ks INTEGER[], seed BIGINT, status VARCHAR,
    started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, flow_run_id VARCHAR, config JSON,
    summary JSON);
INSERT INTO runs (run_id, status) VALUES ('old-run', 'completed');
"""


def test_the_stored_table_matches_the_arrow_schema(tmp_path):
    with Store(tmp_path).db.connect() as con:
        stored = con.sql("SELECT * FROM samples LIMIT 0").to_arrow_table().schema
    assert tuple(stored.names) == (*SAMPLE_COLUMNS, *db.DERIVED_COLUMNS)
    for field in SAMPLE_SCHEMA:
        # `trace` is JSON in DuckDB and its text in Arrow; every other type is the same.
        assert field.name == "trace" or stored.field(field.name).type == field.type, field.name
    assert "PRIMARY KEY (run_id, case_id, sample_index)" in sample_ddl()


def test_an_unversioned_file_upgrades_in_place_keeping_its_rows(tmp_path):
    with duckdb.connect(str(Store(tmp_path).db.path)) as con:
        con.execute(UNVERSIONED)
    with Store(tmp_path).db.connect() as con:
        version = con.execute("SELECT version FROM schema_version").fetchall()
        columns = {r[0] for r in con.execute("DESCRIBE runs").fetchall()}
        tables = {r[0] for r in con.execute("SHOW TABLES").fetchall()}
    assert version == [(db.SCHEMA_VERSION,)]
    assert {"pid", "host", "process_started"} <= columns and {"samples", "aggregates"} <= tables
    assert Store(tmp_path).runs.get("old-run")["status"] == "completed"


def test_a_current_file_takes_no_step_again(tmp_path):
    with Store(tmp_path).db.connect():
        pass
    with Store(tmp_path).db.connect() as con:
        assert db.migrate(con) == db.SCHEMA_VERSION
        assert con.execute("SELECT count(*) FROM schema_version").fetchone() == (1,)


def test_a_file_whose_calibrations_table_predates_its_migration_keeps_its_rows(tmp_path):
    """Before the calibrations table was a migration step, `judge calibrate` created it on
    a version-2 file; taking step 3 leaves that table and its rows as they are."""
    with Store(tmp_path).db.connect() as con:
        con.execute("DELETE FROM schema_version; INSERT INTO schema_version VALUES (2)")
        con.execute("DROP TABLE calibrations")
        con.execute("CREATE TABLE calibrations (judge_fingerprint VARCHAR, judge VARCHAR, suite_version VARCHAR,"
                    " truth VARCHAR, created_at TIMESTAMPTZ, result JSON)")
        con.execute("INSERT INTO calibrations VALUES ('fp', 'j', 'v', 'human', now(), '{\"kappa\": 0.5}')")
    assert Store(tmp_path).calibrations.latest(["fp"]) == {"fp": {"kappa": 0.5}}
    with Store(tmp_path).db.connect() as con:
        assert con.execute("SELECT version FROM schema_version").fetchall() == [(db.SCHEMA_VERSION,)]


def test_a_new_file_has_every_table_before_any_command_writes(tmp_path):
    with Store(tmp_path).db.connect() as con:
        tables = {r[0] for r in con.execute("SHOW TABLES").fetchall()}
    assert {"suites", "cases", "runs", "samples", "aggregates", "calibrations", "schema_version"} <= tables


# The samples table as schema versions 1-3 wrote it: no output key, no usage.
SAMPLES_V3 = """CREATE TABLE IF NOT EXISTS samples (run_id VARCHAR, case_id VARCHAR, sample_index INTEGER,
    seed BIGINT, output VARCHAR, status VARCHAR, passed BOOLEAN, score DOUBLE, detail VARCHAR, safety VARCHAR[],
    trace JSON, duration_s DOUBLE, cache_key VARCHAR, cached BOOLEAN, case_hash VARCHAR,
    PRIMARY KEY (run_id, case_id, sample_index))"""


def _v3_file(home, runs: dict[str, list[bool]]) -> dict[str, dict]:
    """A schema-3 database holding `runs` (run id -> passed per sample of one case "c1"),
    each with the summary evalpipe wrote then (no `usage`); their summaries."""
    import json

    import pyarrow as pa

    from tasks.models import EvalCase, EvalSuite
    from tasks.run import RunSpec, summarize

    suite = EvalSuite(name="old", cases=(EvalCase(id="c1", inputs={"q": 1}, reference="yes", grader={"kind": "exact"}),))
    home.mkdir(parents=True, exist_ok=True)
    summaries = {}
    with duckdb.connect(str(Store(home).db.path)) as con:
        con.execute(db.MIGRATIONS[0].replace(sample_ddl(), SAMPLES_V3))
        for step in db.MIGRATIONS[1:3]:
            con.execute(step)
        con.execute("CREATE TABLE schema_version (version INTEGER); INSERT INTO schema_version VALUES (3)")
        con.execute("INSERT INTO cases VALUES (?, 'c1', ?, [], [])", [suite.version, suite.cases[0].case_hash])
        for run_id, passed in runs.items():
            rows = [[run_id, "c1", i, i, "yes" if ok else "no", "passed" if ok else "failed", ok, float(ok), "", [],
                     "{}", 0.1, f"key-{run_id}-{i}", False, suite.cases[0].case_hash] for i, ok in enumerate(passed)]
            con.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
            spec = RunSpec(run_id=run_id, suite_version=suite.version, suite_name="old", agent="python:a.py:f",
                           agent_fingerprint="fp", n=len(passed), ks=[1], seed=0)
            table = pa.table({"case_id": ["c1"] * len(passed), "sample_index": list(range(len(passed))),
                              "passed": passed, "status": ["passed" if ok else "failed" for ok in passed],
                              "safety": [[] for _ in passed], "cached": [False] * len(passed), "trace": ["{}"] * len(passed)})
            summary = summarize(spec, suite, table.append_column("latency_s", pa.array([None] * len(passed), pa.float64()))
                                .append_column("input_tokens", pa.array([None] * len(passed), pa.int64()))
                                .append_column("output_tokens", pa.array([None] * len(passed), pa.int64()))
                                .append_column("usage_model", pa.array([None] * len(passed), pa.string()))
                                .append_column("cost_usd", pa.array([None] * len(passed), pa.float64())))[0].to_json()
            del summary["usage"]
            summary["duration_s"] = 1.5
            summaries[run_id] = summary
            con.execute("INSERT INTO runs (run_id, suite_version, suite_name, agent, agent_fingerprint, n, ks, seed,"
                        " status, summary) VALUES (?, ?, 'old', 'python:a.py:f', 'fp', ?, [1], 0, 'completed', ?)",
                        [run_id, suite.version, len(passed), json.dumps(summary)])
    return summaries


def main(argv: list[str]) -> int:
    from flows.cli import main as cli_main

    try:
        return cli_main(argv)
    except SystemExit as done:  # typer ends a command it ran itself this way
        return int(done.code or 0)


def test_runs_stored_before_output_keys_still_show_report_and_gate(tmp_path, monkeypatch, capsys):
    import json

    from flows.output import rounded

    home = tmp_path / "home"
    summaries = _v3_file(home, {"old-base": [True, True, False], "old-new": [True, False, False]})
    monkeypatch.setenv("EVALPIPE_HOME", str(home))

    assert main(["runs", "show", "old-base", "--json"]) == 0  # a reader migrates the file first
    assert json.loads(capsys.readouterr().out) == rounded(summaries["old-base"])
    assert main(["runs", "show", "old-new"]) == 0
    assert "pass@1 33.3%" in capsys.readouterr().out
    assert main(["gate", "old-new", "--baseline", "old-base", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["shared_cases"] == 1
    assert main(["report", "old-new", "--out", str(tmp_path / "r.html")]) == 0
    assert "old" in (tmp_path / "r.html").read_text()

    with Store(home).db.connect() as con:
        assert con.execute("SELECT version FROM schema_version").fetchall() == [(db.SCHEMA_VERSION,)]
        kept = con.execute("SELECT count(*), count(output_key), count(latency_s) FROM samples").fetchone()
        heads = con.execute("SELECT count(*) FROM samples WHERE output_head = output").fetchone()
    assert kept == (6, 0, 0)  # every row kept; no key or usage invented for them
    assert heads == (6,)  # the upgrade derived each output's head, which `report` reads
    assert Store(home).samples.of_run("old-base").column_names == list(SAMPLE_COLUMNS)


def test_report_reads_the_head_of_each_output_as_stored(tmp_path):
    """Outputs longer than the head: `store.samples.failing` gives their first characters, whole
    characters (not bytes), and the heads are derived on every insert, an import's too."""
    from tasks.run import RunSpec

    spec = RunSpec(suite_version="0" * 64, suite_name="s", agent="a", agent_fingerprint="f", n=2, ks=[1], seed=0)
    Store(tmp_path).runs.start(spec)
    long = "é" * (db.OUTPUT_HEAD_CHARS + 10)
    rows = [{"run_id": spec.run_id, "case_id": "c1", "sample_index": i, "seed": 0, "output": out,
             "status": "failed", "passed": False, "score": 0.0, "detail": "", "safety": [], "trace": "{}",
             "duration_s": 0.0, "cache_key": f"k{i}", "cached": False, "case_hash": "h"}
            for i, out in enumerate([long, "short"])]
    Store(tmp_path).samples.insert(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA))
    got = Store(tmp_path).samples.failing(spec.run_id, 2, 100)
    assert [r["output"] for r in got] == ["é" * 100, "short"]
    whole = Store(tmp_path).samples.failing(spec.run_id, 1, db.OUTPUT_HEAD_CHARS)
    assert whole[0]["output"] == long[: db.OUTPUT_HEAD_CHARS]
    with pytest.raises(ValueError):
        Store(tmp_path).samples.failing(spec.run_id, 1, db.OUTPUT_HEAD_CHARS + 1)
