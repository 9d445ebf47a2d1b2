"""The local server evalpipe manages, and Prefect's platform failures, on real processes:
`evalpipe server start|status|stop` as a user types them, a run that reports to the managed
server, a stale pid record, an unreachable API and an ephemeral start that times out (exit 3,
one line), and a `kill -9` of a run whose ephemeral server must not outlive it.

Each Prefect server start costs 10-60 s on a loaded 2-core machine: one managed server for the
module, one ephemeral start for the orphan case; servers are always stopped in teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.browser import CHROMIUM, Browser
from support.cli import (
    EVALPIPE,
    ROOT,
    alive,
    client_env,
    dead_pid,
    evalpipe,
    processes_with,
    run_args,
    wait_gone,
    write_work,
)
from support.waiting import wait_until

from server.local import LAUNCHER, free_port, healthy, start_timeout, wait_healthy
from server.managed import stop_managed
from tasks.models import PlatformError


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_work(tmp_path_factory.mktemp("server"))


# --- the managed server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def managed(work: Path) -> Iterator[tuple[dict, dict[str, str]]]:
    """`evalpipe server start` on a free port, over a stale record of a server long gone."""
    home = work / "home-managed"
    (home / "server").mkdir(parents=True)
    (home / "server" / "server.json").write_text(json.dumps({"pid": dead_pid(), "port": 1}))
    env = client_env(work, home)
    port = free_port()
    try:
        proc = evalpipe("server", "start", "--port", str(port), "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        yield doc, env
    finally:
        stop_managed(home)


@pytest.mark.slow
def test_start_reports_where_the_server_is(managed: tuple[dict, dict[str, str]]) -> None:
    doc, env = managed
    assert doc["started"] is True
    assert doc["url"] == f"http://127.0.0.1:{doc['port']}" and doc["api_url"] == doc["url"] + "/api"
    assert doc["ui_url"] == doc["url"] + "/v2"
    assert alive(doc["pid"])
    # Prefect's own `server start`, serving its app through server/busy_retry.py.
    command = Path(f"/proc/{doc['pid']}/cmdline").read_bytes().split(b"\0")
    assert command[1:6] == [b"-P", b"-m", LAUNCHER.encode(), b"server", b"start"], command
    home = Path(env["EVALPIPE_HOME"])
    assert Path(doc["log"]).parent == home / "server" and Path(doc["log"]).is_file()
    # The server's Prefect database is its own, under EVALPIPE_HOME, not the user's PREFECT_HOME.
    assert list((home / "server" / "prefect").glob("*.db"))
    assert not list(Path(env["PREFECT_HOME"]).glob("*.db"))
    # The UI asks the API on the server's own port, not Prefect's default 4200.
    ui_settings = httpx.get(f"{doc['url']}/ui-settings", timeout=30).json()
    assert ui_settings["api_url"] == doc["api_url"]


def basic_auth(doc: dict) -> tuple[str, str]:
    user, _, password = Path(doc["credentials"]).read_text().strip().partition(":")
    return user, password


@pytest.mark.slow
def test_the_managed_server_wants_its_credentials(managed: tuple[dict, dict[str, str]]) -> None:
    doc, env = managed
    credentials = Path(doc["credentials"])
    assert credentials.parent == Path(env["EVALPIPE_HOME"]) / "server"
    assert credentials.stat().st_mode & 0o777 == 0o600
    url = f"{doc['api_url']}/deployments/filter"
    # One unauthenticated POST used to be enough to start a run of any code.
    assert httpx.post(url, json={}, timeout=30).status_code == 401
    assert httpx.post(url, json={}, auth=("evalpipe", "guess"), timeout=30).status_code == 401
    assert httpx.post(url, json={}, auth=basic_auth(doc), timeout=30).status_code == 200
    assert httpx.get(f"{doc['api_url']}/health", timeout=30).status_code == 200  # probes stay open
    # The UI knows to ask for them; another origin's page gets no CORS grant.
    assert httpx.get(f"{doc['url']}/ui-settings", timeout=30).json()["auth"] == "BASIC"
    preflight = httpx.options(url, headers={"Origin": "http://attacker.example",
                                            "Access-Control-Request-Method": "POST"}, timeout=30)
    assert preflight.headers.get("access-control-allow-origin") in (None, doc["url"])


@pytest.mark.slow
def test_another_homes_server_on_the_port_is_not_taken_for_ours(managed: tuple[dict, dict[str, str]]) -> None:
    """Two homes' first runs at once both saw 4200 free; the one whose server lost the port
    found the other's answering its health check and sent its runs there (401s). A server is
    ours only if it takes our credentials."""
    doc, _ = managed
    ours = Path(doc["credentials"]).read_text().strip()
    assert healthy(doc["api_url"]) and healthy(doc["api_url"], ours)
    assert not healthy(doc["api_url"], "evalpipe:another-homes-credentials")
    # Waiting on it for a server process that then exits (its port was taken) fails, naming the exit.
    lost = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    with pytest.raises(PlatformError, match="exited"):
        wait_healthy(doc["api_url"], lost, 30, auth="evalpipe:another-homes-credentials")


@pytest.mark.slow
def test_second_start_says_so_and_exits_0(managed: tuple[dict, dict[str, str]]) -> None:
    doc, env = managed
    again = evalpipe("server", "start", env=env)
    assert again.returncode == 0
    assert "already running" in again.stdout and doc["url"] in again.stdout
    status = json.loads(evalpipe("server", "status", "--json", env=env).stdout)
    assert (status["running"], status["healthy"], status["pid"], status["port"]) == (True, True, doc["pid"], doc["port"])


@pytest.mark.slow
def test_server_env_prints_the_exports_a_deploying_user_needs(managed: tuple[dict, dict[str, str]]) -> None:
    """Issue 47: `export PREFECT_API_URL=...:4200/api` from the docs met a 401. The exports
    `server env` prints, evaluated by a shell, let Prefect's own client in."""
    doc, env = managed
    proc = evalpipe("server", "env", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"export PREFECT_API_URL={doc['api_url']}"
    check = ("import asyncio; from prefect.client.orchestration import get_client\n"
             "async def main():\n    async with get_client() as c: print(len(await c.read_work_pools()))\n"
             "asyncio.run(main())")
    clean = {k: v for k, v in env.items() if not k.startswith("PREFECT_API")}
    shell = subprocess.run(["bash", "-c", f'eval "$({EVALPIPE} server env)" && {sys.executable} -c "$CHECK"'],
                           env={**clean, "CHECK": check}, capture_output=True, text=True, timeout=120)
    assert shell.returncode == 0 and shell.stdout.strip().isdigit(), shell.stderr[-2000:]
    as_json = json.loads(evalpipe("server", "env", "--json", env=env).stdout)
    assert as_json == {"PREFECT_API_URL": doc["api_url"],
                       "PREFECT_API_AUTH_STRING": Path(doc["credentials"]).read_text().strip()}


def test_server_env_without_a_server_is_one_line_and_exit_3(work: Path) -> None:
    proc = evalpipe("server", "env", env=client_env(work, work / "home-none"))
    assert proc.returncode == 3 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "evalpipe: no evalpipe server running for this EVALPIPE_HOME: start it with `evalpipe server start`"]


