"""The run loop as plain code: plan → reuse cached → draw → grade → store → reduce → gate.

Nothing here knows Prefect or DuckDB: the caller passes where the two stages run (`Stages`:
a Prefect task runner each in the flow, two thread pools in `LocalStages`) and where the
samples are kept (`SampleStore`: `storage.store.Store`).

Drawing and grading are two stages with their own concurrency. Agent calls wait on an API
or a coding agent (`RunConfig.draw_slots` of them in flight); tests take a core each
(`RunConfig.grade_workers`). Grading starts as outputs arrive, and what finishes is stored
together, one database write every STORE_EVERY_S (opening the file costs more than a
cheap sample). Every draw slot is used from the start: a slow agent's calls fan out at
once, a fast agent's samples are shared out among them. An agent that makes no call (its
outputs at hand: `reference`, `replay:`) has no draw tasks: its outputs are drawn here as
the grading tasks take them.

A stage's task is bounded by time, not by count: it starts no new sample after
BATCH_BUDGET_S (a draw task: DRAW_BUDGET_S) and hands back the rest, so a kill loses at most
about that much grading per worker, however cheap or dear a sample is; drawn outputs are not lost at all, each logged
as the agent returns it (`SampleStore.outputs.log`, docs/storage.md). Tasks are cut from what is waiting when a slot
frees (a share of it per slot, never fewer samples than fill CHUNK_FLOOR_S at the rate
seen so far): cheap samples go many to a task, so the ~10 ms a Prefect task costs stays
small, and the last tasks are small, so the slots finish together. On a Dask cluster every
output is graded by the task that drew it (`RunConfig.grades_where_drawn`), and a task is
at least CLUSTER_CHUNK_FLOOR_S of work. Drawn outputs not yet
graded are work at risk too: no new draw starts while the graders have more than
BATCH_BUDGET_S of them waiting.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field, replace
from itertools import takewhile
from typing import Any, Protocol

import pyarrow as pa

from tasks.agents.base import makes_calls
from tasks.agents.model_calls import RecordedCall
from tasks.agents.purse import Purse
from tasks.agents.settings import AgentSettings
from tasks.graders import graded_inline
from tasks.graders.judge import judging
from tasks.metrics.cost import PriceTable
from tasks.metrics.diff import CaseResult
from tasks.metrics.rules import GateRules
from tasks.models import EvalCase, EvalSuite, Sample
from tasks.redaction import secret_values
from tasks.run.budget import Meter, budget_summary
from tasks.run.config import RunConfig
from tasks.run.rescore import RescorePlan
from tasks.run.samples import logged_drawn, row_usage, samples_table, stored_drawn
from tasks.run.sampling import (
    Drawn,
    PlannedSample,
    draw_output,
    grade_drawn,
    stored_output,
    timed_prefix,
)
from tasks.run.sequential import draw_sequentially, stopped_gate
from tasks.run.spec import RunSpec, RunStatus
from tasks.run.steps import batch_cases, batch_label, pending, plan, with_stored_outputs
from tasks.run.stored import StoredOutput
from tasks.run.summary import (
    GateSummary,
    Measured,
    RunOutcome,
    RunSummary,
    measure,
    summary_columns,
)
from tasks.run.usage import priced
from tasks.sandbox.policy import allowing_unsafe
from tasks.settings import MachineSettings, current, using
from tasks.trace import SampleTrace

BATCH_BUDGET_S = 2.0
# A draw task's: longer, as its outputs are safe in its log as they arrive, and each task
# boundary leaves its slot idle while the next task starts (a latency-bound run's chunks
# then end in one wave, not two).
DRAW_BUDGET_S = 2 * BATCH_BUDGET_S
CHUNK_FLOOR_S = 0.5
# A task on a Dask worker costs ~0.15 s more (the worker's own Prefect client reports it to the
# API): cut smaller, a CPU-bound run there spent a third of its time on them.
CLUSTER_CHUNK_FLOOR_S = 2.0
# How long a stopped run waits for the agent calls and gradings in flight: what comes back
# by then is stored; a call still out is made again by the run that resumes it.
INTERRUPT_GRACE_S = 2.0
# How long graded rows wait to be written together (one database write for all of them).
STORE_EVERY_S = 2.0
# How often a draw task looks for the run's stop request between agent calls.
STOP_CHECK_S = 0.05


class OutputLog(Protocol):
    """A draw task's log, to which it appends each output as the agent returns it
    (`storage.outputs.OutputLog`), and through which the run asks it to stop."""

    def stopped(self) -> bool: ...
    def logged(self) -> list[Mapping[str, Any]]: ...
    def appending(self) -> AbstractContextManager[Callable[[Drawn], None]]: ...


class DrawnOutputs(Protocol):
    """Drawn outputs not yet graded: the draw tasks' logs (`storage.outputs.Outputs`)."""

    def fold_logs(self, run_id: str | None = None) -> int: ...
    def drawn(self, output_keys: Sequence[str]) -> dict[str, Mapping[str, Any]]: ...
    def log(self, run_id: str) -> OutputLog: ...
    def store_drawn(self, run_id: str, drawn: Sequence[Drawn]) -> None: ...
    def discard_log(self, log: OutputLog) -> None: ...
    def stop_drawing(self, run_id: str) -> None: ...
    def end_logs(self, run_id: str) -> None: ...


