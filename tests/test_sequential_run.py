"""`run --sequential` and `plan` through the CLI, on real flow runs (issue 24): a clear loss stops
early and blocks, a tie runs to the end and passes, a clear win stops early and passes; the
order and the looks are fixed by the seed, and the samples drawn are ordinary cached samples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import in_process

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ROOT / "tests/support/agents.py"
CASES = 200


def write_suite(path: Path, broken: int, fixed: int) -> Path:
    """CASES cases: v1 fails the first 40; v2 breaks `broken` of v1's passing cases and fixes
    `fixed` of its failing ones. The reference is "yes"."""
    lines = [f"name: {path.stem}", "cases:"]
    for i in range(CASES):
        v1 = "no" if i < 40 else "yes"
        v2 = "yes" if i < fixed else "no" if i < 40 or i >= CASES - broken else "yes"
        lines.append(f"  - {{id: q{i:03d}, inputs: {{v1: '{v1}', v2: '{v2}'}}, reference: 'yes', grader: {{kind: exact}}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


def cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`evalpipe ARGS` in this process (support.cli.in_process: the same output and exit
    status without a fresh interpreter's imports); tests/test_cli_run.py runs it as a process."""
    return in_process(args, env)


def run(suite: Path, version: str, env: dict, *extra: str, code: int = 0) -> dict:
    proc = cli(["run", str(suite), "--agent", f"python:{AGENTS}:{version}", "--json", *extra], env)
    assert proc.returncode == code, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def env(prefect_harness, home) -> dict:
    return {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}


def test_a_clear_loss_stops_early_blocks_and_its_samples_are_reused(env, tmp_path):
    suite = write_suite(tmp_path / "loss.yaml", broken=60, fixed=0)
    base = run(suite, "v1", env)["run_id"]
    doc = run(suite, "v2", env, "--baseline", base, "--sequential", code=1)
    seq, gate = doc["sequential"], doc["gate"]
    assert seq["decision"] == "block" and seq["stopped_early"]
    assert seq["rounds"] < seq["planned_rounds"] == 10 and seq["cases_planned"] == CASES
    assert seq["samples_drawn"] == seq["cases_drawn"] == doc["samples"] == doc["cases"] < CASES
    assert len(seq["looks"]) == seq["rounds"] and seq["looks"][-1]["upper"] < 0
    assert [look["cases"] for look in seq["looks"]] == [20 * (i + 1) for i in range(seq["rounds"])]
    assert (gate["decision"], gate["verdict"]) == ("block", "regressed")
    assert gate["reasons"][0].startswith(f"sequential: stopped after round {seq['rounds']} of 10")
    assert gate["delta_ci"] == [seq["looks"][-1]["lower"], seq["looks"][-1]["upper"]]

    # The same command again: the same order and looks, every sample from the cache.
    again = run(suite, "v2", env, "--baseline", base, "--sequential", code=1)
    assert again["sequential"]["looks"] == seq["looks"] and again["cached_samples"] == doc["samples"]
    # A later full run draws only the rest.
    full = run(suite, "v2", env, "--baseline", base, code=1)
    assert full["cases"] == CASES and full["cached_samples"] == doc["samples"] and "sequential" not in full
    assert full["gate"]["decision"] == "block"

    shown = cli(["runs", "show", doc["run_id"]], env).stdout
    assert f"sequential: stopped early (block) after {seq['rounds']} of 10 rounds" in shown


def test_a_tie_runs_to_the_end_and_passes(env, tmp_path):
    suite = write_suite(tmp_path / "tie.yaml", broken=10, fixed=10)
    base = run(suite, "v1", env)["run_id"]
    doc = run(suite, "v2", env, "--baseline", base, "--sequential")
    seq = doc["sequential"]
    assert seq["decision"] is None and not seq["stopped_early"]
    assert seq["rounds"] == seq["planned_rounds"] == 10 and seq["cases_drawn"] == CASES == doc["cases"]
    assert seq["samples_drawn"] == seq["samples_planned"] == doc["samples"] == CASES
    assert (doc["gate"]["decision"], doc["gate"]["verdict"]) == ("pass", "inconclusive")
    lo, hi = seq["looks"][-1]["lower"], seq["looks"][-1]["upper"]
    assert lo < 0 < hi


