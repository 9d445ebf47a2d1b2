"""The machine's settings (`MachineSettings`): the policy of the machine that runs the code,
not options a run's form may set (docs/contract.md §10): how code is sandboxed, a coding
agent's network and the variables it is handed, how environments are built, the plugins each
process imports, the judges that run in the harness, and EVALPIPE_HOME.

They are read from the environment once, at the edge (`evalpipe`'s `main`, the flows, the
Python API: `MachineSettings.from_environ`), and carried with the run: `service.run.execute`
enters them (`using`) and each stage task carries them into its thread, worker process or Dask
worker (`tasks.run.loop`), so code under tasks/ asks `current()` and never the environment of
the process it happens to run in. Code entered by no edge (a process the sandbox starts for a
suite's callable, a test calling a task directly) gets what its own environment says, read the
same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict

from tasks.errors import InputError


class MachineSettings(BaseModel):
    """This machine's policy; each field's default is the built-in one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # "rlimits" forces the fallback (for tests, or machines where user namespaces are
    # forbidden and the probe would be noisy); "auto" uses bubblewrap when it works.
    sandbox: Literal["auto", "rlimits"] = "auto"
    # Every run may use the fallback without bubblewrap (a run's own --unsafe-no-sandbox is an option).
    unsafe_no_sandbox: bool = False
    # A workspace agent's network: its own (through pasta) or the host's.
    agent_network: Literal["own", "host"] = "own"
    # More of the machine's variables handed to a workspace agent, besides the model endpoints'.
    agent_env: tuple[str, ...] = ()
    # "pip" builds environments with `python -m venv` + pip even when uv is installed.
    env_installer: Literal["uv", "pip"] = "uv"
    # More host variables an environment's build receives (upper-cased), besides the index's.
    build_pass_env: frozenset[str] = frozenset()
    # Modules or `.py` files each process imports for their graders, metrics, agents and tools.
    plugins: tuple[str, ...] = ()
    # A suite's judge callables (`FILE:FUNCTION`) that run in the harness, not in the sandbox.
    harness_judges: tuple[str, ...] = ()
    # Where evalpipe keeps its state; None: the nearest `.evalpipe/` (`tasks.home`).
    home: Path | None = None
    # What an `openai:` judge outside a run takes (a run's judges take the run's own); None: the default.
    judge_openai_timeout: float | None = None
    judge_openai_max_attempts: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> MachineSettings:
        """The settings `environ` states (an empty variable is unset); a bad value is
        `InputError` naming the variable."""
        raw = {name: environ.get(var, "").strip() for name, var in ENV.items()}
        return _parsed(tuple(raw.items()))


# Each setting's documented variable (docs/contract.md §10).
ENV: dict[str, str] = {
    "sandbox": "EVALPIPE_SANDBOX",
    "unsafe_no_sandbox": "EVALPIPE_UNSAFE_NO_SANDBOX",
    "agent_network": "EVALPIPE_AGENT_NETWORK",
    "agent_env": "EVALPIPE_AGENT_ENV",
    "env_installer": "EVALPIPE_ENV_INSTALLER",
    "build_pass_env": "EVALPIPE_BUILD_PASS_ENV",
    "plugins": "EVALPIPE_PLUGINS",
    "harness_judges": "EVALPIPE_HARNESS_JUDGES",
    "home": "EVALPIPE_HOME",
    "judge_openai_timeout": "EVALPIPE_OPENAI_TIMEOUT_S",
    "judge_openai_max_attempts": "EVALPIPE_OPENAI_MAX_ATTEMPTS",
}


@lru_cache(maxsize=32)
def _parsed(raw: tuple[tuple[str, str], ...]) -> MachineSettings:
    return MachineSettings(**{name: _value(name, ENV[name], text) for name, text in raw if text})


def _value(name: str, var: str, text: str) -> object:
    annotation = MachineSettings.model_fields[name].annotation
    if get_origin(annotation) is Literal:
        if text not in get_args(annotation):
            raise InputError(f"{var}={text!r}: expected {' or '.join(get_args(annotation))}")
        return text
    if annotation is bool:
        if text not in ("0", "1"):
            raise InputError(f"{var}={text!r}: expected 1 or 0")
        return text == "1"
    if name == "home":
        return Path(text)
    if name.startswith("judge_"):
        return positive_number(var, text, int if name.endswith("attempts") else float)
    items = [part.strip() for part in text.split(",") if part.strip()]
    if name in ("agent_env", "build_pass_env") and (bad := [n for n in items if not n.replace("_", "").isalnum()]):
        raise InputError(f"{var}: {bad[0]!r} is not a variable name")
    return frozenset(n.upper() for n in items) if name == "build_pass_env" else tuple(items)


def positive_number(var: str, text: str, kind: type[int] | type[float]) -> int | float:
    """`text`, the value of variable `var`, as a positive `kind`; else `InputError` naming it."""
    try:
        value = kind(text)
    except ValueError:
        raise InputError(f"{var}={text!r} is not {'a whole number' if kind is int else 'a number'}") from None
    if value <= 0:
        raise InputError(f"{var}={text!r} must be positive")
    return value


_carried: ContextVar[MachineSettings | None] = ContextVar("machine_settings", default=None)


@contextmanager
def using(settings: MachineSettings) -> Iterator[None]:
    """Inside (this thread or task, and what it starts with a copy of its context): code asks
    `current()` and gets `settings`, the run's."""
    token = _carried.set(settings)
    try:
        yield
    finally:
        _carried.reset(token)


def current() -> MachineSettings:
    """The settings the run entered (`using`); entered by no edge, this process's own."""
    carried = _carried.get()
    if carried is not None:
        return carried
    return _own(tuple(map(os.environ.get, _VARIABLES)))


_VARIABLES = tuple(ENV.values())


@lru_cache(maxsize=32)
def _own(values: tuple[str | None, ...]) -> MachineSettings:
    # Keyed on the raw values: every sandboxed program of a process entered by no edge asks.
    return _parsed(tuple((name, (value or "").strip()) for name, value in zip(ENV, values, strict=True)))