class SampleRows(Protocol):
    """The stored samples: the cache the loop reads and where it writes (`storage.samples.Samples`)."""

    def cached(self, keys: Sequence[tuple[str, str]]) -> pa.Table: ...
    def bought_unfinished(self, output_keys: Sequence[str]) -> pa.Table: ...
    def copy(self, run_id: str, copied: pa.Table) -> None: ...
    def stored_outputs(self, places: pa.Table) -> dict[str, tuple[str | StoredOutput, SampleTrace]]: ...
    def insert(self, rows: pa.Table) -> None: ...
    def of_run(self, run_id: str, columns: Sequence[str] | None = None) -> pa.Table: ...
    def case_results(self, run_id: str, *, records: bool = False) -> list[CaseResult]: ...


class RunRows(Protocol):
    """The run's row and its aggregates (`storage.runs.Runs`)."""

    def recorded(self, spec: RunSpec, stopping: Callable[[], bool] | None = None) -> AbstractContextManager[None]: ...
    def finish(self, run_id: str, status: RunStatus, summary: RunSummary | None) -> None: ...
    def write_aggregates(self, run_id: str, rows: Sequence[tuple]) -> None: ...


class KeptCalls(Protocol):
    """The model calls earlier runs kept, for replay (`storage.model_calls.ModelCalls`)."""

    def recorded(self, agent: str, samples: Sequence[tuple[str, int, int]]
                 ) -> Mapping[tuple[str, int, int], tuple[RecordedCall, ...]]: ...


class SampleStore(Protocol):
    """Where a run is recorded and its samples kept (`storage.store.Store`: the parts it uses)."""

    @property
    def runs(self) -> RunRows: ...
    @property
    def samples(self) -> SampleRows: ...
    @property
    def outputs(self) -> DrawnOutputs: ...
    @property
    def model_calls(self) -> KeptCalls: ...


class Future(Protocol):
    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...
    def result(self) -> Any: ...


class Stages(Protocol):
    """Where the stages run: each call starts one task (at most `RunConfig.draw_slots`
    draws and `grade_workers` gradings are asked for at once) and returns its future."""

    def draw(self, task: DrawTask) -> Future: ...
    def grade(self, task: GradeTask) -> Future: ...


@dataclass(frozen=True)
class InlineGrading:
    """How a draw task grades the outputs of `case_ids` itself (their graders are cheap,
    `GraderSpec.inline`, or the run grades where it draws, `RunConfig.grades_where_drawn`):
    a task less per chunk, and their outputs never pass through the run's process on their
    way to a grader."""

    run_id: str
    case_ids: frozenset[str]
    prices: PriceTable
    regrade: int = 0
    settings: AgentSettings | None = None  # the run's, for its judges (`judging`), as `GradeTask`'s


@dataclass(frozen=True)
class Drew:
    """What a draw task did: the first `count` of its planned samples, as outputs for the
    graders (`drawn`, unpriced) and as sample rows it graded itself (`rows`, priced)."""

    drawn: list[Drawn]
    rows: pa.Table | None
    count: int


@contextmanager
def _as_the_run(settings: AgentSettings | None, unsafe: bool, machine: MachineSettings | None) -> Iterator[None]:
    """Inside: what a stage task carries of its run (its judges' settings, its
    --unsafe-no-sandbox, its machine settings), wherever the task runs."""
    with judging(settings), allowing_unsafe(unsafe), using(machine) if machine is not None else nullcontext():
        yield


