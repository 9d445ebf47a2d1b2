"""An empty Prefect database made once per installed Prefect and copied into every server
home that has none yet, so that a fresh home's first start does not run Prefect's SQLite
migrations from scratch (over a hundred of them: most of what a fresh home's first run
paid on top of a plain server start).

The template lives in the user's cache, `$XDG_CACHE_HOME/evalpipe/prefect-db/` (default
`~/.cache/evalpipe/prefect-db/`), named for the Prefect version and a digest of its SQLite
migration scripts: it is only ever copied for the Prefect that made it, and any other
Prefect (another version, a patched one) finds no template of its own and builds one. It
is built by Prefect's own `prefect server database upgrade` in an empty temporary
PREFECT_HOME, never taken from a home's database, so it holds what a fresh migration holds
and nothing of any home's runs. The server still runs its migrations on start (nothing to
do at head), so it never trusts a copied database blindly.

The build also registers the block types, with the function Prefect's server runs on a
home's first start, so that a server's first start on a copy skips it (`FIRST_START`):
1.6 s of CPU of a temporary server's 5.5 s start, paid by every run on a fresh home (a CI
job's). What decides those types beside Prefect itself, the installed Prefect collections
and `PREFECT_EXTRA_ENTRYPOINTS`, is in the key; later starts of a home are Prefect's own
business (it registers again when they change).

A PREFECT_HOME whose database is named elsewhere (a Postgres server, another file: the
`PREFECT_API_DATABASE_*` / `PREFECT_SERVER_DATABASE_*` settings in the environment or its
profiles) is left alone.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path
from typing import IO

DATABASE = "prefect.db"  # Prefect's default SQLite file in its PREFECT_HOME
# The settings that name a server's database somewhere else than PREFECT_HOME/prefect.db.
_NAMING = tuple(f"PREFECT_{scope}_DATABASE_{field}" for scope in ("API", "SERVER")
                for field in ("CONNECTION_URL", "DRIVER", "HOST", "PORT", "USER", "NAME", "PASSWORD"))
BUILD_TIMEOUT_S = 600.0
SEEDED = "the Prefect database was copied from the template"  # said in the server's log
# A server's settings for its first start on a home seeded from the template: the template
# holds the block types it would register.
FIRST_START = {"PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false"}
# Prefect's server registers its block types on a home's first start (`add_block_types` in
# prefect/server/api/server.py): the same function, after the same imports, on the template.
_REGISTER_BLOCKS = """
import asyncio
import prefect.server.api.server
from prefect.plugins import load_prefect_collections
from prefect.server.database import provide_database_interface
from prefect.server.models.block_registration import run_block_auto_registration

async def register():
    load_prefect_collections()
    session = await provide_database_interface().session()
    async with session:
        await run_block_auto_registration(session=session)

