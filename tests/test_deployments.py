"""Deployments end to end on real processes: a `prefect server`, `prefect deploy --all` from a
copy of the repository, a process worker, runs triggered through the REST API as the UI's
form does, the UI itself in headless Chromium, a Dask scheduler with two workers, and a
flow-run process killed mid-run. One server for the whole module; all output goes to log
files under the module's tmp dir, shown only when something fails."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support.browser import Browser

from server.local import Server, free_port, start_server
from storage.store import Store

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEMO_AGENT = "python:examples/agents/demo_agent.py:answer"
POOL = "evalpipe-pool"
DEADLINE_S = 120.0
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
WORKERS = 2

pytestmark = [pytest.mark.skipif(shutil.which("git") is None, reason="needs git"), pytest.mark.slow]


@dataclass
class Stack:
    server: Server
    api: httpx.Client
    clone: Path
    worker_home: Path
    logs: Path
    env: dict[str, str]  # a client's environment: the server's API, its own PREFECT_HOME

    def deployment(self, name: str) -> dict:
        resp = self.api.get(f"/deployments/name/evaluate/{name}")
        resp.raise_for_status()
        return resp.json()

    def trigger(self, name: str, parameters: dict) -> str:
        """What the UI's custom-run form does: POST the parameters to create_flow_run."""
        dep = self.deployment(name)
        resp = self.api.post(f"/deployments/{dep['id']}/create_flow_run", json={"parameters": parameters})
        assert resp.status_code == 201, resp.text
        return resp.json()["id"]

    def wait_final(self, flow_run_id: str) -> dict:
        deadline = time.monotonic() + DEADLINE_S
        while (run := self.api.get(f"/flow_runs/{flow_run_id}").json())["state"]["type"] not in FINAL:
            assert time.monotonic() < deadline, f"flow run still {run['state']['type']}\n{self.tails()}"
            time.sleep(0.3)
        return run

    def wait_completed(self, flow_run_id: str) -> dict:
        run = self.wait_final(flow_run_id)
        assert run["state"]["type"] == "COMPLETED", f"{run['state']}\n{self.tails()}"
        return run

    def artifacts(self, flow_run_id: str) -> dict[str, dict]:
        resp = self.api.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
        return {a["key"] or a["type"]: a for a in resp.json()}

    def tails(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.logs.glob("*.log")))