@dataclass(frozen=True)
class DrawTask:
    """Draw a prefix of `planned` within `budget_s`, each output appended to `log` as the
    agent returns it (none started once the log says the run is stopping), and grade those
    `inline` names. What an earlier attempt at the task logged (a Dask worker lost mid-task:
    the scheduler runs the task again from its start) is taken from the log, not drawn again."""

    agent: Any
    cases: list[EvalCase]
    planned: list[PlannedSample]
    n: int
    cap: int
    budget_s: float | None = DRAW_BUDGET_S
    log: OutputLog | None = None
    inline: InlineGrading | None = None
    unsafe: bool = False  # the run's --unsafe-no-sandbox (a tool that runs code; inline graders)
    prices: PriceTable | None = None  # the run's, for a cap on a sample's spending
    purse: Purse | None = None  # the run's --max-cost, spent call by call (`Meter.purse`)
    machine: MachineSettings | None = None  # the run's machine settings, as `GradeTask`'s

    @property
    def label(self) -> str:
        return batch_label(self.planned)

    def __call__(self) -> Drew:
        with _as_the_run(self.inline.settings if self.inline is not None else None, self.unsafe, self.machine):
            return self._drawn()

    def _drawn(self) -> Drew:
        by_id = {c.id: c for c in self.cases}
        log, inline = self.log, self.inline
        secrets = secret_values()  # once a task: the environment is read per call otherwise
        handed: list[Drawn] = []
        graded: list[tuple[Sample, PlannedSample]] = []
        with log.appending() if log is not None else nullcontext(None) as append:
            def take(drawn: Drawn) -> None:
                p = drawn.planned
                if inline is not None and p.case_id in inline.case_ids:
                    if (usage := priced(drawn.usage, inline.prices)) is not drawn.usage:
                        drawn = replace(drawn, usage=usage)
                    graded.append((grade_drawn(by_id[p.case_id], drawn, inline.regrade, secrets), p))
                else:
                    handed.append(drawn)

            def draw(p: PlannedSample) -> None:
                drawn = draw_output(self.agent, by_id[p.case_id], p, self.n, self.cap, secrets, self.prices,
                                    self.purse)
                if append is not None:
                    append(drawn)
                take(drawn)

            # All of them, whatever the budget: the log is deleted once what the task returns is stored.
            logged = {r["output_key"]: r for r in log.logged()} if log is not None else {}
            earlier = [logged_drawn(p, logged[p.output_key])
                       for p in takewhile(lambda p: p.output_key in logged, self.planned)]
            for drawn in earlier:
                take(drawn)
            done = timed_prefix(self.planned[len(earlier):], draw, self.budget_s,
                                _at_most_every(STOP_CHECK_S, log.stopped) if log is not None else None)
        rows = None
        if graded and inline is not None:
            samples, planned = zip(*graded, strict=True)
            rows = samples_table(inline.run_id, samples, planned)
        return Drew(handed, rows, len(earlier) + len(done))


@dataclass(frozen=True)
class GradeTask:
    """Grade a prefix of `drawn` within `budget_s`: the graded samples as sample rows."""

    run_id: str
    cases: list[EvalCase]
    drawn: list[Drawn]
    regrade: int = 0
    budget_s: float | None = BATCH_BUDGET_S
    settings: AgentSettings | None = None  # the run's, for its judges (`tasks.graders.judge.judging`)
    # The run's --unsafe-no-sandbox, entered where the task runs (a thread, a worker process, a
    # Dask worker): a setting of this run, not of the process, which may hold others.
    unsafe: bool = False
    # The machine settings the run's edge read (`tasks.settings`), entered where the task runs:
    # never those of the worker's own environment. None: those of where it runs.
    machine: MachineSettings | None = None

    @property
    def label(self) -> str:
        return batch_label([d.planned for d in self.drawn])

    def __call__(self) -> pa.Table:
        with _as_the_run(self.settings, self.unsafe, self.machine):
            return self._graded()

    def _graded(self) -> pa.Table:
        by_id = {c.id: c for c in self.cases}
        secrets = secret_values()

        def graded(d: Drawn) -> Sample:
            sample = grade_drawn(by_id[d.planned.case_id], d, self.regrade, secrets)
            # A stored output's row refers to it (`samples_table`): its text is not kept, so a
            # task holds one output at a time, however many it grades.
            return sample.model_copy(update={"output": ""}) if isinstance(d.output, StoredOutput) else sample

        samples = timed_prefix(self.drawn, graded, self.budget_s)
        return samples_table(self.run_id, samples, [d.planned for d in self.drawn[: len(samples)]])


