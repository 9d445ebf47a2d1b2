"""`evalpipe run` and the commands that read stored runs, as a user meets them: gate
thresholds, exit 4 for a broken agent, progress off a terminal, run-id prefixes, and
JSON figures printed at a sensible precision."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_evaluate import agent, write_suite

from flows.cli.running import progress_lines
from flows.output import rounded
from tasks.run.health import broken_agent, broken_grader

ROOT = Path(__file__).resolve().parent.parent
PROGRESS = re.compile(r"^toy: (\d+)/(\d+) samples graded \((\d+)%\) after \d+s$")


def cli(args: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300, **kw)


@pytest.fixture
def env(prefect_harness, home) -> dict:
    return {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}


def floats(doc) -> list[float]:
    if isinstance(doc, float):
        return [doc]
    if isinstance(doc, dict):
        doc = list(doc.values())
    return [x for item in doc for x in floats(item)] if isinstance(doc, list) else []


def test_a_broken_agent_exits_4_after_printing_its_json(env, home, tmp_path):
    suite = write_suite(tmp_path / "toy.yaml", 6, boom=2)  # 2 of 6 cases raise: 33% agent_error
    proc = cli(["run", str(suite), "--agent", agent("boom"), "-n", "2", "--json"], env)
    assert proc.returncode == 4, proc.stderr
    doc = json.loads(proc.stdout)  # still exactly one JSON document
    assert doc["status_counts"]["agent_error"] == 4
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "4 of 12 samples (33%) are agent_error" in warnings[0]
    assert "cannot answer boom" in warnings[0]  # the commonest agent error, quoted
    assert "Traceback" not in proc.stderr

    assert not any(map(PROGRESS.match, proc.stderr.splitlines()))  # --json mode stays quiet

    # Figures print at 6 significant digits; the stored summary keeps full precision.
    assert all(float(f"{x:.6g}") == x for x in floats(doc))
    from storage.store import Store

    stored = floats(Store(home).runs.find(doc["run_id"])["summary"])
    assert any(float(f"{x:.6g}") != x for x in stored)
    assert rounded(Store(home).runs.find(doc["run_id"])["summary"])["pass_at_1_se"] == doc["pass_at_1_se"]

    tolerant = cli(["run", str(suite), "--agent", agent("boom"), "-n", "2", "--max-agent-errors", "0.5"], env)
    assert tolerant.returncode == 0, tolerant.stderr
    assert "warning" not in tolerant.stderr
    # Off a terminal, progress is plain lines on stderr, the last one at 100 %.
    lines = [m.groups() for m in map(PROGRESS.match, tolerant.stderr.splitlines()) if m]
    assert lines and lines[-1][:3] == ("12", "12", "100")
    assert [int(done) for done, _, _ in lines] == sorted(int(done) for done, _, _ in lines)


def test_agent_error_share_is_over_the_threshold_only_when_strictly_above():
    summary = {"status_counts": {"agent_error": 1, "passed": 9}, "samples": 10}
    assert broken_agent(summary, 0.1, "x") is None
    line = broken_agent(summary, 0.05, "gave up after 5 attempts: ConnectError\ntraceback")
    assert "1 of 10 samples (10%)" in line and line.endswith("(exit 4): gave up after 5 attempts: ConnectError")
    assert broken_agent({"status_counts": {}, "samples": 0}, 0.0, "x") is None


def test_grader_error_share_names_the_first_line_of_the_commonest_detail():
    summary = {"status_counts": {"error": 3, "agent_error": 3, "failed": 4}, "samples": 10}
    assert broken_grader(summary, 0.3, "missing predicate.py\ntraceback") is None
    line = broken_grader(summary, 0.2, "missing predicate.py\ntraceback")
    assert "3 of 10 samples (30%) are error, over --max-grader-errors 0.2" in line
    assert line.endswith("(exit 5): missing predicate.py")
    assert broken_grader(summary, 0.2, "").endswith("(exit 5): no detail")
    # agent errors are the agent's, not the grader's
    assert broken_grader({"status_counts": {"agent_error": 9}, "samples": 10}, 0.0, "x") is None


def test_progress_lines_every_ten_percent_or_ten_seconds():
    now = [0.0]
    out: list[str] = []
    hook = progress_lines("toy", out.append, clock=lambda: now[0])
    hook(0, 1000)
    for done in range(1, 1001):
        now[0] += 0.001 if done <= 500 else 0.5  # the second half is slow
        hook(done, 1000)
    pcts = [int(PROGRESS.match(line).group(3)) for line in out]
    assert pcts[0] == 0 and pcts[-1] == 100
    # Fast: one line per 10 %; slow (20 samples per 10 s, 2 % of the run): one line per 10 s.
    assert pcts[:6] == [0, 10, 20, 30, 40, 50]
    assert 20 <= len(out) <= 35
    assert len(out) == len(set(out))


def test_a_terminal_gets_the_bar_not_the_lines(env, tmp_path):
    suite = write_suite(tmp_path / "toy.yaml", 3)
    main, tty = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(suite), "--agent", agent("flaky")],
                            cwd=ROOT, env={**env, "TERM": "xterm"}, stdout=subprocess.PIPE, stderr=tty, text=True)
    os.close(tty)
    chunks: list[bytes] = []

    def drain() -> None:  # read as it comes: a full terminal buffer would block the run
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the last writer closed the terminal
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
        reader.join(timeout=10)
        os.close(main)
    assert proc.returncode == 0
    terminal = b"".join(chunks).decode(errors="replace")
    assert "toy: samples graded" in terminal  # the bar's label
    assert not any(PROGRESS.match(line.strip()) for line in terminal.splitlines())
    assert "pass@1" in out


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_rounded_floats_keep_six_significant_digits(x):
    y = rounded({"a": [x]})["a"][0]
    assert y == float(f"{x:.6g}")
    assert x == 0 or abs(y - x) <= abs(x) * 5e-6


def test_gate_thresholds_reach_the_flow_and_prefixes_name_runs(env, home, tmp_path, capsys):
    from flows.evaluate import evaluate

    suite = write_suite(tmp_path / "toy.yaml", 30)
    good = evaluate(suite=str(suite), agent=agent("better"), n=4, k=[1])
    worse = evaluate(suite=str(suite), agent=agent("worse"), n=4, k=[1], baseline=good["run_id"], max_drop=1.0)
    assert worse["gate"]["decision"] == "pass" and worse["gate"]["verdict"] == "regressed"

    # From the command line, with the baseline named by a prefix of its id.
    prefix = good["run_id"][:-2]
    proc = cli(["run", str(suite), "--agent", agent("better"), "-n", "4", "--baseline", prefix,
                "--min-pass-at-1", "0.99", "--json"], env)
    assert proc.returncode == 1, proc.stderr
    gate = json.loads(proc.stdout)["gate"]
    assert gate["baseline"] == good["run_id"] and gate["decision"] == "block"
    assert any(r.startswith("threshold: pass@1") for r in gate["reasons"])

    proc = cli(["run", str(suite), "--agent", agent("better"), "--max-drop", "0.1"], env)
    assert proc.returncode == 2 and "go with --baseline" in proc.stderr

    # The commands that read stored runs, in this process (no flow run, no Prefect boot).
    code, out, _ = evalpipe(capsys, "runs", "show", prefix, "--json")
    assert code == 0 and json.loads(out)["run_id"] == good["run_id"]
    # No rule given: the decision stored with the run (max drop 100 %), as it was made; a rule
    # given (even the default drop of 0) decides anew by it. Each says which.
    code, out, _ = evalpipe(capsys, "gate", worse["run_id"][:-2], "--baseline", prefix, "--json")
    stored = json.loads(out)
    assert code == 0 and stored["baseline"] == good["run_id"] and stored["decided"] == "at run time"
    assert stored["rules"]["max_drop"] == 1.0 and stored["delta_ci"] == pytest.approx(worse["gate"]["delta_ci"], abs=1e-6)
    code, out, _ = evalpipe(capsys, "gate", worse["run_id"][:-2], "--baseline", prefix, "--max-drop", "0", "--json")
    anew = json.loads(out)
    assert code == 1 and anew["decided"] == "now" and anew["rules"]["max_drop"] == 0.0
    assert anew["delta_ci"] == stored["delta_ci"]  # one paired CI, whatever the rules
    code, _, err = evalpipe(capsys, "report", prefix, "--out", str(tmp_path / "r.html"))
    assert code == 0, err
    assert good["run_id"] in (tmp_path / "r.html").read_text()

    common = os.path.commonprefix([good["run_id"], worse["run_id"]])
    for args in (["runs", "show", common], ["gate", common, "--baseline", prefix],
                 ["report", common, "--out", str(tmp_path / "x.html")]):
        code, _, err = evalpipe(capsys, *args)
        assert code == 2, (args, err)
        assert "ambiguous" in err and good["run_id"] in err and worse["run_id"] in err
        assert len(err.strip().splitlines()) == 1
    code, _, err = evalpipe(capsys, "runs", "show", "19990101")
    assert code == 2 and "no such run" in err
    assert not (tmp_path / "x.html").exists()


def evalpipe(capsys, *args: str) -> tuple[int, str, str]:
    from flows.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_a_command_run_in_process_gives_back_the_signal_handlers_it_found(capsys, home) -> None:
    """`main` handles Ctrl-C and SIGTERM as a command (exit 130 within seconds) while it runs;
    a process that runs a command in-process (`make demo`, a script, a test) has its own
    handlers back after it, not ours: those would end it 4 s after a later Ctrl-C."""

    def own(signum, frame) -> None:
        pass

    found = {signum: signal.signal(signum, own) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        code, out, err = evalpipe(capsys, "suite", "hash", "examples/qa.yaml")
        assert code == 0, err
        assert signal.getsignal(signal.SIGINT) is own and signal.getsignal(signal.SIGTERM) is own
        code, _, err = evalpipe(capsys, "runs", "show", "19990101")  # and after a failed one
        assert code == 2, err
        assert signal.getsignal(signal.SIGINT) is own and signal.getsignal(signal.SIGTERM) is own
    finally:
        for signum, handler in found.items():
            signal.signal(signum, handler)


def test_a_reported_failure_is_known_by_its_exception_and_run_not_by_its_text():
    """What Prefect logs of a failed run whose failure `main` reports as one line: the record
    with the exception, then the run's closing line. Neither reaches the console."""
    import logging

    from flows.cli import _DropReportedFailures
    from tasks.models import PlatformError

    def record(message: str, run_id: str, exc: BaseException | None = None) -> logging.LogRecord:
        rec = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, message, None,
                                (type(exc), exc, None) if exc else None)
        rec.task_run_id = run_id
        return rec

    drop = _DropReportedFailures()
    assert not drop.filter(record("Task run failed with exception", "t1", PlatformError("locked")))
    assert not drop.filter(record("Finished in state Failed('...')", "t1"))
    assert not drop.filter(record("Task run failed", "t2", OSError(28, "No space left on device")))
    # Another run's records stay, whatever their text; so does a bug's traceback.
    assert drop.filter(record("Finished in state Failed('... PlatformError: cancelled by the task runner')", "t3"))
    assert drop.filter(record("Task run failed with exception", "t4", ValueError("a bug")))
    assert drop.filter(record("Finished in state Failed('...')", "t4"))
