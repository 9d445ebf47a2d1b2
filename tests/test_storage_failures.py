"""Bad input and a failing machine, seen from the command line: one line on stderr, no
traceback, exit 2 (the input) or 3 (the machine), and nothing written or overwritten.
Runs whose process is gone read as `interrupted`."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from support.cli import as_process, in_process

from storage import PlatformError
from storage.outputs import read_log
from storage.store import Store
from tasks.run import RunSpec

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ROOT / "tests/support/agents.py"


cli = as_process  # what these tests are about is the process's exit and its one line


def one_line_failure(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` with a hash of its content."""
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def suite_file(path: Path, cases: int) -> Path:
    path.write_text("name: toy\ncases:\n" + "".join(
        f"  - {{id: q{i:03d}, inputs: {{p: 0.5}}, reference: 'yes', grader: {{kind: exact}}}}\n"
        for i in range(cases)))
    return path


# --- suite files past the input limits -------------------------------------------------

def _bomb(levels: int) -> str:
    names = "abcdefghij"[:levels]
    anchors = "".join(f"  - &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in itertools.pairwise(names))
    return (f"name: s\ndescription:\n  - &a [x, x, x, x, x, x, x, x, x]\n{anchors}"
            f"cases: [{{id: a, grader: {{kind: exact}}, reference: *{names[-1]}}}]\n")


OVER_LIMITS = {
    # 9**6 leaves from 330 bytes: small enough that the unlimited parser finishes
    # (exit 0, after seconds), large enough to be past the expansion budget.
    "bomb.yaml": (_bomb(6), "aliases expand the document"),
    "deep.yaml": ("name: s\ncases: [{id: a, grader: {kind: exact}, reference: " + "[" * 3000 + "]" * 3000 + "}]\n",
                  "line 2: nested deeper than 100 levels"),
    "deep.jsonl": ('{"id": "a", "grader": {"kind": "exact"}, "reference": ' + "[" * 5000 + "]" * 5000 + "}\n",
                   "line 1: nested deeper than 100 levels"),
    "bigint.jsonl": ('{"id": "a", "grader": {"kind": "exact"}}\n{"id": "b", "grader": {"kind": "exact"},'
                     ' "reference": ' + "1" * 4301 + "}\n", "line 2: an integer with more than 4300 digits"),
}


@pytest.mark.parametrize("name", sorted(OVER_LIMITS))
def test_suite_past_the_input_limits_is_one_line_exit_2(tmp_path, name):
    text, problem = OVER_LIMITS[name]
    path = tmp_path / name
    path.write_text(text)
    home = tmp_path / "home"
    env = {**os.environ, "EVALPIPE_HOME": str(home)}
    for command in ("hash", "snapshot"):
        line = one_line_failure(cli(["suite", command, str(path)], env), 2)
        assert str(path) in line and problem in line
    assert tree(home) == {}


def test_a_large_alias_bomb_is_refused_without_expanding_it(tmp_path):
    from tasks.suites.dataset import SuiteError, load_suite

    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(10))  # 9**10 leaves: unrefused, hours and far more memory than there is
    with pytest.raises(SuiteError, match=r"aliases expand the document to [\d,]+ nodes"):
        load_suite(path)


# --- the database file -----------------------------------------------------------------

RUN = RunSpec(run_id="r-old", suite_version="v" * 64, suite_name="toy", agent="reference",
              agent_fingerprint="f", n=1, ks=[1], seed=0)


def stored_db(home: Path) -> Path:
    Store(home).runs.start(RUN)
    Store(home).runs.finish(RUN.run_id, "completed", None)
    return Store(home).db.path


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 3]


