"""A run's `--max-cost` where its model calls are made (`Purse`): the priced calls of all its
samples counted as they are answered, so that the call that would take the run past its budget
is refused (the gateway's 403, the in-process SDK's error), not only the next sample. Shared by
the samples drawn in one process; a run drawn on worker processes or a Dask cluster keeps the
budget per process this way, and across them as samples end (`tasks.run.budget.Meter`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Purse:
    limit_usd: float
    spent_usd: float = 0.0
    dearest_usd: float = 0.0  # the dearest call so far, in any sample: what the next may cost
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def refusal(self, pending: int) -> str | None:
        """Why one more call (beside `pending` of the caller's in flight) must not go out, or None."""
        with self.lock:
            if self.dearest_usd and self.spent_usd + (pending + 1) * self.dearest_usd > self.limit_usd:
                return f"--max-cost ${self.limit_usd:g} (${self.spent_usd:.6f} spent by the run's calls)"
            return None

    def spend(self, cost_usd: float) -> None:
        with self.lock:
            self.spent_usd += cost_usd
            self.dearest_usd = max(self.dearest_usd, cost_usd)
