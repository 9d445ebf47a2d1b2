"""The summary's `model_calls` document of a run with `--replay-model-calls`: how many of the
drawn samples' model calls were answered from an earlier run's record and how many went
upstream, and what the replayed ones would have cost in tokens (not spent: the run's `usage`
counts only what was bought)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict

from tasks.agents.model_calls import TRACE_KEY


class ModelCallCounts(BaseModel):
    """`model_calls`: the calls of the samples drawn in this run (not those from the cache)
    that went through the gateway or, in evalpipe's process, through the OpenAI SDK.
    `unseen_samples`: drawn samples none of whose calls went either way (an agent calling its
    endpoint by other means, or making no call), which are neither replayed nor counted here;
    `note` says so."""

    model_config = ConfigDict(extra="forbid")

    replayed: int
    forwarded: int
    replayed_input_tokens: int | None
    replayed_output_tokens: int | None
    unseen_samples: int = 0
    note: str | None = None


def model_call_counts(samples: pa.Table) -> ModelCallCounts:
    """The document over a run's samples (`trace`, `cached` and `status` read)."""
    drawn = samples.filter(pc.invert(samples["cached"].fill_null(False)))
    replayed = forwarded = unseen = 0
    tokens: list[int | None] = [None, None]
    for trace in drawn["trace"].to_pylist():
        section = _section(trace)
        if section is None:
            unseen += 1
            continue
        replayed += int(section.get("replayed") or 0)
        forwarded += int(section.get("forwarded") or 0)
        spent = section.get("replayed_tokens") or {}
        for i, key in enumerate(("input", "output")):
            if isinstance(spent.get(key), int):
                tokens[i] = (tokens[i] or 0) + spent[key]
    note = None
    if unseen:
        note = (f"{unseen} drawn sample(s) made no model call through the gateway or the OpenAI SDK in"
                " evalpipe's process (an agent calling its endpoint by other means, or making no call): none of"
                " their calls can be replayed, and they are not counted here")
    return ModelCallCounts(replayed=replayed, forwarded=forwarded, replayed_input_tokens=tokens[0],
                           replayed_output_tokens=tokens[1], unseen_samples=unseen, note=note)


def _section(trace: Any) -> Mapping[str, Any] | None:
    """A stored trace's `model_calls` section: None where the draw kept none, or kept one for
    a sample that made no call evalpipe could answer."""
    doc = json.loads(trace) if isinstance(trace, str) else trace
    section = doc.get(TRACE_KEY) if isinstance(doc, Mapping) else None
    if not isinstance(section, Mapping) or not (section.get("replayed") or section.get("forwarded")):
        return None
    return section


def model_calls_line(doc: Mapping[str, Any]) -> str:
    """The document as a line of the text summary."""
    counts = ModelCallCounts.model_validate(doc)
    tokens = ""
    if counts.replayed:
        inp, out = (("n/a" if t is None else f"{t:,}") for t in (counts.replayed_input_tokens,
                                                                  counts.replayed_output_tokens))
        tokens = f" (their tokens in {inp} out {out}, not spent)"
    line = f"model calls: {counts.replayed} replayed{tokens}, {counts.forwarded} forwarded upstream"
    return line + (f"; {counts.note}" if counts.note else "")
