"""Stage 2, the sampler: plan n samples per case, draw them from the agent, grade each.

Every sample keeps its raw output, verdict, trace and timing (docs/contract.md §1.2).
Seeds and cache keys are pure functions of content, so planning a run is deterministic and
a re-run can find its finished work by key.

`draw_sample` is the one boundary where an agent's output enters a `Sample`, so whatever
any agent returns (and whatever a grader or judge writes) can be stored: an output that
is not a `str` is an `agent_error`; characters no encoding can store (lone surrogates)
are replaced; configured secrets are masked (`tasks.redaction`); the output is capped at
`max_output_bytes()`. The trace says what was changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.agents import Agent, AgentContext, AgentError, max_output_bytes, seen_beyond_inputs
from tasks.graders import grade, grader_fingerprint
from tasks.models import (
    EvalCase,
    EvalSuite,
    Sample,
    Status,
    Usage,
    Verdict,
    canonical_json,
    content_seed,
    sha256_hex,
)
from tasks.redaction import MASK, redact


def sample_seed(case_id: str, inputs_hash: str, index: int, run_seed: int) -> int:
    """A sample's seed, from what the agent sees (the case's id and inputs hash) and where
    it stands (its index, the run seed): not from the suite version, so that editing a
    reference or adding a case leaves every other sample's draw as it was."""
    return content_seed(case_id, inputs_hash, index, run_seed)


def output_key(asked: Sequence[str], index: int, seed: int, seen: Mapping[str, Any]) -> str:
    """The key of a drawn output, from everything that decides it and nothing else:
    `asked` (agent fingerprint, case id, inputs hash), the index and seed, and `seen`, what
    the agent reads of the case besides its inputs (`seen_beyond_inputs`)."""
    content = ["output", *asked, index, seed]
    return sha256_hex(canonical_json([*content, dict(seen)] if seen else content))


def grading_fingerprint(case: EvalCase) -> str:
    """What a verdict depends on besides the output: the grader's kind, parameters,
    reference and code (`grader_fingerprint`), and the case's safety rules."""
    return sha256_hex(canonical_json([grader_fingerprint(case), case.safety]))


def cache_key(output_key: str, grading_fp: str) -> str:
    """The key of a graded sample (the `cache_key` column): its output's key and how it is graded."""
    return sha256_hex(canonical_json([output_key, grading_fp]))


@dataclass(frozen=True)
class PlannedSample:
    case_id: str
    index: int
    seed: int
    cache_key: str
    case_hash: str
    # A stored output to grade instead of drawing one (a cached output graded anew, or
    # `--regrade`), with what its call took when it was drawn.
    output: str | None = None
    output_key: str = ""
    usage: Usage | None = None


def plan_samples(suite: EvalSuite, agent_fingerprint: str, n: int, run_seed: int,
                 agent_spec: str = "") -> list[PlannedSample]:
    """Every sample the run needs, in (case id, index) order."""
    planned = []
    for case in suite.cases:
        grading_fp = grading_fingerprint(case)
        seen = seen_beyond_inputs(agent_spec, case)
        # Read once: a pydantic model's attribute costs more than the hashing around it.
        case_id, inputs_hash, case_hash = case.id, case.inputs_hash, case.case_hash
        for index in range(n):
            seed = sample_seed(case_id, inputs_hash, index, run_seed)
            out_key = output_key((agent_fingerprint, case_id, inputs_hash), index, seed, seen)
            planned.append(PlannedSample(case_id, index, seed, cache_key(out_key, grading_fp), case_hash,
                                         output_key=out_key))
    return planned


