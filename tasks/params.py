"""Grader parameters (docs/contract.md §4): the built-in kinds' models, and the checking of a
case's grader mapping against its kind's model (the one in `tasks.registry`).

A suite's cases are checked against these when the suite loads, so an unknown or
misspelt key, a missing required one or a mistyped value is bad input naming the case and
the field, not a column of `error` samples at run time. The models only check: the case
keeps, and hashes, its grader mapping exactly as written (so no suite version moves), and
graders are handed their values (`case.params`), defaults filled in.

Numbers are read as numbers wherever they are written as such ("10" is 10); flags must be
true or false (a "yes" is too easily a typo for something else).
"""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from tasks.registry import PLUGINS_ENV, grader_kinds, grader_spec


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, not true/false")
    return value


Number = Annotated[float, BeforeValidator(_not_bool)]
Integer = Annotated[int, BeforeValidator(_not_bool)]
NonEmpty = Annotated[str, Field(min_length=1)]


def _listed(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


# A list of strings, or one string for a list of one.
Strings = Annotated[list[str], BeforeValidator(_listed)]


class Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ExactParams(Params):
    normalize: StrictBool = False


class ContainsParams(Params):
    case_sensitive: StrictBool = True


class RegexParams(Params):
    pattern: str
    fullmatch: StrictBool = False

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"invalid regex {pattern!r}: {exc}") from None
        return pattern


class NumericParams(Params):
    abs_tol: Annotated[Number, Field(ge=0)] = 0.0
    rel_tol: Annotated[Number, Field(ge=0)] = 1e-9


class JsonParams(Params):
    fields: list[str] | None = None


class PredicateParams(Params):
    function: NonEmpty


class PythonTestsParams(Params):
    entry_point: str
    test: str
    timeout_s: Annotated[Number, Field(gt=0)] = 10.0
    memory_mb: Annotated[Integer, Field(ge=16)] = 2048

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, name: str) -> str:
        if not name.isidentifier():
            raise ValueError(f"must be a function name, got {name!r}")
        return name


