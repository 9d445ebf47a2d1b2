"""The run loop without Prefect (`tasks.run.loop`): plain thread pools for the stages, a real
DuckDB file for the store."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import duckdb
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from support.graders import IN_A_TASK

from storage.samples import Samples
from storage.store import Store
from tasks.agents import load_agent
from tasks.agents.base import makes_calls
from tasks.agents.python import CallableAgent
from tasks.models import PlatformError
from tasks.run import RunConfig, RunSpec, RunStatus, plan
from tasks.run.loop import LocalStages, _Pace, local_stages, run_loop
from tasks.suites.dataset import build_suite

ROOT = Path(__file__).resolve().parent.parent


def toy_suite(cases: int, kind: str = "exact"):
    return build_suite("toy", [(f"case {i}", {"id": f"q{i:03d}", "inputs": {"i": i}, "reference": "yes",
                                              "grader": {"kind": kind}}) for i in range(cases)], {}, "test")


def spec_for(config: RunConfig, suite, agent) -> RunSpec:
    return RunSpec(suite_version=suite.version, suite_name=suite.name, agent=agent.spec,
                   agent_fingerprint=agent.fingerprint, n=config.n, ks=list(config.k), seed=config.seed,
                   regrade=config.regrade,
                   config=config.recorded())


def rows(home: Path, sql: str, *params):
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        return con.execute(sql, list(params)).fetchall()


def answer(inputs, ctx) -> str:
    return "yes" if (inputs["i"] + ctx.index) % 3 else "no"


def loop_run(home: Path, suite, agent, **options):
    config = RunConfig(suite="toy", agent=agent.spec, **options)
    store = Store(home)
    spec = spec_for(config, suite, agent)
    with local_stages(config) as stages:
        return run_loop(spec, config, suite, agent, store, stages)


def test_the_loop_runs_without_prefect_and_a_rerun_is_served_from_the_store(tmp_path):
    home, suite = tmp_path / "home", toy_suite(6)
    calls: list[str] = []

    def agent_fn(inputs, ctx):
        calls.append(f"{ctx.case_id}#{ctx.index}")
        return answer(inputs, ctx)

    agent = CallableAgent.of(agent_fn)
    first = loop_run(home, suite, agent, n=3, k=(1, 3), workers=2, agent_concurrency=4)
    assert first.samples == 18 and first.cached_samples == 0 and len(calls) == 18
    expected = sum((i + j) % 3 != 0 for i in range(6) for j in range(3)) / 18
    assert first.pass_at_k["1"] == pytest.approx(expected)
    assert rows(home, "SELECT status FROM runs WHERE run_id = ?", first.run_id) == [(RunStatus.completed,)]
    assert rows(home, "SELECT count(DISTINCT (case_id, sample_index)) FROM samples WHERE run_id = ?",
                first.run_id) == [(18,)]

    again = loop_run(home, suite, agent, n=3, k=(1, 3), workers=2, agent_concurrency=4)
    assert again.cached_samples == 18 and len(calls) == 18  # no agent call
    assert again.pass_at_k == first.pass_at_k
    # Copied row to row in the database: every column the same but the run's own.
    from storage.db import DERIVED_COLUMNS
    from tasks.run.samples import SAMPLE_COLUMNS

    kept = [c for c in (*SAMPLE_COLUMNS, *DERIVED_COLUMNS) if c not in ("run_id", "cached")]
    listed = f"SELECT {', '.join(kept)} FROM samples WHERE run_id = ? ORDER BY case_id, sample_index"
    assert rows(home, listed, again.run_id) == rows(home, listed, first.run_id)
    assert rows(home, "SELECT bool_and(cached), count(output_head) FROM samples WHERE run_id = ?",
                again.run_id) == [(True, 18)]


def test_agent_calls_run_beyond_the_graders_and_grading_starts_as_outputs_arrive(tmp_path):
    """workers=1, agent_concurrency=6: six agent calls in flight at once, never more than one
    grading task, and the first grading starts before the last draw is done."""
    lock, in_flight, peak = threading.Lock(), [0], [0]
    gathered = threading.Event()

    def agent_fn(inputs, ctx):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            if in_flight[0] >= 4:
                gathered.set()
        gathered.wait(1)  # hold until 4 calls are in flight together (or give up: peak says so)
        time.sleep(0.01)
        with lock:
            in_flight[0] -= 1
        return answer(inputs, ctx)

    events: list[tuple[str, str, float]] = []
    grading, grade_peak = [0], [0]

    class Watched(LocalStages):
        def draw(self, task):
            def run():
                out = task()
                events.append(("draw", "end", time.monotonic()))
                return out
            return self.draws.submit(run)

        def grade(self, task):
            def run():
                with lock:
                    grading[0] += 1
                    grade_peak[0] = max(grade_peak[0], grading[0])
                events.append(("grade", "start", time.monotonic()))
                try:
                    return task()
                finally:
                    with lock:
                        grading[0] -= 1
            return self.grades.submit(run)

    suite, agent = toy_suite(24, IN_A_TASK), CallableAgent.of(agent_fn)  # graded in tasks of their own
    config = RunConfig(suite="toy", agent=agent.spec, workers=1, agent_concurrency=6)
    with local_stages(config) as plain:
        summary = run_loop(spec_for(config, suite, agent), config, suite, agent, Store(tmp_path / "home"),
                           Watched(plain.draws, plain.grades))
    assert summary.samples == 24
    assert peak[0] >= 4 > config.grade_workers  # the old single knob kept calls to `workers`
    assert grade_peak[0] == 1
    first_grade = min(t for kind, what, t in events if kind == "grade")
    last_draw = max(t for kind, what, t in events if kind == "draw")
    assert first_grade < last_draw


def test_a_sample_budget_ends_the_run_partial_and_counts_what_it_left(tmp_path):
    suite = toy_suite(5)
    agent = CallableAgent.of(answer)
    summary = loop_run(tmp_path / "home", suite, agent, n=2, max_samples=3)
    assert summary.partial and summary.undrawn_samples == 7 and summary.samples == 3
    assert summary.budget.drawn_samples == 3 and "--max-samples 3" in summary.budget.stopped
    # Index first: sample 0 of three cases, none of sample 1.
    assert rows(tmp_path / "home", "SELECT DISTINCT sample_index FROM samples") == [(0,)]
    assert rows(tmp_path / "home", "SELECT status FROM runs") == [(RunStatus.partial,)]
    with pytest.raises(ValidationError, match="frozen"):  # built once: nothing patches it afterwards
        summary.partial = False


def test_a_failing_store_fails_the_run_and_records_it(tmp_path):
    class Full(Samples):
        def insert(self, rows):
            if rows.num_rows:
                raise PlatformError("disk full writing samples")
            super().insert(rows)

    home, suite = tmp_path / "home", toy_suite(4)
    full = Store(home)
    object.__setattr__(full, "samples", Full(full.db))  # a full disk under the samples alone
    agent = CallableAgent.of(answer)
    config = RunConfig(suite="toy", agent=agent.spec, workers=2)
    spec = spec_for(config, suite, agent)
    with local_stages(config) as stages, pytest.raises(PlatformError, match="disk full"):
        run_loop(spec, config, suite, agent, full, stages)
    assert rows(home, "SELECT status FROM runs WHERE run_id = ?", spec.run_id) == [(RunStatus.failed,)]


def test_stored_outputs_graded_anew_cost_no_agent_call(tmp_path):
    """`regrade`: every stored output is graded again, none drawn again."""
    home, suite = tmp_path / "home", toy_suite(3)
    calls: list[int] = []

    def agent_fn(inputs, ctx):
        calls.append(1)
        return answer(inputs, ctx)

    agent = CallableAgent.of(agent_fn)
    loop_run(home, suite, agent, n=2)
    regraded = loop_run(home, suite, agent, n=2, regrade=2)
    assert len(calls) == 6 and regraded.samples == 6 and regraded.cached_samples == 6
    assert regraded.env_flaky_samples == 0


def test_a_spec_agent_and_the_plan_it_makes_are_the_flows(tmp_path):
    """The loop takes an agent loaded from a spec as the flow does: same plan, same keys."""
    suite = toy_suite(2)
    agent = load_agent(f"python:{ROOT / 'tests/support/agents.py'}:flaky")
    config = RunConfig(suite="toy", agent=agent.spec, n=2)
    spec = spec_for(config, suite, agent)
    summary = loop_run(tmp_path / "home", suite, agent, n=2)
    stored = {(c, i, k) for c, i, k in rows(tmp_path / "home", "SELECT case_id, sample_index, cache_key FROM samples")}
    assert stored == {(p.case_id, p.index, p.cache_key) for p in plan(suite, spec)}
    assert summary.agent == agent.spec


@given(waiting=st.integers(1, 10**6), slots=st.integers(1, 256),
       per_sample=st.one_of(st.none(), st.floats(1e-6, 100)))
def test_a_task_takes_a_share_of_what_waits_and_never_less_than_its_time_floor(waiting, slots, per_sample):
    pace = _Pace() if per_sample is None else _Pace(per_sample, 1)
    size = pace.chunk(waiting, slots)
    assert 1 <= size <= waiting
    assert size >= min(waiting, math.ceil(waiting / slots))
    if per_sample is not None and size > math.ceil(waiting / slots):
        assert (size - 1) * per_sample <= 0.5  # more than a share only to fill the floor


def test_the_output_cap_comes_with_the_run_not_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("EVALPIPE_MAX_OUTPUT_BYTES", raising=False)
    home, suite = tmp_path / "home", toy_suite(1)
    agent = CallableAgent.of(lambda inputs, ctx: "y" * 100)
    loop_run(home, suite, agent, max_output_bytes=10)
    ((output, trace),) = rows(home, "SELECT output, trace FROM samples")
    assert output.startswith("y" * 10 + "\n[evalpipe: output truncated at 10 bytes]")
    assert '"cap_bytes": 10' in trace


def test_the_flows_parameters_are_the_run_configuration():
    """The deployment's form and `RunConfig` are one list: a new option is both or neither."""
    from flows.evaluate import evaluate

    assert set(evaluate.parameters.properties) == set(RunConfig.model_fields)


