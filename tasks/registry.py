"""The registry of grader kinds, metrics, agent kinds and tools: `from tasks.registry import
grader, metric, agent_kind, tool`.

A grader kind is one decorated function, `fn(output, case, params) -> Verdict`:

    @grader("word_count", params=WordCountParams, runs_code=False)
    def word_count(output: str, case: EvalCase, params: WordCountParams) -> Verdict: ...

Its parameter model checks a suite's cases when the suite loads (exit 2 naming the case and
field), `tasks.graders.grade` makes it total (an exception is an `error` verdict),
`runs_code=True` makes a run refuse without bubblewrap (unless it allows running unprotected),
`inline=True` (a cheap check: no sandbox, no model call) grades it in the task that drew the
output rather than in a grading task of its own, and its `version`, its module's source and
`fingerprint(case)` key the cached verdicts.

A grader that takes a keyword parameter `trajectory` is given what the agent did (the
sample's `tasks.trace.Trajectory`, typed steps at `.typed`; None when it recorded none), as
deciding grader, extra grader and in a rescore.

What a grader records goes to the sample's trace (`tasks.trace.SampleTrace`) through a
keyword parameter `trace`. With `trace=Model` (a pydantic model whose fields all have
defaults) it is given a fresh `Model()` to fill, stored under its kind unless left at the
default and read back typed with `sample_trace.section(kind, Model)`. The built-in graders
declare `trace=SampleTrace` and set their own sections of the trace itself. A grader that
asks for `trace` without declaring a model is given a plain dict, whose keys are stored at
the trace's top level (docs/graders.md lists the keys the built-in graders write).

A metric is `fn(tallies) -> float` over one `tasks.metrics.tallies.Tally` per case (`.n`,
`.passes`, `.scores`, each sample's record in `.samples`); with `per_case=True`, `fn(tallies)`
returns one value per case and the metric is their mean. Either way the run reports its value
with a CI clustered by case (`tasks.metrics.tallies.metric_values`), in `run --json` under
`metrics`. A name holding `{k}` registers a family, `fn(tallies, k)`: one metric per k the run
asks (`RunConfig.k`), named with k in place of `{k}` (the built-in `pass@{k}` and `pass^{k}`,
whose members are the summary's `pass_at_k` and `pass_hat_k`). `listed=False` keeps a metric
out of `metrics` (the headline reports it under its own keys).

An agent kind is an `--agent` scheme (`python:`, `cmd:`, `openai:`...): a class or function
`load(spec, rest, base)` decorated with `agent_kind(scheme, runs_code=..., sees=...)`; the
scheme dispatch, the "unknown scheme" message and which kinds a deployment must allow all
read it.

A tool is a Python function decorated with `tool(name=...)` that a case may give the model
(`inputs.tools: [NAME]`, tasks.tools); the `openai:` agent's tool loop calls it in the harness.

The built-in graders, metrics and agent kinds register the way plugins do, imported by name on first
use (so this bottom layer imports no stage above it); then the modules of the entry-point
group `evalpipe.plugins` and of `EVALPIPE_PLUGINS` (module names or paths of `.py` files,
comma-separated). A plugin that fails to import is an `InputError` naming it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from tasks.errors import InputError
from tasks.settings import ENV, current
from tasks.trace import SampleTrace

# `tasks.models.EvalCase` and `Verdict`, named loosely: the models import this module.
EvalCase = Verdict = Any

PLUGIN_GROUP = "evalpipe.plugins"
PLUGINS_ENV = ENV["plugins"]  # `MachineSettings.plugins`: read at the edge, carried with the run
BUILTIN_GRADERS = "tasks.graders"
BUILTIN_METRICS = "tasks.metrics.standard"
BUILTIN_AGENTS = "tasks.agents"
K = "{k}"  # in a metric's name: a family, one member per k the run asks


@dataclass(frozen=True)
class GraderSpec:
    kind: str
    fn: Callable[..., Verdict]
    params: type[BaseModel]
    runs_code: bool  # runs candidate code: in the sandbox, and a run without one refuses
    version: str  # part of the grading fingerprint, with the source of `fn`'s module
    # Extra content a verdict depends on beyond the case (e.g. a predicate's file).
    fingerprint: Callable[[EvalCase], Any] | None
    # Its verdict is checked, not an opinion: what a judge may be calibrated against.
    oracle: bool
    # What "no change" grades as, where grading the empty output would prove nothing
    # (`suite validate`'s vacuity check; repo_tests runs the tests at the base commit).
    baseline: Callable[[EvalCase], Verdict] | None
    takes_trace: bool
    trace: type[BaseModel] | None = None  # the model of what it records (see the docstring)
    # Cheap (microseconds, no sandbox, no model call): graded in the task that drew the
    # output, not handed to a grading task of its own (`tasks.run.loop`).
    inline: bool = False
    # It takes `trajectory`: the sample's (`tasks.trace.Trajectory`, None when the agent
    # recorded none), read-only.
    takes_trajectory: bool = False

    def __call__(self, output: str, case: EvalCase, trace: SampleTrace) -> Verdict:
        seen = {"trajectory": trace.trajectory} if self.takes_trajectory else {}
        if not self.takes_trace:
            return self.fn(output, case, case.params, **seen)
        if self.trace is SampleTrace:
            return self.fn(output, case, case.params, trace=trace, **seen)
        own = self.trace() if self.trace is not None else {}
        try:
            return self.fn(output, case, case.params, trace=own, **seen)
        finally:  # what it recorded before raising shows what went wrong
            trace.record(self.kind, own)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    fn: Callable[[Any], Any]
    per_case: bool  # fn returns one value per case; the metric is their mean
    percent: bool  # a fraction, shown as a percentage (else as a plain number)
    listed: bool = True  # reported under `metrics` in `run --json`


@dataclass(frozen=True)
class MetricFamily:
    """Metrics with a parameter k (`name` holds `{k}`, `fn(tallies, k)`): one member per k a
    run asks, since a run's k values are its configuration, not the metric's."""

    name: str
    fn: Callable[[Any, int], Any]
    per_case: bool
    percent: bool
    listed: bool = True

    def at(self, k: int) -> MetricSpec:
        """The member at `k`: a metric like any other, named with k in place of `{k}`."""
        return MetricSpec(self.name.replace(K, str(k)), functools.partial(self.fn, k=k), self.per_case,
                          self.percent, self.listed)


@dataclass(frozen=True)
class ToolSpec:
    """A Python function a case may give the model as a tool (`inputs.tools: [NAME]`), run in
    the harness by the `openai:` agent's tool loop with a timeout."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]  # the JSON schema of its arguments
    timeout_s: float
    model: type[BaseModel] | None  # the one pydantic parameter the arguments build, if declared so
    runs_code: bool = False  # it runs code the model chose: called in the sandbox, not the harness


