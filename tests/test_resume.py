"""Nothing bought is lost (docs/storage.md): every agent output is stored as the agent
returns it, before grading, so a run killed (`kill -9`), stopped (Ctrl-C, SIGTERM) or whose
grader failed is resumed by the same command without paying again for what had returned.

Real runs of the CLI in a subprocess, stopped for real, with an agent that logs each call's
start and return to a file: the calls are counted, not inferred."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest
from support.cli import alive, in_process
from support.graders import GRADED_IN_ENV, IN_A_TASK
from support.waiting import wait_until
from test_deployments import start_logged, stop

from storage.outputs import SPOOL, read_log
from storage.store import Store
from tasks.models import EvalCase, EvalSuite, Usage
from tasks.run import RunSpec
from tasks.run.loop import DrawTask, reuse_cached
from tasks.run.sampling import Drawn
from tasks.run.steps import plan
from tasks.trace import SampleTrace, Trajectory

ROOT = Path(__file__).resolve().parent.parent



@pytest.fixture
def project(tmp_path: Path, home: Path, prefect_harness) -> dict:
    suite = tmp_path / "suite.yaml"
    suite.write_text("name: resume\ncases:\n" + "".join(
        f"  - {{id: c{i:03d}, reference: 'yes', grader: {{kind: exact}}}}\n" for i in range(40)))
    calls = tmp_path / "calls"
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT), "CALLS": str(calls)}
    return {"suite": suite, "calls": calls, "env": env, "agent": f"python:{ROOT}/tests/support/agents.py"}


def calls(path: Path) -> list[tuple[str, str]]:
    return [tuple(line.split(" ", 1)) for line in path.read_text().splitlines() if " " in line] \
        if path.exists() else []


def stop_at(project: dict, args: list[str], signum: int, started: int) -> subprocess.Popen:
    """Run the CLI, send `signum` once the agent has started `started` calls; the ended process."""
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=project["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while sum(kind == "S" for kind, _ in calls(project["calls"])) < started:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signum)
    proc.communicate(timeout=60)  # a hang guard, not a speed figure
    return proc


def resume(project: dict, args: list[str]) -> dict:
    """The run again after a stop, in this process (support.cli.in_process)."""
    done = in_process(args, project["env"])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def made_again(project: dict, before: list[tuple[str, str]]) -> tuple[set[str], set[str]]:
    """The calls started in both runs, and those of them that had returned before the stop."""
    started = collections.Counter(key for kind, key in calls(project["calls"]) if kind == "S")
    again = {key for key, count in started.items() if count > 1}
    return again, again & {key for kind, key in before if kind == "R"}


def statuses(home: Path) -> list[str]:
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        return [s for (s,) in con.execute("SELECT status FROM runs ORDER BY started_at").fetchall()]


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_kill_9_buys_again_only_the_calls_in_flight(project, home, runner) -> None:
    args = ["run", str(project["suite"]), "--agent", project["agent"] + ":logged", "-n", "3", "--runner", runner,
            "--agent-concurrency", "4", "--workers", "2", "--json"]
    stop_at(project, args, signal.SIGKILL, 48)  # 40 % of 120
    before = calls(project["calls"])
    out = resume(project, args)
    again, returned = made_again(project, before)
    assert len(again) <= 4, again  # at most the calls in flight at the kill
    assert out["samples"] == 120 and out["status_counts"] == {"passed": 120}
    # Outputs drawn and not graded at the kill were graded by the resume, not drawn again.
    assert out["cached_samples"] >= len({key for kind, key in before if kind == "R"}) - len(returned)
    assert statuses(home) == ["interrupted", "completed"]
    assert not (home / SPOOL).exists() or not any((home / SPOOL).rglob("*.log"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_polite_stop_starts_no_call_and_buys_nothing_that_returned_again(project, home, signum) -> None:
    args = ["run", str(project["suite"]), "--agent", project["agent"] + ":logged", "-n", "3",
            "--agent-concurrency", "4", "--workers", "2", "--json"]
    proc = stop_at(project, args, signum, 48)
    assert proc.returncode == 130
    before = calls(project["calls"])
    assert len(before) < 2 * 120  # it stopped drawing: not every call was made
    assert statuses(home) == ["interrupted"]
    out = resume(project, args)
    again, returned = made_again(project, before)
    assert returned == set()
    assert out["cached_samples"] == len({key for kind, key in before if kind == "R"})
    assert out["status_counts"] == {"passed": 120}


def test_sigterm_ends_a_dask_run_waiting_on_a_hung_agent(project, home) -> None:
    """Issue 33 #11: SIGTERM to a `--runner dask` run whose agent hangs ends it, interrupted
    (130), and the same command resumes it, grading what had returned."""
    args = ["run", str(project["suite"]), "--agent", project["agent"] + ":hang_once", "-n", "2", "--runner", "dask",
            "--workers", "2", "--agent-concurrency", "2", "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=project["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(Path(f"{project['calls']}.hung").exists, "an agent call hung", proc=proc)
        returned = sum(kind == "R" for kind, _ in calls(project["calls"]))
        wait_until(lambda: sum(kind == "R" for kind, _ in calls(project["calls"])) >= returned + 3,
                   "the other worker going on to a few more calls", proc=proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)  # a hang guard: bench/resume.py prints the time
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert statuses(home)[0] == "interrupted"
    before = calls(project["calls"])
    out = resume(project, args)
    again, returned = made_again(project, before)
    assert returned == set()  # every output the workers got back was stored
    assert out["status_counts"] == {"passed": 80}


def test_a_stop_that_lands_in_a_database_query_is_recorded_interrupted(home) -> None:
    """Issue 31: DuckDB answers a signal that arrives during a query by ending the query with
    its own RuntimeError, in place of what the signal's handler raised; the run was then
    recorded `failed` (1 in 3 SIGTERMs to a Dask run). The stop stays a stop."""
    store = Store(home)
    spec = RunSpec(suite_version="v", suite_name="s", agent="a", agent_fingerprint="a", n=1, ks=[1], seed=0)

    def stopped(signum, frame):  # as `flows.interrupt` stops a command
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, stopped)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        with pytest.raises(KeyboardInterrupt), store.runs.recorded(spec), store.db.connect() as con:
            timer.start()
            # Still running at 0.3 s (~2 s of scanning here), however the query ends.
            con.execute("SELECT count(*) FROM range(600000000) r(i) WHERE i % 7 = 3").fetchall()
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert statuses(home) == ["interrupted"]


def test_a_killed_grading_process_fails_the_run_and_the_resume_buys_nothing_that_returned(project, home) -> None:
    """Issue 31: a grading worker process killed mid-run (`--runner processes`, SIGKILL) ends
    the run `failed`, a platform failure (exit 3, one line); the same command grades every
    output that had returned without asking the agent for it again."""
    # Graded in tasks of their own (`exact` grades where it is drawn, and no worker would start).
    project["suite"].write_text(project["suite"].read_text().replace("kind: exact", f"kind: {IN_A_TASK}"))
    project["env"]["EVALPIPE_PLUGINS"] = str(ROOT / "tests/support/graders.py")
    args = ["run", str(project["suite"]), "--agent", project["agent"] + ":logged", "-n", "3", "--runner", "processes",
            "--agent-concurrency", "4", "--workers", "2", "--json"]
    graded_in = project["calls"].with_name("graded-in")
    # Drawing (6 s) outlasts the graders' start. The grader names the processes it grades in:
    # guessed from /proc, a "worker" was once the forkserver's own child between its fork and
    # its exec of `git version` (GitPython's import), whose death stops nothing.
    env = {**project["env"], "EVALPIPE_TEST_SLEEP": "0.2", GRADED_IN_ENV: str(graded_in)}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        killed = False
        while not killed:
            assert proc.poll() is None, proc.communicate()
            graders = [pid for pid in sorted({int(p) for p in graded_in.read_text().split()}) if alive(pid)] \
                if graded_in.exists() else []
            returned = sum(kind == "R" for kind, _ in calls(project["calls"]))
            if graders and returned >= 30:
                with contextlib.suppress(ProcessLookupError):  # gone since it was listed: the next
                    os.kill(graders[0], signal.SIGKILL)
                    killed = True
            time.sleep(0.02)
        stdout, stderr = proc.communicate(timeout=60)  # a hang guard
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 3 and "a worker process of the run died" in stderr, \
        (f"killed {graders[0]} of {graders} at {returned} of 120 calls returned", stdout[-2000:], stderr)
    assert statuses(home) == ["failed"]
    before = calls(project["calls"])
    out = resume(project, args)
    _, returned = made_again(project, before)
    assert returned == set()  # every output that came back was stored, graded or not
    assert out["status_counts"] == {"passed": 120}


def _scheduler_address(scheduler_file: Path) -> str | None:
    # The scheduler writes the file in place: it can be there and still empty or cut short.
    try:
        return json.loads(scheduler_file.read_text())["address"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@pytest.fixture
def dask_workers(project, tmp_path: Path):
    """A `dask scheduler` and two one-thread `dask worker` processes (no nanny: a killed worker
    stays dead), with the agent's call log in their environment: (address, worker processes)."""
    from distributed import Client

    dask, scheduler_file, log = Path(sys.executable).parent / "dask", tmp_path / "scheduler.json", tmp_path / "dask.log"
    env = {**project["env"], "EVALPIPE_TEST_SLEEP": "0.05"}
    procs = [start_logged([str(dask), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                           "--scheduler-file", str(scheduler_file)], log, cwd=tmp_path, env=env)]
    try:
        while (address := _scheduler_address(scheduler_file)) is None:
            assert procs[0].poll() is None, log.read_text()
            time.sleep(0.1)
        procs += [start_logged([str(dask), "worker", address, "--nthreads", "1", "--no-nanny", "--no-dashboard"], log,
                               cwd=tmp_path, env=env) for _ in range(2)]
        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
        yield address, procs[1:]
    finally:
        for proc in reversed(procs):
            stop(proc)