asyncio.run(register())
"""


def key(env: Mapping[str, str] | None = None) -> str | None:
    """The installed Prefect's version and the digest of its SQLite migration scripts and of
    what else decides its block types; None when they cannot be found (then no template is
    used)."""
    spec = importlib.util.find_spec("prefect")  # finds the package without importing it (2 s)
    if spec is None or not spec.submodule_search_locations:
        return None
    scripts = Path(spec.submodule_search_locations[0]) / "server/database/_migrations/versions/sqlite"
    found = digest(scripts, also=_block_sources(os.environ if env is None else env))
    return f"prefect-{importlib.metadata.version('prefect')}-{found}" if found else None


def digest(scripts: Path, also: bytes = b"") -> str | None:
    """A digest of the migration scripts in `scripts` (names and contents) and `also`; None
    when there are none."""
    found = sorted(scripts.glob("*.py"))
    if not found:
        return None
    hashed = hashlib.sha256(also)
    for script in found:
        hashed.update(script.name.encode() + b"\0" + script.read_bytes() + b"\0")
    return hashed.hexdigest()[:16]


def _block_sources(env: Mapping[str, str]) -> bytes:
    """Where block types come from besides Prefect: the installed collections (their entry
    points and versions) and the extra entry points its settings name."""
    points = sorted(f"{ep.name}={ep.value} {ep.dist.name if ep.dist else ''} {ep.dist.version if ep.dist else ''}"
                    for ep in importlib.metadata.entry_points(group="prefect.collections"))
    return "\n".join([*points, env.get("PREFECT_EXTRA_ENTRYPOINTS", "")]).encode()


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "evalpipe" / "prefect-db"


def template_path(env: Mapping[str, str] | None = None) -> Path | None:
    name = key(env)
    return cache_dir(env) / f"{name}.db" if name else None


def names_another_database(prefect_home: Path, env: Mapping[str, str]) -> bool:
    """Whether the server's settings could put its database elsewhere than
    PREFECT_HOME/prefect.db (told without importing Prefect; errs on yes)."""
    if any(env.get(name) for name in _NAMING):
        return True
    try:
        return "_DATABASE_" in (prefect_home / "profiles.toml").read_text(errors="replace")
    except OSError:
        return False


def seed(prefect_home: Path, env: Mapping[str, str], log: IO | None = None, *, build_missing: bool = True) -> bool:
    """Give a PREFECT_HOME without a database a copy of the template, building the template
    first when this Prefect has none (or a damaged or incomplete one) and `build_missing`.
    True when the home got one (its server's first start then takes `FIRST_START`); False
    when it has one already, names another database, or there is no template (the server
    then migrates its database itself, as without a template)."""
    if (prefect_home / DATABASE).exists() or names_another_database(prefect_home, env):
        return False
    part = prefect_home / f".{DATABASE}.{os.getpid()}.part"
    try:
        template = ready(env, log, build_missing=build_missing)
        if template is None:
            return False
        prefect_home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, part)
        os.replace(part, prefect_home / DATABASE)
    except (OSError, sqlite3.Error) as exc:  # a read-only cache, a full disk: the server migrates, as without
        part.unlink(missing_ok=True)
        _say(log, f"no Prefect database template ({exc}): the server migrates its own")
        return False
    _say(log, f"{SEEDED} {template}")
    return True


def ready(env: Mapping[str, str], log: IO | None = None, *, build_missing: bool = True) -> Path | None:
    """The installed Prefect's template, built first when it is missing or damaged and
    `build_missing`; None when there is none."""
    template = template_path(env)
    if template is None or not (_complete(template) or (build_missing and build(template, log))):
        return None
    return template


def _say(log: IO | None, line: str) -> None:
    if log is not None:  # the server's log, opened in binary for the server's own output
        log.write(f"evalpipe: {line}\n".encode())
        log.flush()


def build(template: Path, log: IO | None = None) -> bool:
    """Migrate an empty database with Prefect's own command and register its block types,
    in a temporary PREFECT_HOME and working directory of its own (no user setting can point
    it elsewhere), then move it into place. False when it failed (its output went to `log`)."""
    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=template.parent) as scratch:
        home = Path(scratch)
        env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
        env |= {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        if os.environ.get("PREFECT_EXTRA_ENTRYPOINTS"):  # in the key: their blocks are registered too
            env["PREFECT_EXTRA_ENTRYPOINTS"] = os.environ["PREFECT_EXTRA_ENTRYPOINTS"]
        prefect = Path(sys.executable).with_name("prefect")
        steps = ([str(prefect), "server", "database", "upgrade", "--yes"], [sys.executable, "-c", _REGISTER_BLOCKS])
        try:
            done = all(subprocess.run(step, cwd=home, env=env, stdin=subprocess.DEVNULL, stdout=log or subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S).returncode == 0 for step in steps)
        except subprocess.TimeoutExpired:
            done = False
        built, compact = home / DATABASE, home / "template.db"
        if not (done and _complete(built)):
            _say(log, f"could not build the Prefect database template {template}: the server migrates its own")
            return False
        # One self-contained file in rollback mode (no -wal or -shm beside it: it is only
        # read and copied), written whole before it is named.
        with closing(sqlite3.connect(built)) as db:
            db.execute("VACUUM INTO ?", (str(compact),))
        with closing(sqlite3.connect(compact)) as db:
            db.execute("PRAGMA journal_mode=DELETE")
        os.replace(compact, template)  # two builds at once: either file is the same template
    _say(log, f"built the Prefect database template {template} (once for this Prefect)")
    return True


def _complete(database: Path) -> bool:
    """Migrated (at one revision) and its block types registered."""
    try:
        with closing(sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)) as db:
            return (len(db.execute("SELECT version_num FROM alembic_version").fetchall()) == 1
                    and db.execute("SELECT count(*) FROM block_type").fetchone()[0] > 0)
    except sqlite3.Error:
        return False


if __name__ == "__main__":  # `python -m server.db_template`: made ahead, by `make`'s install step
    made = ready(os.environ)
    if made is None:
        sys.exit(f"evalpipe: no Prefect database template could be made in {cache_dir()}")
    print(f"evalpipe: Prefect's database template: {made}")
