"""Persistent agent workers (docs/agents.md "Agents in their own environment"): `pyworker:`, a
`python:` agent's function run in processes of another interpreter (the agent's own virtual
environment), and `cmdworker:`, a `cmd:` agent that answers many cases, one JSON line each.

    pyworker:agent.py:solve?python=/path/venv/bin/python
    cmdworker:/path/venv/bin/python agent.py

A worker imports the agent once and draws one sample at a time for the rest of the run. A
sample that finds none idle starts one when none will come free, or when at the pace measured
so far (calls, starts) its wait would be longer than a start: a quick agent with a slow import
keeps a few workers busy, a slow one gets one per draw slot (`--agent-concurrency` bounds
them). At most one starts per core at a time (an SDK's import is seconds of CPU: sixteen at
once on two cores would each take eight times as long). A sample that
runs past the run's `--cmd-timeout` kills its worker (its process group), and a fresh one
takes the next sample. Workers are killed when the process that started them exits (a
`kill -9` of it too: each looks for its parent every second).

`pyworker:` speaks JSON lines over two pipes of its own with `worker_script.py`, which needs
only the standard library, so the venv need not hold evalpipe; the agent's prints go to its
stderr. `cmdworker:` gets one case a line on stdin (the JSON a `cmd:` agent gets) and
answers one line each on stdout: a JSON string (the output), or an object with `output` or
`error`, and optionally `usage` (`input_tokens`, `output_tokens`, `model`, `latency_s`) and
`steps` (its trajectory). A sample's latency is the worker's time on it (what the agent
reports instead, if it does), never its wait for a worker nor the import.
"""

from __future__ import annotations

import ast
import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from tasks.agents.base import (
    AgentContext,
    AgentError,
    Reloadable,
    declared_dependencies,
    spec_fingerprint,
)
from tasks.agents.cmd import STDERR_TAIL, CmdAgent
from tasks.agents.gateway import Gateway, Grant, gateway_of, grant_for
from tasks.agents.trajectory import capped
from tasks.models import EvalCase, InputError, sha256_hex
from tasks.redaction import redact
from tasks.registry import agent_kind

WORKER_SCRIPT = Path(__file__).with_name("worker_script.py")
# A reply holds the output (at most the run's output cap), its steps and usage: past this much
# more, the worker is broken, not the sample long.
REPLY_SLACK = 4 << 20


class _Gone(Exception):
    """The worker cannot answer: it exited, or broke the protocol."""


