"""The injected agents (docs/contract.md §5): `python:`, `cmd:`, `replay:`, `reference`, `openai:`.

`load_agent(spec)` turns an `--agent` value into an `Agent`: something with the `spec` as
given, a `fingerprint` that enters every cache key, and `generate(case, ctx) -> str`.
Bad specs fail at load time with `InputError`; a failure while generating (user code
raised, the command exited non-zero or timed out, the endpoint gave up) is an `AgentError`,
which the flow records as an `agent_error` sample.

Every agent pickles as (spec, working directory, fingerprint, the run's `AgentSettings`) and
is re-created where it is unpickled (a worker process, a Dask worker) by the loader
`load_agent` uses for its kind, with those settings (`tasks.agents.settings`). If the agent
there has another fingerprint — its code was edited mid-run, or a worker sees another
endpoint — each of its samples fails with `AgentError` rather than being cached under the
wrong key.

Each kind is a module of its own: `python`, `cmd`, `replay`, `reference` and `chat`
(`openai:`, over `openai_client`); what they share, pickling included, is in `base`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Importing a kind's module registers its scheme (`tasks.registry.agent_kind`).
from tasks.agents import chat, cmd, python, reference, replay, worker  # noqa: F401
from tasks.agents.base import Agent, AgentContext, AgentError, Reloadable
from tasks.agents.chat import PROMPT_FIELDS
from tasks.agents.python import call_user_code
from tasks.agents.reference import reference_text
from tasks.agents.replay import parse_replay
from tasks.agents.settings import AgentSettings
from tasks.agents.workspace_runner import DEFAULT_AGENT_TIMEOUT_S, WorkspaceAgent
from tasks.models import EvalCase, InputError
from tasks.registry import AgentKindSpec, agent_kind_spec, agent_kinds

__all__ = [
    "DEFAULT_AGENT_TIMEOUT_S", "PROMPT_FIELDS", "Agent", "AgentContext", "AgentError", "AgentSettings",
    "call_user_code", "load_agent", "parse_replay", "reference_text", "seen_beyond_inputs",
]


def seen_beyond_inputs(spec: str, case: EvalCase) -> dict[str, Any]:
    """What an agent reads of a case besides its id and inputs, which its outputs' cache
    key must therefore hold (its kind's `sees`: the `reference` agent answers with the
    reference)."""
    kind = _kinds().get(spec if ":" not in spec else spec.partition(":")[0])
    return kind.sees(case) if kind is not None and kind.sees is not None else {}


def load_agent(spec: str, workspace_timeout_s: float | None = None, settings: AgentSettings | None = None) -> Agent:
    """Parse and load an `--agent` spec, resolving relative paths against the working directory.
    With `workspace_timeout_s`, a coding agent run per sample in a workspace (`--workspace`).
    `settings`: the run's (`RunConfig.agent_settings`; default: the built-in ones), which the
    agent keeps, pickled or not."""
    settings = settings or AgentSettings()
    base = Path.cwd()
    if workspace_timeout_s is not None:
        return WorkspaceAgent.load(spec, base, workspace_timeout_s, settings)
    agent = _load(spec, base)
    return agent.with_settings(settings) if isinstance(agent, Reloadable) else agent


def _load(spec: str, base: Path) -> Agent:
    scheme, sep, rest = spec.partition(":")
    kind = agent_kind_spec(scheme if sep else spec)
    if kind is None or kind.bare == bool(sep):
        known = sorted(k.named for k in agent_kinds().values())
        raise InputError(f"agent {spec!r}: unknown scheme {scheme!r} (expected {', '.join(known[:-1])} or {known[-1]})")
    if sep and not rest.strip():
        raise InputError(f"agent {spec!r}: nothing after {scheme}:")
    return kind.load(spec, rest, base)


def _kinds() -> dict[str, AgentKindSpec]:
    """The registered kinds, read once per process (a sample asks for its agent's)."""
    global _KNOWN
    if _KNOWN is None:
        _KNOWN = agent_kinds()
    return _KNOWN


_KNOWN: dict[str, AgentKindSpec] | None = None