def test_cheap_graders_grade_where_the_output_is_drawn_and_others_in_grading_tasks(tmp_path):
    """A suite mixing `exact` (inline) and a grader of a task of its own: every sample is
    stored once with the verdict either path gives, the grading tasks see only the second
    kind, and no output log is left behind."""
    cheap = toy_suite(6)
    dear = toy_suite(6, IN_A_TASK)
    cases = [*cheap.cases, *(c.model_copy(update={"id": f"d{c.id}"}) for c in dear.cases)]
    suite = build_suite("mixed", [(c.id, c.model_dump(mode="json", include={"id", "inputs", "reference", "grader"}))
                                  for c in cases], {}, "test")
    graded_in_tasks: list[str] = []

    class Watched(LocalStages):
        def grade(self, task):
            graded_in_tasks.extend(d.planned.case_id for d in task.drawn)
            return super().grade(task)

    agent = CallableAgent.of(answer)
    config = RunConfig(suite="mixed", agent=agent.spec, n=3, workers=1)
    home = tmp_path / "home"
    with local_stages(config) as plain:
        summary = run_loop(spec_for(config, suite, agent), config, suite, agent, Store(home),
                           Watched(plain.draws, plain.grades))
    assert summary.samples == 36
    assert sorted(set(graded_in_tasks)) == sorted(c.id for c in suite.cases if c.id.startswith("d"))
    assert len(graded_in_tasks) == 18
    # The same verdicts either way: the two graders agree on every output.
    by_case = dict(rows(home, "SELECT case_id, list(status ORDER BY sample_index) FROM samples GROUP BY case_id"))
    assert all(by_case[f"d{cid}"] == by_case[cid] for cid in (c.id for c in cheap.cases))
    assert rows(home, "SELECT count(*), count(DISTINCT (case_id, sample_index)) FROM samples") == [(36, 36)]
    assert not list((home / "spool").rglob("*.log"))


