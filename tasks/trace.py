"""A sample's trace: what its agent, the bounding of its output and its graders recorded,
one typed section per writer (docs/contract.md §1.2).

Stored as JSON in `samples.trace`, one top-level key per writer, in the order they write:
the agent's (`agent_run`, `trajectory`, `workspace`), the output's bounding (`output`), the
deciding grader's (`judge`, `python_tests`, `repo_tests`, `grader_steps`), the extra graders'
(`extra_graders`), `--regrade`'s (`regrade`) and a human label's (`human`). A section is
stored only when its writer set it (`to_dict` dumps what was set, nothing defaulted), so
the SQL that reads a key (`$.judge.fingerprint`) finds it where it always was.

Reading is tolerant (`SampleTrace.parse`): unknown keys are kept (and stored again as they
came), a missing key is the field's default, and a section that does not fit its model is
left out rather than failing the report that reads the rest. Traces stored before the
bounding, `repo_tests`, `--regrade` and labels had a section each kept their keys at the top
level (`agent_s`, `timings`, `env_flaky`, `labeller`, ...): reading folds them into their
sections (`_FLAT_KEYS`), so an older home reads as a new one does.

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


class OutputTrace(Section):
    """`output`: what bounding the drawn output changed (`tasks.run.sampling`) and how long
    drawing it took."""

    replaced_chars: int | None = None  # characters no encoding could store, replaced
    redacted: int | None = None  # secrets masked
    truncated: Truncation | None = None
    agent_s: float | None = None  # seconds the draw took


class EnvironmentTrace(Section):
    """The built environment a repository's tests ran in (`tasks.repos.environments`)."""

    name: str = ""
    python: str | None = None
    pytest: str | None = None


class RepoTestsTrace(Section):
    """`repo_tests`: what grading a patch by a repository's tests recorded
    (`tasks.graders.repo_tests`), each key set as its step is reached."""

    timings: dict[str, float] | None = None  # seconds per step
    steps: list[str] | None = None  # what happened, in order
    environment: EnvironmentTrace | None = None
    edited_files: list[str] | None = None
    test_run: ProcessRun | None = None
    tests: dict[str, str] | None = None  # each graded test id's outcome


class RegradeTrace(Section):
    """`regrade` (`run --regrade R`): the statuses of the same output graded R times again,
    and whether any differed from the first (an environment flake)."""

    statuses: list[Status] = []
    env_flaky: bool = False


class HumanLabel(Section):
    """`human`: a label brought in by `labels import` (`tasks.metrics.labels`): who gave it,
    on which run's sample, the label and the labeller's note (stored even when null)."""

    labeller: str = ""
    source_run: str = ""
    label: Literal["pass", "fail"] | None = None
    note: str | None = None


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

# Keys stored at the top level before their writer had a section: where each one now goes.
_FLAT_KEYS = {
    "output_replaced_chars": ("output", "replaced_chars"),
    "output_redacted": ("output", "redacted"),
    "output_truncated": ("output", "truncated"),
    "agent_s": ("output", "agent_s"),
    "timings": ("repo_tests", "timings"),
    "steps": ("repo_tests", "steps"),
    "environment": ("repo_tests", "environment"),
    "edited_files": ("repo_tests", "edited_files"),
    "test_run": ("repo_tests", "test_run"),
    "tests": ("repo_tests", "tests"),
    "regrade": ("regrade", "statuses"),
    "env_flaky": ("regrade", "env_flaky"),
    "labeller": ("human", "labeller"),
    "source_run": ("human", "source_run"),
    "label": ("human", "label"),
    "note": ("human", "note"),
}
# A trace with none of these, and no `regrade` list, has nothing to fold (`_folded`'s fast path).
_OLD_KEYS = frozenset(_FLAT_KEYS) - {"regrade"}
# Repo_tests' keys are folded only beside `timings` (its clock starts before any other is
# written), a label's beside `labeller`: an undeclared grader's own `steps` or `note` stays.
_FOLDED_WITH = {"repo_tests": "timings", "human": "labeller"}


def _stored_flat(data: Mapping[str, Any], key: str, section: str) -> bool:
    if key == "regrade":
        return isinstance(data[key], list)  # the section is a mapping
    mark = _FOLDED_WITH.get(section)
    return mark is None or mark in data


def _folded(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """`data` with the keys an older evalpipe stored flat (`_FLAT_KEYS`) in their sections;
    `data` itself when it has none (every trace written since)."""
    if _OLD_KEYS.isdisjoint(data) and not isinstance(data.get("regrade"), list):
        return data  # the common case, read for every sample of a report: no copy
    flat = [k for k, (section, _) in _FLAT_KEYS.items() if k in data and _stored_flat(data, k, section)]
    if not flat:
        return data
    rest = {k: v for k, v in data.items() if k not in flat}
    for key in flat:
        section, name = _FLAT_KEYS[key]
        held = rest.get(section)
        rest[section] = {**(held if isinstance(held, Mapping) else {}), name: data[key]}
    return rest


class SampleTrace(Section):
    """Every section, in the order their writers write them (the stored key order).
    A section is None until its writer sets it."""

    # The agent (a `--workspace` one: tasks.agents.workspace_runner).
    agent_run: ProcessRun | None = None
    trajectory: Trajectory | None = None
    workspace: WorkspaceChange | None = None
    # What bounding the output changed, and the draw's time (tasks.run.sampling).
    output: OutputTrace | None = None
    # The deciding grader's sections.
    judge: JudgeTrace | None = None
    python_tests: PythonTestsTrace | None = None
    repo_tests: RepoTestsTrace | None = None
    grader_steps: list[GraderStep] | None = None
    extra_graders: list[ExtraGrader] | None = None
    # After grading: `--regrade`'s (tasks.run.sampling); a label's (`labels import`).
    regrade: RegradeTrace | None = None
    human: HumanLabel | None = None

    @model_validator(mode="before")
    @classmethod
    def _fold_flat_keys(cls, data: Any) -> Any:
        return _folded(data) if isinstance(data, Mapping) else data

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
            data = _folded(data)  # what does not fit is named as it is stored now
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
        key by key at the top level (a known section's key, or one that was stored flat
        before it, is checked against its model)."""
        if isinstance(own, BaseModel):
            if own != type(own)():
                setattr(self, kind, own.model_dump())
            return
        for key, value in own.items():
            if key in type(self).model_fields or key in _FLAT_KEYS:
                # Raises (the grader's error) where it does not fit the section that holds
                # it, or would hold it once read back (a key stored flat before sections).
                checked = type(self).model_validate({key: value})
                value = getattr(checked, key) if key in type(self).model_fields else value
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
