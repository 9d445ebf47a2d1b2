"""`repo_tests`: SWE-bench-style grading, a candidate patch judged by a repository's tests.

The verdict follows docs/contract.md §4 step by step, and each step fails closed:

1. empty output → `empty`
2. a clean tree at `base_commit` (`tasks.repos.worktrees`) → `error` if it cannot be had
3. the patch applied exactly (`tasks.repos.patching`) → `not_applied` otherwise
4. scope, from what changed on disk → `scope_violation` (+ safety for forbidden files)
5. test files and runner files (what decides how pytest starts) restored from the base,
   `test_patch` applied, `setup` run, tests run in the sandbox on a disk-capped copy of
   the tree, JUnit read: `passed` only if every FAIL_TO_PASS and PASS_TO_PASS test
   passed; a missing, skipped or errored test, or no JUnit report at all, is a failure.

The trace gets a `repo_tests` section (`tasks.trace.RepoTestsTrace`): `timings` (seconds per
step), `steps` (what happened), `environment`, `edited_files`, `test_run` and `tests` (the
outcome of every graded test id).
"""

from __future__ import annotations

import fnmatch
import secrets
import shlex
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks.graders.junit import PASSED, JUnitError, Report, parse_junit
from tasks.graders.safety import path_violations
from tasks.models import EvalCase, InputError, Status, Verdict
from tasks.params import RepoTestsParams
from tasks.registry import grader
from tasks.repos.environments import (
    Environment,
    EnvironmentFailed,
    Runtime,
    runtime_for,
)
from tasks.repos.patching import apply_patch
from tasks.repos.worktrees import (
    RepoError,
    case_repo,
    changed_paths,
    checkout,
    discard,
    restore_paths,
    scan_tree,
)
from tasks.sandbox import Limits, SandboxError
from tasks.trace import ProcessRun, RepoTestsTrace, SampleTrace

DEFAULT_TEST_FILES = ("tests/**", "test_*.py", "*_test.py", "conftest.py")
# What decides how pytest starts (options, plugins, code run before any test), at any
# depth: pytest reads the config file nearest above the test files and every conftest.py
# on the way; `*.dist-info` entry points and `.pth`/`*customize.py` load code at start.
# The candidate's versions are never used: edits are undone, additions deleted.
RUNNER_FILES = (
    "conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
    "sitecustomize.py", "usercustomize.py", "*.pth",
)  # fmt: skip
RUNNER_DIRS = ("*.dist-info", "*.egg-info")
# A JUnit report larger than this is not read (a few MB covers the largest suites).
JUNIT_CAP_BYTES = 64 << 20
# pytest started so that nothing in the tree can be imported before pytest and its
# plugins are loaded (no `pytest.py`/`_pytest/` shadow, no entry point from a
# `*.dist-info` in the tree); the tree then goes first on sys.path, as `python -m
# pytest` would have put it.
PYTEST_BOOT = """\
import os, sys
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
import pytest
class EvalpipeTreeOnPath:
    @pytest.hookimpl(tryfirst=True)
    def pytest_load_initial_conftests(self):
        sys.path.insert(0, os.getcwd())
sys.exit(pytest.main(sys.argv[1:], plugins=[EvalpipeTreeOnPath()]))
"""
# Runs the test command in the sandbox, then hands back, on a file the harness opened
# (and the sandbox cannot replace), the free space left in the work tree and the JUnit
# report, if it is a regular file: a FIFO or a link there yields no report.
REPORT_WRAPPER = """\
"$@"
rc=$?
{{ stat -f -c '%a %S' . && if [ -f "$0" ] && [ ! -L "$0" ]; then cat -- "$0"; fi; }} > /proc/self/fd/{fd}
exit $rc
"""
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
    disk_mb: int
    environment: Environment | None = None  # None: the harness's interpreter, as before


def parse_params(case: EvalCase) -> Params:
    """The grader's parameters (typed when the suite loaded); raises `InputError` for what
    only a combination of them makes wrong."""
    g = case.params
    if not g.fail_to_pass and not g.pass_to_pass:
        raise InputError("repo_tests: fail_to_pass and pass_to_pass are both empty")
    return Params(
        repo=case_repo(case, g.repo),
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
        disk_mb=g.disk_mb,
        environment=g.environment,
    )


def _matches(path: str, globs: tuple[str, ...], anywhere: bool = False) -> bool:
    """`path` matches a glob as `forbidden_files` does; with `anywhere`, a glob without
    a `/` also matches the file name in any directory (`conftest.py`, `test_*.py`)."""
    if path_violations([path], {"forbidden_files": list(globs)}):
        return True
    name = path.rsplit("/", 1)[-1]
    return anywhere and any("/" not in g and fnmatch.fnmatchcase(name, g) for g in globs)


