"""`Store(home)`: the one object through which everything reaches an evalpipe home's data, as
parts with one job each, sharing the home's DuckDB file (`storage.db.Database`, `store.db`):

- `store.runs` (`storage.runs`): the runs table: a run recorded from start to end, found, listed;
- `store.samples` (`storage.samples`): the runs' samples: the loop's cache and writes, and
  what the commands read of them;
- `store.snapshots` (`storage.snapshots`): the stored suites: snapshot files, suites and cases rows;
- `store.outputs` (`storage.outputs`): drawn outputs not yet graded (the draw tasks' logs);
- `store.calibrations` (`storage.calibrations`): judge calibrations, and a run's judges;
- `store.exports` (`storage.export`): a run out to a file and back in (uses runs and snapshots);
- `store.mined` (`storage.mined`): mined candidates;
- `store.model_calls` (`storage.model_calls`): the model calls kept for replay.

A command, a flow or `evalpipe.evaluate` builds one at its top and passes it down; the run
loop keeps its samples in it (`tasks.run.loop.SampleStore`). To another process (a worker, a
Dask task) it travels as its home, and makes its parts there."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from storage.calibrations import Calibrations
from storage.db import Database
from storage.export import Exports
from storage.mined import MinedCandidates
from storage.model_calls import ModelCalls
from storage.outputs import Outputs
from storage.runs import Runs
from storage.samples import Samples
from storage.snapshots import Snapshots
from storage.suites import resolve_suite
from tasks.home import evalpipe_home
from tasks.models import EvalSuite


@dataclass(frozen=True)
class Store:
    home: Path

    def __post_init__(self) -> None:
        # Absolute, so that a Store handed to a task in another process means the same home.
        object.__setattr__(self, "home", Path(self.home).absolute())

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.home,))

    # The parts, each made when first used (a command reads one or two of them); not fields,
    # so that what looks into a Store's fields (Prefect's parameters, `replace`) sees its home.
    @cached_property
    def db(self) -> Database:
        return Database(self.home)

    @cached_property
    def runs(self) -> Runs:
        return Runs(self.db)

    @cached_property
    def samples(self) -> Samples:
        return Samples(self.db)

    @cached_property
    def snapshots(self) -> Snapshots:
        return Snapshots(self.db)

    @cached_property
    def outputs(self) -> Outputs:
        return Outputs(self.db)

    @cached_property
    def calibrations(self) -> Calibrations:
        return Calibrations(self.db)

    @cached_property
    def exports(self) -> Exports:
        return Exports(self.db, self.runs, self.snapshots)

    @cached_property
    def mined(self) -> MinedCandidates:
        return MinedCandidates(self.home)

    @cached_property
    def model_calls(self) -> ModelCalls:
        return ModelCalls(self.db)

    @classmethod
    def default(cls) -> Store:
        """The home `EVALPIPE_HOME` names (else the nearest `.evalpipe/`: `tasks.home`)."""
        return cls(evalpipe_home())

    def resolve_suite(self, ref: str) -> tuple[EvalSuite, str]:
        """The suite `ref` names, and where it was found, pinned (`storage.suites.resolve_suite`)."""
        return resolve_suite(ref, self.snapshots)