@dataclass(eq=False)  # each worker is itself: kept in a set while busy
class _Worker:
    proc: subprocess.Popen[bytes]
    requests: int  # the pipe the worker reads, one JSON line per sample
    replies: int  # the pipe it answers on
    stderr: Path
    pending: bytes = b""
    # Its token on the run's model gateway (its environment's OPENAI_API_KEY), granted to each
    # sample it draws in turn; None where the environment names no endpoint.
    gateway: Gateway | None = None
    lease: str | None = None

    def ask(self, request: dict[str, Any], deadline: float, cap: int) -> dict[str, Any] | None:
        """The worker's reply to `request` (None past `deadline`); `_Gone` when it cannot."""
        os.truncate(self.stderr, 0)  # the tail kept on failure is this sample's
        data = json.dumps(request).encode() + b"\n"
        try:
            while data:
                data = data[os.write(self.requests, data):]
        except OSError as exc:
            raise _Gone(f"it exited before the sample ({exc.strerror})") from None
        return self.read(deadline, cap)

    def read(self, deadline: float, cap: int) -> dict[str, Any] | None:
        """The next line as a JSON object (None past `deadline`)."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.replies, selectors.EVENT_READ)
            while b"\n" not in self.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if not sel.select(left):
                    continue
                chunk = os.read(self.replies, 1 << 16)
                if not chunk:
                    raise _Gone(self._exited())
                self.pending += chunk
                if len(self.pending) > cap:
                    raise _Gone(f"its reply ran over {cap:,} bytes")
        line, _, self.pending = self.pending.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            raise _Gone(f"it answered a line that is not JSON: {line[:200]!r}") from None
        return reply if isinstance(reply, dict) else {"output": reply}

    def _exited(self) -> str:
        code = self.proc.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        tail = self.stderr_tail()
        return f"the worker {how}: {tail}" if tail else f"the worker {how}"

    def stderr_tail(self) -> str:
        try:
            text = self.stderr.read_bytes()[-4 * STDERR_TAIL:].decode("utf-8", "replace")
        except OSError:
            return ""
        # Masked before it is cut: a secret cut in half would escape the mask.
        return redact(text).strip()[-STDERR_TAIL:]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its session: what it started too
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for fd in (self.requests, self.replies):
            os.close(fd)
        self.stderr.unlink(missing_ok=True)
        if self.gateway is not None and self.lease is not None:
            self.gateway.end_lease(self.lease)


@dataclass
class _Mean:
    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class WorkerPool:
    """The workers of one agent in this process (see the module)."""

    def __init__(self, argv: Callable[[int, int], list[str]], cwd: Path, protocol_on_stdio: bool, handshake: bool,
                 gateway: Gateway | None = None):
        self.argv, self.cwd, self.stdio, self.handshake = argv, cwd, protocol_on_stdio, handshake
        self.gateway = gateway  # where its workers' model calls go (`_Worker.lease`)
        self.idle: list[_Worker] = []
        self.busy: set[_Worker] = set()
        self.starting = 0
        self.waiting = 0  # samples waiting for a worker
        # Seconds a worker took to start (its import), and a sample's call: what decides
        # whether a waiting sample starts one (`_worth_starting`).
        self.start_s, self.call_s = _Mean(), _Mean()
        self.cond = threading.Condition()
        self.scratch = tempfile.mkdtemp(prefix="evalpipe-workers-")

    def call(self, request: dict[str, Any], timeout_s: float, cap: int,
             grant: Callable[[str | None], Grant | None] = lambda lease: None) -> tuple[dict[str, Any], Grant | None]:
        """A worker's reply to `request`, the worker then free for another sample, and the
        sample's `grant(lease)` of the worker's gateway token, revoked once it answered;
        `AgentError` when it cannot answer in `timeout_s` (the worker killed)."""
        worker = self._take(timeout_s, cap)
        granted = grant(worker.lease)
        started = time.monotonic()
        try:
            reply = worker.ask(request, time.monotonic() + timeout_s, cap)
        except _Gone as exc:
            self._drop(worker)
            raise AgentError(str(exc)) from None
        except BaseException:
            self._drop(worker)  # stopped mid-call: its state is unknown
            raise
        finally:
            if granted is not None:
                granted.revoke()
        if reply is None:
            self._drop(worker)
            raise AgentError(f"timed out after {timeout_s:g} s (--cmd-timeout); its worker was killed")
        with self.cond:
            self.call_s.add(time.monotonic() - started)
            self.busy.discard(worker)
            self.idle.append(worker)
            self.cond.notify_all()
        return reply, granted

    def _take(self, timeout_s: float, cap: int) -> _Worker:
        cores = len(os.sched_getaffinity(0))
        with self.cond:
            self.waiting += 1
            try:
                while not self.idle and not self._worth_starting(cores):
                    self.cond.wait()
            finally:
                self.waiting -= 1
            if self.idle:
                worker = self.idle.pop()
                self.busy.add(worker)
                return worker
            self.starting += 1
        started = time.monotonic()
        try:
            worker = self._start(timeout_s, cap)
        finally:
            with self.cond:
                self.starting -= 1
                self.cond.notify_all()
        with self.cond:
            self.start_s.add(time.monotonic() - started)
            self.busy.add(worker)
        return worker

    def _worth_starting(self, cores: int) -> bool:
        """Whether a waiting sample should start a worker rather than wait for one: none will
        come free, or at the pace measured so far the wait is longer than a start (a slow
        call, a quick import); at most one starting per core."""
        if self.starting >= cores:
            return False
        coming = len(self.busy) + self.starting
        if not coming:
            return True
        if self.start_s.mean is None or self.call_s.mean is None:
            return True  # nothing measured yet: up to one starting per core
        return self.waiting * self.call_s.mean / coming > self.start_s.mean

    def _start(self, timeout_s: float, cap: int) -> _Worker:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        stderr = Path(tempfile.mktemp(dir=self.scratch, suffix=".stderr"))  # noqa: S306 - in our own folder
        lease = self.gateway.lease() if self.gateway is not None else None
        env = self.gateway.environ(os.environ, lease) if self.gateway is not None and lease else None
        try:
            with open(stderr, "ab") as err:  # appended: truncating it between samples leaves no hole
                proc = subprocess.Popen(
                    self.argv(req_r, rep_w), cwd=self.cwd, stderr=err, start_new_session=True, env=env,
                    stdin=req_r if self.stdio else subprocess.DEVNULL,
                    stdout=rep_w if self.stdio else subprocess.DEVNULL,
                    pass_fds=() if self.stdio else (req_r, rep_w),
                )
        except OSError as exc:
            for fd in (req_r, req_w, rep_r, rep_w):
                os.close(fd)
            if lease is not None:
                self.gateway.end_lease(lease)
            raise AgentError(f"cannot start the worker: {exc.strerror or exc}") from None
        os.close(req_r)
        os.close(rep_w)
        worker = _Worker(proc, req_w, rep_r, stderr, gateway=self.gateway, lease=lease)
        if not self.handshake:
            return worker
        try:
            ready = worker.read(time.monotonic() + timeout_s, cap)
        except _Gone as exc:
            worker.kill()
            raise AgentError(str(exc)) from None
        if ready is None or not ready.get("ready"):
            worker.kill()
            raise AgentError(ready.get("error", "the worker did not start") if ready else
                             f"the worker did not start within {timeout_s:g} s (--cmd-timeout)")
        return worker

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self.cond:
            self.busy.discard(worker)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            workers, self.idle = [*self.idle, *self.busy], []
            self.busy = set()
        for worker in workers:
            worker.kill()
        try:
            os.rmdir(self.scratch)
        except OSError:
            pass


_POOLS: dict[tuple[str, str, str], WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def close_pools() -> None:
    """Kill every worker this process started (at exit, and where a caller ends its runs)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