@dataclass(frozen=True)
class AgentKindSpec:
    """An `--agent` scheme: `load(spec, rest, base)` makes the agent (`rest`: what follows
    `scheme:`; relative paths resolve against `base`), an object with `spec`, `fingerprint`
    and `generate(case, ctx) -> str`."""

    scheme: str
    load: Callable[[str, str, Path], Any]
    runs_code: bool  # runs the user's code as the worker's user: a deployment must allow it
    sees: Callable[[EvalCase], dict[str, Any]] | None  # what it reads of a case beyond its inputs
    bare: bool  # named without a colon and anything after it (`reference`)

    @property
    def named(self) -> str:
        return self.scheme if self.bare else f"{self.scheme}:"


_GRADERS: dict[str, GraderSpec] = {}
_METRICS: dict[str, MetricSpec] = {}
_FAMILIES: dict[str, MetricFamily] = {}
_AGENTS: dict[str, AgentKindSpec] = {}
_TOOLS: dict[str, ToolSpec] = {}
_LOCK = threading.RLock()
_LOADED: set[str] = set()
_PLUGIN_FAILURE: list[InputError] = []


def grader(
    kind: str,
    *,
    params: type[BaseModel],
    runs_code: bool = False,
    version: str = "1",
    fingerprint: Callable[[EvalCase], Any] | None = None,
    oracle: bool = True,
    baseline: Callable[[EvalCase], Verdict] | None = None,
    trace: type[BaseModel] | None = None,
    inline: bool = False,
) -> Callable[[Callable[..., Verdict]], Callable[..., Verdict]]:
    """Decorator: `fn(output, case, params[, trace=...]) -> Verdict` grades cases of `kind`,
    whose grader parameters `params` (a pydantic model, best with `extra="forbid"`) checks;
    `trace`, the model of what it records (see the module's docstring); `inline`, that it is
    cheap enough to grade where the output is drawn (see `GraderSpec.inline`)."""
    if not isinstance(kind, str) or not kind or kind != kind.strip():
        raise ValueError(f"grader kind must be a non-empty name, got {kind!r}")
    if not (inspect.isclass(params) and hasattr(params, "model_validate")):
        raise ValueError(f"grader {kind!r}: params must be a pydantic model class, got {params!r}")
    _check_trace_model(kind, trace)

    def decorate(fn: Callable[..., Verdict]) -> Callable[..., Verdict]:
        takes_trace = "trace" in inspect.signature(fn).parameters
        takes_trajectory = "trajectory" in inspect.signature(fn).parameters
        if trace is not None and not takes_trace:
            raise ValueError(f"grader {kind!r} declares trace={trace.__name__} but takes no `trace` parameter")
        if inline and runs_code:
            raise ValueError(f"grader {kind!r}: a grader that runs code is graded in the sandbox, not inline")
        spec = GraderSpec(kind, fn, params, bool(runs_code), str(version), fingerprint, oracle, baseline,
                          takes_trace, trace, bool(inline), takes_trajectory)
        _add(_GRADERS, "grader kind", kind, spec)
        return fn

    return decorate


