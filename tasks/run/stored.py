"""An output kept in the home, read only when it is graded (docs/storage.md, "Large outputs").

A long output is stored once, in chunks, by the sha256 of its text; a regrade, a rescore,
the grading of an output drawn before a kill, `runs show --case` and the judges' commands
refer to it by that hash instead of holding it, so that thousands of outputs at the cap are
never in memory together: each is read when its grader (judge, label file, printout) takes
it, and a graded row refers to the same stored text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class OutputReader(Protocol):
    """Where stored outputs are read from (`storage.db.Database`, a store's `db`)."""

    def read_output(self, sha: str) -> str: ...


@dataclass(frozen=True)
class StoredOutput:
    """A stored output by the sha256 of its text, read from `reader` when graded."""

    sha: str
    reader: OutputReader

    def text(self) -> str:
        return self.reader.read_output(self.sha)

    def __str__(self) -> str:
        # What a reader below the run stage (a judge, a label file, `json.dumps(default=str)`)
        # takes it as: read when it is used, one output at a time.
        return self.text()

    def __reduce__(self) -> tuple[Any, ...]:
        # To another process (a process pool, a Dask worker, which may not reach the home)
        # it travels as its text, read here when the task is sent.
        return str, (self.text(),)


def output_text(output: str | StoredOutput) -> str:
    return output if isinstance(output, str) else output.text()


def row_output(row: Mapping[str, Any], reader: OutputReader) -> str | StoredOutput:
    """A stored row's output (a sample's, or a drawn output's): its text where it is kept
    inline, else a `StoredOutput` (its `output_sha`)."""
    sha = row.get("output_sha")
    return row["output"] if sha is None else StoredOutput(sha, reader)