def _at_most_every(seconds: float, check: Callable[[], bool]) -> Callable[[], bool]:
    """`check`, asked at most once every `seconds` (its last answer in between): a stop
    request is a file, and a cheap sample costs less than looking for it."""
    last = [-math.inf, False]

    def checked() -> bool:
        now = time.monotonic()
        if now - last[0] >= seconds:
            last[:] = [now, check()]
        return last[1]

    return checked


@dataclass
class LocalStages:
    """The stages on two thread pools of this process: the loop without Prefect."""

    draws: ThreadPoolExecutor
    grades: ThreadPoolExecutor

    def draw(self, task: DrawTask) -> Future:
        return self.draws.submit(task)

    def grade(self, task: GradeTask) -> Future:
        return self.grades.submit(task)


@contextmanager
def local_stages(config: RunConfig) -> Iterator[LocalStages]:
    with ThreadPoolExecutor(config.draw_slots, "evalpipe-draw") as draws, \
            ThreadPoolExecutor(config.grade_workers, "evalpipe-grade") as grades:
        yield LocalStages(draws, grades)


Progress = Callable[[int, int], None]  # (samples done, samples total)


@dataclass
class Drawing:
    """How drawing went: the meter of what was drawn and spent, and how many samples were
    left undrawn because the budget was spent."""

    meter: Meter
    undrawn: int = 0


def reuse_cached(spec: RunSpec, planned: list[PlannedSample], store: SampleStore, meter: Meter | None = None,
                 prices: PriceTable | None = None) -> list[PlannedSample]:
    """Store the samples found in the cache as this run's; the planned samples left to draw
    (or to grade anew from a stored output). Stored usage without a price is priced by
    `prices` (a price file given after the draw). `meter` (a budgeted run's): counts the
    reused outputs that runs which never finished bought (`SampleStore.samples.bought_unfinished`,
    and the outputs drawn and never graded), so that a resumed run's budget covers what the
    run it resumes spent. A `--fresh` run reuses nothing: every planned sample is drawn."""
    if spec.config.get("fresh"):
        return list(planned)
    prices = prices or PriceTable()
    store.outputs.fold_logs()  # the outputs a killed run (or a lost worker) logged and never stored
    stored = store.samples.cached([(p.output_key, p.cache_key) for p in planned])
    reuse = pending(spec, planned, stored).priced(prices)
    charged = meter is not None and meter.budget.limited
    if charged:
        bought = store.samples.bought_unfinished(stored["output_key"].to_pylist())
        meter.add([priced(row_usage(row), prices).cost_usd for row in bought.to_pylist()])
    store.samples.copy(spec.run_id, reuse.copied)  # in the database: outputs never pass through here
    outputs = store.samples.stored_outputs(reuse.regrade.select(["run_id", "case_id", "sample_index"]))
    missing = with_stored_outputs(reuse.missing, reuse.regrade, outputs, prices)
    # Drawn and never graded (the run was stopped or killed first): graded now, not bought again.
    drawn = store.outputs.drawn([p.output_key for p in missing if p.output is None])
    missing = [stored_drawn(p, row, prices) if (row := drawn.get(p.output_key)) else p for p in missing]
    if charged:
        meter.add([p.usage.cost_usd for p in missing if p.output_key in drawn and p.usage])
    return missing


@dataclass
class _Pace:
    """Seconds per sample a stage has taken so far, per slot."""

    seconds: float = 0.0
    samples: int = 0

    def add(self, seconds: float, samples: int) -> None:
        self.seconds, self.samples = self.seconds + seconds, self.samples + samples

    @property
    def per_sample(self) -> float | None:
        return self.seconds / self.samples if self.samples else None

    def chunk(self, waiting: int, slots: int, floor_s: float = CHUNK_FLOOR_S) -> int:
        """How many of `waiting` samples the next task takes: a share per slot, never fewer
        than fill `floor_s` at the pace so far."""
        share = math.ceil(waiting / slots)
        floor = int(floor_s / self.per_sample) if self.per_sample else 1
        return max(1, min(waiting, max(share, floor)))


