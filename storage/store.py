"""`Store(home)`: the one object through which everything reaches an evalpipe home's data:
its DuckDB file (`storage.db`), suite snapshots (`storage.snapshots`), judge calibrations
(`storage.calibrations`), run files (`storage.export`), drawn outputs not yet graded
(`storage.outputs`) and mined candidates (`storage.mined`), each module holding its part of
the methods. A command, a flow or `evalpipe.evaluate` builds one at its top and passes it
down; the run loop keeps its samples in it (`tasks.run.loop.SampleStore`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from storage.calibrations import Calibrations
from storage.export import Exports
from storage.mined import MinedCandidates
from storage.model_calls import ModelCalls
from storage.outputs import Outputs
from storage.suites import resolve_suite
from tasks.home import evalpipe_home
from tasks.models import EvalSuite


@dataclass(frozen=True)
class Store(Exports, Calibrations, Outputs, MinedCandidates, ModelCalls):
    home: Path

    def __post_init__(self) -> None:
        # Absolute, so that a Store handed to a task in another process means the same home.
        object.__setattr__(self, "home", Path(self.home).absolute())

    @classmethod
    def default(cls) -> Store:
        """The home `EVALPIPE_HOME` names (else the nearest `.evalpipe/`: `tasks.home`)."""
        return cls(evalpipe_home())

    def resolve_suite(self, ref: str) -> tuple[EvalSuite, str]:
        """The suite `ref` names, and where it was found, pinned (`storage.suites.resolve_suite`)."""
        return resolve_suite(ref, self)

    def has_snapshot(self, suite: EvalSuite) -> bool:
        return self.snapshot_path(suite.version).exists()

    def snapshot(self, suite: EvalSuite) -> Path:
        """Write the suite's snapshot (once per version) and record the suite."""
        path = self.write_snapshot(suite)
        self.record_suite(suite, path)
        return path
