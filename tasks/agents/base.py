"""What every agent kind shares: the `Agent` protocol and its `AgentContext`, `AgentError`,
pickling as a spec (`Reloadable`), the fingerprint, and the settings read from the
environment (the output cap, `EVALPIPE_MAX_OUTPUT_BYTES`)."""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from pydantic import ValidationError

from tasks.models import EvalCase, InputError, Usage, canonical_json, sha256_hex
from tasks.trace import SampleTrace

MAX_OUTPUT_ENV = "EVALPIPE_MAX_OUTPUT_BYTES"
DEFAULT_MAX_OUTPUT_BYTES = 4 << 20

_N = TypeVar("_N", int, float)


@dataclass(frozen=True)
class AgentContext:
    case_id: str
    index: int
    seed: int
    n: int
    # A coding agent's (`--workspace`): its checkout, and the file for its steps.
    workspace: Path | None = None
    trajectory: Path | None = None
    # What the agent adds to its sample's trace (its run's tails, its trajectory).
    trace: SampleTrace = field(default_factory=SampleTrace, compare=False, repr=False)

    def record(self, step: dict[str, Any]) -> None:
        """Append one step (a JSON object) to the trajectory; nothing without one."""
        if self.trajectory is not None:
            with open(self.trajectory, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(step, ensure_ascii=False, default=str) + "\n")
    # What the agent reported about its call (`report_usage`), read by the sampler.
    reported: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def report_usage(
        self, *, input_tokens: int | None = None, output_tokens: int | None = None, model: str | None = None
    ) -> None:
        """Tokens this sample's call used and the model that counted them (which prices
        them: docs/agents.md). Checked here, so a bad report fails the call that made it:
        an `AgentError` of one line (a count outside 0 .. 2^63 - 1 is one)."""
        try:
            given = Usage(input_tokens=input_tokens, output_tokens=output_tokens, model=model)
        except ValidationError as exc:
            raise AgentError("reported usage: " + "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {str(e['input'])[:40]})"
                for e in exc.errors())) from None
        self.reported.update(given.model_dump(exclude_none=True))

    def report_latency(self, seconds: float) -> None:
        """The seconds the call itself took, where the agent can tell them from its own
        set-up (an SDK imported and a client started on the first call): the sample's
        `latency_s`, instead of the whole of `generate`."""
        self.reported["latency_s"] = Usage(latency_s=seconds).latency_s


class AgentError(Exception):
    """The agent failed on one sample; the message is the reason."""


class Agent(Protocol):
    spec: str
    fingerprint: str

    def generate(self, case: EvalCase, ctx: AgentContext) -> str: ...


def max_output_bytes() -> int:
    """The cap on an agent's output: `EVALPIPE_MAX_OUTPUT_BYTES`, default 4 MB."""
    return env_positive(MAX_OUTPUT_ENV, DEFAULT_MAX_OUTPUT_BYTES, int, "a whole number of bytes")


def env_positive(name: str, default: _N, kind: Callable[[str], _N], what: str) -> _N:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise InputError(f"{name}={raw!r} is not {what}") from None
    if value <= 0:
        raise InputError(f"{name}={raw!r} must be positive")
    return value


def spec_fingerprint(spec: str, code: Any) -> str:
    """A fingerprint of the spec and what it reads (code, files, a recording): every kind
    but `openai:`, whose identity is its endpoint and settings."""
    return sha256_hex(canonical_json({"spec": spec, "code": code}))


@dataclass(frozen=True)
class Reloadable(ABC):
    """An agent that pickles as its kind, spec, working directory and fingerprint, and is
    loaded anew where it is unpickled (see `tasks.agents`)."""

    spec: str
    fingerprint: str
    base: Path

    @classmethod
    @abstractmethod
    def load(cls, spec: str, rest: str, base: Path) -> Self:
        """The agent `spec` names (`rest`: what follows its scheme), with relative paths
        resolved against `base`; `InputError` when it cannot be loaded."""

    def settings(self) -> dict[str, Any]:
        """The run's settings of this agent (a timeout, an output cap) that its spec does not
        carry: they travel with it when it is pickled (to a process or a Dask worker) and are
        set again on the agent loaded there, never read anew from that machine's environment."""
        return {}

    def with_settings(self, settings: dict[str, Any]) -> Self:
        return replace(self, **settings) if settings else self

    def __reduce__(self) -> tuple[Callable[..., Agent], tuple[Any, ...]]:
        # The kind, not the `--agent` dispatch in `tasks.agents`: that sits above every
        # kind, and this module below them.
        return _restore, (type(self), self.spec, str(self.base), self.fingerprint, self.settings())


def _restore(kind: type[Reloadable], spec: str, base: str, fingerprint: str,
             settings: dict[str, Any] | None = None) -> Agent:
    try:
        agent = kind.load(spec, spec.partition(":")[2], Path(base))
    except InputError as exc:
        return _Unavailable(spec, fingerprint, f"cannot re-create the agent here: {exc}")
    if agent.fingerprint != fingerprint:
        return _Unavailable(
            spec, fingerprint, "the agent's code or settings changed since the run started"
        )
    return agent.with_settings(settings or {})


@dataclass(frozen=True)
class _Unavailable:
    spec: str
    fingerprint: str
    reason: str

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        raise AgentError(self.reason)
