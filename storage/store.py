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
Dask task) it travels as its home, and builds its parts there."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    db: Database = field(init=False, repr=False, compare=False)
    runs: Runs = field(init=False, repr=False, compare=False)
    samples: Samples = field(init=False, repr=False, compare=False)
    snapshots: Snapshots = field(init=False, repr=False, compare=False)
    outputs: Outputs = field(init=False, repr=False, compare=False)
    calibrations: Calibrations = field(init=False, repr=False, compare=False)
    exports: Exports = field(init=False, repr=False, compare=False)
    mined: MinedCandidates = field(init=False, repr=False, compare=False)
    model_calls: ModelCalls = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Absolute, so that a Store handed to a task in another process means the same home.
        home = Path(self.home).absolute()
        db = Database(home)
        runs, snapshots = Runs(db), Snapshots(db)
        parts = {"home": home, "db": db, "runs": runs, "samples": Samples(db), "snapshots": snapshots,
                 "outputs": Outputs(db), "calibrations": Calibrations(db), "exports": Exports(db, runs, snapshots),
                 "mined": MinedCandidates(home), "model_calls": ModelCalls(db)}
        for name, part in parts.items():
            object.__setattr__(self, name, part)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Store, (self.home,))

    @classmethod
    def default(cls) -> Store:
        """The home `EVALPIPE_HOME` names (else the nearest `.evalpipe/`: `tasks.home`)."""
        return cls(evalpipe_home())

    def resolve_suite(self, ref: str) -> tuple[EvalSuite, str]:
        """The suite `ref` names, and where it was found, pinned (`storage.suites.resolve_suite`)."""
        return resolve_suite(ref, self.snapshots)