atexit.register(close_pools)


class _Persistent(Reloadable):
    """What both kinds share: a pool per agent and process, one request per sample."""

    def _pool(self) -> WorkerPool:
        raise NotImplementedError

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        key = (type(self).__name__, self.fingerprint, str(self.base))
        with _POOLS_LOCK:
            pool = _POOLS.get(key) or _POOLS.setdefault(key, self._pool())
        cap = self.settings.max_output_bytes + 1  # one byte over tells the sampler to truncate
        request = {"id": case.id, "case_id": case.id, "inputs": case.inputs, "index": ctx.index,
                   "seed": ctx.seed, "n": ctx.n, "cap": cap}
        reply, grant = pool.call(request, self.settings.cmd_timeout,
                                 cap + self.settings.max_trajectory_bytes + REPLY_SLACK,
                                 lambda lease: grant_for(os.environ, self.settings, ctx, lease) if lease else None)
        try:
            return _apply(reply, ctx, self.settings.max_trajectory_bytes)
        finally:  # what the gateway saw of the sample's calls: its usage, and its trajectory unless it recorded turns
            if grant is not None and (tapped := grant.settle(ctx, ctx.trace.trajectory,
                                                             self.settings.max_trajectory_bytes)) is not None:
                ctx.trace.trajectory = tapped