class RetryBusy(httpx.HTTPTransport):
    """Retry 503s with backoff, as Prefect's own client does. The server answers 503 when its
    SQLite database is busy (two workers polling while a run is created); the transaction was
    rolled back, so the request is safe to repeat."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for delay in (0.2, 0.5, 1.0, 2.0, 4.0):
            response = super().handle_request(request)
            if response.status_code != 503:
                return response
            response.close()
            time.sleep(delay)
        return super().handle_request(request)


def run_logged(cmd: list[str], log: Path, **kwargs) -> None:
    with log.open("ab") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{log.read_text()[-4000:]}"


def start_logged(cmd: list[str], log: Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def copy_tracked_files(dest: Path) -> None:
    """A fresh clone of the working tree as it is now: the tracked files, nothing else."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    if not (dest / "prefect.yaml").exists():  # not yet committed while this file is developed
        shutil.copy2(ROOT / "prefect.yaml", dest / "prefect.yaml")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("deployments")
    logs = tmp / "logs"
    logs.mkdir()
    server = start_server(prefect_home=tmp / "prefect-server", log=(logs / "server.log").open("ab"),
                          timeout_s=240)  # a fresh database on a loaded machine
    clone = tmp / "clone"
    copy_tracked_files(clone)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "EVALPIPE_"))}
    env |= {"PREFECT_API_URL": server.api_url, "PREFECT_HOME": str(tmp / "prefect-client"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    workers: list[subprocess.Popen] = []
    try:
        run_logged([str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "process"],
                   logs / "deploy.log", env=env)
        # `{{ $PWD }}` in prefect.yaml is the shell's PWD, which subprocess's cwd does not set.
        run_logged([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], logs / "deploy.log",
                   cwd=clone, env=env | {"PWD": str(clone)})
        worker_home = tmp / "worker-home"
        # Two workers on the pool, one flow run at a time each, sharing one EVALPIPE_HOME (as
        # on a shared disk). They start elsewhere: the deployment's pull step must move each
        # flow run into the clone.
        for i in range(WORKERS):
            workers.append(start_logged(
                [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--name", f"test-worker-{i}",
                 "--limit", "1"],
                logs / f"worker-{i}.log", cwd=tmp,
                env=env | {"EVALPIPE_HOME": str(worker_home), "PREFECT_HOME": str(tmp / f"prefect-worker-{i}"),
                           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "5"},
            ))
        with httpx.Client(base_url=server.api_url, timeout=30, transport=RetryBusy()) as api:
            yield Stack(server, api, clone, worker_home, logs, env)
    finally:
        for worker in workers:
            stop(worker)
        server.stop()


@pytest.fixture(scope="module")
def on_demand(stack: Stack) -> dict:
    """One run of `evaluate/on-demand` with custom parameters from the 'form'."""
    params = {"suite": "examples/qa.yaml", "agent": DEMO_AGENT, "n": 3, "k": [1, 3], "seed": 7}
    return stack.wait_completed(stack.trigger("on-demand", params))


def worker_run(stack: Stack, flow_run_id: str) -> dict:
    runs = [r for r in Store(stack.worker_home).runs.list(limit=1000) if r["flow_run_id"] == flow_run_id]
    assert len(runs) == 1, runs
    return runs[0]


def test_on_demand_run_lands_in_the_workers_duckdb(stack: Stack, on_demand: dict) -> None:
    assert on_demand["parameters"]["n"] == 3
    run = worker_run(stack, on_demand["id"])
    assert (run["status"], run["n"], run["seed"], run["ks"]) == ("completed", 3, 7, [1, 3])
    samples = Store(stack.worker_home).samples.of_run(run["run_id"])
    assert samples.num_rows == 10 * 3
    assert set(samples["sample_index"].to_pylist()) == {0, 1, 2}
    assert run["summary"]["pass_at_k"].keys() == {"1", "3"}
    assert (stack.clone / "examples/qa.yaml").is_file() and not (stack.clone / ".evalpipe").exists()


def test_artifacts_on_the_flow_run(stack: Stack, on_demand: dict) -> None:
    summary = worker_run(stack, on_demand["id"])["summary"]
    arts = stack.artifacts(on_demand["id"])
    assert {"evalpipe-qa-summary", "evalpipe-qa-slices", "progress"} <= arts.keys()
    assert f"pass@1 {100 * summary['pass_at_k']['1']:.1f}%" in arts["evalpipe-qa-summary"]["data"]
    table = arts["evalpipe-qa-slices"]["data"]
    table = json.loads(table) if isinstance(table, str) else table
    assert {row["slice"] for row in table} >= {"easy", "hard", "geography"}
    assert arts["progress"]["data"] == 100


def test_nightly_has_its_schedule_and_gates_on_the_previous_run(stack: Stack) -> None:
    nightly = stack.deployment("nightly")
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 3 * * *"]
    assert all(s["active"] for s in nightly["schedules"])
    assert nightly["parameters"]["baseline"] == "previous"
    assert stack.deployment("on-demand")["schedules"] == []
    first = worker_run(stack, stack.wait_completed(stack.trigger("nightly", {}))["id"])
    second = worker_run(stack, stack.wait_completed(stack.trigger("nightly", {}))["id"])
    assert second["config"]["baseline"] == first["run_id"]
    assert second["summary"]["gate"]["baseline"] == first["run_id"]
    # Same suite, agent and seed: the second night is all cache hits and gates as no change.
    assert second["summary"]["cached_samples"] == second["summary"]["samples"] == 50
    assert second["summary"]["gate"]["decision"] == "pass"


def test_the_run_form_takes_the_gate_s_rules_and_a_blocked_run_is_failed(stack: Stack, on_demand: dict) -> None:
    """The deployment is one more mode of the one run service: the same rules, the same
    decision. Its one row of the rule matrix: the rest run on the local loop
    (tests/test_one_decision.py), the threshold's and the budget's flow run states in a flow
    call (tests/test_evaluate.py)."""
    params = {"suite": "examples/qa.yaml", "agent": DEMO_AGENT, "n": 3, "k": [1, 3], "seed": 7,
              "baseline": "previous", "min_slice": {"hard": 1.0}, "max_new_failures": 0}
    final = stack.wait_final(stack.trigger("on-demand", params))
    assert (final["state"]["type"], final["state"]["name"]) == ("FAILED", "Blocked")
    gate = worker_run(stack, final["id"])["summary"]["gate"]
    assert gate["decision"] == "block" and gate["rules"]["min_slice"] == {"hard": 1.0}
    assert gate["rules"]["max_new_failures"] == 0 and gate["baseline_choice"].startswith("previous:")
    assert "slice_threshold" in [b["rule"] for b in gate["blocks"]]


@pytest.mark.parametrize(("params", "message"), [
    ({"n": 0}, "Validation failed for field 'n'. Failure reason: 0 is less than the minimum of 1"),
    ({"runner": "gpu"}, "Validation failed for field 'runner'. Failure reason: 'gpu' is not one of"),
    ({"k": []}, "Validation failed for field 'k'"),
])
def test_form_rejects_bad_parameters(stack: Stack, params: dict, message: str) -> None:
    dep = stack.deployment("on-demand")
    body = {"parameters": {"suite": "examples/qa.yaml", "agent": DEMO_AGENT, **params}}
    resp = stack.api.post(f"/deployments/{dep['id']}/create_flow_run", json=body)
    assert resp.status_code == 409
    assert message in resp.json()["detail"]


def test_the_run_form_cannot_run_code_the_deployment_does_not_allow(stack: Stack, tmp_path: Path) -> None:
    """A `cmd:` agent from the form, refused on the worker before it runs. The form's other
    ways to run code (`unsafe_no_sandbox`, another `dask_address`) go through the same check
    with the same parameters, each case of it in tests/test_agents.py
    (test_a_deployment_runs_code_agents_only_as_configured): a flow run here costs ~5 s of CPU."""
    marker = tmp_path / "ran"
    params = {"suite": "examples/qa.yaml", "agent": f"cmd:touch {marker}"}
    run = stack.wait_final(stack.trigger("on-demand", params))
    assert run["state"]["type"] == "FAILED"
    assert "EVALPIPE_DEPLOYMENT_ALLOWS" in run["state"]["message"], run["state"]
    assert not marker.exists()


def test_a_deployment_takes_a_form_s_suite_only_as_its_configuration_allows(stack: Stack) -> None:
    """(#45 item 1) The nightly deployment allows nothing in EVALPIPE_DEPLOYMENT_ALLOWS: a form
    naming another suite (whose predicates and judges would run on the worker) is refused."""
    run = stack.wait_final(stack.trigger("nightly", {"suite": "examples/coding/calc.yaml"}))
    assert run["state"]["type"] == "FAILED"
    assert "suite 'examples/coding/calc.yaml'" in run["state"]["message"], run["state"]
    assert "EVALPIPE_DEPLOYMENT_ALLOWS=suite:" in run["state"]["message"], run["state"]


def test_form_fields_have_descriptions(stack: Stack) -> None:
    schema = stack.deployment("on-demand")["parameter_openapi_schema"]
    assert schema["required"] == ["suite", "agent"]
    assert all(field.get("description") for field in schema["properties"].values())
    assert schema["properties"]["runner"]["enum"] == ["threads", "processes", "dask"]


def test_ui_flow_run_page_shows_the_summary(stack: Stack, on_demand: dict, tmp_path: Path) -> None:
    pass_at_1 = f"pass@1 {100 * worker_run(stack, on_demand['id'])['summary']['pass_at_k']['1']:.1f}%"
    (tmp_path / "profile").mkdir()
    browser = Browser(tmp_path / "profile", stack.logs / "chromium.log")
    try:
        browser.open(f"{stack.server.url}/runs/flow-run/{on_demand['id']}")
        # The flow run page lists the run's artifacts under its Artifacts tab; the summary's
        # card opens the artifact page with the rendered markdown.
        browser.wait_for(_click("li.p-tab", "Artifacts"))
        browser.wait_for(_click("a, .artifact-card, [class*=card]", "evalpipe-qa-summary"))
        text = browser.wait_for(f"document.body.innerText.includes({json.dumps(pass_at_1)}) && document.body.innerText")
        shot = browser.screenshot(tmp_path / "summary-artifact.png")
    finally:
        browser.close()
    assert "evalpipe-qa-summary" in text
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000


def _click(selector: str, text: str) -> str:
    """JS: click the innermost element matching `selector` whose text contains `text`."""
    return f"""(() => {{
        const hits = [...document.querySelectorAll({json.dumps(selector)})]
            .filter(e => e.textContent.includes({json.dumps(text)}));
        const el = hits[hits.length - 1];
        if (el) el.click();
        return !!el;
    }})()"""


HANGING_AGENT = '''
import os, sys, time
from pathlib import Path
HERE = Path(__file__).parent
sys.path.insert(0, {root!r})
from examples.agents.demo_agent import answer as demo

def answer(inputs, ctx):
    # The last case hangs while the marker exists: the run is killed with the rest stored.
    if ctx.case_id == "water-boiling-point" and (HERE / "hang").exists():
        (HERE / "pid").write_text(str(os.getpid()))
        time.sleep(600)
    return demo(inputs, ctx)
'''


def test_killed_flow_run_is_crashed_and_the_next_run_resumes(stack: Stack, tmp_path: Path) -> None:
    agent_file = tmp_path / "hanging_agent.py"
    agent_file.write_text(HANGING_AGENT.format(root=str(stack.clone)))
    (tmp_path / "hang").touch()
    params = {"suite": "examples/qa.yaml", "agent": f"python:{agent_file}:answer", "n": 2,
              "workers": 1, "batch_size": 1}
    flow_run_id = stack.trigger("on-demand", params)
    deadline = time.monotonic() + DEADLINE_S
    while not (tmp_path / "pid").exists() or _stored(stack, flow_run_id) < 9 * 2:
        assert time.monotonic() < deadline, stack.tails()
        time.sleep(0.3)
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)  # the flow-run process, OOM-style

    crashed = stack.wait_final(flow_run_id)
    assert crashed["state"]["type"] == "CRASHED", crashed["state"]
    killed = worker_run(stack, flow_run_id)
    # Its process is gone: the run reads interrupted, and no score was recorded.
    assert killed["status"] == "interrupted" and killed["summary"] is None

    (tmp_path / "hang").unlink()
    resumed = worker_run(stack, stack.wait_completed(stack.trigger("on-demand", params))["id"])
    assert resumed["summary"]["cached_samples"] == 9 * 2
    assert resumed["summary"]["samples"] == 10 * 2


def _stored(stack: Stack, flow_run_id: str) -> int:
    if not Store(stack.worker_home).db.path.exists():
        return 0
    runs = [r for r in Store(stack.worker_home).runs.list() if r["flow_run_id"] == flow_run_id]
    return Store(stack.worker_home).samples.of_run(runs[0]["run_id"]).num_rows if runs else 0


PID_AGENT = '''
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from examples.agents.demo_agent import answer as demo

def answer(inputs, ctx):
    (Path(__file__).parent / "pids" / str(os.getpid())).touch()
    return demo(inputs, ctx)
'''


@pytest.fixture
def dask_cluster(stack: Stack, tmp_path: Path) -> Iterator[tuple[str, list[int]]]:
    """`dask scheduler` and two `dask worker` processes on localhost, started from the venv
    alone: a worker's scratch directory goes first on its sys.path and holds a `storage/`
    spill folder, which must not shadow evalpipe's `storage` (see the Makefile)."""
    from distributed import Client

    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [start_logged([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port",
                           address.rsplit(":", 1)[1], "--no-dashboard"], stack.logs / "dask-scheduler.log",
                          cwd=tmp_path, env=stack.env)]
    try:
        for i in range(2):
            procs.append(start_logged(
                [str(BIN / "dask"), "worker", address, "--nthreads", "1", "--no-nanny", "--no-dashboard",
                 "--name", f"w{i}"], stack.logs / f"dask-worker-{i}.log", cwd=tmp_path, env=stack.env))
        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=DEADLINE_S)
        yield address, [p.pid for p in procs[1:]]
    finally:
        for proc in reversed(procs):
            stop(proc)