def is_test_file(path: str, globs: tuple[str, ...] = DEFAULT_TEST_FILES) -> bool:
    """Whether `path` is a test file under `globs` (the grader restores those from the base
    and leaves them to `test_patch`)."""
    return _matches(path, globs, anywhere=True)


def is_runner_file(path: str) -> bool:
    """Whether `path` could change how pytest starts (see `RUNNER_FILES`)."""
    *dirs, name = path.split("/")
    return any(fnmatch.fnmatchcase(name, g) for g in RUNNER_FILES) or any(
        fnmatch.fnmatchcase(d, g) for d in dirs for g in RUNNER_DIRS
    )


class _Clock:
    """Seconds per step, into `trace.timings`."""

    def __init__(self, trace: RepoTestsTrace) -> None:
        if trace.timings is None:
            trace.timings = {}
        self.timings = trace.timings

    @contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[step] = self.timings.get(step, 0.0) + time.perf_counter() - start


def _section(trace: SampleTrace) -> RepoTestsTrace:
    """The sample's `repo_tests` section, begun if it is not yet."""
    if trace.repo_tests is None:
        trace.repo_tests = RepoTestsTrace()
    return trace.repo_tests


def _steps(trace: RepoTestsTrace) -> list[str]:
    """`trace.steps`, begun if it is not yet."""
    if trace.steps is None:
        trace.steps = []
    return trace.steps


def report_of(case: EvalCase, patch: str | None) -> tuple[Verdict, Report | None]:
    """The tests of the case's test files run exactly as a sample's are: at the base
    commit with `patch` applied as a candidate's output would be (None: no edit, as
    `grade_base`), `test_patch` after. Returns the verdict and the whole JUnit report (every
    test of those files, not only the graded ids); None when no report was read (the patch
    did not apply, the environment or setup failed, the run timed out or crashed)."""
    trace, reports = RepoTestsTrace(), []
    params = parse_params(case)
    clock = _Clock(trace)
    try:
        with checkout(params.repo, params.base_commit) as tree:
            if patch is None:
                verdict = _test_tree(tree, params, {}, trace, clock, reports)
            else:
                verdict = _grade_tree(tree, patch, params, case, trace, clock, reports)
    except RepoError as exc:
        return Verdict.fail(Status.error, f"checkout failed: {exc}"), None
    return verdict, (reports[0] if reports else None)


def grade_base(case: EvalCase, trace: SampleTrace | None = None) -> Verdict:
    """The tests at the base commit with no candidate edit. `suite validate` expects this
    to fail: a FAIL_TO_PASS test that already passes makes the case vacuous."""
    own = _section(SampleTrace() if trace is None else trace)
    params = parse_params(case)
    clock = _Clock(own)
    with checkout(params.repo, params.base_commit) as tree:
        return _test_tree(tree, params, {}, own, clock)


@grader("repo_tests", params=RepoTestsParams, runs_code=True, baseline=grade_base, trace=SampleTrace)
def grade_repo_tests(output: str, case: EvalCase, typed: RepoTestsParams, *, trace: SampleTrace) -> Verdict:
    # `parse_params` completes the typed parameters with what resolves against the case.
    if not output.strip():
        return Verdict.fail(Status.empty, "empty output")
    try:
        params = parse_params(case)
    except InputError as exc:
        return Verdict.fail(Status.error, str(exc))
    own = _section(trace)
    clock = _Clock(own)
    try:
        with ExitStack() as held:
            with clock("checkout"):
                tree = held.enter_context(checkout(params.repo, params.base_commit))
            _steps(own).append(f"checked out {params.base_commit[:12]}")
            return _grade_tree(tree, output, params, case, own, clock)
    except RepoError as exc:
        return Verdict.fail(Status.error, f"checkout failed: {exc}")


def _grade_tree(
    tree: Path, output: str, params: Params, case: EvalCase, trace: RepoTestsTrace, clock: _Clock,
    reports: list[Report] | None = None,
) -> Verdict:
    steps = _steps(trace)
    with clock("apply"):
        applied = apply_patch(tree, output)
    if applied.empty:
        return Verdict.fail(Status.empty, "empty patch")
    if not applied.applied:
        return Verdict.fail(Status.not_applied, applied.detail)
    with clock("scope"):
        changed = changed_paths(tree)
    steps.append(f"applied: {len(changed)} path(s) changed")
    trace.edited_files = sorted(changed)
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

    return _test_tree(tree, params, changed, trace, clock, reports)