def encodable(text: str) -> tuple[str, int]:
    """`text` with every lone surrogate replaced by U+FFFD (a valid pair is joined into
    its character), and how many characters were replaced."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        fixed = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        return fixed, fixed.count("\ufffd") - text.count("\ufffd")
    return text, 0


def storable(text: str) -> str:
    """Any string as it may be stored: encodable, secrets masked."""
    return redact(encodable(text)[0])


def truncation_marker(cap: int) -> str:
    return f"\n[evalpipe: output truncated at {cap} bytes]"


def bounded_output(output: Any, cap: int) -> tuple[str, dict[str, Any]]:
    """An agent's output as it is graded and stored, and what the trace says about it.
    `AgentError` if it is not a `str`: converting it would hide a bug (a `None` from a
    missing `return` would grade as "None")."""
    if not isinstance(output, str):
        raise AgentError(f"returned {type(output).__name__}, expected str")
    notes: dict[str, Any] = {}
    text, replaced = encodable(output)
    if replaced:
        notes["output_replaced_chars"] = replaced
    masked = redact(text)
    if masked != text:
        notes["output_redacted"] = masked.count(MASK) - text.count(MASK)
    data = masked.encode("utf-8")
    if len(data) > cap:
        notes["output_truncated"] = {"cap_bytes": cap, "bytes": len(data)}
        # `ignore` drops a character cut in half at the cap.
        masked = data[:cap].decode("utf-8", "ignore") + truncation_marker(cap)
    return masked, notes


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(v, fn) for v in value]
    return value


def draw_sample(
    agent, case: EvalCase, planned: PlannedSample, n: int, regrade: int = 0, cap: int | None = None
) -> Sample:
    """Draw one output (or take the planned stored one) and grade it. Never raises: agent
    failures become `agent_error`. `cap`: the output limit in bytes (default from the
    environment, see `max_output_bytes`)."""
    started = time.perf_counter()
    trace: dict = {}
    ctx = AgentContext(case_id=case.id, index=planned.index, seed=planned.seed, n=n, trace=trace)
    usage = planned.usage or Usage()
    try:
        if planned.output is None:
            try:
                raw = agent.generate(case, ctx)
            finally:  # a failed call took its time (and maybe its tokens) too
                usage = Usage(latency_s=time.perf_counter() - started, **ctx.reported)
            output, notes = bounded_output(raw, max_output_bytes() if cap is None else cap)
            trace.update(notes)
        else:  # stored, so bounded when it was drawn: a second cut would add a second marker
            output = planned.output
    except AgentError as exc:
        output = ""
        verdict = Verdict.fail(Status.agent_error, f"agent failed: {exc}")
    else:
        trace["agent_s"] = round(time.perf_counter() - started, 6)
        verdict = grade(output, case, trace)
        if regrade:
            # Same output graded again: any disagreement is the environment's flakiness.
            again = [grade(output, case, {}).status.value for _ in range(regrade)]
            trace["regrade"] = again
            trace["env_flaky"] = any(s != verdict.status.value for s in again)
    # Graders and judges write text of their own (an exception, a judge's rationale).
    verdict = verdict.model_copy(
        update={"detail": storable(verdict.detail), "safety": tuple(map(storable, verdict.safety))}
    )
    return Sample(
        case_id=case.id,
        index=planned.index,
        seed=planned.seed,
        output=output,
        verdict=verdict,
        trace=_map_strings(trace, storable),
        duration_s=time.perf_counter() - started,
        cached=planned.output is not None,
        usage=usage,
    )


def run_batch(
    agent: Agent, cases: Sequence[EvalCase], planned: Sequence[PlannedSample], n: int, regrade: int = 0,
    budget_s: float | None = None,
) -> list[Sample]:
    """Draw and grade planned samples in order. With `budget_s`, stop starting new ones once
    the batch has run that long (at least one is always drawn) and return the finished
    prefix: the caller stores it and submits the rest again, so a kill loses at most about
    `budget_s` of work per worker. An agent sent to a worker process is re-created there
    from its spec and refuses to run if its fingerprint moved."""
    by_id = {c.id: c for c in cases}
    cap = max_output_bytes()
    started = time.monotonic()
    drawn: list[Sample] = []
    for p in planned:
        if drawn and budget_s is not None and time.monotonic() - started >= budget_s:
            break
        drawn.append(draw_sample(agent, by_id[p.case_id], p, n, regrade, cap))
    return drawn
