"""The `openai:` agent: an OpenAI-compatible chat-completions endpoint (through
`tasks.agents.openai_client`), and the chat a case becomes: its `messages`, else its
prompt (`PROMPT_FIELDS`, which judges read too)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from tasks.agents.base import AgentContext, AgentError, Reloadable
from tasks.agents.openai_client import EndpointError, OpenAIClient
from tasks.agents.settings import AgentSettings
from tasks.models import EvalCase, InputError, canonical_json, sha256_hex
from tasks.registry import agent_kind

# Body fields evalpipe sets itself, so a spec may not: one sample per request, our seed.
RESERVED_PARAMS = frozenset({"model", "messages", "seed", "n", "stream"})
# Inputs tried in order for the user message when a case has no `messages`.
PROMPT_FIELDS = ("prompt", "question", "issue", "input", "text")


@agent_kind("openai")
@dataclass(frozen=True)
class OpenAIAgent(Reloadable):
    model: str = ""
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)
    system: str | None = None
    client: OpenAIClient = field(default_factory=OpenAIClient, repr=False, compare=False)

    @classmethod
    def load(cls, spec: str, rest: str, base: Path) -> OpenAIAgent:
        model, _, query = rest.partition("?")
        if not model:
            raise InputError(f"agent {spec!r}: no model name (openai:MODEL[?param=value&...])")
        params = {
            key: _param_value(value) for key, value in parse_qsl(query, keep_blank_values=True)
        }
        reserved = sorted(RESERVED_PARAMS & set(params))
        if reserved:
            raise InputError(
                f"agent {spec!r}: {', '.join(reserved)} cannot be set (evalpipe sets them)"
            )
        system = params.pop("system", None)
        if system is not None and not isinstance(system, str):
            system = json.dumps(system)
        client = OpenAIClient.from_env()
        identity = {
            "model": model, "params": params, "system": system, "base_url": client.base_url
        }
        fingerprint = sha256_hex(canonical_json({"openai": identity}))
        return cls(spec, fingerprint, base, model, params, system, client)

    def with_settings(self, settings: AgentSettings) -> OpenAIAgent:
        # The client's timeout and retries; never its key, which each machine reads itself.
        client = replace(self.client, timeout_s=settings.openai_timeout, max_attempts=settings.openai_max_attempts)
        return replace(self, settings=settings, client=client)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        messages = chat_messages(case.inputs, self.system)
        try:
            reply = self.client.chat_reply(self.model, messages, seed=ctx.seed, params=dict(self.params))
        except EndpointError as exc:
            raise AgentError(str(exc)) from None
        ctx.report_usage(input_tokens=reply.input_tokens, output_tokens=reply.output_tokens, model=reply.model)
        if reply.latency_s is not None:
            ctx.report_latency(reply.latency_s)
        return reply.content


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


def _param_value(raw: str) -> Any:
    """`0.2` → 0.2, `true` → True, `["a","b"]` → a list; anything else stays a string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
