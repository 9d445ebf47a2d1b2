"""A run's budget (`--max-cost`, `--max-samples`): how many agent calls it may start and
what they may cost. Only drawing spends: a cached output, graded anew or not, is free.

Once the budget is spent no new agent call starts; calls in flight finish and are stored.
What is left undrawn makes the run `partial`; the same command with a larger budget draws
only the rest (the drawn outputs are in the cache). A budgeted run draws sample 0 of every
case before sample 1 of any, so that what a budget buys covers the suite.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from tasks.agents.purse import Purse
from tasks.run.sampling import PlannedSample
from tasks.run.summary import BudgetSummary


class Budget(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_cost_usd: float | None = Field(default=None, gt=0)
    max_samples: int | None = Field(default=None, ge=1)

    @property
    def limited(self) -> bool:
        return self.max_cost_usd is not None or self.max_samples is not None

    def order(self, to_draw: Sequence[PlannedSample], drawn: int = 0
              ) -> tuple[list[PlannedSample], list[PlannedSample]]:
        """The samples to draw in the order a budgeted run draws them (index first), cut at
        what `max_samples` leaves after the `drawn` samples the run has already bought:
        (may be drawn, left undrawn)."""
        if not self.limited:
            return list(to_draw), []
        ordered = sorted(to_draw, key=lambda p: (p.index, p.case_id))
        cut = len(ordered) if self.max_samples is None else max(0, self.max_samples - drawn)
        return ordered[:cut], ordered[cut:]


class Meter:
    """What a run has drawn and spent so far, against its budget."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        # The same limit where the money is spent: each priced model call of the run's samples,
        # as it is answered (the gateway, in-process capture), the call past it refused.
        self.purse = Purse(budget.max_cost_usd) if budget.max_cost_usd is not None else None
        self.drawn = 0
        self.cost_usd = 0.0
        self.dearest = 0.0  # the dearest call so far
        self.stopped: str | None = None  # why no new agent call may start

    def add(self, costs: Sequence[float | None]) -> None:
        """Count drawn samples (never cached ones) by their cost, None where it is unknown."""
        self.drawn += len(costs)
        known = [c for c in costs if c is not None]
        self.cost_usd += sum(known)
        self.dearest = max([self.dearest, *known])
        limit = self.budget.max_cost_usd
        if limit is None or self.stopped:
            return
        unpriced = sum(c is None for c in costs)
        if unpriced:
            # Spending that cannot be counted cannot be kept under a limit: stop, and say so.
            self.stopped = (f"--max-cost {limit:g}: {unpriced} drawn sample(s) have no known cost"
                            " (no token counts, or no price for the model), so the budget cannot be kept")
        elif self.cost_usd >= limit:
            self.stopped = f"--max-cost {limit:g} spent (${self.cost_usd:.6g})"

    @property
    def may_draw(self) -> bool:
        if self.stopped is None and self.purse is not None and (why := self.purse.refusal(0)) is not None:
            self.stopped = why  # a sample's next call would be refused: no new sample starts
        return self.stopped is None


def budget_summary(budget: Budget, meter: Meter, undrawn: int) -> BudgetSummary:
    stopped = meter.stopped
    if stopped is None and undrawn:
        stopped = f"--max-samples {budget.max_samples} drawn"
    return BudgetSummary(max_cost_usd=budget.max_cost_usd, max_samples=budget.max_samples,
                         drawn_samples=meter.drawn, spent_usd=meter.cost_usd, stopped=stopped)
