"""Graders of what an agent did (docs/graders.md "What the agent did"): its tool calls, their
order, its steps and what its world received, read from the sample's trajectory
(`tasks.trajectory`). Cheap and deterministic: graded inline, and graded again from a stored
trajectory with no model call.

A sample with no trajectory (an agent that records none) cannot be judged on its actions: its
verdict is `error` saying so, never a silent pass or fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tasks.graders.judge import case_judge, judge
from tasks.models import EvalCase, Status, Verdict, canonical_json, sha256_hex
from tasks.params import (
    ExpectedCall,
    FileAssertion,
    FinalStateParams,
    JudgeParams,
    StepsParams,
    ToolCalledParams,
    ToolSequenceParams,
)
from tasks.registry import grader
from tasks.repos.patching import apply_patch
from tasks.repos.worktrees import RepoError, case_repo, checkout
from tasks.trace import SampleTrace
from tasks.trajectory import Action, Steps, call_text, matches, transcript


def _steps(trace: SampleTrace) -> Steps | None:
    return trace.trajectory.typed if trace.trajectory is not None else None


NO_TRAJECTORY = "no trajectory recorded for this sample: the agent reported no model turns or tool calls"


def _fits(expected: ExpectedCall, action: Action) -> bool:
    return action.name == expected.name and (
        expected.args is None or matches(expected.args, action.call.arguments, exact=expected.exact))


def _named(expected: ExpectedCall) -> str:
    return expected.name if expected.args is None else call_text(expected.name, expected.args)


def _made(actions: Sequence[Action], limit: int = 8) -> str:
    names = [call_text(a.name, a.call.arguments) for a in actions[:limit]]
    more = f" and {len(actions) - limit} more" if len(actions) > limit else ""
    return (", ".join(names) + more) if names else "no tool calls"


@grader("tool_called", params=ToolCalledParams, trace=SampleTrace, inline=True)
def tool_called(output: str, case: EvalCase, params: ToolCalledParams, *, trace: SampleTrace) -> Verdict:
    steps = _steps(trace)
    if steps is None:
        return Verdict.fail(Status.error, NO_TRAJECTORY)
    actions, want = steps.actions(), params.call
    count = sum(_fits(want, a) for a in actions)
    low = params.min if params.min is not None else (0 if params.max == 0 else 1)
    if params.max == 0:
        return (Verdict.ok(f"never called {_named(want)}") if count == 0
                else Verdict.fail(detail=f"called {_named(want)} {count} time(s), which it must never do"))
    if count < low:
        return Verdict.fail(detail=f"called {_named(want)} {count} time(s), at least {low} expected;"
                                   f" made: {_made(actions)}")
    if params.max is not None and count > params.max:
        return Verdict.fail(detail=f"called {_named(want)} {count} time(s), at most {params.max} allowed")
    return Verdict.ok(f"called {_named(want)} {count} time(s)")


@grader("tool_sequence", params=ToolSequenceParams, trace=SampleTrace, inline=True)
def tool_sequence(output: str, case: EvalCase, params: ToolSequenceParams, *, trace: SampleTrace) -> Verdict:
    steps = _steps(trace)
    if steps is None:
        return Verdict.fail(Status.error, NO_TRAJECTORY)
    made, want = steps.actions(), params.calls
    wanted = ", ".join(map(_named, want))
    if params.mode == "strict":
        ok = len(made) == len(want) and all(_fits(w, a) for w, a in zip(want, made, strict=True))
        why = f"expected exactly, in order: {wanted}"
    elif params.mode == "unordered":
        ok = len(made) == len(want) and _pairs_all(want, made)
        why = f"expected exactly these, in any order: {wanted}"
    elif params.mode == "subset":
        stray = [a for a in made if not any(_fits(w, a) for w in want)]
        ok = not stray
        why = f"called {_made(stray)}, which is not among {wanted}"
    else:  # superset
        missing = [w for w in want if not any(_fits(w, a) for a in made)]
        ok = not missing
        why = f"never called {', '.join(map(_named, missing))}"
    if ok:
        return Verdict.ok(f"{params.mode}: {_made(made)}")
    return Verdict.fail(detail=f"{params.mode}: {why}; made: {_made(made)}")


def _pairs_all(want: Sequence[ExpectedCall], made: Sequence[Action]) -> bool:
    """Whether each expected call can be paired with its own made call (a matching in the
    bipartite graph of fits; Kuhn's augmenting paths: a greedy pairing can miss one)."""
    owner: dict[int, int] = {}

    def place(w: int, seen: set[int]) -> bool:
        for m, action in enumerate(made):
            if m not in seen and _fits(want[w], action):
                seen.add(m)
                if m not in owner or place(owner[m], seen):
                    owner[m] = w
                    return True
        return False

    return all(place(w, set()) for w in range(len(want)))


@grader("steps", params=StepsParams, trace=SampleTrace, inline=True)
def steps_grader(output: str, case: EvalCase, params: StepsParams, *, trace: SampleTrace) -> Verdict:
    steps = _steps(trace)
    if steps is None:
        return Verdict.fail(Status.error, NO_TRAJECTORY)
    figures = {"turns": len(steps.turns), "tool_calls": steps.tool_calls, "tokens": steps.tokens}
    broken = []
    for what, value in figures.items():
        low, high = getattr(params, f"min_{what}"), getattr(params, f"max_{what}")
        if low is None and high is None:
            continue
        if value is None:
            return Verdict.fail(Status.error, f"the trajectory does not say its {what.replace('_', ' ')}")
        if high is not None and value > high:
            broken.append(f"{value} {what.replace('_', ' ')}, at most {high} allowed")
        if low is not None and value < low:
            broken.append(f"{value} {what.replace('_', ' ')}, at least {low} expected")
    said = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in figures.items() if v is not None)
    if trace.trajectory is not None and trace.trajectory.stop:
        said += f" (stopped: {trace.trajectory.stop})"
    return Verdict.fail(detail="; ".join(broken) + f" ({said})") if broken else Verdict.ok(said)