@dataclass
class _Scheduler:
    """The two stages fed from their queues, and their results stored as they finish.

    Each draw task appends its outputs to a log of its own as the agent returns them
    (`SampleStore.outputs.log`); the log is deleted once every output in it is graded and its
    sample stored. On an interrupt (Ctrl-C, a termination signal, a failed task) no new
    agent call starts; the tasks in flight get INTERRUPT_GRACE_S to come back, and what was
    drawn and not graded is stored for the run that resumes this one."""

    spec: RunSpec
    config: RunConfig
    cases: Mapping[str, EvalCase]
    agent: Any
    stages: Stages
    store: SampleStore
    prices: PriceTable
    progress: Progress | None
    done: int
    total: int
    meter: Meter
    to_draw: deque[PlannedSample]
    to_grade: deque[Drawn]
    inline: InlineGrading | None = None  # the cases whose outputs their draw task grades
    # Planned samples of an agent whose outputs are at hand (`makes_calls`): drawn here as
    # the graders take them, as if they were waiting in `to_grade`.
    at_hand: deque[PlannedSample] = field(default_factory=deque)
    undrawn: int = 0
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    running: dict[Any, tuple[str, list, float, OutputLog | None]] = field(default_factory=dict)
    draw_pace: _Pace = field(default_factory=_Pace)
    grade_pace: _Pace = field(default_factory=_Pace)
    # The machine settings the run entered (`service.run.execute`), carried by each task.
    machine: MachineSettings = field(default_factory=current)
    # A drawn output's log (by output key), and how many outputs of each log are not stored yet.
    log_of: dict[str, OutputLog] = field(default_factory=dict)
    unstored: dict[OutputLog, int] = field(default_factory=dict)
    # Graded rows not written yet, and when the last write was (see `_store`).
    held: list[tuple[pa.Table, OutputLog | None]] = field(default_factory=list)
    stored_at: float = field(default_factory=time.monotonic)

    def in_flight(self, kind: str) -> int:
        return sum(1 for k, *_ in self.running.values() if k == kind)

    def _start(self, kind: str, items: list, future: Future, log: OutputLog | None = None) -> None:
        self.running[id(future)] = (kind, items, time.monotonic(), log)
        future.add_done_callback(lambda f, key=id(future): self.events.put((key, f)))

    def _size(self, waiting: int, pace: _Pace, slots: int) -> int:
        if self.config.batch_size:  # the user's size, in cases
            return self.config.batch_size * self.spec.n
        return pace.chunk(waiting, slots, CLUSTER_CHUNK_FLOOR_S if self.config.grades_where_drawn else CHUNK_FLOOR_S)

    def _take(self, waiting: deque, pace: _Pace, slots: int) -> list:
        size = self._size(len(waiting), pace, slots)
        return [waiting.popleft() for _ in range(min(size, len(waiting)))]

    def _to_grade(self, slots: int) -> list[Drawn]:
        """The next grading task's outputs: those waiting, then outputs at hand drawn here."""
        size = self._size(len(self.to_grade) + len(self.at_hand), self.grade_pace, slots)
        chunk = [self.to_grade.popleft() for _ in range(min(size, len(self.to_grade)))]
        if len(chunk) < size and self.at_hand:
            secrets = secret_values()
            planned = [self.at_hand.popleft() for _ in range(min(size - len(chunk), len(self.at_hand)))]
            drawn = [draw_output(self.agent, self.cases[p.case_id], p, self.spec.n, self.config.output_cap, secrets)
                     for p in planned]
            self.meter.add([d.usage.cost_usd for d in drawn])
            chunk += drawn
        return chunk

    def _draw_limit(self) -> int:
        """Draws in flight allowed now: a cost budget allows no more calls than it can still
        pay for at the dearest call seen (one while no call has been priced)."""
        slots = self.config.stage_slots
        limit = self.meter.budget.max_cost_usd
        if limit is None:
            return slots
        if not self.meter.dearest:
            return 1
        return max(1, min(slots, math.floor((limit - self.meter.cost_usd) / self.meter.dearest)))

    def _backlog_ok(self) -> bool:
        """Whether the graders' queue is short enough for more draws (work at risk)."""
        per_sample = self.grade_pace.per_sample
        if per_sample is None:
            return len(self.to_grade) <= self.config.grade_workers * self.config.draw_slots
        return len(self.to_grade) * per_sample / self.config.grade_workers <= BATCH_BUDGET_S

    def top_up(self) -> None:
        slots = self.config.grade_workers
        while (self.to_grade or self.at_hand) and self.in_flight("grade") < slots:
            drawn = self._to_grade(slots)
            task = GradeTask(self.spec.run_id, batch_cases(self.cases, [d.planned for d in drawn]), drawn,
                             self.spec.regrade, BATCH_BUDGET_S, self.config.agent_settings,
                             self.config.unsafe_no_sandbox, self.machine)
            self._start("grade", drawn, self.stages.grade(task))
        while (self.to_draw and self.meter.may_draw and self.in_flight("draw") < self._draw_limit()
               and self._backlog_ok()):
            paced = self.meter.budget.max_cost_usd is not None
            planned = [self.to_draw.popleft()] if paced else self._take(self.to_draw, self.draw_pace,
                                                                         self.config.stage_slots)
            log = self.store.outputs.log(self.spec.run_id)
            task = DrawTask(self.agent, batch_cases(self.cases, planned), planned, self.spec.n,
                            self.config.output_cap, DRAW_BUDGET_S, log, self.inline, self.config.unsafe_no_sandbox,
                            self.prices, self.meter.purse, self.machine)
            self._start("draw", planned, self.stages.draw(task), log)

    def _ready(self, timeout: float | None) -> list[tuple[tuple[str, list, float, OutputLog | None], Any]]:
        """The tasks finished by now, waiting up to `timeout` for the first (None: as long as it takes)."""
        try:
            ready = [self.events.get(timeout=timeout)]
        except queue.Empty:
            return []
        while not self.events.empty():
            ready.append(self.events.get())
        return [(self.running.pop(key), future) for key, future in ready]

    def finished(self, ready: list) -> list[tuple[pa.Table, OutputLog | None]]:
        """Handle finished tasks: drawn outputs go to the graders, graded rows are returned
        to be stored (those a draw task graded with its log, see `_store`), the undone rest
        of a task that ran out of time waits again at the front."""
        rows = []
        for (kind, items, started, log), future in ready:
            result = future.result()  # a failed task raises its exception
            took = time.monotonic() - started
            if kind == "draw":
                drawn = [replace(d, usage=priced(d.usage, self.prices)) for d in result.drawn]
                graded = result.rows.num_rows if result.rows is not None else 0
                self.draw_pace.add(took, result.count)
                self.meter.add([d.usage.cost_usd for d in drawn]
                               + (result.rows["cost_usd"].to_pylist() if graded else []))
                self._logged(drawn, graded, log)
                self.to_grade.extend(drawn)
                if graded:
                    rows.append((result.rows, log))
                rest = items[result.count:]
                if self.meter.may_draw:
                    self.to_draw.extendleft(reversed(rest))
                else:
                    self.undrawn += len(rest)
            else:
                self.grade_pace.add(took, result.num_rows)
                self.to_grade.extendleft(reversed(items[result.num_rows:]))
                rows.append((result, None))
        return rows

    def _logged(self, drawn: list[Drawn], graded: int, log: OutputLog | None) -> None:
        """Count a draw task's outputs against its log: `drawn` for the graders, and
        `graded` rows it graded itself."""
        if log is None:
            return
        if not drawn and not graded:
            self.store.outputs.discard_log(log)
            return
        self.unstored[log] = len(drawn) + graded
        self.log_of.update((d.planned.output_key, log) for d in drawn)

    def _release(self, log: OutputLog, stored: int) -> None:
        """`stored` more of `log`'s outputs are stored as samples: once all are, it is deleted."""
        self.unstored[log] -= stored
        if not self.unstored[log]:
            del self.unstored[log]
            self.store.outputs.discard_log(log)

    def _store(self, rows: list[tuple[pa.Table, OutputLog | None]], *, now: bool = False) -> None:
        """Store graded rows, together with those held back since the last write, once
        STORE_EVERY_S has passed since it (or `now`): a write opens the database, which costs
        more than grading a cheap sample, and rows held back are not lost on a kill (their
        outputs' logs stay until they are stored). A log all of whose outputs are now stored
        is deleted."""
        self.held.extend(rows)
        if not self.held or not (now or time.monotonic() - self.stored_at >= STORE_EVERY_S):
            return
        held, self.held, self.stored_at = self.held, [], time.monotonic()
        table = pa.concat_tables([rows for rows, _ in held])
        self.store.samples.insert(table)
        for rows, log in held:
            if log is not None:  # graded by the task that drew them, all from its log
                self._release(log, rows.num_rows)
                continue
            for key in rows["output_key"].to_pylist():
                if (drawn_in := self.log_of.pop(key, None)) is not None:
                    self._release(drawn_in, 1)
        self.done += table.num_rows
        if self.progress:
            self.progress(self.done, self.total)

    def run(self) -> None:
        try:
            self.top_up()
            while self.running:
                # Rows held back are written when their time comes, even if no task finishes by then.
                wait = max(0.0, self.stored_at + STORE_EVERY_S - time.monotonic()) if self.held else None
                rows = self.finished(self._ready(wait))
                self.top_up()  # the stages get more before this thread writes
                self._store(rows)
            self._store([], now=True)
        except BaseException:
            self._wind_down()
            raise
        self.store.outputs.end_logs(self.spec.run_id)
        self.undrawn += len(self.to_draw) + len(self.at_hand)

    def _wind_down(self) -> None:
        """Stopped (an interrupt, a failed task): start no new agent call, give the tasks in
        flight up to INTERRUPT_GRACE_S to come back, store what they graded, and store every
        output drawn and not graded (what the tasks still out have logged so far included),
        so that the same command grades it instead of paying for it again."""
        self.store.outputs.stop_drawing(self.spec.run_id)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while self.running and (left := deadline - time.monotonic()) > 0:
            for entry, future in self._ready(left):
                try:
                    self.held.extend(self.finished([(entry, future)]))
                except Exception:  # noqa: S112 - a failed task has nothing to store; the others may
                    continue
        with suppress(Exception):  # as below: the logs keep what cannot be stored now
            self._store([], now=True)
        # The run is ending on an error or a signal already, which is what is reported; the
        # logs stay for the next run if the database cannot take their outputs now.
        with suppress(Exception):
            self.store.outputs.store_drawn(self.spec.run_id, [d for d in self.to_grade if not d.cached])
            self.store.outputs.fold_logs(self.spec.run_id)


