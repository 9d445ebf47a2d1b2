"""The data model every stage speaks (docs/contract.md §2): cases, suites, samples, verdicts
(`tasks.verdict`, named here too) and a sample's trace (`tasks.trace`).

All these models are frozen: a case or a verdict, once made, is a value. Stages build new
values instead of editing old ones, which is what lets the cache key on content. (A trace is
the exception: its writers fill it in turn while the sample is made.)
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tasks.errors import InputError as InputError
from tasks.errors import PlatformError as PlatformError
from tasks.params import grader_name, grader_params
from tasks.tools import check_case
from tasks.trace import SampleTrace
from tasks.verdict import Status as Status
from tasks.verdict import Verdict as Verdict


def canonical_json(value: Any) -> bytes:
    """The one byte encoding every content hash is taken over.

    Keys sorted, UTF-8, no insignificant whitespace. Integral floats are written as
    integers (JSON has one number type: ``1`` and ``1.0`` are the same value), and
    NaN/Infinity are refused because they have no JSON spelling.
    """
    if type(value) in (list, tuple):  # every sample's keys: flat lists, written directly
        try:
            return ("[" + ",".join([_FLAT[type(v)](v) for v in value]) + "]").encode("utf-8")
        except KeyError:
            pass
    return json.dumps(
        _normalize_numbers(value),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


# Values canonical JSON writes as they are (exact types: a subclass takes the long way),
# each with the spelling `json.dumps` gives it (its own string encoder, `int.__repr__`).
_FLAT: dict[type, Callable[[Any], str]] = {
    str: json.encoder.encode_basestring, int: int.__repr__,
    bool: lambda b: "true" if b else "false", type(None): lambda _: "null",
}
_AS_IS = frozenset(_FLAT)


def _normalize_numbers(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if isinstance(value, dict):
        return {str(k): _normalize_numbers(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if all(type(v) in _AS_IS for v in value):  # the keys of every sample: nothing to do
            return list(value)
        return [_normalize_numbers(v) for v in value]
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_seed(*content: Any) -> int:
    """A 63-bit seed from content (e.g. suite version, case id, index, run seed): the same
    content draws alike on every run. Seeds enter cache keys, so changing this derivation
    would orphan every stored sample (tests/test_seeds.py pins known values)."""
    return int(sha256_hex(canonical_json(list(content)))[:16], 16) >> 1


# The bounds of a run's options: one source for the CLI (exit 2, one line) and the flow's
# parameter schema (the Prefect UI form, deployments).
MAX_N = 10_000
MAX_WORKERS = 256
MAX_REGRADE = 100
MAX_ROUNDS = 1000  # looks of a sequential run (tasks.metrics.sequential)


# Unicode categories a case id may not hold: controls, format characters (bidi overrides),
# line and paragraph separators.
_CONTROL = frozenset({"Cc", "Cf", "Zl", "Zp"})
# The validation context of a case read back from this home's own storage.
STORED = {"stored": True}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class EvalCase(_Frozen):
    id: str = Field(min_length=1)
    inputs: dict[str, Any] = Field(default_factory=dict)
    reference: Any = None
    grader: dict[str, Any]  # decides `passed`
    # More graders of the same output, each its own verdict (in the trace), none deciding.
    extra_graders: tuple[dict[str, Any], ...] = ()
    slices: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    safety: dict[str, Any] | None = None
    # A gate rule, not something measured: any failing sample of this case blocks the gate.
    # Part of the suite's version (a stored run says which cases were must-pass), not of the
    # case hash, so a run before and after the marking still pair on this case.
    must_pass: bool = False
    # What the case records about itself (where it came from: a mined case's commit, date and
    # files). Never given to the agent nor graded; part of the case hash like any content.
    metadata: dict[str, Any] | None = None
    # Computed once at construction, so equal cases carry equal hashes.
    _case_hash: str = PrivateAttr(default="")
    # Where the case's relative paths (a local `repo`, a `path.py:function`) resolve: its
    # suite file's directory, set by the loader. Not content: the same case read from
    # another place is the same case, with the same hash.
    _base_dir: str | None = PrivateAttr(default=None)

    _inputs_hash: str = PrivateAttr(default="")
    # An extra grader's view of the case (`graded_by`): the deciding grader it stands beside.
    _decided_by: dict[str, Any] | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        measured = {k: v for k, v in self.content().items() if k != "must_pass"}
        self._case_hash = sha256_hex(canonical_json(measured))
        self._inputs_hash = sha256_hex(canonical_json(self.inputs))

    @field_validator("id")
    @classmethod
    def _inert_id(cls, value: str, info: ValidationInfo) -> str:
        # An id reaches the agent's environment, file names and messages: a URL in it was
        # forwarded to the sandboxed agent as a host port, a control character rewrites a line.
        # A case stored before the rule (`STORED`: a snapshot) still reads.
        if info.context == STORED:
            return value
        if "://" in value:
            raise ValueError("an id may not contain '://' (it is a name, not a URL)")
        bad = next((ch for ch in value if unicodedata.category(ch) in _CONTROL), None)
        if bad is not None:
            raise ValueError(f"an id may not contain a control character (U+{ord(bad):04X})")
        return value

    @field_validator("slices", "tags", mode="before")
    @classmethod
    def _as_sorted_set(cls, value: Any) -> Any:
        # Slices and tags are sets: their order in the file is formatting, not content.
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(sorted(set(value)))
        return value

    @field_validator("grader")
    @classmethod
    def _typed_params(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Checked, not replaced: the mapping as written is what the case hash covers.
        grader_params(value)
        return value

    @field_validator("extra_graders")
    @classmethod
    def _typed_extra(cls, value: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        for i, grader in enumerate(value):
            where = f"extra_graders.{i}"
            try:
                grader_params(grader)
            except ValueError as exc:
                message = str(exc)
                if message.startswith(("grader.", "grader:")):
                    raise ValueError(where + message.removeprefix("grader")) from None
                raise ValueError(f"{where}: {message}") from None
        return value

    @model_validator(mode="after")
    def _graders_and_tools(self) -> EvalCase:
        # Each grader's name labels its verdict and its metric: one per case. The tools the
        # case declares, its world and what its graders name of them are checked together.
        if "must_pass" in self.grader:
            raise ValueError("grader.must_pass: the deciding grader's case is must-pass by the case's own"
                             " `must_pass: true`; on a grader it marks an extra one")
        given = [g["name"] for g in (self.grader, *self.extra_graders) if "name" in g]
        for where, grader in self.named_graders():
            if "name" in grader and given.count(grader["name"]) > 1:
                raise ValueError(f"{where}.name: another grader of the case is named {grader['name']!r}")
        check_case(self.inputs, self.named_graders())
        return self

    def named_graders(self) -> list[tuple[str, dict[str, Any]]]:
        """Every grader mapping with where it is written: `grader`, then `extra_graders.I`."""
        return [("grader", self.grader), *((f"extra_graders.{i}", g) for i, g in enumerate(self.extra_graders))]

    @property
    def grader_labels(self) -> list[str]:
        """What each grader is called, the deciding one first: its `name`, else its kind, and
        a second unnamed grader of a kind `KIND#2` (suites before names keep loading)."""
        given = {g["name"] for g in (self.grader, *self.extra_graders) if "name" in g}
        labels: list[str] = []
        for grader in (self.grader, *self.extra_graders):
            label, count = grader_name(grader), 1
            while "name" not in grader and (label in labels or label in given):
                count += 1
                label = f"{grader['kind']}#{count}"
            labels.append(label)
        return labels

    def graded_by(self, grader: dict[str, Any]) -> EvalCase:
        """The case as one of its extra graders sees it: that grader's, and no others (the
        deciding one is still at hand: `deciding_grader`)."""
        seen = self.model_copy(update={"grader": grader, "extra_graders": ()})
        seen._decided_by = self.deciding_grader
        return seen

    @property
    def deciding_grader(self) -> dict[str, Any]:
        """The grader that decides `passed` (an extra grader's view: the case's own)."""
        return self._decided_by or self.grader

    @property
    def kind(self) -> str:
        return self.grader["kind"]

    @property
    def params(self) -> BaseModel:
        """The grader's typed parameters, defaults filled in. Read from `grader` each
        time, so a copy with other parameters (`model_copy`) is checked too."""
        try:
            return grader_params(self.grader)
        except ValueError as exc:
            raise InputError(f"case {self.id!r}: {exc}") from None

    def content(self) -> dict[str, Any]:
        """The case as plain JSON data: what is hashed and what is stored."""
        # Python mode: JSON mode would quietly turn NaN into null and hash it as such.
        data = self.model_dump()
        data["slices"], data["tags"] = list(self.slices), list(self.tags)
        if data["safety"] is None:
            del data["safety"]
        if not data["must_pass"]:  # absent when false: suites without it keep their versions
            del data["must_pass"]
        if data["metadata"] is None:  # likewise
            del data["metadata"]
        if not data["extra_graders"]:  # likewise
            del data["extra_graders"]
        else:
            data["extra_graders"] = list(data["extra_graders"])
        return data

    @property
    def case_hash(self) -> str:
        return self._case_hash

    @property
    def inputs_hash(self) -> str:
        """sha256 of the inputs alone: what the agent sees, so what an output is keyed by
        (a changed reference, grader, slice or tag leaves it as it is)."""
        return self._inputs_hash

    def __eq__(self, other: object) -> bool:
        # What a case is, not where its file was read: the base directory is left out.
        if not isinstance(other, EvalCase):
            return NotImplemented
        return self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(self._case_hash)

    def located_at(self, base_dir: Path) -> EvalCase:
        """This case, its relative paths resolving against `base_dir`."""
        self._base_dir = str(base_dir.resolve())
        return self

    def local_path(self, path: str) -> Path:
        """A path a suite wrote, resolved against its suite file's directory. A path that
        exists only relative to the working directory (where evalpipe before 0.4 looked)
        still resolves there, so older suites keep working."""
        written = Path(path).expanduser()
        if self._base_dir is None or written.is_absolute():
            return written.resolve()
        beside = Path(self._base_dir) / written
        return beside if beside.exists() or not written.exists() else written.resolve()


class EvalSuite(_Frozen):
    name: str = Field(min_length=1)
    cases: tuple[EvalCase, ...]
    _version: str = PrivateAttr(default="")

    @field_validator("cases", mode="after")
    @classmethod
    def _ordered_by_id(cls, cases: tuple[EvalCase, ...]) -> tuple[EvalCase, ...]:
        # The canonical order: a suite is the same value whatever order its file lists cases in.
        return tuple(sorted(cases, key=lambda c: c.id))

    @model_validator(mode="after")
    def _unique_ids(self) -> EvalSuite:
        seen: set[str] = set()
        for case in self.cases:
            if case.id in seen:
                raise ValueError(f"duplicate case id {case.id!r}")
            seen.add(case.id)
        return self

    def model_post_init(self, context: Any) -> None:
        self._version = sha256_hex(canonical_json([c.content() for c in self.cases]))

    @property
    def grader_kinds(self) -> frozenset[str]:
        """Every grader kind the suite's cases use, deciding and extra (a run checks them
        for the sandbox: tasks.sandbox.run_sandbox_mode)."""
        return frozenset(g["kind"] for c in self.cases for g in (c.grader, *c.extra_graders))

    @property
    def version(self) -> str:
        """sha256 of the canonical JSON of the cases ordered by id (docs/contract.md §1.1)."""
        return self._version

    def case(self, case_id: str) -> EvalCase:
        for case in self.cases:
            if case.id == case_id:
                return case
        raise KeyError(case_id)


MAX_COUNT = 2**63 - 1  # the largest token count a sample holds (a BIGINT)


class Usage(_Frozen):
    """What one agent call took: its latency and, where the agent reports them, the tokens
    it used and the model they were counted for (which prices them), and its price."""

    latency_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # Bounded by the samples' BIGINT columns: a larger count cannot be stored, only crash.
    input_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT, strict=True)
    output_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT, strict=True)
    model: str | None = Field(default=None, min_length=1)
    # Priced from the tokens and model when the sample is stored (tasks/metrics/cost.py).
    cost_usd: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class Sample(_Frozen):
    case_id: str
    index: int = Field(ge=0)
    seed: int
    output: str
    verdict: Verdict
    trace: SampleTrace = Field(default_factory=SampleTrace)
    duration_s: float = 0.0
    cached: bool = False
    usage: Usage = Usage()
