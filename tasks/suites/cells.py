"""Cells of the CSV files evalpipe writes for people to open in a spreadsheet (label files),
and the same cells read back.

A spreadsheet runs a cell that starts with `=`, `+`, `-` or `@` (and, in some, a tab or a
carriage return) as a formula: an output `=HYPERLINK("https://evil.example", "Paris")`
shows the labeller "Paris". Such a cell is written after an apostrophe, which spreadsheets
take as "text" and do not show, and a cell that starts with an apostrophe gets one more, so
that reading back is exact: `cell_text(inert_cell(s)) == s` for every string, and a cell a
spreadsheet saved without the apostrophe reads as itself.
"""

from __future__ import annotations

_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_TEXT_MARK = "'"


def inert_cell(value: str) -> str:
    """`value` as a CSV cell no spreadsheet runs."""
    return _TEXT_MARK + value if value.startswith((*_FORMULA_START, _TEXT_MARK)) else value


def cell_text(cell: str) -> str:
    """The value an `inert_cell` stands for (a cell of any other shape is its own value)."""
    rest = cell.removeprefix(_TEXT_MARK)
    return rest if cell.startswith(_TEXT_MARK) and rest.startswith((*_FORMULA_START, _TEXT_MARK)) else cell