def draw_and_grade(spec: RunSpec, config: RunConfig, suite: EvalSuite, agent: Any, missing: list[PlannedSample],
                   total: int, store: SampleStore, stages: Stages, *, prices: PriceTable | None = None,
                   progress: Progress | None = None, meter: Meter | None = None) -> Drawing:
    """Draw the missing samples, grade them (and the stored outputs among them, without an
    agent call) and store them as they finish. A budgeted run draws index first and starts
    no agent call once the budget is spent; what is left is counted `undrawn`. `meter`: the
    run's (what it had spent before, see `reuse_cached`), shared by all its draws (a
    sequential run's rounds) so that one budget holds over all of them; default: a new one."""
    budget = config.budget
    meter = meter or Meter(budget)
    if progress:
        progress(total - len(missing), total)
    wanted = [p for p in missing if p.output is None]
    to_draw, cut = budget.order(wanted, meter.drawn) if meter.may_draw else ([], wanted)
    if config.replay_model_calls and to_draw and agent is not None and makes_calls(agent):
        to_draw = with_recorded_calls(spec.agent, to_draw, store)
    stored = [stored_output(p) for p in missing if p.output is not None]
    if not stored and not to_draw:
        return Drawing(meter, len(cut))
    prices = prices or PriceTable()
    inline = frozenset(c.id for c in suite.cases if config.grades_where_drawn or graded_inline(c))
    # Outputs at hand (the reference, a recording) are made here as the graders take them: a
    # `sample` task for them would cost more (~10 ms here and ~35 ms of the server's CPU) than
    # the draw. Not on a cluster, where the task that draws an output grades it, nor under a
    # cost budget, which draws one sample at a time.
    at_hand = (agent is not None and not makes_calls(agent) and not config.grades_where_drawn
               and budget.max_cost_usd is None)
    scheduler = _Scheduler(spec, config, {c.id: c for c in suite.cases}, agent, stages, store,
                           prices, progress, total - len(missing), total, meter,
                           deque() if at_hand else deque(to_draw), deque(stored),
                           InlineGrading(spec.run_id, inline, prices, spec.regrade, config.agent_settings)
                           if inline else None, deque(to_draw) if at_hand else deque())
    scheduler.run()
    return Drawing(meter, len(cut) + scheduler.undrawn)


