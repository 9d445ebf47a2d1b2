"""The `python:` agent: a user's function called in the harness, and `call_user_code`,
which judges use too: what user code raises is its failure, a real signal stops the run."""

from __future__ import annotations

import copy
import inspect
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.agents.base import (
    AgentContext,
    AgentError,
    Reloadable,
    declared_dependencies,
    spec_fingerprint,
)
from tasks.agents.capture import captured
from tasks.callables import load_callable
from tasks.models import EvalCase, InputError
from tasks.registry import agent_kind


@agent_kind("python", runs_code=True)
@dataclass(frozen=True)
class PythonAgent(Reloadable):
    """`FUNC(inputs, ctx) -> str`. Whatever it raises — `KeyboardInterrupt` and `SystemExit`
    included — is an `AgentError`; only a signal the process really received stops the run.
    What it returns is checked where it enters the sample (`tasks.run.sampling`)."""

    func: Callable[..., Any] = field(repr=False, compare=False, default=None)

    @classmethod
    def load(cls, spec: str, rest: str, base: Path) -> PythonAgent:
        try:
            loaded = load_callable(rest, base)
        except InputError as exc:
            raise InputError(f"agent {spec!r}: {exc}") from None
        depends = declared_dependencies(spec, loaded.source.parent if loaded.source else None)
        return cls(spec, spec_fingerprint(spec, loaded.code_sha256, depends), base, loaded.func)

    def generate(self, case: EvalCase, ctx: AgentContext) -> Any:
        # A copy: the case is a frozen value shared by every sample.
        with captured(ctx, self.settings):
            return call_user_code(self.func, inputs_copy(case.inputs), ctx)


@dataclass(frozen=True)
class CallableAgent:
    """A Python function given as the agent (`evalpipe.evaluate(agent=func)`), called as a
    `python:` agent's is: `func(inputs, ctx) -> str`. Its spec names it (`callable:MOD:NAME`);
    its fingerprint is its code, so an edited function draws anew, not from the cache. It
    runs in the process that holds it: drawing runs on threads."""

    spec: str
    fingerprint: str
    func: Callable[..., Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, func: Callable[..., Any]) -> CallableAgent:
        if not callable(func):
            raise InputError(f"agent {func!r}: not a spec string nor a callable")
        name = getattr(func, "__qualname__", type(func).__qualname__)
        spec = f"callable:{getattr(func, '__module__', None) or '?'}:{name}"
        return cls(spec, spec_fingerprint(spec, _code_of(func)), func)

    def generate(self, case: EvalCase, ctx: AgentContext) -> Any:
        with captured(ctx):
            return call_user_code(self.func, inputs_copy(case.inputs), ctx)


def inputs_copy(value: Any) -> Any:
    """A deep copy of a case's inputs for the agent to own (the case is a frozen value
    shared by every sample): JSON data copied directly, anything else (a YAML date) by
    `copy.deepcopy`. A cheap sample's agent call costs less than `deepcopy` alone."""
    kind = type(value)
    if kind is dict:
        return {k: inputs_copy(v) for k, v in value.items()}
    if kind is list:
        return [inputs_copy(v) for v in value]
    if kind in _IMMUTABLE:
        return value
    return copy.deepcopy(value)


_IMMUTABLE = frozenset({str, int, float, bool, type(None)})


def _code_of(func: Callable[..., Any]) -> str:
    """What a function does, as text: its source, else its bytecode and constants."""
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        code = getattr(func, "__code__", None) or getattr(type(func).__call__, "__code__", None)
        return repr((code.co_code.hex(), code.co_consts)) if code else repr(func)


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
        # None: installed outside Python, cannot be put back. SIG_IGN: the process ignores
        # it (started by a shell in the background, which hands its children SIGINT
        # ignored): relaying would stop ignoring it, and one received would make the
        # agent's own exception stop the run.
        if handler is not None and handler != signal.SIG_IGN:
            previous[signum] = handler
            signal.signal(signum, relay)
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
