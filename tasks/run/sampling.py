"""Stage 2, the sampler: plan n samples per case, draw them from the agent, grade each.

Every sample keeps its raw output, verdict, trace and timing (docs/contract.md §1.2).
Seeds and cache keys are pure functions of content, so planning a run is deterministic and
a re-run can find its finished work by key.

Drawing (`draw_output`, I/O-bound) and grading (`grade_drawn`, CPU-bound) are two stages a
run runs with their own concurrency (`tasks.run.loop`); `draw_sample` is both in turn.
They are the one boundary where an agent's output enters a `Sample`, so whatever any agent
returns (and whatever a grader or judge writes) can be stored: an output that
is not a `str` is an `agent_error`; characters no encoding can store (lone surrogates)
are replaced; configured secrets are masked (`tasks.redaction`); the output is capped at
the run's `max_output_bytes`. The trace says what was changed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tasks.agents import AgentContext, AgentError, seen_beyond_inputs
from tasks.agents.model_calls import TRACE_KEY as MODEL_CALLS_KEY
from tasks.agents.model_calls import CallBook, RecordedCall
from tasks.agents.purse import Purse
from tasks.agents.settings import DEFAULT_MAX_OUTPUT_BYTES
from tasks.graders import grade, grader_fingerprint
from tasks.metrics.cost import PriceTable
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
from tasks.redaction import MASK, redact, secret_values
from tasks.run.stored import StoredOutput, output_text
from tasks.trace import OutputTrace, RegradeTrace, SampleTrace, Truncation

T = TypeVar("T")
R = TypeVar("R")


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
    # `--regrade`, or one drawn before a kill and never graded), with what its call took
    # when it was drawn and, for the last, the trace the agent wrote. A long one is a
    # `StoredOutput`, read when it is graded.
    output: str | StoredOutput | None = None
    output_key: str = ""
    usage: Usage | None = None
    trace: SampleTrace | None = field(default=None, hash=False, compare=False)
    draw_s: float = 0.0
    # `--replay-model-calls`: the calls an earlier run kept for this case, index and seed, to
    # answer identical ones from (empty: none kept); None without the option.
    replay: tuple[RecordedCall, ...] | None = field(default=None, hash=False, compare=False)


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


def storable(text: str, secrets: Sequence[str] | None = None) -> str:
    """Any string as it may be stored: encodable, secrets masked (`secrets`: read once by a
    caller with many strings, see `tasks.redaction.redact`)."""
    return redact(encodable(text)[0], secrets=secrets)


def truncation_marker(cap: int) -> str:
    return f"\n[evalpipe: output truncated at {cap} bytes]"


def bounded_output(output: Any, cap: int, trace: SampleTrace, secrets: Sequence[str] | None = None) -> str:
    """An agent's output as it is graded and stored; `trace` records what was changed.
    `AgentError` if it is not a `str`: converting it would hide a bug (a `None` from a
    missing `return` would grade as "None"). `secrets`: see `storable`."""
    if not isinstance(output, str):
        raise AgentError(f"returned {type(output).__name__}, expected str")
    bounding = OutputTrace()
    text, replaced = encodable(output)
    if replaced:
        bounding.replaced_chars = replaced
    masked = redact(text, secrets=secrets)
    if masked != text:
        bounding.redacted = masked.count(MASK) - text.count(MASK)
    data = masked.encode("utf-8")
    if len(data) > cap:
        bounding.truncated = Truncation(cap_bytes=cap, bytes=len(data))
        # `ignore` drops a character cut in half at the cap.
        masked = data[:cap].decode("utf-8", "ignore") + truncation_marker(cap)
    if bounding.model_fields_set:
        trace.output = bounding
    return masked


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(v, fn) for v in value]
    return value


def _storable_trace(trace: SampleTrace, secrets: Sequence[str]) -> SampleTrace:
    """`trace` with every string storable (parsed anew only if one changed: most never do)."""
    written = trace.to_dict()
    cleaned = _map_strings(written, functools.partial(storable, secrets=secrets))
    return trace if cleaned == written else SampleTrace.model_validate(cleaned)


@dataclass(frozen=True)
class Drawn:
    """An output on its way from the drawing stage to the grading stage: the planned sample,
    the output as it is graded and stored ("" when the call failed, `error` set), what the
    call took, and the trace the agent and the output's bounding wrote."""

    planned: PlannedSample
    output: str | StoredOutput
    usage: Usage
    trace: SampleTrace
    draw_s: float = 0.0
    error: str | None = None

    @property
    def cached(self) -> bool:
        return self.planned.output is not None