@pytest.mark.slow
def test_a_run_reports_to_the_managed_server(managed: tuple[dict, dict[str, str]], work: Path) -> None:
    doc, env = managed
    proc = evalpipe(*run_args(work), env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("run ")
    # Off a terminal, progress lines come too; beside them only the flow run's URL (no hint).
    lines = [line for line in proc.stderr.splitlines() if " samples graded " not in line]
    assert len(lines) == 1 and lines[0].startswith(f"evalpipe: flow run {doc['ui_url']}/runs/flow-run/"), proc.stderr
    flow_run_id = lines[0].rsplit("/", 1)[1]
    flow_run = httpx.get(f"{doc['api_url']}/flow_runs/{flow_run_id}", auth=basic_auth(doc), timeout=30).json()
    assert flow_run["state"]["type"] == "COMPLETED"

    as_json = evalpipe(*run_args(work, "--json"), env=env)
    assert as_json.returncode == 0 and as_json.stderr == ""
    summary = json.loads(as_json.stdout)
    flow_run = f"{doc['api_url']}/flow_runs/{summary['flow_run_id']}"
    assert httpx.get(flow_run, auth=basic_auth(doc), timeout=30).status_code == 200


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed")
def test_the_printed_link_opens_on_a_plain_login_and_the_credentials_get_in(
        managed: tuple[dict, dict[str, str]], work: Path, tmp_path: Path) -> None:
    """What a user meets following the flow run link a run prints: the login form and nothing
    else (the classic UI's link greeted them with "Authentication failed" and "Oops" before
    they typed), "Invalid credentials" for a wrong password, the flow run once the right ones
    are in."""
    doc, env = managed
    proc = evalpipe(*run_args(work), env=env)
    assert proc.returncode == 0, proc.stderr
    link = next(line.split(" ")[-1] for line in proc.stderr.splitlines() if line.startswith("evalpipe: flow run "))
    flow_run = httpx.get(f"{doc['api_url']}/flow_runs/{link.rsplit('/', 1)[1]}", auth=basic_auth(doc),
                         timeout=30).json()
    (tmp_path / "profile").mkdir()
    browser = Browser(tmp_path / "profile", tmp_path / "chromium.log")
    try:
        browser.open(link)
        browser.wait_for(_LOGIN_SETTLED, timeout_s=60)
        before = browser.evaluate("document.body.innerText")
        _log_in(browser, "evalpipe:wrong")
        wrong = browser.wait_for("document.body.innerText.includes('Invalid credentials') && document.body.innerText")
        _log_in(browser, ":".join(basic_auth(doc)))
        inside = browser.wait_for(f"document.body.innerText.includes({json.dumps(flow_run['name'])})"
                                  " && document.body.innerText", timeout_s=60)
        path = browser.evaluate("location.pathname")
    finally:
        browser.close()
    assert [line for line in before.splitlines() if line.strip()] == ["Login", "Login"], before
    assert "Oops" not in wrong and "Something went wrong" not in wrong
    assert path == f"/v2/runs/flow-run/{flow_run['id']}" and "Login" not in inside.splitlines()


# The login form is up, the page has probed the API (and been refused: 401), and nothing on
# it has changed for a second since: what it shows then is what a user sees before typing.
_LOGIN_SETTLED = """(() => {
    if (!window.__watched) {
        window.__watched = true;
        window.__changed = performance.now();
        new MutationObserver(() => { window.__changed = performance.now(); }).observe(
            document, {subtree: true, childList: true, characterData: true, attributes: true});
    }
    const refused = performance.getEntriesByType('resource')
        .some(r => r.name.includes('/api/') && r.responseStatus === 401);
    return !!document.querySelector('input[type=password]') && refused
        && performance.now() - window.__changed > 1000;
})()"""


def _log_in(browser: Browser, credentials: str) -> None:
    """Type `credentials` into the login form, replacing what is there, and press its button."""
    browser.evaluate("document.querySelector('input[type=password]').select()")
    browser.evaluate("document.querySelector('input[type=password]').focus()")
    browser.send("Input.insertText", text=credentials)
    browser.evaluate("document.querySelector('form button[type=submit]').click()")


@pytest.mark.slow
def test_stop_stops_it(managed: tuple[dict, dict[str, str]]) -> None:
    doc, env = managed
    stopped = evalpipe("server", "stop", "--json", env=env)
    assert stopped.returncode == 0 and json.loads(stopped.stdout)["stopped"] is True
    assert not alive(doc["pid"])
    assert json.loads(evalpipe("server", "status", "--json", env=env).stdout)["running"] is False
    again = evalpipe("server", "stop", env=env)
    assert again.returncode == 0 and "no evalpipe server running" in again.stdout


def test_a_stale_record_is_detected_and_removed(work: Path) -> None:
    home = work / "home-stale"
    record = home / "server" / "server.json"
    record.parent.mkdir(parents=True)
    pid = dead_pid()
    record.write_text(json.dumps({"pid": pid, "port": free_port()}))
    status = json.loads(evalpipe("server", "status", "--json", env=client_env(work, home)).stdout)
    assert (status["running"], status["stale_pid"]) == (False, pid)
    assert not record.exists()


# --- platform failures: exit 3, one line ------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "validate"])
def test_an_unreachable_api_is_one_line_and_exit_3(work: Path, command: str) -> None:
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    env = client_env(work, work / "home-unreachable", PREFECT_API_URL=url)
    args = run_args(work) if command == "run" else ["suite", "validate", str(work / "one.jsonl")]
    proc = evalpipe(*args, "--json", env=env)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert url in proc.stderr and "PREFECT_API_URL" in proc.stderr


@pytest.mark.slow
def test_an_ephemeral_start_timeout_is_one_line_and_exit_3(work: Path) -> None:
    home = work / "home-timeout"
    env = client_env(work, home, EVALPIPE_SERVER_START_TIMEOUT="0.01")
    proc = evalpipe(*run_args(work), env=env)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert "temporary server did not start within" in proc.stderr and "EVALPIPE_SERVER_START_TIMEOUT" in proc.stderr
    assert processes_with("EVALPIPE_HOME", str(home)) == []  # the half-started server is gone
    assert not (home / "server").exists()  # a temporary server keeps nothing in EVALPIPE_HOME


def test_a_first_start_waits_three_times_as_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVALPIPE_SERVER_START_TIMEOUT", "10")
    assert start_timeout(tmp_path) == 30.0  # no database yet: it is created on this start
    (tmp_path / "prefect.db").touch()
    assert start_timeout(tmp_path) == 10.0
    monkeypatch.delenv("EVALPIPE_SERVER_START_TIMEOUT")
    assert start_timeout(tmp_path) == 90.0


def test_a_bad_start_timeout_is_bad_input(work: Path) -> None:
    proc = evalpipe(*run_args(work), env=client_env(work, work / "home-bad", EVALPIPE_SERVER_START_TIMEOUT="soon"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == "evalpipe: EVALPIPE_SERVER_START_TIMEOUT='soon': expected a positive number of seconds"


# --- no orphans -------------------------------------------------------------------------------


def test_the_reaper_kills_a_child_whose_parent_was_killed(tmp_path: Path) -> None:
    script = ("import subprocess, sys, time\n"
              "from server.reaper import guard\n"
              "child = subprocess.Popen(['sleep', '600'])\n"
              "guard(child.pid)\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    wait_until(lambda: watching(parent.pid), "the reaper watching parent and child", proc=parent)
    assert alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_gone([child], 10.0), "the child outlived its parent"


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(p) for p in (task / "children").read_text().split()]
    return kids


def watching(parent: int) -> bool:
    """Whether `parent`'s reaper holds its two pidfds (parent's and child's): it waits on them."""
    for kid in children(parent):
        try:
            if b"reaper.py" in Path(f"/proc/{kid}/cmdline").read_bytes():
                fds = Path(f"/proc/{kid}/fd").iterdir()
                return sum(os.readlink(fd) == "anon_inode:[pidfd]" for fd in fds) == 2
        except OSError:  # gone, or a fd closed while listed
            continue
    return False


@pytest.mark.slow
def test_kill_9_of_a_run_takes_its_ephemeral_server_with_it(work: Path) -> None:
    mark = work / "slow-agent-started"
    env = client_env(work, work / "home-orphan", MARK=str(mark))
    run = subprocess.Popen([str(EVALPIPE), *run_args(work)], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not mark.exists():  # the server is up and the flow is in the agent
            assert run.poll() is None, run.stderr.read()
            assert time.monotonic() < deadline, "the run never reached the agent"
            time.sleep(0.5)
        kids = children(run.pid)
        cmdlines = {k: Path(f"/proc/{k}/cmdline").read_bytes() for k in kids}
        servers = [k for k, cmd in cmdlines.items() if b"uvicorn" in cmd]
        assert len(servers) == 1, cmdlines
        run.send_signal(signal.SIGKILL)
        run.wait()
        assert wait_gone(kids, 10.0), "the ephemeral server (or its reaper) outlived the run"
        # Before the kill, the run had said once, in one line, how to start faster.
        hint = [line for line in run.stderr.read().splitlines() if "evalpipe server start" in line]
        assert len(hint) == 1 and "3x faster" in hint[0], hint
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for pid in processes_with("EVALPIPE_HOME", env["EVALPIPE_HOME"]):
            os.kill(pid, signal.SIGKILL)


PROBE = '''
import os
import urllib.error
import urllib.request


def probe(inputs, ctx):
    """What anything on the machine gets from the run's Prefect API without credentials."""
    from prefect.server.api.server import SubprocessASGIServer

    url = os.environ.get("PREFECT_API_URL") or SubprocessASGIServer().api_url
    codes = []
    for method, path in (("POST", "/variables/filter"), ("POST", "/block_documents/filter"),
                         ("POST", "/flow_runs/filter"), ("DELETE", "/flow_runs/00000000-0000-0000-0000-000000000000")):
        request = urllib.request.Request(url + path, data=b"{}" if method == "POST" else None, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                codes.append(str(answer.status))
        except urllib.error.HTTPError as exc:
            codes.append(str(exc.code))
    return " ".join(codes)
'''


@pytest.mark.slow
def test_the_temporary_server_requires_credentials_its_own_workers_have(work: Path) -> None:
    """Issue 33: with `CI` set (or EVALPIPE_SERVER=temporary) the temporary server had no
    auth, and an agent read Secret blocks and Variables and deleted its own flow run through
    it. Now it takes a random auth string, as the managed server does: the run (its
    process-pool workers too) works, and a client without it gets 401 everywhere."""
    (work / "probe.py").write_text(PROBE)
    suite = work / "probe.jsonl"
    suite.write_text(json.dumps({"id": "p", "inputs": {}, "reference": "401 401 401 401",
                                 "grader": {"kind": "exact"}}) + "\n")
    env = client_env(work, work / "home-probe", CI="1")
    proc = evalpipe("run", str(suite), "--agent", f"python:{work / 'probe.py'}:probe", "--runner", "processes",
                    "--workers", "1", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status_counts"] == {"passed": 1}