def _test_tree(tree: Path, params: Params, changed: dict, trace: RepoTestsTrace, clock: _Clock,
               reports: list[Report] | None = None) -> Verdict:
    """Restore test files, apply test_patch, run setup and the tests: the part of grading
    after the candidate's edits are on disk. The parsed report goes to `reports` too."""
    steps = _steps(trace)
    try:
        with clock("environment"):
            runtime = runtime_for(params.environment, params.repo, params.base_commit,
                                  needs_pytest=params.test_cmd is None, trace=trace)
    except EnvironmentFailed as exc:
        return Verdict.fail(Status.error, str(exc))
    with clock("restore"):
        protected = {
            p: code
            for p, code in changed.items()
            if _matches(p, params.test_files, anywhere=True) or is_runner_file(p)
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
    if params.setup:
        with clock("disk"):
            before = scan_tree(tree).bytes
    for command in params.setup:
        with clock("setup"):
            try:
                result = runtime.run(command, tree, limits, TEST_ENV)
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
    if params.setup:
        # setup writes the real tree (the tests need what it builds), so its writes are
        # measured after the fact rather than capped.
        with clock("disk"):
            grown = scan_tree(tree).bytes - before
        if grown > params.disk_mb << 20:
            discard(tree)
            return Verdict.fail(
                Status.error, f"setup wrote {grown >> 20} MB, over disk_mb={params.disk_mb}"
            )
    return _run_tests(tree, params, limits, trace, clock, runtime, reports)


def _test_argv(params: Params, junit: str, python: str) -> list[str]:
    # Whole test files, not single ids: one id pytest cannot find (or cannot parse, like a
    # parameter containing "::") would otherwise abort the run and hide every other result.
    files = list(
        dict.fromkeys(t.split("::", 1)[0] for t in params.fail_to_pass + params.pass_to_pass)
    )
    if params.test_cmd is None:
        return [
            # --rootdir=.: node ids relative to the tree even when it sits below a directory
            # with a pytest config of its own (EVALPIPE_HOME inside a project).
            python, "-c", PYTEST_BOOT, "-q", "-p", "no:cacheprovider", "--rootdir=.",
            "-o", "junit_family=xunit1", f"--junitxml={junit}", *files,
        ]  # fmt: skip
    argv: list[str] = []
    for arg in params.test_cmd:
        if arg == "{tests}":
            argv += files
        else:
            argv.append(arg.replace("{junit}", junit))
    return argv


def _run_tests(
    tree: Path, params: Params, limits: Limits, trace: RepoTestsTrace, clock: _Clock, runtime: Runtime,
    reports: list[Report] | None = None,
) -> Verdict:
    # The report goes to a directory made just now under a random name (no file from the
    # patch, nor one left by an earlier sample, can stand in for it), in the sandbox's copy
    # of the tree; the wrapper hands it back on `out`, a file only the harness can name.
    report_dir = tree / f".evalpipe-junit-{secrets.token_hex(8)}"
    report_dir.mkdir()
    junit = runtime.path(report_dir / "report.xml", tree)  # as the sandbox sees it
    with clock("disk"):
        scratch_mb = (scan_tree(tree).bytes >> 20) + 1 + params.disk_mb
    with tempfile.TemporaryFile(prefix="evalpipe-junit-") as out, clock("tests"):
        wrapper = REPORT_WRAPPER.format(fd=out.fileno())
        argv = ["/bin/sh", "-c", wrapper, junit, *_test_argv(params, junit, runtime.python)]
        try:
            result = runtime.run(
                argv, tree, limits, TEST_ENV, scratch_mb=scratch_mb, pass_fds=(out.fileno(),)
            )
        except SandboxError as exc:
            return Verdict.fail(Status.error, f"the test command could not start: {exc}")
        out.seek(0)
        handed = out.read(JUNIT_CAP_BYTES + 1)
    trace.test_run = ProcessRun(
        returncode=result.returncode,
        duration_s=result.duration_s,
        isolation=result.isolation,
        stdout_tail=_tail(result.stdout),
        stderr_tail=_tail(result.stderr),
    )
    if result.timed_out:
        return Verdict.fail(
            Status.timeout, f"the tests did not finish within {params.timeout_s:g}s"
        )
    free, _, xml = handed.partition(b"\n")
    if result.isolation == "bwrap" and _free_bytes(free) < 1 << 20:
        return Verdict.fail(
            Status.failed,
            f"the tests filled the work tree: over disk_mb={params.disk_mb} (writes past it failed)",
        )
    if len(xml) > JUNIT_CAP_BYTES:
        return Verdict.fail(Status.failed, f"the JUnit report is over {JUNIT_CAP_BYTES >> 20} MB")
    with clock("parse"):
        try:
            report = parse_junit(xml)
        except JUnitError:
            return Verdict.fail(
                Status.failed,
                f"no JUnit report: the test command did not finish (exit {result.returncode})",
            )
        if reports is not None:
            reports.append(report)
        outcomes = {
            test: report.outcome(test) for test in params.fail_to_pass + params.pass_to_pass
        }
    trace.tests = outcomes
    return _verdict(params, outcomes)


def _free_bytes(line: bytes) -> int:
    """`stat -f -c '%a %S'` (free blocks, block size) as bytes; 0 if it is not that."""
    try:
        blocks, size = (int(v) for v in line.split())
    except ValueError:
        return 0
    return blocks * size


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
