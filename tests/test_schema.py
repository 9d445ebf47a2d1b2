"""The sample schema is defined once, and database files upgrade in place."""

from __future__ import annotations

import duckdb

from storage import db
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
    with db.connect(tmp_path) as con:
        stored = con.sql("SELECT * FROM samples LIMIT 0").to_arrow_table().schema
    assert tuple(stored.names) == SAMPLE_COLUMNS
    for field in SAMPLE_SCHEMA:
        # `trace` is JSON in DuckDB and its text in Arrow; every other type is the same.
        assert field.name == "trace" or stored.field(field.name).type == field.type, field.name
    assert "PRIMARY KEY (run_id, case_id, sample_index)" in sample_ddl()


def test_an_unversioned_file_upgrades_in_place_keeping_its_rows(tmp_path):
    with duckdb.connect(str(db.db_path(tmp_path))) as con:
        con.execute(UNVERSIONED)
    with db.connect(tmp_path) as con:
        version = con.execute("SELECT version FROM schema_version").fetchall()
        columns = {r[0] for r in con.execute("DESCRIBE runs").fetchall()}
        tables = {r[0] for r in con.execute("SHOW TABLES").fetchall()}
    assert version == [(db.SCHEMA_VERSION,)]
    assert {"pid", "host", "process_started"} <= columns and {"samples", "aggregates"} <= tables
    assert db.get_run("old-run", tmp_path)["status"] == "completed"


def test_a_current_file_takes_no_step_again(tmp_path):
    with db.connect(tmp_path):
        pass
    with db.connect(tmp_path) as con:
        assert db.migrate(con) == db.SCHEMA_VERSION
        assert con.execute("SELECT count(*) FROM schema_version").fetchone() == (1,)


def test_a_file_whose_calibrations_table_predates_its_migration_keeps_its_rows(tmp_path):
    """Before the calibrations table was a migration step, `judge calibrate` created it on
    a version-2 file; taking step 3 leaves that table and its rows as they are."""
    with db.connect(tmp_path) as con:
        con.execute("DELETE FROM schema_version; INSERT INTO schema_version VALUES (2)")
        con.execute("DROP TABLE calibrations")
        con.execute("CREATE TABLE calibrations (judge_fingerprint VARCHAR, judge VARCHAR, suite_version VARCHAR,"
                    " truth VARCHAR, created_at TIMESTAMPTZ, result JSON)")
        con.execute("INSERT INTO calibrations VALUES ('fp', 'j', 'v', 'human', now(), '{\"kappa\": 0.5}')")
    from storage.calibrations import latest_calibrations

    assert latest_calibrations(["fp"], tmp_path) == {"fp": {"kappa": 0.5}}
    with db.connect(tmp_path) as con:
        assert con.execute("SELECT version FROM schema_version").fetchall() == [(db.SCHEMA_VERSION,)]


def test_a_new_file_has_every_table_before_any_command_writes(tmp_path):
    with db.connect(tmp_path) as con:
        tables = {r[0] for r in con.execute("SHOW TABLES").fetchall()}
    assert {"suites", "cases", "runs", "samples", "aggregates", "calibrations", "schema_version"} <= tables