def test_a_clear_win_stops_early_and_passes_unless_a_rule_needs_every_case(env, tmp_path):
    suite = write_suite(tmp_path / "win.yaml", broken=0, fixed=40)
    base = run(suite, "v1", env)["run_id"]
    doc = run(suite, "v2", env, "--baseline", base, "--sequential", "--seed", "3")
    seq = doc["sequential"]
    assert seq["decision"] == "pass" and seq["stopped_early"] and seq["looks"][-1]["lower"] > 0
    assert (doc["gate"]["decision"], doc["gate"]["verdict"]) == ("pass", "improved")
    assert seq["samples_drawn"] < CASES and seq["order_seed"] == 3
    # A threshold on the whole run's pass@1 needs every case: no early pass.
    ruled = run(suite, "v2", env, "--baseline", base, "--sequential", "--min-pass-at-1", "0.5")
    assert not ruled["sequential"]["early_pass"] and ruled["sequential"]["cases_drawn"] == CASES
    assert ruled["gate"]["decision"] == "pass"


def test_sequential_needs_a_baseline(env, tmp_path):
    suite = write_suite(tmp_path / "lonely.yaml", broken=0, fixed=0)
    proc = cli(["run", str(suite), "--agent", f"python:{AGENTS}:v1", "--sequential"], env)
    assert proc.returncode == 2 and "--sequential needs --baseline" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_plan_from_a_baseline_and_when_the_suite_is_too_small(env, tmp_path):
    suite = write_suite(tmp_path / "plan.yaml", broken=0, fixed=0)
    base = run(suite, "v1", env, "-n", "2")["run_id"]
    doc = json.loads(cli(["plan", "--baseline", base, "--detect", "0.3", "--json"], env).stdout)
    # v1 passes 160 of 200 cases always: all spread between cases, none within.
    assert doc["measured_cases"] == CASES and doc["within_case_variance"] == 0
    assert doc["between_case_variance"] == pytest.approx(0.8 * 0.2 * CASES / (CASES - 1))
    assert doc["reachable"] and doc["samples_per_case"] == 1 and doc["suite_cases"] == CASES
    small = cli(["plan", "--baseline", base, "--detect", "0.01"], env)
    assert small.returncode == 2 and "the smallest detectable drop is" in small.stderr
    assert len(small.stderr.strip().splitlines()) == 1
    both = cli(["plan", str(suite), "--baseline", base, "--prior", "0.5", "--detect", "0.1"], env)
    assert both.returncode == 2 and "not both" in both.stderr
    bare = cli(["plan", "--baseline", base], env)
    assert bare.returncode == 2 and "--detect D is required" in bare.stderr


SLOW_AGENT = '''
import os, time

def answer(inputs, ctx):
    with open(os.environ["EVALPIPE_TEST_CALLS"], "a") as fh:
        fh.write(f"{ctx.case_id}#{ctx.index}\\n")
    time.sleep(0.05)
    return inputs.get("v2", "")
'''


def test_a_sequential_run_killed_mid_sequence_resumes_from_its_samples(env, tmp_path):
    import signal
    import time

    suite = write_suite(tmp_path / "resume.yaml", broken=30, fixed=0)
    base = run(suite, "v1", env)["run_id"]
    agent = tmp_path / "slow_agent.py"
    agent.write_text(SLOW_AGENT)
    calls = tmp_path / "calls.txt"
    calls.touch()
    slow_env = {**env, "EVALPIPE_TEST_CALLS": str(calls)}
    args = ["run", str(suite), "--agent", f"python:{agent}:answer", "--baseline", base, "--sequential",
            "--rounds", "20", "--batch-size", "1", "--workers", "1",
            "--agent-concurrency", "1", "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=slow_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(calls.read_text().splitlines()) < 25 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be killed mid-sequence"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    before = len(calls.read_text().splitlines())
    assert 25 <= before < CASES

    done = cli(args, slow_env)
    assert done.returncode == 1, done.stderr
    doc = json.loads(done.stdout)
    seq = doc["sequential"]
    assert seq["decision"] == "block" and seq["stopped_early"]
    # What was stored before the kill is reused, not drawn again: only the few samples in
    # flight (answered, not yet written) are drawn twice.
    in_flight = 5
    assert before - in_flight <= doc["cached_samples"] <= before
    total = len(calls.read_text().splitlines())
    assert seq["samples_drawn"] <= total <= seq["samples_drawn"] + in_flight
    # And the decision and looks are those of an uninterrupted run with the same seed.
    again = json.loads(cli(args, slow_env).stdout)
    assert again["sequential"]["looks"] == seq["looks"] and again["cached_samples"] == seq["samples_drawn"]