def with_recorded_calls(agent_spec: str, planned: list[PlannedSample], store: SampleStore) -> list[PlannedSample]:
    """`--replay-model-calls`: each planned sample with the calls an earlier run of the agent
    spec kept for its case, index and seed (none: an empty record, its calls kept anew)."""
    kept = store.model_calls.recorded(agent_spec, [(p.case_id, p.index, p.seed) for p in planned])
    return [replace(p, replay=kept.get((p.case_id, p.index, p.seed), ())) for p in planned]


def reduce_run(spec: RunSpec, suite: EvalSuite, store: SampleStore) -> Measured:
    """The one reduction: read the run's samples back, measure, store the aggregates."""
    measured = measure(spec, suite, store.samples.of_run(spec.run_id, summary_columns(spec, suite)))
    store.runs.write_aggregates(spec.run_id, measured.rows())
    return measured


@dataclass(frozen=True)
class Gate:
    """A run's gate: the baseline it is compared with, and the check of its figures (the
    `gate --json` document)."""

    baseline: str | None  # None: the rules that need no baseline (`flows.gate.run_gate`)
    check: Callable[[Measured], GateSummary | Mapping[str, Any] | None]
    rules: GateRules = GateRules()  # what a sequential run may stop on before the check


def run_loop(spec: RunSpec, config: RunConfig, suite: EvalSuite, agent: Any, store: SampleStore, stages: Stages, *,
             prices: PriceTable | None = None, progress: Progress | None = None, gate: Gate | None = None,
             no_baseline: str | None = None, log: logging.Logger | logging.LoggerAdapter | None = None,
             reduce: Callable[[RunSpec, EvalSuite, SampleStore], Measured] = reduce_run,
             started: float | None = None, rescoring: RescorePlan | None = None,
             stopping: Callable[[], bool] | None = None) -> RunSummary:
    """A whole run, recorded in `store` from `running` to its end status: plan, reuse what is
    cached, draw and grade the rest (`config.sequential` with a `gate`: in rounds, until its
    decision is made, each look logged to `log`), reduce, and `gate` the figures
    (`no_baseline`: one was asked for and none exists, said in the summary); then the summary,
    built once. `started`: when the run began (`time.perf_counter()`), for its `duration_s`;
    default: now. `rescoring`: a rescore, which grades another run's stored outputs in place
    of drawing (no agent is called) and is gated, budgeted and summarized as any run.
    `stopping`: whether the process was asked to stop (a signal), so that an error the stop
    surfaced as records the run `interrupted`, not `failed`."""
    started = time.perf_counter() if started is None else started
    with store.runs.recorded(spec, stopping):
        planned = plan(suite, spec)
        record = None
        if rescoring is not None:
            store.samples.insert(rescoring.failed_calls)
            drawing = draw_and_grade(spec, config, suite, None, rescoring.to_grade,
                                     len(rescoring.to_grade) + rescoring.failed_calls.num_rows, store, stages,
                                     progress=progress)
        elif config.sequential and gate is not None and gate.baseline is not None:
            meter = Meter(config.budget)  # one for the run: every round spends from it

            def draw_round(chunk: list[PlannedSample], shown: Progress | None) -> int:
                return draw_and_grade(spec, config, suite, agent, reuse_cached(spec, chunk, store, meter, prices),
                                      len(chunk), store, stages, prices=prices, progress=shown, meter=meter).undrawn

            drawn = draw_sequentially(spec, config, suite, planned, store.samples, draw_round, baseline=gate.baseline,
                                      rules=gate.rules, progress=progress, log=log or logging.getLogger("evalpipe"))
            record, drawing = drawn.record, Drawing(meter, drawn.undrawn)
        else:
            meter = Meter(config.budget)
            missing = reuse_cached(spec, planned, store, meter, prices)
            drawing = draw_and_grade(spec, config, suite, agent, missing, len(planned), store, stages,
                                     prices=prices, progress=progress, meter=meter)
        measured = reduce(spec, suite, store)
        decided = gate.check(measured) if gate is not None else None  # None: nothing to decide
        checked = GateSummary.model_validate(decided) if decided is not None else None
        cases = None
        if record is not None and record.stopped_early and checked is not None:
            checked, cases = stopped_gate(checked, record), record.cases_drawn  # `sequential` has the suite's count
        summary = measured.summary(RunOutcome(
            gate=checked,
            no_baseline=no_baseline,
            budget=budget_summary(config.budget, drawing.meter, drawing.undrawn) if config.budget.limited else None,
            undrawn_samples=drawing.undrawn,
            sequential=record.to_json() if record is not None else None,
            cases=len(suite.cases) - len(rescoring.unscored) if rescoring is not None else cases,
            source_run=rescoring.source_run if rescoring is not None else None,
            unscored=rescoring.unscored if rescoring is not None else None,
            sandbox=spec.config.get("sandbox"),
            duration_s=round(time.perf_counter() - started, 3),
        ))
        store.runs.finish(spec.run_id, RunStatus.partial if summary.partial else RunStatus.completed, summary)
    return summary
