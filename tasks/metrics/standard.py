"""The built-in registered metrics, in `run --json` under `metrics` beside every plugin's.
Registered as a plugin's are (`tasks.registry.metric`); numpy is imported when one is computed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.registry import metric

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from tasks.metrics.tallies import Tallies


@metric("pass@1", per_case=True)
def pass_at_1(tallies: Tallies) -> NDArray:
    """Each case's unbiased pass@1 (its pass rate), averaged over the cases."""
    from tasks.metrics.stats import pass_at_k

    return pass_at_k(tallies.n, tallies.passes, 1)


@metric("mean_score", per_case=True)
def mean_score(tallies: Tallies) -> NDArray | None:
    """The graders' scores (partial credit, judges), per case then over the cases."""
    return tallies.mean_scores
