"""Commands' options generated from `RunConfig`'s fields: each field's flag, help
(`description`), default, bounds and metavar (`tasks.run.options.Flag`), so that `run`,
`rescore`, `gate` and `report`, the flow's form and `evalpipe.evaluate` take the same options,
declared once.

A command states where fields go with a parameter annotated `Fields(...)`; it gets their values
as one dict under that name. Typer builds a command from its function's signature:
`FieldOptions` builds that signature, and the command from it, when the command is first
parsed or its help shown, not when the command line starts: the fields' module imports the
core (NumPy, Arrow), which `evalpipe --help` and `suite hash` need not load."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from annotated_types import Ge, Le
from typer.core import TyperCommand

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Fields:
    """Where a command takes `RunConfig` fields: `names`, or those from `start` up to (not
    including) `stop` in the fields' order. `unset`: each option defaults to None (not given),
    for a command that tells an option not given from its default (`gate`: then the decision
    stored with the run stands)."""

    names: tuple[str, ...] = ()
    start: str | None = None
    stop: str | None = None
    unset: bool = False


def mount(app: typer.Typer, name: str, function: Callable[..., Any]) -> None:
    """`function` as the command `name` of `app`, its `Fields` parameters generated on first use."""
    def declared() -> None:  # what typer inspects at start: no parameter, the function's help
        raise AssertionError("FieldOptions calls the generated command")

    declared.__doc__, declared.__wrapped__ = function.__doc__, function  # type: ignore[attr-defined]
    declared.__signature__ = inspect.Signature()  # type: ignore[attr-defined]
    app.command(name, cls=FieldOptions)(declared)


class FieldOptions(TyperCommand):
    """A command whose parameters are its function's, each `Fields` one replaced by the fields'
    options, built when click first reads them."""

    def __init__(self, **kwargs: Any) -> None:
        self._generated: TyperCommand | None = None
        super().__init__(**kwargs)

    def _command(self) -> Any:
        if self._generated is None:
            generated = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
            generated.command()(with_fields(inspect.unwrap(self._declared)))
            self._generated = typer.main.get_command(generated)
        return self._generated

    # Typer sets these from the function as declared (no parameter); click reads them to parse
    # and to show the help: the generated command's.
    @property
    def params(self) -> list[Any]:
        return self._command().params

    @params.setter
    def params(self, value: list[Any]) -> None:
        pass

    @property
    def callback(self) -> Callable[..., Any] | None:
        return self._command().callback

    @callback.setter
    def callback(self, value: Callable[..., Any]) -> None:
        self._declared = value


def with_fields(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` under a signature where each `Fields` parameter is the fields' parameters,
    called with their values (read into the fields' form) gathered back under its name."""
    parameters: list[inspect.Parameter] = []
    groups: dict[str, list[str]] = {}
    for parameter in inspect.signature(function, eval_str=True).parameters.values():
        group = next((m for m in getattr(parameter.annotation, "__metadata__", ()) if isinstance(m, Fields)), None)
        if group is None:  # keyword-only, as the fields' are: typer passes every value by name
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
            continue
        generated = field_parameters(group)
        groups[parameter.name] = [p.name for p in generated]
        parameters += generated

    def command(**given: Any) -> Any:
        for name, members in groups.items():
            given[name] = field_values({member: given.pop(member) for member in members})
        return function(**given)

    command.__doc__ = function.__doc__
    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return command


def field_parameters(group: Fields) -> list[inspect.Parameter]:
    """A keyword parameter per field of `group`, in the fields' order (the order help lists them)."""
    from tasks.run.config import RunConfig

    names = list(RunConfig.model_fields)
    if not group.names:
        names = names[names.index(group.start) if group.start else 0:
                      names.index(group.stop) if group.stop else None]
    unknown = set(group.names) - set(names)
    assert not unknown, f"not fields of RunConfig: {sorted(unknown)}"
    return [_parameter(name, RunConfig.model_fields[name], group.unset) for name in names
            if not group.names or name in group.names]


def _parameter(name: str, field: FieldInfo, unset: bool) -> inspect.Parameter:
    from tasks.run.options import flag_name, flag_of

    flag = flag_of(field)
    kind = flag.text or next(t for t in _args(field.annotation) if t is not type(None))
    if kind not in (int, float, bool) and not flag.text:
        kind = str  # a Literal's or an alias's values are typed as text; the field checks them
    if flag.argument:
        info = typer.Argument(help=field.description)
    else:
        info = typer.Option(flag_name(name, field), help=field.description, metavar=flag.metavar,
                            **_bounds(field, kind))
    if field.is_required():
        default: Any = inspect.Parameter.empty
    elif unset:
        default = None
    else:
        default = field.default if flag.text_default is None else flag.text_default
    annotation = kind | None if default is None else kind
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[annotation, info])


def _args(annotation: Any) -> tuple[Any, ...]:
    return getattr(annotation, "__args__", None) or (annotation,)


def _bounds(field: FieldInfo, kind: type) -> dict[str, Any]:
    """The field's inclusive bounds, as the option's range. An exclusive one (> 0) is the field's
    to enforce: a click range would print it as `x>0` where the help has never shown it."""
    if kind not in (int, float):
        return {}
    found: dict[str, Any] = {}
    for bound in field.metadata:
        if isinstance(bound, Ge):
            found["min"] = kind(bound.ge)
        elif isinstance(bound, Le):
            found["max"] = kind(bound.le)
    return found


def field_values(given: Mapping[str, Any]) -> dict[str, Any]:
    """The fields' values from the command line's: those typed in another form read into the field's."""
    from tasks.run.config import RunConfig
    from tasks.run.options import flag_of

    values = {}
    for name, value in given.items():
        parse = flag_of(RunConfig.model_fields[name]).parse
        values[name] = parse(value) if parse and value is not None else value
    return values


def option_name(name: str) -> str:
    """A field as the command line names it, for error messages (`--rounds`, `-k`)."""
    from tasks.run.config import RunConfig
    from tasks.run.options import flag_name

    return flag_name(name, RunConfig.model_fields[name])
