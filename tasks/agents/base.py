"""What every agent kind shares: the `Agent` protocol and its `AgentContext`, `AgentError`,
pickling as a spec with the run's settings (`Reloadable`), and the fingerprint."""

from __future__ import annotations

import json
import os
import tomllib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, Self

from pydantic import ValidationError

from tasks.agents.model_calls import CallBook
from tasks.agents.purse import Purse
from tasks.agents.settings import AgentSettings
from tasks.models import EvalCase, InputError, Usage, canonical_json, sha256_hex
from tasks.trace import SampleTrace, Trajectory


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
        """Append one step (a JSON object: an OpenAI chat message is a typed step, docs/agents.md
        "Tools") to the sample's trajectory: a coding agent's file, else the trace itself."""
        if self.trajectory is not None:
            with open(self.trajectory, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(step, ensure_ascii=False, default=str) + "\n")
            return
        kept = self.trace.trajectory or Trajectory()
        self.trace.trajectory = Trajectory(steps=kept.steps + 1, entries=[*kept.entries, dict(step)])
    # What the agent reported about its call (`report_usage`), read by the sampler.
    reported: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The run's prices: (model, input tokens, output tokens) -> USD, None where unknown; what a
    # cap on a sample's spending (`--max-sample-cost`) counts with.
    cost_of: Callable[[str | None, int | None, int | None], float | None] | None = field(
        default=None, compare=False, repr=False)
    # The run's `--max-cost`, spent by each priced call of its samples as it is answered.
    purse: Purse | None = field(default=None, compare=False, repr=False)
    # `--replay-model-calls`: the sample's calls through the gateway, kept, and answered from
    # an earlier run's where identical (`tasks.agents.model_calls`); None without the option.
    calls: CallBook | None = field(default=None, compare=False, repr=False)

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


def makes_calls(agent: Agent) -> bool:
    """Whether drawing an output of `agent` is a call (an API, a program, the user's code):
    not for a kind whose outputs are at hand (`recorded = True`: the case's reference, a
    recording), which a run draws in its own process as its graders take them."""
    return not getattr(agent, "recorded", False)


def spec_fingerprint(spec: str, code: Any, depends: dict[str, Any] | None = None) -> str:
    """A fingerprint of the spec and what it reads (code, files, a recording): every kind
    but `openai:`, whose identity is its endpoint and settings. `depends`: what the agent
    declared besides (`declared_dependencies`); None leaves the fingerprint as it was
    before declarations existed, so an agent that declares nothing keeps its cache."""
    doc = {"spec": spec, "code": code} if depends is None else {"spec": spec, "code": code, "depends": depends}
    return sha256_hex(canonical_json(doc))


# What an agent reads besides its own file (a config, prompts, an environment variable),
# declared in this file beside it, enters its fingerprint (docs/agents.md).
DEPENDS_FILE = "evalpipe-agent.toml"
# Folders of generated files that change when nothing the agent reads did.
_SKIPPED_DIRS = frozenset({"__pycache__", ".git"})


def declared_dependencies(spec: str, folder: Path | None) -> dict[str, Any] | None:
    """The content of what `folder/evalpipe-agent.toml` declares (`files`: files or folders,
    relative to it; `env`: variable names): each file's sha256, each variable's value's
    (None when unset); None without the file. A bad file, or a declared path that is not
    there, is an `InputError` naming it."""
    if folder is None or not (folder / DEPENDS_FILE).is_file():
        return None
    declared = folder / DEPENDS_FILE
    try:
        doc = tomllib.loads(declared.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"agent {spec!r}: {declared}: {exc}") from None
    unknown = sorted(set(doc) - {"files", "env"})
    if unknown:
        raise InputError(f"agent {spec!r}: {declared}: unknown key {unknown[0]!r} (expected files, env)")
    for key in ("files", "env"):
        if not isinstance(doc.get(key, []), list) or not all(isinstance(v, str) and v for v in doc.get(key, [])):
            raise InputError(f"agent {spec!r}: {declared}: {key} must be a list of non-empty strings")
    files = {}
    for name in doc.get("files", []):
        path = folder / name
        if not path.exists():
            raise InputError(f"agent {spec!r}: {declared} declares {name!r}, which is not there")
        try:
            files[name] = _content(path)
        except OSError as exc:
            raise InputError(f"agent {spec!r}: {declared} declares {name!r}: {exc.strerror or exc}") from None
    # A value's hash, not the value: a declared variable may hold a secret.
    env = {name: None if os.environ.get(name) is None else sha256_hex(os.environ[name].encode())
           for name in doc.get("env", [])}
    return {"files": files, "env": env}


def _content(path: Path) -> str | dict[str, str]:
    """A file's sha256, or a folder's files' by relative path (generated folders left out)."""
    if not path.is_dir():
        return sha256_hex(path.read_bytes())
    hashes = {}
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in sorted(names):
            file = Path(root) / name
            if file.is_file():
                hashes[file.relative_to(path).as_posix()] = sha256_hex(file.read_bytes())
    return hashes


@dataclass(frozen=True)
class Reloadable(ABC):
    """An agent that pickles as its kind, spec, working directory and fingerprint, and is
    loaded anew where it is unpickled (see `tasks.agents`)."""

    spec: str
    fingerprint: str
    base: Path
    # The run's settings (a timeout, an output cap) that the spec does not carry: set by
    # `with_settings` when the run loads the agent, they travel with it when it is pickled
    # (to a process or a Dask worker) and are set again on the agent loaded there, never
    # read anew from that machine's environment.
    settings: AgentSettings = field(default_factory=AgentSettings, kw_only=True)

    @classmethod
    @abstractmethod
    def load(cls, spec: str, rest: str, base: Path) -> Self:
        """The agent `spec` names (`rest`: what follows its scheme), with relative paths
        resolved against `base`; `InputError` when it cannot be loaded."""

    def with_settings(self, settings: AgentSettings) -> Self:
        """This agent with the run's `settings` (a kind that keeps a setting elsewhere, in a
        client, sets it there too)."""
        return replace(self, settings=settings)

    def __reduce__(self) -> tuple[Callable[..., Agent], tuple[Any, ...]]:
        # The kind, not the `--agent` dispatch in `tasks.agents`: that sits above every
        # kind, and this module below them.
        return _restore, (type(self), self.spec, str(self.base), self.fingerprint, self.settings)


def _restore(kind: type[Reloadable], spec: str, base: str, fingerprint: str, settings: AgentSettings) -> Agent:
    try:
        agent = kind.load(spec, spec.partition(":")[2], Path(base))
    except InputError as exc:
        return _Unavailable(spec, fingerprint, f"cannot re-create the agent here: {exc}")
    if agent.fingerprint != fingerprint:
        return _Unavailable(
            spec, fingerprint, "the agent's code or settings changed since the run started"
        )
    return agent.with_settings(settings)


@dataclass(frozen=True)
class _Unavailable:
    spec: str
    fingerprint: str
    reason: str

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        raise AgentError(self.reason)
