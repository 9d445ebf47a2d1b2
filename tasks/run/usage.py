"""What a run's agent calls took and cost: drawn samples priced as they are drawn
(`priced`), and the `usage` document of the summary (`usage_summary`), with the samples
drawn in this run and those whose output came from the cache counted apart: the second is
what the cache saved."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict

from tasks.agents.capture import unavailable as capture_unavailable
from tasks.metrics.cost import PriceTable
from tasks.models import Usage


def priced(usage: Usage, prices: PriceTable) -> Usage:
    """A sample's usage with its `cost_usd` where it can be priced (a price it had when drawn
    is kept; one it lacked, a price file given later supplies: its tokens are stored); the
    summary says why the others cannot (`UsageFigures.cost_note`)."""
    if usage.cost_usd is not None or (usage.input_tokens is None and usage.output_tokens is None):
        return usage  # priced already, or nothing to price by
    cost = prices.cost(usage.model, usage.input_tokens, usage.output_tokens)[0]
    return usage.model_copy(update={"cost_usd": cost})


class UsageFigures(BaseModel):
    """Tokens, cost and agent latency over a set of samples. `cost_usd` is null, and
    `cost_note` says why, when no sample could be priced or one that reported tokens
    could not; samples that reported no tokens are left out of it, and the note says so."""

    model_config = ConfigDict(extra="forbid")

    samples: int
    input_tokens: int | None
    output_tokens: int | None
    cost_usd: float | None
    cost_note: str | None = None
    latency_p50_s: float | None
    latency_p95_s: float | None


class RunUsage(UsageFigures):
    """The `usage` document: the samples drawn in this run, and beside them `cached`, the
    same figures for the samples whose output the cache supplied."""

    cached: UsageFigures


# The sample columns `usage_summary` reads (with `cached`).
USAGE_SAMPLE_COLUMNS = ("latency_s", "input_tokens", "output_tokens", "usage_model", "cost_usd")


def usage_summary(samples: pa.Table) -> RunUsage:
    cached = samples["cached"].fill_null(False)
    drawn = _figures(samples.filter(pc.invert(cached)))
    return RunUsage(**drawn.model_dump(), cached=_figures(samples.filter(cached)))


def _figures(rows: pa.Table) -> UsageFigures:
    latency = rows["latency_s"].drop_null().to_numpy()
    has_tokens = pc.or_(pc.is_valid(rows["input_tokens"]), pc.is_valid(rows["output_tokens"]))
    counted = rows.filter(has_tokens)
    cost, note = _cost(rows, counted)
    known = counted.num_rows or not rows.num_rows  # no samples used no tokens; unreported ones are unknown
    return UsageFigures(
        samples=rows.num_rows,
        input_tokens=_total(counted["input_tokens"]) if known else None,
        output_tokens=_total(counted["output_tokens"]) if known else None,
        cost_usd=cost,
        cost_note=note,
        latency_p50_s=float(np.percentile(latency, 50)) if latency.size else None,
        latency_p95_s=float(np.percentile(latency, 95)) if latency.size else None,
    )


def _total(column: pa.ChunkedArray) -> int:
    return int(pc.sum(column).as_py() or 0)


def _cost(rows: pa.Table, counted: pa.Table) -> tuple[float | None, str | None]:
    if rows.num_rows == 0:
        return 0.0, None
    if counted.num_rows == 0:
        answered = pc.sum(pc.fill_null(pc.not_equal(rows["status"], "agent_error"), True)).as_py()
        if not answered:  # an `openai:` agent whose endpoint was never reached reports usage when it answers
            return None, "no sample reported token counts: every one is agent_error, the agent never answered"
        why = capture_unavailable()  # then not even a python: agent's SDK calls could be counted
        return None, ("no sample reported token counts: the agent does not report usage (docs/agents.md)"
                      + (f"; {why}" if why else ""))
    unpriced = counted.filter(pc.is_null(counted["cost_usd"]))
    if unpriced.num_rows:
        models = sorted({m for m in unpriced["usage_model"].to_pylist() if m})
        why = (f"no price for model(s) {', '.join(map(repr, models))} (genai-prices, or a price file: --prices)"
               if models else "tokens were reported without the model that counted them")
        return None, f"{unpriced.num_rows} sample(s) could not be priced: {why}"
    cost = float(pc.sum(counted["cost_usd"]).as_py() or 0.0)
    missing = rows.num_rows - counted.num_rows
    return cost, (f"{missing} sample(s) reported no tokens and are not counted" if missing else None)



USAGE_COLUMNS = ("outputs", "samples", "input tokens", "output tokens", "cost (USD)", "agent latency p50",
                 "agent latency p95", "note")


def usage_rows(usage: RunUsage | Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The `usage` document as table rows (`USAGE_COLUMNS`): drawn in this run, then what
    the cache saved. Unknown figures read "n/a", never 0."""
    usage = RunUsage.model_validate(usage)
    return [_row("drawn", usage), _row("cached", usage.cached)]


def usage_lines(usage: RunUsage | Mapping[str, Any]) -> list[str]:
    """The same as text lines."""
    return [f"usage {label:<6} {samples} samples  tokens in {inp} out {out}  cost {cost}"
            f"  agent latency p50 {p50} p95 {p95}" + (f"  ({note})" if note else "")
            for label, samples, inp, out, cost, p50, p95, note in usage_rows(usage)]


def latency_text(x: float | None, *, none: str = "", gap: str = " ") -> str:
    """A latency in the smallest unit it fits in three digits of (µs, ms, s): a fast agent takes
    microseconds, never "2.3e-05s" (nor "1e+03ms" just under a second); `none` when unknown."""
    if x is None:
        return none
    for unit, scale in (("µs", 1e6), ("ms", 1e3)):
        if x * scale < 999.5:
            return f"{x * scale:.3g}{gap}{unit}"
    return f"{x:.3g}{gap}s" if x < 99.95 else f"{x:,.1f}{gap}s"


def _row(label: str, f: UsageFigures) -> tuple[str, ...]:
    def tokens(x: int | None) -> str:
        return "n/a" if x is None else f"{x:,}"

    def seconds(x: float | None) -> str:
        return latency_text(x, none="n/a", gap="")

    cost = "n/a" if f.cost_usd is None else f"${f.cost_usd:,.6f}"
    return (label, str(f.samples), tokens(f.input_tokens), tokens(f.output_tokens), cost,
            seconds(f.latency_p50_s), seconds(f.latency_p95_s), f.cost_note or "")
