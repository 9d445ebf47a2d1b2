"""Warm by default (issue 22): with no Prefect API configured, the first flow-running command
starts evalpipe's managed server in the background and says so once; later commands reuse
it; two first commands at once start one; a kill -9 of a run leaves it healthy and the run
`interrupted`; it stops itself when unused and leaves no process or record behind; under CI
a command starts none. And every task runner records its task runs on the server that holds
the flow run, the managed one and the temporary one alike, with a clean stderr.

One managed server for the module (on a home of its own, stopped in teardown), one
temporary start per temporary run; real processes throughout."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
from support.cli import (
    EVALPIPE,
    ROOT,
    client_env,
    evalpipe,
    processes_with,
    run_args,
    wait_gone,
    write_work,
)
from support.prefect_db import block_types
from support.task_runs import kind, task_runs

from server import db_template
from server.managed import stop_managed

IDLE_S = 20  # long enough that the module's commands keep the server, short enough to wait out
STARTED = "evalpipe: started a local Prefect server"
RUNNERS = ("threads", "processes", "dask")
# Dask's own noise when a LocalCluster closes under load (a worker's heartbeat meets the closed
# scheduler); not the API's business, and left to the Dask runner's owner.
DASK_CLOSING = "distributed.worker - ERROR - Failed to communicate with scheduler during heartbeat"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = write_work(tmp_path_factory.mktemp("warm"))
    cases = [{"id": f"c{i}", "inputs": {}, "reference": "yes", "grader": {"kind": "exact"}} for i in range(6)]
    (work / "six.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    return work


def managed_env(work: Path, home: Path, **extra: str) -> dict[str, str]:
    return client_env(work, home, EVALPIPE_SERVER="managed", EVALPIPE_SERVER_IDLE_S=str(IDLE_S), **extra)


def server_processes(home: Path) -> list[int]:
    """The `prefect server start` processes started for `home`."""
    return [pid for pid in processes_with("EVALPIPE_HOME", str(home))
            if b"server\0start" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def status(env: dict[str, str]) -> dict:
    return json.loads(evalpipe("server", "status", "--json", env=env).stdout)


@pytest.fixture(scope="module")
def warm(work: Path) -> Iterator[tuple[Path, dict[str, str], list[subprocess.CompletedProcess]]]:
    """Two first runs at once on a fresh home (no server yet)."""
    home = work / "home-warm"
    env = managed_env(work, home)
    try:
        procs = [subprocess.Popen([str(EVALPIPE), *run_args(work, "--json")], cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        done = [subprocess.CompletedProcess(p.args, p.wait(600), *p.communicate()) for p in procs]
        yield home, env, done
    finally:
        stop_managed(home)


@pytest.mark.slow
def test_two_first_runs_at_once_start_one_server_and_both_succeed(warm) -> None:
    home, env, done = warm
    assert [p.returncode for p in done] == [0, 0], [p.stderr for p in done]
    started = [line for p in done for line in p.stderr.splitlines() if line.startswith(STARTED)]
    doc = status(env)
    assert doc["running"] and doc["healthy"]
    # One line, once, with the UI's URL and how to stop it.
    assert len(started) == 1 and doc["url"] in started[0] and "evalpipe server stop" in started[0], started
    assert server_processes(home) == [doc["pid"]]
    for p in done:  # both runs reported to it
        flow_run_id = json.loads(p.stdout)["flow_run_id"]
        assert _task_runs(doc, flow_run_id, "snapshot") == 1


@pytest.mark.slow
def test_a_later_run_reuses_the_server(warm, work: Path) -> None:
    home, env, _ = warm
    before = status(env)
    proc = evalpipe(*run_args(work), env=env)
    assert proc.returncode == 0, proc.stderr
    assert STARTED not in proc.stderr
    assert f"evalpipe: flow run {before['ui_url']}/runs/flow-run/" in proc.stderr
    after = status(env)
    assert (after["pid"], after["url"]) == (before["pid"], before["url"])
    assert server_processes(home) == [before["pid"]]


@pytest.mark.slow
def test_kill_9_of_a_run_leaves_the_server_healthy_and_the_run_interrupted(warm, work: Path) -> None:
    home, env, _ = warm
    before = status(env)
    mark = work / "slow-agent-started"
    run = subprocess.Popen([str(EVALPIPE), *run_args(work, "--seed", "9")], cwd=ROOT, env=env | {"MARK": str(mark)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not mark.exists():
            assert run.poll() is None, run.stderr.read()
            assert time.monotonic() < deadline, "the run never reached the agent"
            time.sleep(0.2)
        run.send_signal(signal.SIGKILL)
        run.wait()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    after = status(env)
    assert (after["pid"], after["healthy"]) == (before["pid"], True)
    runs = json.loads(evalpipe("runs", "list", "--json", env=env).stdout)
    assert runs[0]["status"] == "interrupted"


@pytest.mark.slow
def test_every_runner_records_its_task_runs_on_the_managed_server(warm, work: Path) -> None:
    _, env, _ = warm
    doc = status(env)
    for seed, runner in enumerate(RUNNERS, start=100):
        flow_run_id = _clean_run(work, env, runner, seed)
        assert _task_runs(doc, flow_run_id, "sample") > 0, runner


@pytest.mark.slow
def test_it_stops_itself_when_unused_and_leaves_nothing_behind(warm) -> None:
    home, env, _ = warm
    pid = status(env)["pid"]  # a request: the idle time counts from here
    assert wait_gone([pid], IDLE_S + 60), "the server outlived its idle time"
    # The watch beside it ends with it; the record goes; no lock file is left.
    assert wait_gone(processes_with("EVALPIPE_HOME", str(home)), 10)
    assert sorted(p.name for p in (home / "server").iterdir()) == ["credentials", "prefect", "server.log"]
    assert status(env)["running"] is False


@pytest.mark.slow
def test_a_server_whose_home_was_deleted_stops_within_seconds(work: Path, tmp_path: Path) -> None:
    """Issue 34 #6: 21 servers of throw-away homes were found idling after an hour of benches.
    Deleting the home stops its server within HOME_CHECK_S, however long its idle time."""
    from server.idle import HOME_CHECK_S

    home = tmp_path / "throw-away"
    env = client_env(work, home, EVALPIPE_SERVER="managed", EVALPIPE_SERVER_IDLE_S="1800")
    try:
        assert evalpipe(*run_args(work), env=env).returncode == 0
        pids = server_processes(home)
        assert pids and status(env)["running"]
        shutil.rmtree(home)
        assert wait_gone(pids, HOME_CHECK_S + 20), "the server outlived its deleted home"
        assert wait_gone(processes_with("EVALPIPE_HOME", str(home)), 10)  # its idle watch too
    finally:
        for pid in server_processes(home):
            os.killpg(pid, signal.SIGKILL)


@pytest.mark.slow
def test_server_start_keeps_a_server_a_command_started(warm, work: Path) -> None:
    home, env, _ = warm
    assert evalpipe(*run_args(work), env=env).returncode == 0  # starts one (the last one idled out)
    watch = [pid for pid in processes_with("EVALPIPE_HOME", str(home))
             if b"server.idle" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(watch) == 1 and status(env)["idle_stop_s"] == IDLE_S
    kept = evalpipe("server", "start", env=env)
    assert kept.returncode == 0 and "already running (kept until stopped)" in kept.stdout
    assert wait_gone(watch, 10), "the idle watch outlived `server start`"
    doc = status(env)
    assert doc["running"] and doc["idle_stop_s"] is None


@pytest.mark.slow
def test_every_runner_records_its_task_runs_on_the_temporary_server(work: Path) -> None:
    """The three runs at once, each on a Prefect home of its own: each temporary server ended
    with its run, and its database holds what it recorded. The threads run is CI's (`CI=true`,
    no server setting): CI keeps no server, it starts the run's temporary one, on a fresh
    Prefect home seeded from the user's template (server/db_template.py; `make` builds it)."""
    template = db_template.ready(os.environ)
    assert template is not None
    built = template.stat().st_mtime_ns
    homes = {runner: work / f"prefect-temporary-{runner}" for runner in RUNNERS}
    envs = {runner: client_env(work, work / f"home-temporary-{runner}", PREFECT_HOME=str(homes[runner]))
            for runner in RUNNERS}
    ci_home = work / "home-ci"
    envs["threads"] = {k: v for k, v in client_env(work, ci_home, CI="true", PREFECT_HOME=str(homes["threads"])).items()
                       if k != "EVALPIPE_SERVER"}
    # CI's run prints for a person (what it started is said only there): each home's database
    # holds one flow run, the run's.
    procs = {runner: _start_clean_run(work, envs[runner], runner, seed, json_mode=runner != "threads")
             for seed, runner in enumerate(RUNNERS, start=200)}
    recorded = {}
    try:
        for runner, proc in procs.items():
            _, stderr = _finished(proc)  # the run ended, and its server with it
            if runner == "threads":
                assert STARTED not in stderr and "started a temporary Prefect server" in stderr
            log = (homes[runner] / "evalpipe-ephemeral.log").read_text()
            assert f"{db_template.SEEDED} {template}" in log and "built the Prefect database template" not in log
            # The copy's block types were not registered again on the server's first start.
            assert block_types(homes[runner] / "prefect.db") == block_types(template)
            with closing(sqlite3.connect(homes[runner] / "prefect.db")) as db:
                (flow_run_id,), = db.execute("SELECT id FROM flow_run").fetchall()
                (recorded[runner],), = db.execute("SELECT count(*) FROM task_run WHERE flow_run_id = ?"
                                                  " AND (name = 'sample' OR name LIKE 'sample %')", (flow_run_id,))
    finally:  # one run failed: the others (and their servers) end with the test
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert all(recorded.values()), recorded
    assert template.stat().st_mtime_ns == built  # seeded three homes, built by none
    assert not (ci_home / "server").exists()
    assert processes_with("EVALPIPE_HOME", str(ci_home)) == []


