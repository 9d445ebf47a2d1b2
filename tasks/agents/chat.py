"""The `openai:` agent: an OpenAI-compatible chat-completions endpoint (through
`tasks.agents.openai_client`), and the chat a case becomes: its `messages`, else its
prompt (`PROMPT_FIELDS`, which judges read too)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from tasks.agents import sdk_calls
from tasks.agents.base import AgentContext, AgentError, Reloadable
from tasks.agents.gateway import Tap
from tasks.agents.openai_client import ChatReply, EndpointError, OpenAIClient
from tasks.agents.settings import AgentSettings
from tasks.agents.toolbox import Toolbox
from tasks.agents.trajectory import capped
from tasks.models import EvalCase, InputError, canonical_json, sha256_hex
from tasks.registry import agent_kind
from tasks.trajectory import parse_call

# Body fields evalpipe sets itself, so a spec may not: one sample per request, our seed, the
# case's tools.
RESERVED_PARAMS = frozenset({"model", "messages", "seed", "n", "stream", "tools"})
DEFAULT_MAX_STEPS = 10  # model turns of a tool loop (`openai:MODEL?max_steps=N`)
# Inputs that configure the tool loop, never shown to the model as the case's text.
TOOL_INPUTS = ("tools", "world")
# Inputs tried in order for the user message when a case has no `messages`.
PROMPT_FIELDS = ("prompt", "question", "issue", "problem_statement", "input", "text")


@agent_kind("openai")
@dataclass(frozen=True)
class OpenAIAgent(Reloadable):
    model: str = ""
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)
    system: str | None = None
    client: OpenAIClient = field(default_factory=OpenAIClient, repr=False, compare=False)
    max_steps: int = DEFAULT_MAX_STEPS

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
        max_steps = params.pop("max_steps", DEFAULT_MAX_STEPS)
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not 1 <= max_steps <= 1000:
            raise InputError(f"agent {spec!r}: max_steps must be a whole number of model turns from 1 to 1000,"
                             f" got {max_steps!r}")
        client = OpenAIClient.from_env()
        identity = {
            "model": model, "params": params, "system": system, "base_url": client.base_url
        }
        if max_steps != DEFAULT_MAX_STEPS:  # absent at the default: older fingerprints hold
            identity["max_steps"] = max_steps
        fingerprint = sha256_hex(canonical_json({"openai": identity}))
        return cls(spec, fingerprint, base, model, params, system, client, max_steps)

    def with_settings(self, settings: AgentSettings) -> OpenAIAgent:
        # The client's timeout and retries; never its key, which each machine reads itself.
        client = replace(self.client, timeout_s=settings.openai_timeout, max_attempts=settings.openai_max_attempts)
        return replace(self, settings=settings, client=client)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        messages = chat_messages(case.inputs, self.system)
        if "tools" in case.inputs:
            return self.run_tools(Toolbox.for_case(case), messages, ctx)
        with self._calling(ctx) as tap:
            reply, _ = self._ask(messages, ctx, None, tap)
        spent: dict[str, Any] = {"input_tokens": None, "output_tokens": None, "latency_s": 0.0, "model": None}
        _add_usage(spent, reply)
        ctx.report_usage(input_tokens=spent["input_tokens"], output_tokens=spent["output_tokens"], model=reply.model)
        if reply.latency_s is not None:
            ctx.report_latency(reply.latency_s)
        return reply.content

    @contextmanager
    def _calling(self, ctx: AgentContext) -> Iterator[Tap]:
        """Around a sample's calls: the run's caps on them and its budget, counted as the gateway
        counts an agent's calls (the call past a cap is never sent), and their routing in this
        process (`--model-concurrency`, `--replay-model-calls`: `tasks.agents.sdk_calls`)."""
        tap = Tap(max_calls=self.settings.max_model_calls, max_cost_usd=self.settings.max_sample_cost,
                  cost_of=ctx.cost_of, purse=ctx.purse)
        with sdk_calls.routing(sdk_calls.sample_calls(ctx.calls, self.settings.model_concurrency)):
            yield tap

    def _ask(self, messages: list[dict[str, Any]], ctx: AgentContext, tools: list[dict[str, Any]] | None,
             tap: Tap) -> tuple[ChatReply, dict[str, Any] | None]:
        """The model's reply, counted against the caps (`AgentError` naming the cap that refuses
        it, before anything is sent), and the note the trajectory gets when its model has no price."""
        if (why := tap.admit()) is not None:
            raise AgentError(f"stopped at {why}: the loop wanted a model call more")
        try:
            reply = self.client.chat_reply(self.model, messages, seed=ctx.seed, params=dict(self.params), tools=tools)
        except EndpointError as exc:
            tap.paid(None, None, None)
            raise AgentError(str(exc)) from None
        return reply, tap.paid(reply.model, reply.input_tokens, reply.output_tokens, replayed=reply.replayed)

    def run_tools(self, toolbox: Toolbox, messages: list[dict[str, Any]], ctx: AgentContext) -> str:
        """Ask, answer each tool call in order, send the results back; until the model answers
        without a tool call or `max_steps` turns have passed. Every turn and result goes to the
        sample's trajectory as it happens (a failed call keeps what came before it); the
        output is the last turn's content."""
        entries: list[dict[str, Any]] = []
        stop = None
        spent: dict[str, Any] = {"input_tokens": None, "output_tokens": None, "latency_s": 0.0, "model": None}
        with self._calling(ctx) as tap:
            try:
                for _ in range(self.max_steps):
                    reply, note = self._ask(messages, ctx, toolbox.definitions, tap)
                    if note is not None:
                        entries.append(note)
                    _add_usage(spent, reply)
                    said = {"role": "assistant", "content": reply.content or None,
                            **({"tool_calls": list(reply.tool_calls)} if reply.tool_calls else {})}
                    messages.append(said)
                    entries.append({**said, "usage": {"input_tokens": reply.input_tokens,
                                                      "output_tokens": reply.output_tokens},
                                    **({"replayed": True} if reply.replayed else {}),
                                    "latency_s": reply.latency_s, "model": reply.model,
                                    **({"request_sha256": reply.request_sha256} if reply.request_sha256 else {})})
                    if not reply.tool_calls:
                        return reply.content
                    for call in map(parse_call, reply.tool_calls):
                        answer = toolbox.answer(call)
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": answer.content})
                        entries.append({"role": "tool", "tool_call_id": call.id, "name": call.name,
                                        "content": answer.content, "duration_s": round(answer.duration_s, 6),
                                        **({"error": answer.error} if answer.error is not None else {})})
                stop = "max_steps"
                return reply.content
            finally:
                ctx.trace.trajectory = capped(entries, self.settings.max_trajectory_bytes, stop)
                ctx.report_usage(input_tokens=spent["input_tokens"], output_tokens=spent["output_tokens"],
                                 model=spent["model"])
                ctx.report_latency(spent["latency_s"])


def _add_usage(spent: dict[str, Any], reply: ChatReply) -> None:
    """A turn's tokens and latency added to the loop's (a count no turn reported stays None;
    a replayed turn's tokens were not bought: known, and none)."""
    for key, value in (("input_tokens", reply.input_tokens), ("output_tokens", reply.output_tokens)):
        if reply.replayed:
            spent[key] = spent[key] or 0
        elif value is not None:
            spent[key] = (spent[key] or 0) + value
    spent["latency_s"] += reply.latency_s or 0.0
    spent["model"] = reply.model


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
            text = canonical_json({k: v for k, v in inputs.items() if k not in TOOL_INPUTS}).decode("utf-8")
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
