"""A fresh home's Prefect database, copied from a template made once per Prefect rather than
migrated (server/db_template.py): a real fresh home started from it records its run's flow
run, its block types already registered; a damaged template is rebuilt by Prefect's own
migrations and block registration; a template is keyed by the Prefect version, its
migration scripts and where else its block types come from, so another Prefect never takes
this one's; a home whose database is named elsewhere, or that has one, is left alone.

Real processes: a managed server per fresh home (stopped in teardown), the build through
`prefect server database upgrade`, in a cache directory of the test's own (XDG_CACHE_HOME).
A temporary server's fresh home is seeded from the user's own template in
test_warm.py::test_every_runner_records_its_task_runs_on_the_temporary_server."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from support.cli import client_env, evalpipe, run_args, write_work
from support.prefect_db import block_types

from server import db_template
from server.managed import stop_managed


def _flow_run_state(home: Path, flow_run_id: str) -> str:
    server = json.loads((home / "server" / "server.json").read_text())
    user, _, password = (home / "server" / "credentials").read_text().strip().partition(":")
    url = f"http://127.0.0.1:{server['port']}/api/flow_runs/{flow_run_id}"
    return httpx.get(url, auth=(user, password), timeout=30).json()["state"]["type"]


def _revision(database: Path) -> list[tuple[str]]:
    with closing(sqlite3.connect(database)) as db:
        return db.execute("SELECT version_num FROM alembic_version").fetchall()


@pytest.mark.slow
def test_a_fresh_home_starts_from_the_template_rebuilt_and_records_its_run(tmp_path: Path) -> None:
    work = write_work(tmp_path)
    cache = tmp_path / "cache"
    template = db_template.template_path({"XDG_CACHE_HOME": str(cache)})
    template.parent.mkdir(parents=True)
    template.write_bytes(b"not a database")  # damaged: rebuilt, never copied
    foreign = template.parent / "prefect-0.0.1-0123456789abcdef.db"  # another Prefect's: never used
    with closing(sqlite3.connect(foreign)) as db:
        db.executescript("CREATE TABLE alembic_version (version_num TEXT); INSERT INTO alembic_version VALUES ('foreign');")
    home = tmp_path / "home"  # a fresh home seeded from a built template: test_warm.py's temporary-server test
    try:
        env = client_env(work, home, EVALPIPE_SERVER="managed", EVALPIPE_SERVER_IDLE_S="0", XDG_CACHE_HOME=str(cache))
        proc = evalpipe(*run_args(work, "--json"), env=env)
        assert proc.returncode == 0, proc.stderr
        # The run is recorded on the server of its fresh home, whose database came from the template.
        assert _flow_run_state(home, json.loads(proc.stdout)["flow_run_id"]) == "COMPLETED"
        log = (home / "server" / "server.log").read_text()
        assert "built the Prefect database template" in log and f"{db_template.SEEDED} {template}" in log
        assert len(_revision(template)) == 1 and _revision(foreign) == [("foreign",)]
        # The template stays pristine: the run went to the home's copy.
        assert sorted(p.name for p in template.parent.iterdir()) == sorted([template.name, foreign.name])
        with closing(sqlite3.connect(template)) as db:
            assert db.execute("SELECT count(*) FROM flow_run").fetchone() == (0,)
        assert _revision(home / "server" / "prefect" / "prefect.db") == _revision(template)
        # The template holds the block types Prefect registers (its own and its collections',
        # prefect-dask's among them), so the server's first start on the copy did not register
        # them again.
        registered = block_types(template)
        assert {"local-file-system", "secret"} <= {slug for slug, _ in registered}
        assert block_types(home / "server" / "prefect" / "prefect.db") == registered
    finally:
        stop_managed(home)


def test_the_key_names_the_prefect_version_and_changes_with_its_migrations(tmp_path: Path) -> None:
    import prefect

    key = db_template.key()
    assert key is not None and key.startswith(f"prefect-{prefect.__version__}-")
    assert db_template.key() == key  # stable
    # Blocks from extra entry points would be in the template: another set, another template.
    assert db_template.key({"PREFECT_EXTRA_ENTRYPOINTS": "my_blocks"}) not in (key, None)
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "2026_01_01_000000_abc_first.py").write_text("revision = 'abc'\n")
    before = db_template.digest(scripts)
    (scripts / "2026_01_02_000000_def_second.py").write_text("revision = 'def'\n")
    added = db_template.digest(scripts)
    (scripts / "2026_01_02_000000_def_second.py").write_text("revision = 'def'  # patched\n")
    assert len({before, added, db_template.digest(scripts)}) == 3


def test_a_template_that_cannot_be_made_leaves_the_migration_to_the_server(tmp_path: Path) -> None:
    (tmp_path / "not-a-folder").write_text("")
    log = tmp_path / "server.log"
    with log.open("ab") as out:
        copied = db_template.seed(tmp_path / "home", {"XDG_CACHE_HOME": str(tmp_path / "not-a-folder")}, out)
    assert copied is False
    assert log.read_text().startswith("evalpipe: no Prefect database template (")
    assert not (tmp_path / "home").exists()  # nothing half-made: the server creates it all


def test_a_home_with_a_database_or_one_named_elsewhere_is_left_alone(tmp_path: Path) -> None:
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    # No template and no build asked for: nothing happens, nothing is written.
    assert db_template.seed(tmp_path / "none", cache, build_missing=False) is False
    assert not (tmp_path / "none").exists() and not (tmp_path / "cache").exists()
    has_one = tmp_path / "has-one"
    has_one.mkdir()
    (has_one / "prefect.db").write_bytes(b"the user's own")
    assert db_template.seed(has_one, cache) is False
    assert (has_one / "prefect.db").read_bytes() == b"the user's own"
    url = {"PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://db/prefect"}
    assert db_template.seed(tmp_path / "postgres", cache | url) is False
    profiled = tmp_path / "profiled"
    profiled.mkdir()
    (profiled / "profiles.toml").write_text('[profiles.x]\nPREFECT_SERVER_DATABASE_HOST = "db"\n')
    assert db_template.seed(profiled, cache) is False
    assert not (tmp_path / "cache").exists() and not (profiled / "prefect.db").exists()
