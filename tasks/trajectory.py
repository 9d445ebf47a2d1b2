"""A sample's trajectory as typed steps: what its agent did, read from the entries stored in
`SampleTrace.trajectory` (docs/contract.md §1.2, docs/agents.md "Tools").

The interchange shape is OpenAI's chat messages: an assistant message is a model turn (its
content and `tool_calls`, each with an id, a function name and JSON arguments), a `tool`
message is a tool result (its `tool_call_id`, content, and evalpipe's `error` when the call
failed). evalpipe adds its own keys beside them where it knows them: `usage`
(`input_tokens`, `output_tokens`), `latency_s`, `cost_usd` and `model` on a turn,
`duration_s` and `name` on a result. Anything else an agent wrote (a user message, a line
of free text, another shape) is a `Note`, kept as it came: so anything that can print its
messages fits, and nothing an agent wrote is lost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# What a tool call's arguments are when its JSON does not parse: kept as text, flagged.
UNPARSED = "unparsed"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: Any  # the parsed JSON (a mapping, as a rule), or the raw text when it is not JSON
    arguments_error: str | None = None  # why `arguments` is raw text

    def as_message(self) -> dict[str, Any]:
        """The call as OpenAI's `tool_calls` item."""
        raw = self.arguments if self.arguments_error else json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": raw}}


@dataclass(frozen=True)
class ModelTurn:
    index: int  # the entry's position in the trajectory
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    input_tokens: int | None = None
    output_tokens: int | None = None
    latency_s: float | None = None
    cost_usd: float | None = None
    model: str | None = None

    @property
    def tokens(self) -> int | None:
        return total_tokens(self.input_tokens, self.output_tokens)


def total_tokens(input_tokens: int | None, output_tokens: int | None) -> int | None:
    """Input and output tokens together; None when neither was reported."""
    if input_tokens is None and output_tokens is None:
        return None
    return (input_tokens or 0) + (output_tokens or 0)


@dataclass(frozen=True)
class ToolResult:
    index: int
    call_id: str
    content: str
    name: str | None = None
    error: str | None = None
    duration_s: float | None = None


@dataclass(frozen=True)
class Note:
    index: int
    data: Mapping[str, Any] = field(default_factory=dict)


Step = ModelTurn | ToolResult | Note


@dataclass(frozen=True)
class Action:
    """One tool call with what answered it (None: nothing did, e.g. the loop stopped)."""

    turn: int  # the 1-based model turn that made it
    call: ToolCall
    result: ToolResult | None

    @property
    def name(self) -> str:
        return self.call.name


@dataclass(frozen=True)
class Steps:
    """A trajectory's typed steps, and what graders and metrics ask of them."""

    steps: tuple[Step, ...] = ()

    @classmethod
    def of(cls, entries: Iterable[Mapping[str, Any]] | None) -> Steps:
        return cls(tuple(parse_step(i, e) for i, e in enumerate(entries or ())))

    @property
    def turns(self) -> list[ModelTurn]:
        return [s for s in self.steps if isinstance(s, ModelTurn)]

    def actions(self) -> list[Action]:
        """Every tool call in order, each with the result that answered its id."""
        results = {s.call_id: s for s in self.steps if isinstance(s, ToolResult)}
        return [Action(n, call, results.get(call.id))
                for n, turn in enumerate(self.turns, 1) for call in turn.tool_calls]

    @property
    def tool_calls(self) -> int:
        return sum(len(t.tool_calls) for t in self.turns)

    @property
    def tokens(self) -> int | None:
        counted = [t.tokens for t in self.turns if t.tokens is not None]
        return sum(counted) if counted else None

    @property
    def cost_usd(self) -> float | None:
        priced = [t.cost_usd for t in self.turns if t.cost_usd is not None]
        return sum(priced) if priced else None


def parse_step(index: int, entry: Mapping[str, Any]) -> Step:
    """One stored entry as its step; anything not a model turn or a tool result is a `Note`."""
    if not isinstance(entry, Mapping):
        return Note(index, {"text": str(entry)})
    role = entry.get("role")
    if role == "assistant":
        return ModelTurn(
            index, _text(entry.get("content")),
            tuple(parse_call(c) for c in entry.get("tool_calls") or () if isinstance(c, Mapping)),
            *usage_counts(entry.get("usage")),
            _number(entry.get("latency_s")), _number(entry.get("cost_usd")),
            entry.get("model") if isinstance(entry.get("model"), str) else None)
    if role == "tool":
        error = entry.get("error")
        return ToolResult(index, str(entry.get("tool_call_id") or ""), _text(entry.get("content")),
                          entry.get("name") if isinstance(entry.get("name"), str) else None,
                          None if error is None else str(error), _number(entry.get("duration_s")))
    return Note(index, dict(entry))