def test_dask_scheduler_run_equals_threads_run(stack: Stack, dask_cluster, tmp_path: Path) -> None:
    address, worker_pids = dask_cluster
    (tmp_path / "pids").mkdir()
    agent_file = tmp_path / "pid_agent.py"
    agent_file.write_text(PID_AGENT.format(root=str(stack.clone)))
    agent = f"python:{agent_file}:answer"

    def adhoc(name: str, *runner: str) -> dict:
        """An ad-hoc `evalpipe run` that reports to the shared server."""
        out = tmp_path / f"{name}.json"
        with out.open("wb") as stdout, (stack.logs / f"evalpipe-{name}.log").open("ab") as stderr:
            proc = subprocess.run(
                [str(BIN / "evalpipe"), "run", "examples/qa.yaml", "--agent", agent, "-n", "4",
                 "-k", "1,4", "--seed", "3", "--json", *runner], cwd=stack.clone, stdout=stdout,
                stderr=stderr, env=stack.env | {"EVALPIPE_HOME": str(tmp_path / name)}, timeout=DEADLINE_S)
        assert proc.returncode == 0, stack.tails()
        return json.loads(out.read_text())

    threads = adhoc("threads", "--runner", "threads")
    pids_threads = {p.name for p in (tmp_path / "pids").iterdir()}
    dask = adhoc("dask", "--runner", "dask", "--dask-address", address)
    pids_dask = {int(p.name) for p in (tmp_path / "pids").iterdir() if p.name not in pids_threads}

    assert pids_dask and pids_dask <= set(worker_pids)  # the samples were drawn on the Dask workers
    keys = ("suite_version", "samples", "pass_at_k", "pass_at_1_ci", "slices", "flaky_cases", "status_counts")
    assert {k: dask[k] for k in keys} == {k: threads[k] for k in keys}
    cols = ["case_id", "sample_index", "seed", "output", "status", "passed", "cache_key"]
    assert (Store(tmp_path / "dask").samples.of_run(dask["run_id"]).select(cols)
            == Store(tmp_path / "threads").samples.of_run(threads["run_id"]).select(cols))
    for summary in (threads, dask):  # both ad-hoc runs are in the server's history
        assert stack.api.get(f"/flow_runs/{summary['flow_run_id']}").json()["state"]["type"] == "COMPLETED"


