"""Stage 2, the sampler: plan n samples per case, draw them from the agent, grade each.

Every sample keeps its raw output, verdict, trace and timing (docs/contract.md §1.2). Seeds and cache
keys are pure functions of content, so planning a run is deterministic and a re-run can
find its finished work by key.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tasks.agents import Agent, AgentContext, AgentError
from tasks.graders import grade, grader_fingerprint
from tasks.models import EvalCase, EvalSuite, Sample, Status, Verdict, canonical_json, sha256_hex


def sample_seed(suite_version: str, case_id: str, index: int, run_seed: int) -> int:
    """A 63-bit seed from (suite version, case id, sample index, run seed)."""
    digest = sha256_hex(canonical_json([suite_version, case_id, index, run_seed]))
    return int(digest[:16], 16) >> 1


def cache_key(case_hash: str, agent_fingerprint: str, index: int, seed: int, grader_fp: str) -> str:
    return sha256_hex(canonical_json([case_hash, agent_fingerprint, index, seed, grader_fp]))


@dataclass(frozen=True)
class PlannedSample:
    case_id: str
    index: int
    seed: int
    cache_key: str
    case_hash: str
    # A stored output to grade again instead of drawing one (`--regrade` of cached work).
    output: str | None = None


def plan_samples(suite: EvalSuite, agent_fingerprint: str, n: int, run_seed: int) -> list[PlannedSample]:
    """Every sample the run needs, in (case id, index) order."""
    planned = []
    for case in suite.cases:
        grader_fp = grader_fingerprint(case)
        for index in range(n):
            seed = sample_seed(suite.version, case.id, index, run_seed)
            key = cache_key(case.case_hash, agent_fingerprint, index, seed, grader_fp)
            planned.append(PlannedSample(case.id, index, seed, key, case.case_hash))
    return planned


def draw_sample(agent, case: EvalCase, planned: PlannedSample, n: int, regrade: int = 0) -> Sample:
    """Draw one output (or take the planned stored one) and grade it. Never raises: agent
    failures become `agent_error`."""
    started = time.perf_counter()
    ctx = AgentContext(case_id=case.id, index=planned.index, seed=planned.seed, n=n)
    trace: dict = {}
    try:
        output = agent.generate(case, ctx) if planned.output is None else planned.output
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
    return Sample(
        case_id=case.id,
        index=planned.index,
        seed=planned.seed,
        output=output,
        verdict=verdict,
        trace=trace,
        duration_s=time.perf_counter() - started,
        cached=planned.output is not None,
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
    started = time.monotonic()
    drawn: list[Sample] = []
    for p in planned:
        if drawn and budget_s is not None and time.monotonic() - started >= budget_s:
            break
        drawn.append(draw_sample(agent, by_id[p.case_id], p, n, regrade))
    return drawn