def _check_trace_model(kind: str, model: Any) -> None:
    """A declared trace model must build empty (the grader fills it) and its kind must not
    name a built-in section, where it is stored."""
    if model is None or model is SampleTrace:
        return
    if not (inspect.isclass(model) and issubclass(model, BaseModel)):
        raise ValueError(f"grader {kind!r}: trace must be a pydantic model class, got {model!r}")
    if kind in SampleTrace.model_fields:
        raise ValueError(f"grader {kind!r}: its kind names a built-in trace section, where its own would go")
    try:
        model()
    except ValidationError as exc:
        raise ValueError(f"grader {kind!r}: trace model {model.__name__} needs a default for every field: "
                         f"{exc.errors()[0]['loc']}") from None


def metric(name: str, *, per_case: bool = False, percent: bool = True,
           listed: bool = True) -> Callable[[Callable], Callable]:
    """Decorator: `fn(tallies)` is the metric `name`, or with `{k}` in `name`, `fn(tallies, k)`
    is a family of them (see the module's docstring)."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"metric name must be a non-empty name, got {name!r}")

    def decorate(fn: Callable) -> Callable:
        if K in name:
            if "k" not in inspect.signature(fn).parameters:
                raise ValueError(f"metric family {name!r}: its function takes no `k` parameter")
            _add(_FAMILIES, "metric", name, MetricFamily(name, fn, per_case, percent, listed))
        else:
            _add(_METRICS, "metric", name, MetricSpec(name, fn, per_case, percent, listed))
        return fn

    return decorate


def agent_kind(scheme: str, *, runs_code: bool = False, sees: Callable[[EvalCase], dict[str, Any]] | None = None,
               bare: bool = False) -> Callable[[Any], Any]:
    """Decorator of an agent kind: a class with `load(spec, rest, base)` (a classmethod) or a
    function `load(spec, rest, base)`, which makes the agent `--agent SCHEME:REST` names.
    `runs_code`: it runs the user's code (a deployment runs it only as its own parameters
    name it or its EVALPIPE_DEPLOYMENT_ALLOWS allows); `sees(case)`: what it reads of a case
    beyond its id and inputs (it enters the outputs' cache key); `bare`: named without a
    colon. Plugins add kinds the same way (docs/agents.md)."""
    if not isinstance(scheme, str) or not scheme.isidentifier():
        raise ValueError(f"agent scheme must be a name, got {scheme!r}")

    def decorate(target: Any) -> Any:
        load = target.load if inspect.isclass(target) else target
        _add(_AGENTS, "agent scheme", scheme, AgentKindSpec(scheme, load, bool(runs_code), sees, bare))
        return target

    return decorate


def tool(name: str | None = None, *, description: str | None = None,
         timeout_s: float = 10.0, runs_code: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: the function is a tool cases may name (`inputs.tools: [NAME]`; default
    name: the function's). Its arguments' JSON schema comes from its signature (str, int,
    float, bool, list, dict and their optionals), or from its one parameter's pydantic model;
    the description from `description` or the docstring's first paragraph. It returns what
    the model is told (text as it is, anything else as JSON); what it raises is an error the
    model sees. `runs_code=True` (it runs code or commands the model chose): each call runs in
    the sandbox (no network, no key, a read-only view of the machine), not in the harness."""

    def decorate(fn: Callable) -> Callable:
        tool_name = name or fn.__name__
        model, schema = _tool_schema(tool_name, fn)
        text = description if description is not None else (inspect.getdoc(fn) or "").split("\n\n")[0]
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise ValueError(f"tool {tool_name!r}: timeout_s must be a positive number of seconds")
        _add(_TOOLS, "tool", tool_name,
             ToolSpec(tool_name, fn, " ".join(text.split()), schema, float(timeout_s), model, bool(runs_code)))
        return fn

    return decorate


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _tool_schema(name: str, fn: Callable) -> tuple[type[BaseModel] | None, dict[str, Any]]:
    import typing

    hints = typing.get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(params) == 1 and inspect.isclass(hints.get(params[0].name)) and issubclass(hints[params[0].name], BaseModel):
        model = hints[params[0].name]
        return model, model.model_json_schema()
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in params:
        hint = hints.get(p.name, str)
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = typing.get_origin(hint) or hint
        if base not in _JSON_TYPES and len(args) == 1:  # Optional[X]
            base = typing.get_origin(args[0]) or args[0]
        if base not in _JSON_TYPES:
            raise ValueError(f"tool {name!r}: parameter {p.name!r} has type {hint!r}, which has no JSON schema here"
                             " (use str, int, float, bool, list, dict, or one pydantic model)")
        properties[p.name] = {"type": _JSON_TYPES[base]}
        if p.default is p.empty:
            required.append(p.name)
    return None, {"type": "object", "properties": properties, "required": required}


def tool_spec(name: str) -> ToolSpec | None:
    """The tool registered as `name`, or None (the plugins are loaded when it is not known)."""
    if name not in _TOOLS:
        load_plugins()
    return _TOOLS.get(name)


def agent_kinds() -> dict[str, AgentKindSpec]:
    """Every registered agent kind by scheme, the built-ins first."""
    _load_builtin(BUILTIN_AGENTS)
    load_plugins()
    return dict(_AGENTS)


def agent_kind_spec(scheme: str) -> AgentKindSpec | None:
    """The agent kind of `scheme`, or None (the plugins are loaded when it is not a built-in)."""
    _load_builtin(BUILTIN_AGENTS)
    if scheme not in _AGENTS:
        load_plugins()
    return _AGENTS.get(scheme)


def _add(table: dict[str, Any], what: str, name: str,
         spec: GraderSpec | MetricSpec | MetricFamily | AgentKindSpec | ToolSpec) -> None:
    with _LOCK:
        old = table.get(name)
        # The same function registering again (its module reloaded) replaces itself.
        if old is not None and _origin(_code(old)) != _origin(_code(spec)):
            raise ValueError(f"{what} {name!r} is already registered by {_origin(_code(old))}; "
                             f"{_origin(_code(spec))} registers it too")
        table[name] = spec


def _code(spec: GraderSpec | MetricSpec | MetricFamily | AgentKindSpec | ToolSpec) -> Callable:
    return spec.load if isinstance(spec, AgentKindSpec) else spec.fn


def _origin(fn: Callable) -> str:
    """The function by module, name and file: two files may define one module name."""
    code = getattr(fn, "__code__", None)
    where = f" in {code.co_filename}" if code is not None else ""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}{where}"