def test_a_killed_dask_worker_s_task_run_again_buys_only_the_calls_in_flight(project, home, dask_workers) -> None:
    """A Dask worker process killed (-9) at 40 % of the run: the scheduler runs its task again,
    from its start, on the other worker, and the run completes; the new attempt takes what
    the lost one had logged, so only the calls in flight at the kill are made again."""
    address, workers = dask_workers
    args = ["run", str(project["suite"]), "--agent", project["agent"] + ":logged", "-n", "3", "--runner", "dask",
            "--dask-address", address, "--agent-concurrency", "4", "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=project["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while sum(kind == "S" for kind, _ in calls(project["calls"])) < 48:  # 40 % of 120
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        os.kill(workers[0].pid, signal.SIGKILL)
        out, stderr = proc.communicate(timeout=300)  # a hang guard
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr
    assert json.loads(out)["status_counts"] == {"passed": 120}
    started = collections.Counter(key for kind, key in calls(project["calls"]) if kind == "S")
    assert len(started) == 120
    again = {key for key, count in started.items() if count > 1}
    assert len(again) <= 4, again  # at most the calls in flight at the kill (the concurrency)
    assert statuses(home) == ["completed"]


# ---------------------------------------------------------------- the logs and the table


def _drawn(planned, output: str, trace: SampleTrace | None = None) -> Drawn:
    return Drawn(planned, output, Usage(latency_s=0.25, input_tokens=10, output_tokens=2, model="m"),
                 trace or SampleTrace())


def test_a_logged_output_is_graded_by_the_next_run_with_its_trace_and_a_torn_record_is_drawn_again(home):
    suite = EvalSuite(name="s", cases=[EvalCase(id=f"c{i}", reference="yes", grader={"kind": "exact"})
                                       for i in range(3)])
    spec = RunSpec(suite_version=suite.version, suite_name="s", agent="a", agent_fingerprint="a", n=1, ks=[1], seed=0)
    store = Store(home)
    store.runs.start(spec)
    planned = plan(suite, spec)
    log = store.outputs.log(spec.run_id)
    trace = SampleTrace(trajectory=Trajectory(steps=2, entries=[{"tool": "edit"}]))
    with log.appending() as append:
        append(_drawn(planned[0], "yes", trace))
        append(_drawn(planned[1], "no"))
    with open(log.path, "ab") as fh:  # the third, cut short by a kill
        fh.write(b"0123456789abcdef {\"run_id\": ")
    assert [r["case_id"] for r in read_log(log.path)] == ["c0", "c1"]

    again = RunSpec(suite_version=suite.version, suite_name="s", agent="a", agent_fingerprint="a", n=1, ks=[1],
                    seed=0)
    store.runs.start(again)
    missing = reuse_cached(again, plan(suite, again), store)
    assert not log.path.exists()  # folded into the table: its writer is gone
    assert [(p.case_id, p.output) for p in missing] == [("c0", "yes"), ("c1", "no"), ("c2", None)]
    assert missing[0].trace == trace and missing[0].usage.input_tokens == 10


class _Counting:
    """An agent that answers "yes" and counts its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def generate(self, case, ctx) -> str:
        self.calls.append(case.id)
        return "yes"


def test_a_draw_task_run_again_takes_what_its_earlier_attempt_logged(home) -> None:
    """A Dask worker lost mid-task: the scheduler runs the task again from its start, with the
    same log. The new attempt calls the agent only for what the lost one never returned."""
    suite = EvalSuite(name="s", cases=[EvalCase(id=f"c{i}", reference="yes", grader={"kind": "exact"})
                                       for i in range(3)])
    spec = RunSpec(suite_version=suite.version, suite_name="s", agent="a", agent_fingerprint="a", n=1, ks=[1], seed=0)
    store = Store(home)
    planned = plan(suite, spec)
    log = store.outputs.log(spec.run_id)
    with log.appending() as append:  # the lost attempt's two returned calls
        append(_drawn(planned[0], "yes", SampleTrace(trajectory=Trajectory(steps=1, entries=[]))))
        append(_drawn(planned[1], "no"))
    with open(log.path, "ab") as fh:  # and its third, cut short by the kill
        fh.write(b"0123456789abcdef {\"run_id\": ")
    agent = _Counting()
    drew = DrawTask(agent, suite.cases, planned, 1, 1 << 20, None, log)()
    assert agent.calls == ["c2"]
    assert drew.count == 3 and [(d.planned.case_id, d.output) for d in drew.drawn] == [("c0", "yes"), ("c1", "no"),
                                                                                        ("c2", "yes")]
    assert drew.drawn[0].trace.trajectory.steps == 1 and drew.drawn[1].usage.input_tokens == 10
    assert [r["case_id"] for r in read_log(log.path)] == ["c0", "c1", "c2"]  # the torn record ended, the new one whole


def test_a_resumed_budgeted_run_counts_what_the_killed_run_bought(project, home) -> None:
    args = ["run", str(project["suite"]), "--agent", project["agent"] + ":logged", "-n", "2", "--max-samples", "40",
            "--agent-concurrency", "4", "--workers", "2", "--json"]
    stop_at(project, args, signal.SIGKILL, 20)
    done = in_process(args, project["env"])
    assert done.returncode == 6, done.stderr  # partial: the budget is spent
    out = json.loads(done.stdout)
    returned = {key for kind, key in calls(project["calls"]) if kind == "R"}
    assert len(returned) <= 40  # the two runs together bought no more than the budget
    assert out["budget"]["drawn_samples"] == 40 and out["samples"] + out["undrawn_samples"] == 80