def parse_call(item: Mapping[str, Any]) -> ToolCall:
    """An OpenAI `tool_calls` item (`{id, function: {name, arguments}}`), its arguments parsed."""
    function = item.get("function") if isinstance(item.get("function"), Mapping) else item
    raw = function.get("arguments")
    name = str(function.get("name") or "")
    if raw is None or isinstance(raw, Mapping):
        return ToolCall(str(item.get("id") or ""), name, dict(raw or {}))
    try:
        return ToolCall(str(item.get("id") or ""), name, json.loads(raw))
    except (TypeError, ValueError) as exc:
        return ToolCall(str(item.get("id") or ""), name, str(raw), f"{UNPARSED}: {exc}")


def call_text(name: str, arguments: Any) -> str:
    """`get_weather({"city": "Paris"})`: a call as messages and details name it."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, sort_keys=True)
    return f"{name}({args})"


def matches(expected: Mapping[str, Any], given: Any, *, exact: bool = False) -> bool:
    """Whether a call's arguments `given` fit `expected`: every expected key present with an
    equal value (a subset; nested mappings alike), or with `exact` the whole object equal. A
    value `{"regex": P}` matches a string that P searches; `{"any": true}` any value present."""
    if not isinstance(given, Mapping):
        return not expected and not exact
    if exact and set(expected) != set(given):
        return False
    return all(key in given and _value_matches(want, given[key], exact) for key, want in expected.items())


def _value_matches(want: Any, got: Any, exact: bool) -> bool:
    if isinstance(want, Mapping):
        if set(want) == {"any"} and want["any"] is True:
            return True
        if set(want) == {"regex"} and isinstance(want["regex"], str):
            return isinstance(got, str) and re.search(want["regex"], got) is not None
        return matches(want, got, exact=exact)
    if isinstance(want, Sequence) and not isinstance(want, str):
        return (isinstance(got, Sequence) and not isinstance(got, str) and len(want) == len(got)
                and all(_value_matches(w, g, exact) for w, g in zip(want, got, strict=True)))
    if isinstance(want, bool) or isinstance(got, bool):
        return want is got
    return want == got


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: the text ones, joined
        return "".join(p.get("text", "") for p in value if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return json.dumps(value, ensure_ascii=False, default=str)


def usage_counts(usage: Any) -> tuple[int | None, int | None]:
    """(input, output) tokens of a `usage` object as chat completions (`prompt_tokens`,
    `completion_tokens`), the Responses API or evalpipe (`input_tokens`, `output_tokens`)
    write it; a count that is not a whole number >= 0 is no count."""
    usage = usage if isinstance(usage, Mapping) else {}
    return (_count(usage.get("input_tokens", usage.get("prompt_tokens"))),
            _count(usage.get("output_tokens", usage.get("completion_tokens"))))


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else None


def transcript(entries: Sequence[Mapping[str, Any]], output: str) -> str:
    """What the agent did, one numbered line a step, then its final answer: what a
    trajectory judge reads."""
    lines = [f"{i}. {step_text(e)}" for i, e in enumerate(entries, 1)]
    return "TRAJECTORY\n" + "\n".join(lines) + "\n\nFINAL ANSWER\n" + output


def step_text(step: Mapping[str, Any]) -> str:
    """One entry as a line of text: a model turn (`model: content  calls NAME(ARGS), ...
    [tokens, seconds]`), a tool result (`-> NAME: result` or `-> NAME error: ...`), else
    `role: content`, `tool NAME: input -> output` (an agent's own shape), or its JSON."""
    typed = parse_step(0, step)
    if isinstance(typed, ModelTurn):
        said = [flat(typed.content)] if typed.content else []
        if typed.tool_calls:
            said.append("calls " + ", ".join(call_text(c.name, c.arguments) for c in typed.tool_calls))
        text = " ".join(["model:", *said])
        took = [f"{typed.tokens} tokens" if typed.tokens is not None else "",
                f"{typed.latency_s:.2f} s" if typed.latency_s is not None else ""]
        return text + (f"  [{', '.join(t for t in took if t)}]" if any(took) else "")
    if isinstance(typed, ToolResult):
        head = f"-> {typed.name or typed.call_id}"
        return f"{head} error: {flat(typed.error)}" if typed.error else f"{head}: {flat(typed.content)}"
    rest = {k: v for k, v in step.items() if k not in ("role", "content", "tool", "input", "output", "text")}
    if "tool" in step:
        text = f"tool {step['tool']}: {flat(step.get('input', ''))}"
        if "output" in step:
            text += f" -> {flat(step['output'])}"
    elif "role" in step:
        text = f"{step['role']}: {flat(step.get('content') or '')}"
    elif set(step) == {"text"}:
        return flat(step["text"])
    else:
        return flat(step)
    return f"{text} {flat(rest)}" if any(v not in (None, [], "") for v in rest.values()) else text


def flat(value: Any) -> str:
    """A value as one line: text with its whitespace collapsed, anything else as JSON."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return " ".join(text.split())