def grader_spec(kind: str) -> GraderSpec | None:
    """The registered grader of `kind`, or None; loads the built-ins, then the plugins, when
    the kind is not known yet."""
    if kind not in _GRADERS:
        _load_builtin(BUILTIN_GRADERS)
    if kind not in _GRADERS:
        load_plugins()
    return _GRADERS.get(kind)


def grader_kinds() -> frozenset[str]:
    _load_builtin(BUILTIN_GRADERS)
    load_plugins()
    return frozenset(_GRADERS)


def runs_code(kind: str) -> bool:
    spec = grader_spec(kind)
    return spec is not None and spec.runs_code


def metrics(ks: Sequence[int] = ()) -> dict[str, MetricSpec]:
    """Every registered metric by name, the built-ins first; then each family's members at
    `ks` (a run's k values), where no metric above has the member's name."""
    _load_builtin(BUILTIN_METRICS)
    load_plugins()
    found = dict(_METRICS)
    for family in _FAMILIES.values():
        for spec in map(family.at, ks):
            found.setdefault(spec.name, spec)
    return found


def metric_named(name: str) -> MetricSpec | None:
    """The metric `name` names: a registered one, or a family's member at the k it names
    (`pass@3` of `pass@{k}`, k ≥ 1); None when none does."""
    known = metrics()
    if name in known:
        return known[name]
    for family in metric_families():
        head, _, tail = family.name.partition(K)
        k = name[len(head):len(name) - len(tail)] if name.startswith(head) and name.endswith(tail) else ""
        if k.isascii() and k.isdigit() and int(k) >= 1 and str(int(k)) == k:
            return family.at(int(k))
    return None


