"""JSON Lines read as objects, with the line number of each, for one-line errors."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from tasks.models import InputError
from tasks.suites.input_limits import LimitError, parse_json


def object_lines(
    text: str, where: str, error: type[InputError] = InputError
) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; `error` naming `where` and the line
    when a line is not JSON, not an object, or past the input limits."""
    return list(iter_object_lines(text.splitlines(), where, error))


def iter_object_lines(
    lines: Iterable[str], where: str, error: type[InputError] = InputError
) -> Iterator[tuple[int, dict[str, Any]]]:
    """`object_lines` over lines as they are read (a large file is never held whole)."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: line {lineno}: malformed JSON: {exc.msg}") from None
        except LimitError as exc:
            raise error(f"{where}: line {lineno}: {exc}") from None
        if not isinstance(record, dict):
            raise error(f"{where}: line {lineno}: expected a JSON object")
        yield lineno, record
