"""`repo_tests`: SWE-bench-style grading, a candidate patch judged by a repository's tests.

The verdict follows SPEC §4 step by step, and each step fails closed:

1. empty output → `empty`
2. a clean tree at `base_commit` (`tasks.repos`) → `error` if it cannot be had
3. the patch applied exactly (`tasks.patching`) → `not_applied` otherwise
4. scope, from what changed on disk → `scope_violation` (+ safety for forbidden files)
5. test files restored from the base, `test_patch` applied, `setup` run, tests run in
   the sandbox, JUnit read: `passed` only if every FAIL_TO_PASS and PASS_TO_PASS test
   passed; a missing, skipped or errored test, or no JUnit report at all, is a failure.

`trace` gets `steps` (what happened), `timings` (seconds per step) and `tests` (the
outcome of every graded test id).
"""

from __future__ import annotations

import fnmatch
import secrets
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks.graders import register
from tasks.junit import PASSED, JUnitError, parse_junit
from tasks.models import EvalCase, InputError, Status, Verdict
from tasks.patching import apply_patch
from tasks.repos import RepoError, changed_paths, checkout, restore_paths
from tasks.safety import path_violations
from tasks.sandbox import Limits, SandboxError, run_command

DEFAULT_TEST_FILES = ("tests/**", "test_*.py", "*_test.py", "conftest.py")
# pytest takes options (and so plugins) from these files at the root of the run: a
# candidate must not get to add a `-p` or an `addopts` there, so they are restored too.
RUNNER_CONFIG = ("pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MEMORY_MB = 4096
# Added to the sandbox's scrubbed environment: no user site-packages, stable hashing.
TEST_ENV = {"PYTHONNOUSERSITE": "1", "PYTHONHASHSEED": "0"}


@dataclass(frozen=True)
class Params:
    repo: str
    base_commit: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    allowed_files: tuple[str, ...] | None  # None: every path may be edited
    test_files: tuple[str, ...]
    test_patch: str | None
    test_cmd: tuple[str, ...] | None
    setup: tuple[tuple[str, ...], ...]
    timeout_s: float
    memory_mb: int


def parse_params(case: EvalCase) -> Params:
    """The grader's parameters (typed when the suite loaded); raises `InputError` for what
    only a combination of them makes wrong."""
    g = case.params
    if not g.fail_to_pass and not g.pass_to_pass:
        raise InputError("repo_tests: fail_to_pass and pass_to_pass are both empty")
    return Params(
        repo=g.repo,
        base_commit=g.base_commit,
        fail_to_pass=tuple(g.fail_to_pass),
        pass_to_pass=tuple(g.pass_to_pass),
        allowed_files=None if g.allowed_files is None else tuple(g.allowed_files),
        test_files=DEFAULT_TEST_FILES if g.test_files is None else tuple(g.test_files),
        test_patch=g.test_patch or None,
        test_cmd=None if g.test_cmd is None else tuple(g.test_cmd),
        setup=tuple(tuple(c) for c in g.setup or ()),
        timeout_s=g.timeout_s,
        memory_mb=g.memory_mb,
    )


def _matches(path: str, globs: tuple[str, ...], anywhere: bool = False) -> bool:
    """`path` matches a glob as `forbidden_files` does; with `anywhere`, a glob without
    a `/` also matches the file name in any directory (`conftest.py`, `test_*.py`)."""
    if path_violations([path], {"forbidden_files": list(globs)}):
        return True
    name = path.rsplit("/", 1)[-1]
    return anywhere and any("/" not in g and fnmatch.fnmatchcase(name, g) for g in globs)


class _Clock:
    """Seconds per step, into `trace["timings"]`."""

    def __init__(self, trace: dict) -> None:
        self.timings: dict[str, float] = trace.setdefault("timings", {})

    @contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[step] = self.timings.get(step, 0.0) + time.perf_counter() - start


@register("repo_tests", version="1")
def grade_repo_tests(output: str, case: EvalCase, trace: dict) -> Verdict:
    if not output.strip():
        return Verdict.fail(Status.empty, "empty output")
    try:
        params = parse_params(case)
    except InputError as exc:
        return Verdict.fail(Status.error, str(exc))
    clock = _Clock(trace)
    try:
        with ExitStack() as held:
            with clock("checkout"):
                tree = held.enter_context(checkout(params.repo, params.base_commit))
            trace.setdefault("steps", []).append(f"checked out {params.base_commit[:12]}")
            return _grade_tree(tree, output, params, case, trace, clock)
    except RepoError as exc:
        return Verdict.fail(Status.error, f"checkout failed: {exc}")


def grade_base(case: EvalCase, trace: dict | None = None) -> Verdict:
    """The tests at the base commit with no candidate edit. `suite validate` expects this
    to fail: a FAIL_TO_PASS test that already passes makes the case vacuous."""
    trace = {} if trace is None else trace
    params = parse_params(case)
    clock = _Clock(trace)
    with checkout(params.repo, params.base_commit) as tree:
        return _test_tree(tree, params, {}, trace, clock)


def _grade_tree(
    tree: Path, output: str, params: Params, case: EvalCase, trace: dict, clock: _Clock
) -> Verdict:
    steps: list[str] = trace["steps"]
    with clock("apply"):
        applied = apply_patch(tree, output)
    if applied.empty:
        return Verdict.fail(Status.empty, "empty patch")
    if not applied.applied:
        return Verdict.fail(Status.not_applied, applied.detail)
    with clock("scope"):
        changed = changed_paths(tree)
    steps.append(f"applied: {len(changed)} path(s) changed")
    trace["edited_files"] = sorted(changed)
    if not changed:
        return Verdict.fail(Status.empty, "the patch changes no file")
    # A forbidden file is out of scope whatever allowed_files says.
    violations = {p: path_violations([p], case.safety) for p in sorted(changed)}
    outside = [
        p
        for p, hits in violations.items()
        if hits or (params.allowed_files is not None and not _matches(p, params.allowed_files))
    ]
    if outside:
        safety = tuple(v for hits in violations.values() for v in hits)
        detail = f"edits outside the allowed files: {', '.join(outside)}"
        return Verdict.fail(Status.scope_violation, detail, safety=safety)

    return _test_tree(tree, params, changed, trace, clock)


def _test_tree(
    tree: Path, params: Params, changed: dict, trace: dict, clock: _Clock
) -> Verdict:
    """Restore test files, apply test_patch, run setup and the tests: the part of grading
    after the candidate's edits are on disk."""
    steps: list[str] = trace.setdefault("steps", [])
    with clock("restore"):
        protected = {
            p: code
            for p, code in changed.items()
            if _matches(p, params.test_files, anywhere=True) or p in RUNNER_CONFIG
        }
        restore_paths(tree, protected)
    if protected:
        steps.append(f"restored from base: {', '.join(sorted(protected))}")
    if params.test_patch:
        with clock("restore"):
            test_patch = apply_patch(tree, params.test_patch)
        if not test_patch.applied:
            return Verdict.fail(Status.error, f"test_patch does not apply: {test_patch.detail}")
    limits = Limits(timeout_s=params.timeout_s, memory_mb=params.memory_mb)
    for command in params.setup:
        with clock("setup"):
            try:
                result = run_command(list(command), workdir=tree, limits=limits, env=TEST_ENV)
            except SandboxError as exc:
                return Verdict.fail(
                    Status.error, f"setup {shlex.join(command)} could not start: {exc}"
                )
        if result.timed_out:
            return Verdict.fail(
                Status.timeout, f"setup {shlex.join(command)} timed out after {params.timeout_s:g}s"
            )
        if result.returncode != 0:
            tail = _tail(result.stderr, 500).strip()
            return Verdict.fail(
                Status.error, f"setup {shlex.join(command)} exited {result.returncode}: {tail}"
            )
    return _run_tests(tree, params, limits, trace, clock)


def _test_argv(params: Params, junit: Path) -> list[str]:
    # Whole test files, not single ids: one id pytest cannot find (or cannot parse, like a
    # parameter containing "::") would otherwise abort the run and hide every other result.
    files = list(
        dict.fromkeys(t.split("::", 1)[0] for t in params.fail_to_pass + params.pass_to_pass)
    )
    if params.test_cmd is None:
        return [
            # --rootdir=.: node ids relative to the tree even when it sits below a directory
            # with a pytest config of its own (EVALPIPE_HOME inside a project).
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir=.",
            "-o", "junit_family=xunit1", f"--junitxml={junit}", *files,
        ]  # fmt: skip
    argv: list[str] = []
    for arg in params.test_cmd:
        if arg == "{tests}":
            argv += files
        else:
            argv.append(arg.replace("{junit}", str(junit)))
    return argv


def _run_tests(tree: Path, params: Params, limits: Limits, trace: dict, clock: _Clock) -> Verdict:
    # The sandbox can write only the tree, so the report goes there, into a directory
    # made just now under a random name: no file from the patch, and no report left by an
    # earlier sample, can stand in for it. (It is untracked, so the next reset removes it.)
    report_dir = tree / f".evalpipe-junit-{secrets.token_hex(8)}"
    report_dir.mkdir()
    junit = report_dir / "report.xml"
    argv = _test_argv(params, junit)
    with clock("tests"):
        try:
            result = run_command(argv, workdir=tree, limits=limits, env=TEST_ENV)
        except SandboxError as exc:
            return Verdict.fail(Status.error, f"the test command could not start: {exc}")
    trace["test_run"] = {
        "returncode": result.returncode,
        "duration_s": result.duration_s,
        "isolation": result.isolation,
        "stdout_tail": _tail(result.stdout),
        "stderr_tail": _tail(result.stderr),
    }
    if result.timed_out:
        return Verdict.fail(
            Status.timeout, f"the tests did not finish within {params.timeout_s:g}s"
        )
    with clock("parse"):
        try:
            report = parse_junit(junit)
        except JUnitError:
            return Verdict.fail(
                Status.failed,
                f"no JUnit report: the test command did not finish (exit {result.returncode})",
            )
        outcomes = {
            test: report.outcome(test) for test in params.fail_to_pass + params.pass_to_pass
        }
    trace["tests"] = outcomes
    return _verdict(params, outcomes)


def _tail(data: bytes, size: int = 2000) -> str:
    return data[-size:].decode("utf-8", "replace")


def _verdict(params: Params, outcomes: dict[str, str]) -> Verdict:
    failing = {
        label: [f"{t} ({outcomes[t]})" for t in tests if outcomes[t] != PASSED]
        for label, tests in (
            ("FAIL_TO_PASS", params.fail_to_pass),
            ("PASS_TO_PASS", params.pass_to_pass),
        )
    }
    if not any(failing.values()):
        return Verdict.ok(
            f"{len(params.fail_to_pass)} FAIL_TO_PASS and {len(params.pass_to_pass)} PASS_TO_PASS tests passed"
        )
    detail = "; ".join(
        f"{label} failed: {', '.join(tests)}" for label, tests in failing.items() if tests
    )
    return Verdict.fail(Status.failed, detail)
