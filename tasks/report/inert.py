"""Suite text in Markdown, inert (issue #45): a case id, a slice, a grader's detail shown in a
PR comment or a Prefect artifact renders as itself, never as a mention, link, reference,
emphasis or HTML."""

from __future__ import annotations

import re


def longest_backticks(text: str) -> int:
    """The longest run of backticks in `text` (0 for none)."""
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def code_span(text: str, *, cell: bool = False) -> str:
    """`text` as an inline code span, literal whatever it holds (no mention, link, reference,
    emphasis or HTML renders inside one): delimited by more backticks than any run in it,
    padded with a space where it starts or ends with a backtick or a space (CommonMark strips
    one each side), on one line. In a table `cell`, a pipe is escaped: GFM splits cells on
    pipes before it reads code spans."""
    text = str(text).replace("\r", " ").replace("\n", " ")
    if cell:
        text = text.replace("|", "\\|")
    ticks = "`" * (longest_backticks(text) + 1)
    pad = " " if text[:1] in ("`", " ") or text[-1:] in ("`", " ") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"
