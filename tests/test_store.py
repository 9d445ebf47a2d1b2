"""`Store(home)`: the one object through which an evalpipe home's data is reached. Two stores
on two homes in one process keep their data apart, and `evaluate(home=...)` keeps its run in
the home it is given, hidden from the sandbox as EVALPIPE_HOME is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evalpipe import evaluate
from flows.cli import main
from storage.store import Store
from tasks.models import InputError

CASES = [
    {"id": "add", "inputs": {"a": 2, "b": 3}, "reference": "5", "grader": {"kind": "exact"}},
    {"id": "sub", "inputs": {"a": 2, "b": 1}, "reference": "1", "grader": {"kind": "exact"}},
]


def adder(inputs, ctx):
    return str(inputs["a"] + inputs["b"])


def test_two_stores_in_one_process_keep_their_runs_apart(home, tmp_path, capsys, monkeypatch):
    """A run kept through one store is not found through another until it is exported from
    the one and imported into the other; the default home (EVALPIPE_HOME) sees neither."""
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    first = evaluate(CASES, adder, name="arith", n=2, home=a.home)
    second = evaluate(CASES[:1], adder, name="add", n=1, home=b.home)

    assert [r["run_id"] for r in a.runs.list()] == [first.run_id]
    assert [r["run_id"] for r in b.runs.list()] == [second.run_id]
    assert a.runs.find(first.run_id[:10])["summary"] == first.to_json()
    with pytest.raises(InputError, match=f"no such run in {b.db.path}"):
        b.runs.find(first.run_id)
    assert b.snapshots.has(b.snapshots.read(second.suite_version))
    assert not a.snapshots.path(second.suite_version).exists()
    assert not Store(home).db.path.exists()  # nothing reached EVALPIPE_HOME
    assert main(["runs", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []

    out = tmp_path / "first.tar"
    assert a.exports.export_run(first.run_id, out)["samples"] == 4
    assert b.exports.import_run(out)["imported"] is True
    assert {r["run_id"] for r in b.runs.list()} == {first.run_id, second.run_id}
    assert b.runs.find(first.run_id)["summary"] == first.to_json()
    assert b.samples.of_run(first.run_id).num_rows == 4
    assert [r["run_id"] for r in a.runs.list()] == [first.run_id]  # the export left `a` as it was
    with pytest.raises(InputError, match="no such run"):
        a.runs.find(second.run_id)
    # Each command builds its store when it runs: the CLI follows EVALPIPE_HOME from one to the other.
    for store, expected in ((a, {first.run_id}), (b, {first.run_id, second.run_id})):
        monkeypatch.setenv("EVALPIPE_HOME", str(store.home))
        assert main(["runs", "list", "--json"]) == 0
        assert {r["run_id"] for r in json.loads(capsys.readouterr().out)} == expected


def test_a_store_names_one_home_wherever_it_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EVALPIPE_HOME", "elsewhere")
    assert Store("rel").home == tmp_path / "rel"  # absolute: a task in another process means the same
    assert Store.default() == Store(tmp_path / "elsewhere")
    assert Store.default().db.path == tmp_path / "elsewhere/evalpipe.duckdb"


def test_a_home_given_to_evaluate_is_hidden_from_the_sandbox(home, tmp_path):
    from tasks.sandbox.limits import Limits
    from tasks.sandbox.namespace import bwrap_argv

    named = tmp_path / "named-home"

    def tmpfs_over(argv: list[str]) -> set[str]:
        return {argv[i + 1] for i, flag in enumerate(argv) if flag == "--tmpfs"}

    home.mkdir()
    assert str(named) not in tmpfs_over(bwrap_argv(Limits(), None, False))
    evaluate(CASES, adder, name="arith", n=1, home=named)
    assert {str(named), str(home)} <= tmpfs_over(bwrap_argv(Limits(), None, False))


def test_a_store_on_a_home_with_nothing_yet_reads_as_empty(tmp_path: Path):
    store = Store(tmp_path / "new")
    assert store.runs.list() == [] and store.runs.latest_completed_of_suite("0" * 64) is None
    with pytest.raises(InputError, match="no such run"):
        store.runs.find("r")
    assert store.snapshots.find("abcdef12") is None


def test_a_run_is_found_by_any_unique_part_of_its_id(tmp_path: Path, capsys, monkeypatch):
    """Issue 47: the random suffix a terminal shows (`889c34`) finds its run as a prefix does;
    a part two runs share is exit 2, one line naming both."""
    from tasks.run import RunSpec

    store = Store(tmp_path / "home")
    ids = ["20261206-071512-889c34", "20261206-071530-1a2b3c", "20261207-090000-c34d12"]
    for run_id in ids:
        with store.runs.recorded(RunSpec(run_id=run_id, suite_version="v", suite_name="s", agent="reference",
                                         agent_fingerprint="f", n=1, ks=[1], seed=0)):
            pass
    assert store.runs.find("889c34")["run_id"] == ids[0]
    assert store.runs.find("071530")["run_id"] == ids[1]
    assert store.runs.find("20261207")["run_id"] == ids[2]
    assert store.runs.find(ids[1])["run_id"] == ids[1]
    with pytest.raises(InputError, match=f"'c34' is ambiguous, it could be {ids[0]}, {ids[2]}: give more"):
        store.runs.find("c34")
    with pytest.raises(InputError, match=f"it could be {ids[0]}, {ids[1]}:"):
        store.runs.find("20261206-0715")
    with pytest.raises(InputError, match="no such run"):
        store.runs.find("ffffff")
    monkeypatch.setenv("EVALPIPE_HOME", str(store.home))
    assert main(["runs", "show", "1a2b3c", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_id"] == ids[1]
    assert main(["runs", "show", "c34", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ambiguous" in err and ids[0] in err and ids[2] in err


@pytest.mark.parametrize(("stopping", "status"), [(False, "failed"), (True, "interrupted")])
def test_an_error_a_stop_surfaced_as_records_the_run_interrupted(tmp_path: Path, stopping: bool, status: str):
    """A signal that reaches a library first (DuckDB, Dask) can come out as an ordinary error:
    once the process was asked to stop, the run is `interrupted` (resumable), not `failed`."""
    from tasks.run import RunSpec

    store = Store(tmp_path / "home")
    spec = RunSpec(suite_version="v", suite_name="s", agent="reference", agent_fingerprint="f", n=1, ks=[1], seed=0)
    with pytest.raises(RuntimeError), store.runs.recorded(spec, lambda: stopping):
        raise RuntimeError("Query interrupted")
    assert store.runs.get(spec.run_id)["status"] == status


def test_a_homes_file_is_shared_by_threads_and_released_to_other_processes_after_each_use(tmp_path: Path):
    """A process keeps one DuckDB instance and attaches a home's file to it per use
    (`storage.db`): threads share the file, a writer waits for the process's readers, two
    homes are apart, and between uses another process can open the file."""
    import subprocess
    import sys
    import threading

    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    for store, value in ((a, 1), (b, 2)):
        with store.db.connect() as con:
            con.execute("CREATE TABLE t (x INTEGER)")
            con.execute("INSERT INTO t VALUES (?)", [value])
    reading, release, wrote = threading.Event(), threading.Event(), threading.Event()

    def read() -> None:
        with a.db.connect(read_only=True) as con:
            reading.set()
            release.wait(10)
            assert con.execute("SELECT x FROM t").fetchall() == [(1,)]

    def write() -> None:
        with a.db.connect() as con:
            con.execute("INSERT INTO t VALUES (3)")
        wrote.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert reading.wait(10)
    with a.db.connect(read_only=True) as con:  # a second reader shares the attachment
        assert con.execute("SELECT count(*) FROM t").fetchone() == (1,)
    writer = threading.Thread(target=write)
    writer.start()
    assert not wrote.wait(0.5), "a writer went in beside a read-only attachment"
    with b.db.connect() as con:  # the other home is its own file
        assert con.execute("SELECT x FROM t").fetchall() == [(2,)]
    release.set()
    reader.join()
    writer.join()
    assert wrote.is_set()
    read_elsewhere = subprocess.run(
        [sys.executable, "-c", "import duckdb, sys; print(duckdb.connect(sys.argv[1], read_only=True)"
         ".execute('SELECT sum(x) FROM t').fetchone()[0])", str(a.db.path)],
        capture_output=True, text=True, timeout=60)
    assert read_elsewhere.stdout.strip() == "4", read_elsewhere.stderr
