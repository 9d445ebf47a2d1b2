"""A sample's trace: what its agent, the bounding of its output and its graders recorded,
one typed section per writer (docs/contract.md §1.2).

Stored as JSON in `samples.trace` with the keys and nesting every evalpipe wrote: a section
is stored only when its writer set it (`to_dict` dumps what was set, nothing defaulted),
so old stores, exports and the SQL that reads a key (`$.judge.fingerprint`) still read.
Reading is tolerant (`SampleTrace.parse`): unknown keys are kept (and stored again as they
came), a missing key is the field's default, and a section that does not fit its model is
left out rather than failing the report that reads the rest.

A registered grader declaring `trace=Model` records a section of its own, stored under its
kind and read back with `trace.section(kind, Model)` (`tasks.registry`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_serializer, model_validator

from tasks.trajectory import Steps
from tasks.verdict import Status, Verdict

M = TypeVar("M", bound=BaseModel)


# Made once: `json.dumps` with an option builds an encoder per call (every sample's trace).
_TRACE_JSON = json.JSONEncoder(default=str)


class Section(BaseModel):
    # Keys this evalpipe does not know (an older or newer one's) are kept, not dropped.
    model_config = ConfigDict(extra="allow")


class Truncation(Section):
    """Something cut at a cap: the cap and the size before the cut."""

    cap_bytes: int = 0
    bytes: int = 0


class ProcessRun(Section):
    """One sandboxed command: a `--workspace` agent's run (`agent_run`), a repository's tests
    (`test_run`)."""

    returncode: int | None = None
    duration_s: float | None = None
    isolation: str | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""


class Trajectory(Section):
    """What an agent did: its entries (OpenAI chat messages and notes, `tasks.trajectory`),
    how many there are (`steps`), what was cut at the cap, and why the agent stopped when it
    did not stop by itself (`stop`: "max_steps")."""

    steps: int = 0
    entries: list[dict[str, Any]] = []
    truncated: Truncation | None = None
    stop: str | None = None

    @property
    def typed(self) -> Steps:
        """The entries as typed steps: model turns, tool results, notes."""
        return Steps.of(self.entries)


class WorkspaceChange(Section):
    """What a `--workspace` agent changed: the paths of its patch and the files it removed."""

    files: list[str] = []
    removed: list[str] = []


class JudgeDraw(Section):
    """One judge draw: its verdict, or the error that stood for one."""

    seed: int = 0
    passed: bool | None = None
    score: float | None = None
    rationale: str = ""
    error: str | None = None


class JudgeTrace(Section):
    """`judge`: who judged (`spec`, `fingerprint`) and, once it drew, its J draws."""

    spec: str = ""
    fingerprint: str = ""
    seeds: list[int] = []
    draws: list[JudgeDraw] = []
    passes: int = 0
    errors: int = 0
    agreement: float | None = None  # None when a draw errored


class PythonTestsTrace(Section):
    """`python_tests`: the sandboxed program's run."""

    isolation: str | None = None
    returncode: int | None = None
    timed_out: bool = False
    completed: bool = False
    duration_s: float | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False


class EnvironmentTrace(Section):
    """The built environment a repository's tests ran in (`tasks.repos.environments`)."""

    name: str = ""
    python: str | None = None
    pytest: str | None = None


class NumericCheck(Section):
    parsed: float | None = None
    reference: float | None = None


class GraderStep(Section):
    """One step an assertion grader recorded (`numeric`: what it parsed and compared)."""

    numeric: NumericCheck | None = None


