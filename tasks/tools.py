"""A case's tools (docs/agents.md "Tools"): the function tools it gives the model
(`inputs.tools`) and the scripted world that answers them (`inputs.world`), checked when the
case is made so that a bad definition is bad input naming the case and the field.

`inputs.tools` is a list of OpenAI function tools, each `{"type": "function", "function":
{name, description, parameters}}`, the short `{name, description, parameters}`, or the name of a
tool registered with `tasks.registry.tool` (its schema from the function's signature). The
world maps a tool's name to its rules, `{when: {...}, result: ...}` (or `error: ...`): the
first rule whose `when` is a subset of the call's arguments answers it (`tasks.trajectory.matches`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.registry import tool_spec

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    registered: bool = False  # a `@tool` of the registry, run in the harness

    def as_openai(self) -> dict[str, Any]:
        """The definition as a chat-completions request sends it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class WorldRule:
    when: Mapping[str, Any] | None
    result: Any = None
    error: str | None = None


def case_tools(inputs: Mapping[str, Any]) -> list[ToolDef]:
    """The tools a case declares, in order ([] when none); `ValueError` naming the field
    (`inputs.tools.2.function.parameters: ...`) when one is not a function definition."""
    given = inputs.get("tools")
    if given is None:
        return []
    if not isinstance(given, list) or not given:
        raise ValueError("inputs.tools: expected a non-empty list of function tools")
    tools: list[ToolDef] = []
    for i, item in enumerate(given):
        tool = _tool(item, f"inputs.tools.{i}")
        if any(t.name == tool.name for t in tools):
            raise ValueError(f"inputs.tools.{i}: tool {tool.name!r} is declared twice")
        tools.append(tool)
    return tools


def _tool(item: Any, where: str) -> ToolDef:
    if isinstance(item, str):
        spec = tool_spec(item)
        if spec is None:
            raise ValueError(f"{where}: no tool registered as {item!r} (a plugin's tool needs its plugin)")
        return ToolDef(spec.name, spec.description, spec.parameters, registered=True)
    if not isinstance(item, Mapping):
        raise ValueError(f"{where}: expected a function tool (a mapping), got {type(item).__name__}")
    if "type" in item or "function" in item:
        if item.get("type") != "function" or not isinstance(item.get("function"), Mapping):
            raise ValueError(f"{where}: expected {{type: function, function: {{name, description, parameters}}}}")
        item, where = item["function"], f"{where}.function"
    unknown = sorted(set(item) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not a field of a function tool (name, description, parameters)")
    name = item.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ValueError(f"{where}.name: a tool's name is 1-64 letters, digits, _ or -, got {name!r}")
    description = item.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"{where}.description: expected text, got {type(description).__name__}")
    parameters = item.get("parameters", {"type": "object", "properties": {}})
    _check_schema(parameters, f"{where}.parameters")
    return ToolDef(name, description, parameters)


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise ValueError(f"{where}: a tool's parameters are a JSON schema of type object")
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"{where}: not a valid JSON schema: {exc.message}") from None


def case_world(inputs: Mapping[str, Any], tools: list[ToolDef]) -> dict[str, list[WorldRule]]:
    """The scripted world's rules per tool; `ValueError` naming the field for a rule that is
    not `{when?, result | error}` or a tool the case does not declare."""
    given = inputs.get("world")
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ValueError("inputs.world: expected a mapping of tool name to rules")
    declared = {t.name for t in tools}
    world: dict[str, list[WorldRule]] = {}
    for name, rules in given.items():
        where = f"inputs.world.{name}"
        if name not in declared:
            raise ValueError(f"{where}: the case declares no tool {name!r} (inputs.tools:"
                             f" {', '.join(sorted(declared)) or 'none'})")
        if isinstance(rules, Mapping):
            rules = [rules]
        if not isinstance(rules, list):
            raise ValueError(f"{where}: expected a list of rules {{when, result}}")
        world[name] = [_rule(rule, f"{where}.{i}") for i, rule in enumerate(rules)]
    return world


def _rule(rule: Any, where: str) -> WorldRule:
    if not isinstance(rule, Mapping):
        raise ValueError(f"{where}: expected a rule {{when, result}}, got {type(rule).__name__}")
    unknown = sorted(set(rule) - {"when", "result", "error"})
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not a field of a world rule (when, result, error)")
    if ("result" in rule) == ("error" in rule):
        raise ValueError(f"{where}: a rule gives a result or an error (one of them)")
    when = rule.get("when")
    if when is not None and not isinstance(when, Mapping):
        raise ValueError(f"{where}.when: expected the arguments to match (a mapping)")
    error = rule.get("error")
    if error is not None and not isinstance(error, str):
        raise ValueError(f"{where}.error: expected text")
    return WorldRule(when, rule.get("result"), error)


def check_case(inputs: Mapping[str, Any], graders: list[tuple[str, Mapping[str, Any]]]) -> None:
    """Every check of a case's tools at load: the definitions, the world, and each grader
    that names a tool (`tool_names` of its parameters) against what the case declares. A case
    without `inputs.tools` (an agent with tools of its own) has nothing to check them against."""
    tools = case_tools(inputs)
    case_world(inputs, tools)
    if not tools:
        return
    declared = {t.name for t in tools}
    for where, grader in graders:
        for field_name, name in _named_tools(grader):
            if name not in declared:
                raise ValueError(f"{where}.{field_name}: the case declares no tool {name!r}"
                                 f" (inputs.tools: {', '.join(sorted(declared))})")


def _named_tools(grader: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The tools a grader mapping names, with where: a trajectory grader's `name`/`calls`,
    `world` assertions; other kinds name none."""
    from tasks.registry import grader_spec

    spec = grader_spec(str(grader.get("kind")))
    names = getattr(spec.params, "tool_names", None) if spec is not None else None
    if names is None:
        return []
    try:
        params = spec.params.model_validate({k: v for k, v in grader.items() if k not in ("kind", "name")})
    except ValueError:
        return []  # the parameter check says what is wrong
    return names(params)