def stored_output(planned: PlannedSample) -> Drawn:
    """A planned sample's stored output, graded without an agent call (bounded when it was
    drawn: a second cut would add a second marker)."""
    assert planned.output is not None
    return Drawn(planned, planned.output, planned.usage or Usage(), planned.trace or SampleTrace(), planned.draw_s)


def draw_output(agent, case: EvalCase, planned: PlannedSample, n: int, cap: int,
                secrets: Sequence[str] | None = None, prices: PriceTable | None = None,
                purse: Purse | None = None) -> Drawn:
    """Draw one output from the agent. Never raises: a failed call is a `Drawn` with its
    `error`. `cap`: the output limit in bytes (`RunConfig.output_cap`); `secrets`: see `storable`;
    `prices`: the run's, which a cap on a sample's spending counts with; `purse`: the run's
    `--max-cost`, which each priced model call spends from as it is answered."""
    if planned.output is not None:
        return stored_output(planned)
    started = time.perf_counter()
    trace = SampleTrace()
    calls = CallBook(planned.replay) if planned.replay is not None else None
    ctx = AgentContext(case_id=case.id, index=planned.index, seed=planned.seed, n=n, trace=trace,
                       cost_of=None if prices is None else (lambda model, i, o: prices.cost(model, i, o)[0]),
                       calls=calls, purse=purse)
    try:
        try:
            raw = agent.generate(case, ctx)
        finally:  # a failed call took its time (and maybe its tokens) too
            usage = Usage(**{"latency_s": time.perf_counter() - started, **ctx.reported})
            if calls is not None:
                setattr(trace, MODEL_CALLS_KEY, calls.section())
        output = bounded_output(raw, cap, trace, secrets)
    except AgentError as exc:
        return Drawn(planned, "", usage, trace, time.perf_counter() - started, f"agent failed: {exc}")
    return Drawn(planned, output, usage, trace, time.perf_counter() - started)


def grade_drawn(case: EvalCase, drawn: Drawn, regrade: int = 0, secrets: Sequence[str] | None = None) -> Sample:
    """Grade a drawn (or stored) output into its `Sample`. Never raises: an agent failure is
    an `agent_error`; a grader's is the grader's verdict. `secrets`: see `storable`."""
    started = time.perf_counter()
    trace = drawn.trace.model_copy()
    output = output_text(drawn.output)
    if drawn.error is not None:
        verdict = Verdict.fail(Status.agent_error, drawn.error)
    else:
        # A copy: the drawn trace's section is shared with `trace` (a shallow copy).
        took = {"agent_s": round(drawn.draw_s, 6)}
        trace.output = trace.output.model_copy(update=took) if trace.output else OutputTrace(**took)
        verdict = grade(output, case, trace)
        if regrade:
            # Same output graded again: any disagreement is the environment's flakiness.
            again = [grade(output, case).status for _ in range(regrade)]
            trace.regrade = RegradeTrace(statuses=again, env_flaky=any(s != verdict.status for s in again))
    # Graders and judges write text of their own (an exception, a judge's rationale).
    secrets = secret_values() if secrets is None else secrets
    detail, safety = storable(verdict.detail, secrets), tuple(storable(v, secrets) for v in verdict.safety)
    if detail != verdict.detail or safety != verdict.safety:
        verdict = verdict.model_copy(update={"detail": detail, "safety": safety})
    p = drawn.planned
    return Sample(
        case_id=case.id,
        index=p.index,
        seed=p.seed,
        output=output,
        verdict=verdict,
        trace=_storable_trace(trace, secrets),
        duration_s=drawn.draw_s + time.perf_counter() - started,
        cached=drawn.cached,
        usage=drawn.usage,
    )


def draw_sample(
    agent, case: EvalCase, planned: PlannedSample, n: int, regrade: int = 0, cap: int | None = None
) -> Sample:
    """Draw one output (or take the planned stored one) and grade it: both stages in turn.
    `cap`: the output limit in bytes (default: the built-in one, `AgentSettings`)."""
    return grade_drawn(case, draw_output(agent, case, planned, n, DEFAULT_MAX_OUTPUT_BYTES if cap is None else cap),
                       regrade)


def timed_prefix(items: Sequence[T], work: Callable[[T], R], budget_s: float | None,
                 stopped: Callable[[], bool] | None = None) -> list[R]:
    """`work` on each item in order; with `budget_s`, none started that would, at the pace so
    far, end past that much time (at least one always is): the finished prefix. The caller
    stores it and hands the rest out again, so a kill loses at most about `budget_s` of work
    per worker. Once `stopped()` says so, none more is started (not even the first)."""
    started = time.monotonic()
    done: list[R] = []
    for item in items:
        if stopped is not None and stopped():
            break
        if done and budget_s is not None:
            spent = time.monotonic() - started
            if spent + spent / len(done) > budget_s:
                break
        done.append(work(item))
    return done