class ExtraGrader(Section):
    """One of a case's `extra_graders`: its kind, its name when it was given one, its verdict
    and what it traced. Stored flat, as `{"kind"[, "name"], "passed", "score", "status",
    "detail", "safety"[, "trace"]}`."""

    kind: str
    name: str | None = None
    verdict: Verdict
    must_pass: bool | None = None  # set (true) when every sample must pass it: a gate rule
    trace: SampleTrace | None = None

    @model_validator(mode="before")
    @classmethod
    def _unflatten(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "verdict" not in data:
            fields = Verdict.model_fields
            rest = {k: v for k, v in data.items() if k not in fields}
            return {**rest, "verdict": {k: v for k, v in data.items() if k in fields}}
        return data

    @model_serializer(mode="wrap")
    def _flatten(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        named = {"name": name} if (name := data.pop("name", None)) is not None else {}
        return {"kind": data.pop("kind"), **named, **data.pop("verdict"), **data}

    @property
    def label(self) -> str:
        """What the grader is called: its name, else its kind."""
        return self.name or self.kind


# The sections the agent writes (what it did), which every grader of the sample sees.
AGENT_SECTIONS = ("agent_run", "trajectory", "workspace")


class SampleTrace(Section):
    """Every section, in the order their writers write them (the stored key order).
    A section is None until its writer sets it."""

    # The agent (a `--workspace` one: tasks.agents.workspace_runner).
    agent_run: ProcessRun | None = None
    trajectory: Trajectory | None = None
    workspace: WorkspaceChange | None = None
    # What bounding the output changed (tasks.run.sampling).
    output_replaced_chars: int | None = None
    output_redacted: int | None = None
    output_truncated: Truncation | None = None
    agent_s: float | None = None  # seconds the draw took
    # The deciding grader's sections.
    judge: JudgeTrace | None = None
    python_tests: PythonTestsTrace | None = None
    timings: dict[str, float] | None = None  # repo_tests: seconds per step
    steps: list[str] | None = None  # repo_tests: what happened, in order
    environment: EnvironmentTrace | None = None
    edited_files: list[str] | None = None
    test_run: ProcessRun | None = None
    tests: dict[str, str] | None = None  # repo_tests: each graded test id's outcome
    grader_steps: list[GraderStep] | None = None
    extra_graders: list[ExtraGrader] | None = None
    # `--regrade`: the statuses of the same output graded again, and whether any differed.
    regrade: list[Status] | None = None
    env_flaky: bool | None = None
    # A human label (`labels import`, tasks.metrics.labels): who gave it, on which run's
    # sample, the label and the labeller's note (stored even when null).
    labeller: str | None = None
    source_run: str | None = None
    label: Literal["pass", "fail"] | None = None
    note: str | None = None

    @classmethod
    def parse(cls, stored: str | Mapping[str, Any] | None) -> SampleTrace:
        """A stored trace (JSON text, its mapping, or NULL) as the model; never raises on
        its content (see the module's docstring)."""
        data = json.loads(stored) if isinstance(stored, str) else stored
        if not isinstance(data, Mapping):
            return cls()
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            unfit = {e["loc"][0] for e in exc.errors() if e["loc"]}
            return cls.model_validate({k: v for k, v in data.items() if k not in unfit})

    def to_dict(self) -> dict[str, Any]:
        """The trace as stored: the sections set, in order, then any other keys."""
        if not self.model_fields_set and not self.__pydantic_extra__:
            return {}  # most drawn outputs' traces: no dump needed
        return self.model_dump(exclude_unset=True)

    def to_json(self) -> str:
        """The text of the `samples.trace` column (a value JSON cannot hold as its `str`)."""
        return _TRACE_JSON.encode(self.to_dict())

    def record(self, kind: str, own: BaseModel | Mapping[str, Any]) -> None:
        """What a registered grader recorded (`tasks.registry`): a declared section under
        its kind unless it is still the model's default; an undeclared grader's mapping
        key by key at the top level (a known section's key is checked against its model)."""
        if isinstance(own, BaseModel):
            if own != type(own)():
                setattr(self, kind, own.model_dump())
            return
        for key, value in own.items():
            if key in type(self).model_fields:
                value = getattr(type(self).model_validate({key: value}), key)
            setattr(self, key, value)

    def agent_part(self) -> SampleTrace:
        """Only what the agent wrote (`AGENT_SECTIONS`): what a stored output's graders see
        when it is graded again."""
        return SampleTrace(**{k: getattr(self, k) for k in AGENT_SECTIONS if getattr(self, k) is not None})

    def section(self, kind: str, model: type[M]) -> M | None:
        """The section a registered grader of `kind` declared, as its model; None if absent."""
        value = (self.model_extra or {}).get(kind)
        return None if value is None else model.model_validate(value)


ExtraGrader.model_rebuild()
