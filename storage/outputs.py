"""Drawn outputs, stored as the agent returns them, before and apart from grading
(docs/storage.md, "Nothing bought is lost").

Two places, one per kind of writer:
- the log of each draw task (`OutputLog`): a file of its own under `spool/RUN_ID/` in the
  home, to which the task, on whatever thread, process or Dask worker it runs, appends each
  output the moment the agent returns it (cheap ones a few at a time, see `HOLD_S`): one
  `write`, no lock shared with any other
  writer, and DuckDB (which one process at a time may hold) is not touched. The loop
  deletes a log once every output in it is graded and stored as a sample;
- the `outputs` table of the DuckDB file, written only by a process that runs a loop: the
  outputs of logs whose writer is gone (a killed run, a lost worker), folded in before a
  run's cache lookup (`fold_logs`), and those a stopped run drew and did not grade. A row
  leaves the table when its graded sample is stored (`Samples.insert`).

A log is locked (`flock`) while its task writes it, so a log that can be locked has no
writer left. A record is one line, `CHECKSUM JSON`: a line cut short by a kill fails its
checksum and is skipped (that output's call is made again).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from storage.db import Database, chunked, stored_columns
from tasks.run.samples import output_record, outputs_table
from tasks.run.sampling import Drawn
from tasks.run.stored import row_output

SPOOL = "spool"
# A log holds back outputs that took less than this, all together, to draw (see `appending`).
HOLD_S = 0.01
# In a run's spool folder: its draw tasks start no new agent call (Ctrl-C, a termination signal).
STOP = "STOP"


# Made once: `json.dumps` with an option builds an encoder per call (every drawn output).
_LOG_JSON = json.JSONEncoder(ensure_ascii=False)


def _checksum(line: bytes) -> bytes:
    return hashlib.sha256(line).hexdigest()[:16].encode()


@dataclass(frozen=True)
class OutputLog:
    """One draw task's log of drawn outputs (picklable: it travels with the task)."""

    run_id: str
    path: Path

    def stopped(self) -> bool:
        """Whether the run asked its draw tasks to start no new agent call."""
        return (self.path.parent / STOP).exists()

    def logged(self) -> list[dict[str, Any]]:
        """The records already in the log: those of an earlier attempt at the same task (a
        Dask worker lost mid-task, whose task the scheduler runs again from its start).
        Read while `appending`, which holds the lock: an earlier writer is gone by then."""
        return read_log(self.path) if self.path.exists() else []

    @contextmanager
    def appending(self) -> Iterator[Callable[[Drawn], None]]:
        """An appender of drawn outputs, the log locked while it is open. Where the home
        cannot be written (a Dask worker on a machine without it, a full disk) the outputs
        are stored when the task comes back, as they are anyway: a log that fails is not
        written to again (a record cut short fails its checksum)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError:
            yield lambda drawn: None
            return
        failed = False
        held: list[bytes] = []
        held_s = 0.0  # what the outputs held back took to draw

        def write() -> None:
            nonlocal failed, held_s
            data = memoryview(b"".join(held))
            held.clear()
            held_s = 0.0
            try:
                while data and not failed:
                    data = data[os.write(fd, data):]
            except OSError:
                failed = True

        def append(drawn: Drawn) -> None:
            # Written at once, unless it and those held back took under HOLD_S to draw: a
            # write costs more than such an output, and losing them to a kill costs less.
            nonlocal held_s
            line = _LOG_JSON.encode(output_record(self.run_id, drawn)).encode()
            held.append(_checksum(line) + b" " + line + b"\n")
            held_s += drawn.draw_s
            if held_s >= HOLD_S:
                write()

        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # An earlier attempt's record cut short by its kill is ended, so the next one is whole.
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                held.append(b"\n")
            yield append
        finally:
            write()
            os.close(fd)


def read_log(path: Path) -> list[dict[str, Any]]:
    """The whole records of a log (a torn last line is left out)."""
    records = []
    with open(path, "rb") as fh:
        for raw in fh:
            checksum, _, line = raw.rstrip(b"\n").partition(b" ")
            if raw.endswith(b"\n") and checksum == _checksum(line):
                records.append(json.loads(line))
    return records


def _writer_gone(path: Path) -> bool:
    """Whether no task is writing `path` now (its lock is free)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@dataclass(frozen=True)
