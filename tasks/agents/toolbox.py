"""What answers a model's tool calls in the `openai:` agent's tool loop (docs/agents.md
"Tools"): a workspace's tools (`with_handlers`), the case's scripted world, else a tool
registered with `tasks.registry.tool`, run in the harness with its timeout.

Total: a call to an undeclared tool, arguments that are not JSON or do not fit the tool's
schema, a world with no rule for the arguments, a tool that raises or runs past its timeout:
each is an error result the model sees, recorded as such, and the sample goes on.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tasks.models import EvalCase
from tasks.registry import ToolSpec, tool_spec
from tasks.sandbox import SandboxError
from tasks.sandbox.servers import ServerDied, call_in_sandbox
from tasks.tools import ToolDef, WorldRule, case_tools, case_world
from tasks.trajectory import ToolCall, call_text, matches

RESULT_CHARS = 64_000  # of one tool's result sent to the model and kept
_KEPT = 256  # toolboxes of distinct case inputs kept made
_MADE: dict[str, Toolbox] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Answer:
    content: str  # what the model is sent
    error: str | None
    duration_s: float


@dataclass(frozen=True)
class Toolbox:
    tools: dict[str, ToolDef]
    world: dict[str, list[WorldRule]]
    # Made once per case: checking a schema and building its validator cost milliseconds.
    validators: dict[str, Any] = field(default_factory=dict)
    definitions: list[dict[str, Any]] = field(default_factory=list)
    # Tools the harness answers itself (a workspace's: `tasks.agents.workspace_tools`), by name.
    handlers: Mapping[str, Callable[[dict[str, Any]], str]] = field(default_factory=dict)

    def with_handlers(self, tools: list[ToolDef], handlers: Mapping[str, Callable[[dict[str, Any]], str]]) -> Toolbox:
        """This toolbox and `tools`, answered by `handlers` (a handler raises `ToolFailed`
        for an error the model sees); a case's own tool of the same name is refused."""
        from jsonschema import Draft202012Validator

        taken = sorted(set(self.tools) & {t.name for t in tools})
        if taken:
            raise ToolFailed(f"the case declares {', '.join(taken)}, which the workspace's tools are named")
        return replace(self, tools={**self.tools, **{t.name: t for t in tools}},
                       validators={**self.validators, **{t.name: Draft202012Validator(t.parameters) for t in tools}},
                       definitions=[*self.definitions, *(t.as_openai() for t in tools)],
                       handlers={**self.handlers, **handlers})

    @classmethod
    def of(cls, inputs: Mapping[str, Any]) -> Toolbox:
        from jsonschema import Draft202012Validator

        tools = case_tools(inputs)
        return cls({t.name: t for t in tools}, case_world(inputs, tools),
                   {t.name: Draft202012Validator(t.parameters) for t in tools}, [t.as_openai() for t in tools])

    @classmethod
    def for_case(cls, case: EvalCase) -> Toolbox:
        """The case's toolbox, made once per distinct inputs (each sample of a case asks)."""
        with _LOCK:
            box = _MADE.get(case.inputs_hash)
        if box is None:
            box = cls.of(case.inputs)
            with _LOCK:
                _MADE[case.inputs_hash] = box
                while len(_MADE) > _KEPT:
                    _MADE.pop(next(iter(_MADE)))
        return box

    def answer(self, call: ToolCall) -> Answer:
        started = time.perf_counter()
        try:
            content = self._run(call)
            error = None
        except ToolFailed as exc:
            content, error = f"error: {exc}", str(exc)
        if len(content) > RESULT_CHARS:
            content = content[:RESULT_CHARS] + f"\n[evalpipe: tool result cut at {RESULT_CHARS} characters]"
        return Answer(content, error, time.perf_counter() - started)

    def _run(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            raise ToolFailed(f"no tool named {call.name!r} (tools: {', '.join(self.tools) or 'none'})")
        if call.arguments_error:
            raise ToolFailed(f"{call.name}: arguments are not JSON ({call.arguments_error.partition(': ')[2]})")
        _fits(tool.name, self.validators[tool.name], call.arguments)
        if call.name in self.handlers:
            return self.handlers[call.name](call.arguments)
        if call.name in self.world:
            return _scripted(call, self.world[call.name])
        if tool.registered:
            return _registered(call)
        raise ToolFailed(f"no scripted result for {call_text(call.name, call.arguments)}")


class ToolFailed(Exception):
    """A tool call that yields an error result; the message is what the model is told."""


def _fits(name: str, validator: Any, arguments: Any) -> None:
    error = next(iter(validator.iter_errors(arguments)), None)
    if error is not None:
        at = "/".join(map(str, error.absolute_path))
        raise ToolFailed(f"{name}: arguments do not fit its schema: {error.message}" + (f" (at {at})" if at else ""))


def _scripted(call: ToolCall, rules: list[WorldRule]) -> str:
    for rule in rules:
        if rule.when is None or matches(rule.when, call.arguments):
            if rule.error is not None:
                raise ToolFailed(rule.error)
            return as_text(rule.result)
    raise ToolFailed(f"no scripted result for {call_text(call.name, call.arguments)}")


def _registered(call: ToolCall) -> str:
    """The registered function's answer, on a thread of its own: one past its timeout is left
    to end by itself (Python cannot stop a thread) and the model is told it timed out."""
    spec = tool_spec(call.name)
    assert spec is not None  # a registered ToolDef came from the registry
    if spec.runs_code:
        return _sandboxed(spec, call)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            args = call.arguments
            box["value"] = spec.fn(spec.model.model_validate(args)) if spec.model else spec.fn(**args)
        except BaseException as exc:  # noqa: BLE001 - what a tool raises is the model's error result
            box["error"] = f"{call.name} raised {type(exc).__name__}: {exc}"

    worker = threading.Thread(target=run, name=f"tool-{call.name}", daemon=True)
    worker.start()
    worker.join(spec.timeout_s)
    if worker.is_alive():
        raise ToolFailed(f"{call.name} timed out after {spec.timeout_s:g} s")
    if "error" in box:
        raise ToolFailed(box["error"])
    return as_text(box.get("value"))


def _sandboxed(spec: ToolSpec, call: ToolCall) -> str:
    """A `runs_code` tool's answer from its module loaded in the sandbox (`tasks.agents.tool_host`)."""
    source = Path(inspect.getsourcefile(spec.fn) or "")
    try:
        reply = call_in_sandbox(f"{source}:{spec.fn.__name__}", source.parent, [str(source.parent)],
                                {"name": call.name, "args": call.arguments}, host="tasks.agents.tool_host",
                                timeout_s=spec.timeout_s)
    except ServerDied:
        raise ToolFailed(f"{call.name} timed out after {spec.timeout_s:g} s or died in the sandbox") from None
    except SandboxError as exc:
        raise ToolFailed(f"{call.name} runs code, which runs only in the sandbox: {exc}") from None
    if "failure" in reply:
        raise ToolFailed(reply["failure"])
    return reply["value"]


def as_text(value: Any) -> str:
    """A result as the model is told it: text as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