def test_outputs_at_hand_are_drawn_as_the_graders_take_them_with_no_sampling_task(tmp_path):
    """The `reference` agent makes no call: its outputs are drawn by the loop as grading
    tasks take them, so the run starts no sampling task, and every sample is stored once
    with the reference's verdict."""
    suite = toy_suite(7, IN_A_TASK)
    agent = load_agent("reference")
    started: dict[str, int] = {"draw": 0, "grade": 0}

    class Counted(LocalStages):
        def draw(self, task):
            started["draw"] += 1
            return super().draw(task)

        def grade(self, task):
            started["grade"] += 1
            return super().grade(task)

    config = RunConfig(suite="toy", agent=agent.spec, n=4, workers=2)
    home = tmp_path / "home"
    with local_stages(config) as plain:
        summary = run_loop(spec_for(config, suite, agent), config, suite, agent, Store(home),
                           Counted(plain.draws, plain.grades))
    assert started["draw"] == 0
    assert started["grade"] >= 1
    assert summary.samples == 28
    assert rows(home, "SELECT status, count(*), count(DISTINCT (case_id, sample_index)) FROM samples"
                      " GROUP BY status") == [("passed", 28, 28)]
    # A recording is at hand too; an agent that runs the user's code is not.
    recording = tmp_path / "outputs.jsonl"
    recording.write_text('{"case_id": "q000", "output": "yes"}\n')
    assert not makes_calls(load_agent(f"replay:{recording}"))
    assert makes_calls(CallableAgent.of(answer))