BARRIER_AGENT = '''
import os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from examples.agents.demo_agent import answer as demo
RUNNING = Path(__file__).parent / "running"

def answer(inputs, ctx):
    # Every run waits here until {runs} flow-run processes are drawing at the same time.
    (RUNNING / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(RUNNING.iterdir())) < {runs}:
        if time.monotonic() > deadline:
            raise RuntimeError("the other runs never started")
        time.sleep(0.05)
    return demo(inputs, ctx)
'''


def test_workers_on_one_pool_run_flow_runs_side_by_side(stack: Stack, tmp_path: Path) -> None:
    agent_file = tmp_path / "barrier_agent.py"
    agent_file.write_text(BARRIER_AGENT.format(root=str(stack.clone), runs=WORKERS))
    (tmp_path / "running").mkdir()
    params = {"suite": "examples/qa.yaml", "agent": f"python:{agent_file}:answer", "n": 2, "workers": 1}
    ids = [stack.trigger("on-demand", params | {"seed": 100 + i}) for i in range(WORKERS)]
    runs = [worker_run(stack, stack.wait_completed(flow_run_id)["id"]) for flow_run_id in ids]
    # Each worker takes one run at a time, so the runs met at the barrier on different workers.
    assert len(list((tmp_path / "running").iterdir())) == WORKERS
    for i in range(WORKERS):
        log = (stack.logs / f"worker-{i}.log").read_text()
        assert sum(_ran(log, flow_run_id) for flow_run_id in ids) == 1, stack.tails()
    # Both wrote their samples into the one shared DuckDB file, side by side.
    for run in runs:
        assert run["summary"]["status_counts"].get("agent_error", 0) == 0
        assert Store(stack.worker_home).samples.of_run(run["run_id"]).num_rows == 10 * 2


def _ran(worker_log: str, flow_run_id: str) -> int:
    """Whether a worker ran a flow run: both workers may try to submit it; the server lets
    one through and sends the other an abort."""
    return (worker_log.count(f"submitting flow run '{flow_run_id}'")
            - worker_log.count(f"Aborted submission of flow run '{flow_run_id}'"))