class Outputs:
    """One home's drawn outputs not yet graded (`storage.store.Store.outputs`)."""

    db: Database

    def log(self, run_id: str) -> OutputLog:
        """A new log for one draw task of `run_id`."""
        return OutputLog(run_id, self.db.home / SPOOL / run_id / f"{uuid.uuid4().hex}.log")

    def store_drawn(self, run_id: str, drawn: Sequence[Drawn]) -> None:
        """Store drawn outputs the loop holds and has not graded (a stopped run's)."""
        if drawn:
            self._insert_outputs(outputs_table([output_record(run_id, d) for d in drawn]))

    def discard_log(self, log: OutputLog) -> None:
        """Delete a log whose outputs are all stored as samples."""
        log.path.unlink(missing_ok=True)

    def stop_drawing(self, run_id: str) -> None:
        """Ask `run_id`'s draw tasks to start no new agent call."""
        with suppress(OSError):
            folder = self.db.home / SPOOL / run_id
            folder.mkdir(parents=True, exist_ok=True)
            (folder / STOP).touch()

    def fold_logs(self, run_id: str | None = None) -> int:
        """Store the outputs of logs no task writes any more, and delete those logs; with
        `run_id`, also what that run's tasks still writing have logged so far (the run is
        stopping: their logs stay, for the run that resumes it). Returns how many records were read."""
        root = self.db.home / SPOOL
        if not root.is_dir():
            return 0
        read = 0
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            logs = sorted(folder.glob("*.log"))
            for path in logs:
                done = _writer_gone(path)
                if done or folder.name == run_id:
                    records = read_log(path)
                    read += len(records)
                    if records:
                        self._insert_outputs(outputs_table(records))
                    if done:
                        path.unlink(missing_ok=True)
            if folder.name != run_id and not any(folder.glob("*.log")):
                shutil.rmtree(folder, ignore_errors=True)
        return read

    def end_logs(self, run_id: str) -> None:
        """Remove `run_id`'s spool folder once none of its logs is left."""
        folder = self.db.home / SPOOL / run_id
        if not any(folder.glob("*.log")):
            shutil.rmtree(folder, ignore_errors=True)

    def _insert_outputs(self, table: pa.Table) -> None:
        # An output whose sample is stored is done with: a log can outlive that by a moment.
        with self.db.connect() as con:
            con.execute("BEGIN")
            drawn = chunked(con, table)
            con.register("drawn", drawn)
            con.execute(
                f"INSERT INTO outputs ({', '.join(drawn.column_names)}) SELECT {stored_columns(drawn, 'drawn')} FROM drawn"
                " WHERE output_key NOT IN (SELECT output_key FROM samples JOIN drawn USING (output_key))"
                " ON CONFLICT DO NOTHING")
            con.execute("COMMIT")

    def drawn(self, output_keys: Sequence[str]) -> dict[str, Mapping[str, Any]]:
        """Output key → the stored, ungraded output with that key (rows of `OUTPUT_SCHEMA`,
        a long output as a `StoredOutput`, read when it is graded; a failed call has none to
        reuse)."""
        if not output_keys:
            return {}
        wanted = pa.table({"output_key": pa.array(list(output_keys), pa.string())})
        with self.db.connect(read_only=True) as con:
            con.register("wanted", wanted)
            rows = con.sql(
                "SELECT outputs.* FROM outputs JOIN wanted USING (output_key) WHERE error IS NULL"
                " QUALIFY row_number() OVER (PARTITION BY output_key ORDER BY run_id DESC) = 1").to_arrow_table()
        return {row["output_key"]: {**row, "output": row_output(row, self.db)} for row in rows.to_pylist()}