def _scramble(data: bytes) -> bytes:
    # Keep the headers, spoil the blocks: a checksum mismatch, found only when read.
    return data[:12288] + hashlib.sha512(data).digest() * ((len(data) - 12288) // 64)


def _not_duckdb(data: bytes) -> bytes:
    return b"this is not a database\n" * 100


@pytest.mark.parametrize("damage", [_truncate, _scramble, _not_duckdb], ids=lambda f: f.__name__.strip("_"))
def test_damaged_database_is_reported_and_left_alone(tmp_path, damage):
    home = tmp_path / "home"
    path = stored_db(home)
    path.write_bytes(damage(path.read_bytes()))
    before = tree(home)
    env = {**os.environ, "EVALPIPE_HOME": str(home)}
    suite = suite_file(tmp_path / "toy.yaml", 2)
    for args in (["runs", "list"], ["runs", "show", "r-old", "--json"],
                 ["run", str(suite), "--agent", "reference", "--json"]):
        line = one_line_failure(cli(args, env), 3)
        assert f"database {path} is damaged" in line and "move it aside" in line, args
    assert tree(home) == before


def test_locked_database_names_its_holder_after_a_bounded_wait(tmp_path):
    home = tmp_path / "home"
    path = stored_db(home)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('held', flush=True);"
         " time.sleep(600)", str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        env = {**os.environ, "EVALPIPE_HOME": str(home), "EVALPIPE_DB_LOCK_WAIT_S": "1"}
        started = time.monotonic()
        line = one_line_failure(cli(["runs", "list"], env), 3)
        waited = time.monotonic() - started
        assert f"database {path} is locked by PID {holder.pid} ({sys.executable} -c import duckdb" in line
        assert "gave up after 1 s" in line and "EVALPIPE_DB_LOCK_WAIT_S" in line
        line = one_line_failure(cli(["runs", "list"], {**env, "EVALPIPE_DB_LOCK_WAIT_S": "soon"}), 2)
        assert "EVALPIPE_DB_LOCK_WAIT_S='soon'" in line
    finally:
        holder.kill()
        holder.wait()
    print(f"locked database refused after {waited:.1f} s (wait 1 s, including interpreter start)")
    proc = cli(["runs", "list", "--json"], env)
    assert proc.returncode == 0 and [r["run_id"] for r in json.loads(proc.stdout)] == ["r-old"]


def test_older_database_files_gain_the_owner_columns(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    con = duckdb.connect(str(Store(home).db.path))
    con.execute("CREATE TABLE runs (run_id VARCHAR PRIMARY KEY, suite_version VARCHAR, suite_name VARCHAR,"
                " agent VARCHAR, agent_fingerprint VARCHAR, n INTEGER, ks INTEGER[], seed BIGINT, status VARCHAR,"
                " started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, flow_run_id VARCHAR, config JSON, summary JSON)")
    con.execute("INSERT INTO runs (run_id, status, started_at) VALUES ('r-1', 'completed', now())")
    con.close()
    assert [r["status"] for r in Store(home).runs.list()] == ["completed"]
    Store(home).runs.start(RUN.model_copy(update={"run_id": "r-2"}))
    assert Store(home).runs.get("r-2")["pid"] == os.getpid()
    assert {r["run_id"]: r["status"] for r in Store(home).runs.list()} == {"r-1": "completed", "r-2": "running"}


# --- who owns a run ----------------------------------------------------------------------

def test_a_run_owner_is_gone_when_its_pid_ends_or_is_reused():
    from storage import process

    me = process.current()
    assert not process.gone(me)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process.gone(process.Owner(child.pid, me.host, me.started))
    # Our own pid, but started at another time: a reused pid, so the owner is gone.
    assert process.gone(process.Owner(me.pid, me.host, "another-boot:1"))
    # Another host's processes cannot be seen from here: never called gone.
    assert not process.gone(process.Owner(child.pid, "elsewhere-" + socket.gethostname(), None))


def test_killed_run_reads_interrupted_and_resumes(prefect_harness, tmp_path):
    home = tmp_path / "home"
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "EVALPIPE_HOME": str(home), "PREFECT_API_URL": prefect_harness,
           "EVALPIPE_TEST_SLEEP": "0.1", "EVALPIPE_TEST_CALLS": str(calls), "PYTHONPATH": str(ROOT)}
    args = ["run", str(suite_file(tmp_path / "toy.yaml", 20)), "--agent", f"python:{AGENTS}:slow",
            "--batch-size", "1", "--workers", "2", "--agent-concurrency", "2", "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while (not calls.exists() or len(calls.read_text().split()) < 8) and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    # What the killed process left, read and resumed in this one (support.cli.in_process).
    listed = json.loads(in_process(["runs", "list", "--json"], env).stdout)
    assert [r["status"] for r in listed] == ["interrupted"]
    killed = listed[0]["run_id"]
    shown = in_process(["runs", "show", killed, "--json"], env)
    assert shown.returncode == 0 and json.loads(shown.stdout)["status"] == "interrupted"
    assert killed in in_process(["runs", "list"], env).stdout.split("interrupted")[0]

    proc = in_process(args, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads(proc.stdout)
    assert resumed["cached_samples"] > 0 and resumed["samples"] == 20
    # Starting the new run stored the verdict, so other readers (SQL, a dashboard) see it.
    con = duckdb.connect(str(Store(home).db.path), read_only=True)
    assert con.execute("SELECT status FROM runs WHERE run_id = ?", [killed]).fetchone() == ("interrupted",)
    con.close()


# --- a full disk -------------------------------------------------------------------------

BIG_AGENT = '''
import os


def big(inputs, ctx):
    return "yes " + os.urandom(100_000).hex()
'''


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs: room for the database and a few samples, not for a whole run."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_disk_full_keeps_what_was_stored(prefect_harness, tmp_path, small_disk):
    home = small_disk / "home"
    (tmp_path / "bigagent.py").write_text(BIG_AGENT)
    env = {**os.environ, "EVALPIPE_HOME": str(home), "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}
    args = ["run", str(suite_file(tmp_path / "toy.yaml", 30)), "--agent", f"python:{tmp_path}/bigagent.py:big",
            "--batch-size", "1", "--workers", "1", "--json"]
    line = one_line_failure(cli(args, env), 3)
    assert line.startswith(f"evalpipe: disk full writing {home}") and "what was stored before is kept" in line

    (run,) = json.loads(in_process(["runs", "list", "--json"], env).stdout)
    assert run["status"] in ("failed", "interrupted")
    # What was kept: the samples stored, and the outputs logged as the agent returned them
    # (docs/storage.md), which take the disk's room first.
    con = duckdb.connect(str(Store(home).db.path), read_only=True)
    kept = {key for (key,) in con.execute("SELECT output_key FROM samples UNION SELECT output_key FROM outputs").fetchall()}
    con.close()
    kept |= {r["output_key"] for path in (home / "spool").rglob("*.log") for r in read_log(path)}
    assert 0 < len(kept) < 30

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    proc = in_process(args, env)  # the resume
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["cached_samples"] == len(kept)


def test_a_checkpoint_that_finds_the_disk_full_reads_disk_full_and_loses_nothing(small_disk):
    """Rows committed to the write-ahead log, then no room for the checkpoint that giving the
    file back makes: DuckDB names the cause on its message's second line."""
    home = small_disk / "home"
    store = Store(home)
    filler = small_disk / "filler"
    with pytest.raises(PlatformError, match=r"^disk full writing .*what was stored before is kept"):
        with store.db.connect() as con:
            con.execute("CREATE TABLE kept AS SELECT range AS n FROM range(50000)")
            with filler.open("wb") as out, contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
    filler.unlink()
    with store.db.connect(read_only=True) as con:
        assert con.execute("SELECT count(*), sum(n) FROM kept").fetchall() == [(50000, sum(range(50000)))]


def test_disk_full_snapshot_is_one_line_and_leaves_no_part(tmp_path, small_disk):
    home = small_disk / "home"
    (small_disk / "filler").write_bytes(b"\0" * (3 * 2**20 - 64 * 2**10))
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "grader": {"kind": "exact"}, "reference": os.urandom(20_000).hex()})
                            + "\n" for i in range(30)))
    env = {**os.environ, "EVALPIPE_HOME": str(home)}
    line = one_line_failure(cli(["suite", "snapshot", str(path)], env), 3)
    assert line.startswith(f"evalpipe: disk full writing {home / 'snapshots'}")
    assert tree(home) == {}