@grader("final_state", params=FinalStateParams, trace=SampleTrace, inline=True)
def final_state(output: str, case: EvalCase, params: FinalStateParams, *, trace: SampleTrace) -> Verdict:
    files = _files_broken(output, case, params.files) if params.files else []
    if isinstance(files, Verdict):
        return files
    if not params.world:
        return Verdict.fail(detail="; ".join(files)) if files else Verdict.ok(
            f"{len(params.files)} file assertion(s) hold after the change")
    steps = _steps(trace)
    if steps is None:
        return Verdict.fail(Status.error, NO_TRAJECTORY)
    # What the world received: the calls it answered without an error.
    received = [a for a in steps.actions() if a.result is not None and a.result.error is None]
    broken = list(files)
    for want in params.world:
        count = sum(_fits(want, a) for a in received)
        if want.count == 0 and count:
            broken.append(f"the world received {_named(want)} {count} time(s), which it must not")
        elif count < want.count:
            broken.append(f"the world never received {_named(want)}" if not count else
                          f"the world received {_named(want)} {count} time(s), {want.count} expected")
    if broken:
        return Verdict.fail(detail="; ".join(broken) + f"; it received: {_made(received)}")
    return Verdict.ok(f"the world received {_made(received)}")


def trajectory_fingerprint(judge_fingerprint: str) -> str:
    """What a trajectory judge's verdicts and calibration are recorded under: its judge's
    fingerprint, set apart from that judge over outputs alone (another instrument, whose
    calibration says nothing about this one)."""
    return sha256_hex(canonical_json({"trajectory_judge": judge_fingerprint}))


@grader("trajectory_judge", params=JudgeParams, oracle=False,
        fingerprint=lambda case: trajectory_fingerprint(case_judge(case).fingerprint), trace=SampleTrace)
def trajectory_judge(output: str, case: EvalCase, params: JudgeParams, *, trace: SampleTrace) -> Verdict:
    """A judge (`judge`'s function, rubric and samples) over what the agent did: each turn,
    call and result, then its answer, fenced in the judge's prompt as any output is."""
    if trace.trajectory is None:
        return Verdict.fail(Status.error, NO_TRAJECTORY)
    verdict = judge(transcript(trace.trajectory.entries, output), case, params, trace=trace)
    if trace.judge is not None:
        trace.judge = trace.judge.model_copy(update={"fingerprint": trajectory_fingerprint(trace.judge.fingerprint)})
    return verdict


def _files_broken(output: str, case: EvalCase, files: list[FileAssertion]) -> list[str] | Verdict:
    """What is wrong with the files after the change (the deciding `repo_tests` grader's
    repository at its base commit, the output applied as a patch); a `Verdict` when they
    cannot be had."""
    decided = case.deciding_grader
    if decided.get("kind") != "repo_tests":
        return Verdict.fail(Status.error, "final_state files: the case is not a repo_tests case (no repository"
                                          " and base commit to apply the change to)")
    repo = case_repo(case, decided["repo"])
    try:
        with checkout(repo, decided["base_commit"]) as tree:
            applied = apply_patch(tree, output)
            if output.strip() and not applied.applied:
                return Verdict.fail(Status.not_applied, applied.detail)
            return [problem for f in files if (problem := _file_problem(tree, f))]
    except RepoError as exc:
        return Verdict.fail(Status.error, f"final_state files: checkout failed: {exc}")


def _file_problem(tree: Path, want: FileAssertion) -> str | None:
    path = tree / want.path
    there = path.is_file() and tree.resolve() in path.resolve().parents
    if want.exists is not None and there != want.exists:
        return f"{want.path} {'does not exist' if want.exists else 'exists'}"
    if want.contains is None and want.equals is None:
        return None
    if not there:
        return f"{want.path} does not exist"
    text = path.read_text(encoding="utf-8", errors="replace")
    if want.contains is not None and want.contains not in text:
        return f"{want.path} does not contain {want.contains!r}"
    if want.equals is not None and text != want.equals:
        return f"{want.path} is not as expected ({len(text)} characters)"
    return None