def _apply(reply: dict[str, Any], ctx: AgentContext, trajectory_cap: int) -> str:
    """What the worker said about its sample, into the sample's trace and usage; the output."""
    steps = reply.get("steps") or []
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise AgentError("the worker's steps are not a list of JSON objects")
    if steps:
        ctx.trace.trajectory = capped(steps, trajectory_cap)
    if isinstance(reply.get("latency_s"), int | float):
        ctx.report_latency(reply["latency_s"])
    usage = reply.get("usage") or {}
    if not isinstance(usage, dict) or set(usage) - {"input_tokens", "output_tokens", "model", "latency_s"}:
        raise AgentError("the worker's usage: expected an object with input_tokens, output_tokens, model, latency_s")
    if "latency_s" in usage:
        ctx.report_latency(usage.pop("latency_s"))
    if usage:
        ctx.report_usage(**usage)
    if "error" in reply:
        raise AgentError(str(reply["error"]))
    if "returned" in reply:
        raise AgentError(f"returned {reply['returned']}, expected str")
    if not isinstance(reply.get("output"), str):
        raise AgentError("the worker's reply has no output string")
    return reply["output"]


@agent_kind("pyworker", runs_code=True)
@dataclass(frozen=True)
class PyWorkerAgent(_Persistent):
    """`pyworker:FILE.py:FUNC[?python=INTERPRETER]`: `FUNC(inputs, ctx)` in persistent workers
    of INTERPRETER (default: evalpipe's own)."""

    python: str = ""
    file: str = ""
    func: str = ""

    @classmethod
    def load(cls, spec: str, rest: str, base: Path) -> PyWorkerAgent:
        ref, _, query = rest.partition("?")
        options = dict(parse_qsl(query, keep_blank_values=True))
        unknown = sorted(set(options) - {"python"})
        if unknown:
            raise InputError(f"agent {spec!r}: unknown option {unknown[0]!r} (expected python=INTERPRETER)")
        target, sep, func = ref.rpartition(":")
        if not sep or not target.endswith(".py") or not func.isidentifier():
            raise InputError(f"agent {spec!r}: expected pyworker:path/to/file.py:FUNCTION[?python=INTERPRETER]")
        file = (base / target).resolve()
        try:
            code = file.read_bytes()
            defined = _top_level_names(ast.parse(code, str(file)))
        except (OSError, SyntaxError, ValueError) as exc:
            raise InputError(f"agent {spec!r}: {target}: {exc}") from None
        if func not in defined:
            raise InputError(f"agent {spec!r}: {target} defines no {func!r} at its top level")
        python = options.get("python") or sys.executable
        interpreter = Path(os.path.abspath(base / python))  # a venv's python keeps its path (not resolved)
        if not interpreter.is_file() or not os.access(interpreter, os.X_OK):
            raise InputError(f"agent {spec!r}: python={python}: not an executable file")
        # The interpreter's path is in the spec; its venv's packages are its environment, which
        # only what evalpipe-agent.toml declares brings in.
        fingerprint = spec_fingerprint(spec, {"file": sha256_hex(code), "python": str(interpreter)},
                                       declared_dependencies(spec, file.parent))
        return cls(spec, fingerprint, base, python=str(interpreter), file=str(file), func=func)

    def _pool(self) -> WorkerPool:
        def argv(requests: int, replies: int) -> list[str]:
            return [self.python, str(WORKER_SCRIPT), str(requests), str(replies), self.file, self.func]

        return WorkerPool(argv, self.base, protocol_on_stdio=False, handshake=True,
                          gateway=gateway_of(os.environ, self.settings))


@agent_kind("cmdworker", runs_code=True)
@dataclass(frozen=True)
class CmdWorkerAgent(_Persistent):
    """`cmdworker:COMMAND`: a `cmd:` agent that stays up and answers one JSON line per case."""

    argv: tuple[str, ...] = ()

    @classmethod
    def load(cls, spec: str, rest: str, base: Path) -> CmdWorkerAgent:
        inner = CmdAgent.load(spec, rest, base)  # its checks, and its fingerprint: the files it names
        return cls(spec, inner.fingerprint, base, argv=inner.argv)

    def _pool(self) -> WorkerPool:
        return WorkerPool(lambda _r, _w: list(self.argv), self.base, protocol_on_stdio=True, handshake=False,
                          gateway=gateway_of(os.environ, self.settings))


def _top_level_names(tree: ast.Module) -> set[str]:
    """What a module defines at its top level (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names
