"""`evalpipe run`'s options, generated from `RunConfig`'s fields: each field's flag, help
(`description`), default, bounds and metavar (`tasks.run.options.Flag`), so that the command,
the flow's form and `evalpipe.evaluate` take the same options, declared once.

Typer builds a command from its function's signature: `FieldOptions` builds that signature
from the fields, and the command from it, when the command is first parsed or its help shown,
not when the command line starts: the fields' module imports the core (NumPy, Arrow), which
`evalpipe --help` and `suite hash` need not load."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any

import typer
from annotated_types import Ge, Le
from typer.core import TyperCommand

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo


class FieldOptions(TyperCommand):
    """A command taking `RunConfig`'s fields as options, besides its function's own keyword
    options: those go after the field `own_after`, the last of them (`--json`) last. The
    function takes the fields as `**fields` and states no other parameter."""

    own_after = ""

    def __init__(self, **kwargs: Any) -> None:
        self._generated: typer.core.TyperCommand | None = None
        super().__init__(**kwargs)

    def _command(self) -> Any:
        if self._generated is None:
            function = inspect.unwrap(self._bare)
            generated = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
            generated.command()(with_field_options(function, self.own_after))
            self._generated = typer.main.get_command(generated)
        return self._generated

    # Typer sets these from the function as written (its own options only); click reads them
    # to parse and to show the help: the generated command's.
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
        self._bare = value


def with_field_options(function: Callable[..., Any], own_after: str) -> Callable[..., Any]:
    """`function` (`def f(*, own options..., **fields)`) under a signature with the fields."""
    own = [p for p in inspect.signature(function, eval_str=True).parameters.values()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]
    fields = field_parameters()
    at = [p.name for p in fields].index(own_after) + 1

    def command(**given: Any) -> Any:
        return function(**given)

    command.__doc__ = function.__doc__
    command.__signature__ = inspect.Signature([*fields[:at], *own[:-1], *fields[at:], *own[-1:]])  # type: ignore[attr-defined]
    return command


def field_parameters() -> list[inspect.Parameter]:
    """A keyword parameter per field, in the fields' order (the order `run --help` lists them)."""
    from tasks.run.config import RunConfig

    return [_parameter(name, field) for name, field in RunConfig.model_fields.items()]


def _parameter(name: str, field: FieldInfo) -> inspect.Parameter:
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
    for name, field in RunConfig.model_fields.items():
        parse = flag_of(field).parse
        values[name] = parse(given[name]) if parse and given[name] is not None else given[name]
    return values


def option_name(name: str) -> str:
    """A field as the command line names it, for error messages (`--rounds`, `-k`)."""
    from tasks.run.config import RunConfig
    from tasks.run.options import flag_name

    return flag_name(name, RunConfig.model_fields[name])