class Environment(Params):
    """`repo_tests`' `environment` parameter (on the grader, or in `grader_defaults`)."""

    python: str | None = Field(default=None, min_length=1)  # default: the harness's
    install: tuple[str, ...] = ()  # shell commands, run in order in the activated venv
    setup_commit: str | None = Field(default=None, min_length=1)  # default: base_commit
    timeout_s: float = Field(default=1800.0, gt=0)  # for the whole build

    @field_validator("install", mode="before")
    @classmethod
    def _one_command(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


def _command(value: Any) -> Any:
    return shlex.split(value) if isinstance(value, str) else value


Command = Annotated[list[str], BeforeValidator(_command), Field(min_length=1)]


class RepoTestsParams(Params):
    repo: NonEmpty
    base_commit: NonEmpty
    fail_to_pass: Strings = []
    pass_to_pass: Strings = []
    allowed_files: Strings | None = None  # None: every path may be edited
    test_files: Strings | None = None  # None: the grader's defaults
    test_patch: str | None = None
    test_cmd: Command | None = None  # None: pytest writing JUnit XML
    setup: Annotated[list[Command], BeforeValidator(_listed)] | None = None
    timeout_s: Annotated[Number, Field(gt=0)] = 600.0
    memory_mb: Annotated[Integer, Field(ge=16)] = 4096
    disk_mb: Annotated[Integer, Field(ge=1)] = 1024
    environment: Environment | None = None

    @field_validator("test_cmd")
    @classmethod
    def _writes_junit(cls, cmd: list[str] | None) -> list[str] | None:
        if cmd is not None and not any("{junit}" in arg for arg in cmd):
            raise ValueError("must write JUnit XML to {junit}")
        return cmd


class JudgeParams(Params):
    function: NonEmpty  # MODULE:FUNC, path.py:FUNC or openai:MODEL
    rubric: str | None = None
    samples: Annotated[Integer, Field(ge=1)] = 1
    params: dict[str, Any] = {}  # extra request fields for openai: judges


class HumanParams(Params):
    pass


# --- what an agent did (tasks/graders/trajectory.py) -----------------------------------------


class ExpectedCall(Params):
    """A tool call a trajectory grader looks for: its name and, optionally, its arguments
    (a subset of the call's unless `exact`; a value `{regex: P}` or `{any: true}` per field)."""

    name: NonEmpty
    args: dict[str, Any] | None = None
    exact: StrictBool = False


class ToolCalledParams(Params):
    """`tool_called`: how many of the sample's calls of `tool` fit `args`, between `min`
    (default 1) and `max` (`max: 0` is "never called"). The tool is `tool`, not `name`: a
    grader's `name` is what the grader is called."""

    tool: NonEmpty
    args: dict[str, Any] | None = None
    exact: StrictBool = False
    min: Annotated[Integer, Field(ge=0)] | None = None
    max: Annotated[Integer, Field(ge=0)] | None = None

    @property
    def call(self) -> ExpectedCall:
        return ExpectedCall(name=self.tool, args=self.args, exact=self.exact)

    def tool_names(self) -> list[tuple[str, str]]:
        return [("tool", self.tool)]


class ToolSequenceParams(Params):
    calls: Annotated[list[ExpectedCall], Field(min_length=1)]
    mode: Literal["strict", "unordered", "subset", "superset"] = "strict"

    def tool_names(self) -> list[tuple[str, str]]:
        return [(f"calls.{i}.name", c.name) for i, c in enumerate(self.calls)]


Bound = Annotated[Integer, Field(ge=0)] | None


class StepsParams(Params):
    """`steps`: bounds on the model turns, tool calls and tokens of the trajectory."""

    max_turns: Bound = None
    max_tool_calls: Bound = None
    max_tokens: Bound = None
    min_turns: Bound = None
    min_tool_calls: Bound = None
    min_tokens: Bound = None

    @model_validator(mode="after")
    def _some_bound(self) -> StepsParams:
        if all(getattr(self, f) is None for f in type(self).model_fields):
            raise ValueError(f"give at least one of {', '.join(type(self).model_fields)}")
        return self


class WorldAssertion(ExpectedCall):
    """A call the world received and answered without an error: at least `count` of them
    (`count: 0`: none at all)."""

    count: Annotated[Integer, Field(ge=0)] = 1


class FileAssertion(Params):
    """A file of the workspace after the run (the base commit with the agent's change): it
    exists or not (`exists`), holds `contains`, or is exactly `equals`."""

    path: NonEmpty
    exists: StrictBool | None = None
    contains: str | None = None
    equals: str | None = None

    @model_validator(mode="after")
    def _one_check(self) -> FileAssertion:
        if self.exists is None and self.contains is None and self.equals is None:
            raise ValueError("give exists, contains or equals")
        return self


class FinalStateParams(Params):
    """`final_state`: what the case's world received by the end of the sample, and the
    workspace's files after it (a `repo_tests` case's checkout with the change applied)."""

    world: list[WorldAssertion] = []
    files: list[FileAssertion] = []

    @model_validator(mode="after")
    def _something(self) -> FinalStateParams:
        if not self.world and not self.files:
            raise ValueError("give world or files assertions")
        return self

    def tool_names(self) -> list[tuple[str, str]]:
        return [(f"world.{i}.name", w.name) for i, w in enumerate(self.world)]


def parameter_names(kind: Any) -> frozenset[str] | None:
    """The parameters a kind takes (None for an unknown kind)."""
    spec = grader_spec(kind) if isinstance(kind, str) else None
    return None if spec is None else frozenset(spec.params.model_fields)


# A grader's `name` (default: its kind) labels its verdict, its metric and its gate rules.
GRADER_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")
# The keys of a grader mapping that are not its kind's parameters: what it is, what it is
# called, and (an extra grader) whether every sample must pass it.
GRADER_KEYS = ("kind", "name", "must_pass")


def grader_name(grader: dict[str, Any]) -> str:
    """What a grader of a case is called: its `name`, else its kind."""
    return str(grader.get("name") or grader.get("kind"))


def grader_params(grader: dict[str, Any]) -> BaseModel:
    """The typed parameters of a grader mapping (`kind`, an optional `name`, and its parameters). Raises
    `ValueError` with one line naming the field: unknown kind, unknown key, missing
    required key, or a value of the wrong type."""
    kind = grader.get("kind")
    if not isinstance(kind, str):
        raise ValueError("grader needs a 'kind'")
    spec = grader_spec(kind)
    if spec is None:
        raise ValueError(f"unknown grader kind {kind!r} (known: {', '.join(sorted(grader_kinds()))};"
                         f" a plugin's kind needs its plugin installed or named in {PLUGINS_ENV})")
    name = grader.get("name", kind)
    if not isinstance(name, str) or not GRADER_NAME.match(name):
        raise ValueError(f"grader.name: a grader's name is 1-64 letters, digits, _ . : @ or -, got {name!r}")
    if not isinstance(grader.get("must_pass", False), bool):
        raise ValueError(f"grader.must_pass: true or false, got {grader['must_pass']!r}")
    model = spec.params
    try:
        return model.model_validate({k: v for k, v in grader.items() if k not in GRADER_KEYS})
    except ValidationError as exc:
        raise ValueError(_one_line(kind, model, exc.errors()[0])) from None


def _one_line(kind: str, model: type[BaseModel], err: dict[str, Any]) -> str:
    field = "grader" + "".join(f".{p}" for p in err["loc"])  # a check across fields has no loc
    if err["type"] == "extra_forbidden":
        known = f" (known: {', '.join(model.model_fields) or 'none'})" if len(err["loc"]) == 1 else ""
        return f"{field}: not a parameter of {kind} graders{known}"
    if err["type"] == "missing":
        return f"{field}: required by {kind} graders"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{field}: {msg}, got {err['input']!r}"
