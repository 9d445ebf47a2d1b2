"""How a run's option reads outside Python: `Flag`, declared on a `RunConfig` field beside its
`Field`, which states the rest (help: `description`; default; bounds). `evalpipe run`'s options
are generated from the fields (`flows/cli/run_options.py`), and `RunConfig.build` reads each
field's environment override from here: a new option is one field."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic.fields import FieldInfo

from tasks.metrics.rules import parse_increases, parse_slice_thresholds
from tasks.models import InputError
from tasks.settings import positive_number


@dataclass(frozen=True)
class Flag:
    """A field's form on the command line and in the environment, where it is not the plain one
    (`--field-name`, typed as the field is, no variable)."""

    name: str = ""  # the flag: "-n", "--rounds"; empty: --field-name
    metavar: str | None = None
    argument: bool = False  # positional (SUITE), not a flag
    env: str | None = None  # the documented variable that overrides the default (docs/contract.md §10)
    # Where the value is typed in another form than the field holds (k: "1,5"): that form's type,
    # its reading into the field's value, and the default as typed.
    text: Any = None
    parse: Callable[[Any], Any] | None = None
    text_default: Any = None


def flag_of(field: FieldInfo) -> Flag:
    return next((m for m in field.metadata if isinstance(m, Flag)), Flag())


def flag_name(name: str, field: FieldInfo) -> str:
    """How the command line names the field `name` (an error message names it so)."""
    return flag_of(field).name or "--" + name.replace("_", "-")


def env_overrides(fields: Mapping[str, FieldInfo], environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The values `environ` gives the fields that declare a variable (an empty one is unset); a
    number that is not one, or not positive, is `InputError` naming the variable."""
    found: dict[str, Any] = {}
    for name, field in fields.items():
        var = flag_of(field).env
        raw = environ.get(var, "").strip() if var else ""
        if not raw:
            continue
        kind = next((t for t in (int, float) if t in _types(field.annotation)), str)
        if kind is str:
            found[name] = raw
            continue
        # Each numeric override is a size, a time or a count (tests/test_run_options.py).
        found[name] = positive_number(var, raw, kind)
    return found


def _types(annotation: Any) -> tuple[Any, ...]:
    return getattr(annotation, "__args__", None) or (annotation,)


def parse_ks(text: str) -> tuple[int, ...]:
    """`-k 1,5,10`."""
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"-k: expected comma-separated integers like 1,5,10, got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise InputError(f"-k: every k must be a positive integer, got {text!r}")
    return tuple(ks)


def slice_thresholds(specs: list[str]) -> dict[str, float] | None:
    """`--min-slice SLICE=X`, repeated."""
    return parse_slice_thresholds(specs) or None


def increases(specs: list[str]) -> dict[str, float] | None:
    """`--max-increase FIGURE=FRACTION`, repeated."""
    return parse_increases(specs) or None