def metric_families() -> list[MetricFamily]:
    """Every registered family of metrics (`{k}` in its name), the built-ins first."""
    _load_builtin(BUILTIN_METRICS)
    load_plugins()
    return list(_FAMILIES.values())


def metric_family(name: str) -> MetricFamily:
    """The registered family `name` (holding `{k}`); `KeyError` when there is none."""
    _load_builtin(BUILTIN_METRICS)
    return _FAMILIES[name]


def _load_builtin(module: str) -> None:
    with _LOCK:
        if module not in _LOADED:
            _LOADED.add(module)  # first: a module being imported may look kinds up
            try:
                importlib.import_module(module)
            except BaseException:
                _LOADED.discard(module)  # a failure is raised again, never a silent gap
                raise


def load_plugins() -> None:
    """Import the plugin modules, once per process (after the built-ins, so a plugin cannot
    take a built-in's name). Raises `InputError` naming a plugin that fails to import, on
    this and every later call."""
    with _LOCK:
        if "plugins" not in _LOADED:
            _load_builtin(BUILTIN_GRADERS)
            _load_builtin(BUILTIN_METRICS)
            _load_builtin(BUILTIN_AGENTS)
            _LOADED.add("plugins")
            for what, load in _plugins():
                try:
                    load()
                except (Exception, SystemExit) as exc:  # reported as bad input, one line
                    message = f"{type(exc).__name__}: {exc}".replace("\n", " ")
                    _PLUGIN_FAILURE.append(InputError(f"plugin {what} failed to import: {message}"))
                    break
        if _PLUGIN_FAILURE:
            raise _PLUGIN_FAILURE[0]


def _plugins() -> list[tuple[str, Callable[[], Any]]]:
    found: list[tuple[str, Callable[[], Any]]] = [
        (f"{ep.name} ({ep.value}, entry point)", ep.load)
        for ep in sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name)
    ]
    for item in current().plugins:
        if item.endswith(".py"):
            found.append((f"{item} ({PLUGINS_ENV})", lambda path=item: _import_file(Path(path))))
        else:
            found.append((f"{item} ({PLUGINS_ENV})", lambda name=item: importlib.import_module(name)))
    return found


def _import_file(path: Path) -> None:
    """A plugin given as a file: imported as a module named by its resolved path
    (`evalpipe_plugin_<stem>_<hash>`): two files with one stem are two modules, and one
    file named twice (or through a link) is one."""
    if not path.is_file():
        raise FileNotFoundError(f"no such file {str(path)!r}")
    resolved = path.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    name = f"evalpipe_plugin_{resolved.stem}_{digest}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