@pytest.mark.parametrize(("name", "value"), [("EVALPIPE_SERVER", "sometimes"), ("EVALPIPE_SERVER_IDLE_S", "soon")])
def test_a_bad_server_setting_is_bad_input(work: Path, name: str, value: str) -> None:
    proc = evalpipe(*run_args(work), env=managed_env(work, work / "home-bad") | {name: value})
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"evalpipe: {name}={value!r}: expected") and len(proc.stderr.splitlines()) == 1


def _clean_run(work: Path, env: dict[str, str], runner: str, seed: int) -> str:
    """A run drawing fresh samples (a seed of its own) on `runner`, whose stderr holds no
    traceback; its flow run's id."""
    return json.loads(_finished(_start_clean_run(work, env, runner, seed))[0])["flow_run_id"]


def _start_clean_run(work: Path, env: dict[str, str], runner: str, seed: int, json_mode: bool = True) -> subprocess.Popen:
    # One worker: a worker process of its own reporting is what is checked, and each one more
    # costs its imports (a Dask worker's ~4.5 s of CPU, read from /proc in a full run).
    return subprocess.Popen([str(EVALPIPE), "run", str(work / "six.jsonl"), "--agent", f"python:{work / 'agent.py'}:answer",
                             "-n", "2", "--workers", "1", "--runner", runner, "--seed", str(seed),
                             *(["--json"] if json_mode else [])],
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finished(proc: subprocess.Popen) -> tuple[str, str]:
    """A clean run's stdout and stderr, once it ended."""
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    # One record a log line (Prefect's and Dask's start with their time) or evalpipe line.
    records = re.split(r"\n(?=\d\d:\d\d:\d\d\.\d+ \||\d{4}-\d\d-\d\d |evalpipe: )", stderr)
    bad = [r for r in records if ("Traceback" in r or "FOREIGN KEY" in r) and DASK_CLOSING not in r]
    assert bad == [], bad[0][-3000:]
    return stdout, stderr


def _task_runs(doc: dict, flow_run_id: str, name: str) -> int:
    """How many of the flow run's task runs named `name` the server at doc["api_url"] holds."""
    from prefect.client.orchestration import SyncPrefectClient

    auth = Path(doc["credentials"]).read_text().strip() if doc["credentials"] else None
    with SyncPrefectClient(doc["api_url"], auth_string=auth) as client:
        return sum(kind(r) == name for r in task_runs(client, flow_run_id, {name}))


def test_idle_watch_reads_use_from_the_tcp_table(tmp_path: Path) -> None:
    """An open connection is use now; one in TIME_WAIT is use as long ago as it closed;
    other ports and the listening socket are not use."""
    from server.idle import last_use_age

    table = tmp_path / "tcp"
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    tick = os.sysconf("SC_CLK_TCK")

    def row(local: str, remote: str, state: str, when: int = 0) -> str:
        return f"   0: {local} {remote} {state} 00000000:00000000 03:{when:08X} 00000000  0 0 0\n"

    listen = row("0100007F:1068", "00000000:0000", "0A")
    closed_20s_ago = row("0100007F:1068", "0100007F:A332", "06", 40 * tick)
    other_port = row("0100007F:1069", "0100007F:A333", "01")
    table.write_text(header + listen + other_port)
    assert last_use_age(4200, (str(table),)) is None
    table.write_text(header + listen + closed_20s_ago + other_port)
    assert last_use_age(4200, (str(table),)) == pytest.approx(20.0)
    table.write_text(header + listen + closed_20s_ago + row("0100007F:B000", "0100007F:1068", "01"))
    assert last_use_age(4200, (str(table),)) == 0.0


def test_the_idle_stop_never_stops_a_server_under_a_command(tmp_path: Path) -> None:
    """A command holds the server (the use lock, shared) for as long as it runs; the idle
    stop gives way to it, whatever the TCP table says, and to a start or stop in progress."""
    import fcntl

    from server.managed import _state_lock, _use_lock, stop_if_unused

    directory = tmp_path / "server"
    (directory / "prefect").mkdir(parents=True)
    # A process that passes for the server: its command line names prefect, it leads its group.
    # The interpreter itself: a `python3` shim (pyenv) execs several times, and a lookup
    # caught between two execs finds no prefect in the command line.
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "prefect"], start_new_session=True)
    try:
        # Popen returns once the exec is past its point of no return, before the kernel has set
        # the new command line: under load /proc reads it empty for a while (298 of 400 starts
        # with three busy loops beside them on 2 cores).
        cmdline = Path(f"/proc/{stand_in.pid}/cmdline")
        deadline = time.monotonic() + 10
        while b"prefect" not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        (directory / "server.json").write_text(json.dumps({"pid": stand_in.pid, "port": 1}))
        asked: list[bool] = []

        def used_meanwhile() -> bool:
            asked.append(True)
            return True

        with _use_lock(directory, fcntl.LOCK_SH):  # a command runs
            assert stop_if_unused(directory, stand_in.pid, used_meanwhile) is False
        with _state_lock(directory):  # a start or stop in progress
            assert stop_if_unused(directory, stand_in.pid, used_meanwhile) is False
        assert asked == []  # it gave way before looking
        assert stop_if_unused(directory, stand_in.pid, used_meanwhile) is False and asked == [True]
        assert stand_in.poll() is None and (directory / "server.json").exists()
        assert stop_if_unused(directory, stand_in.pid, lambda: False) is True
        assert stand_in.wait(10) is not None and not (directory / "server.json").exists()
    finally:
        stand_in.kill()
        stand_in.wait()


def test_prefect_is_imported_beside_the_server_start_only_when_nothing_can_name_an_api(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.prefect_api import _may_name_an_api

    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.chdir(tmp_path)
    assert _may_name_an_api() is False
    (tmp_path / "prefect-home").mkdir()
    (tmp_path / "prefect-home" / "profiles.toml").write_text(
        'active = "work"\n[profiles.work]\nPREFECT_API_URL = "http://127.0.0.1:4300/api"\n')
    assert _may_name_an_api() is True
    (tmp_path / "prefect-home" / "profiles.toml").unlink()
    (tmp_path / "pyproject.toml").write_text('[tool.prefect.api]\nurl = "http://127.0.0.1:4300/api"\n')
    assert _may_name_an_api() is True
    (tmp_path / "pyproject.toml").unlink()
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4300/api")
    assert _may_name_an_api() is True
