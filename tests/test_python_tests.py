"""python_tests: HumanEval canonical solutions pass, stubs fail, hostile programs are contained."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest
from support.sandbox_modes import bwrap_only

from tasks.graders import grade
from tasks.graders.python_tests import build_program
from tasks.models import EvalCase, Status
from tasks.sandbox import ForkServer, Limits
from tasks.suites.importers import humaneval_suite
from tasks.trace import SampleTrace

# Every test here runs under bubblewrap and in the fallback a run may allow.
pytestmark = pytest.mark.usefixtures("mode")

HOSTILE = Path(__file__).parent / "hostile"
ROOT = Path(__file__).resolve().parent.parent


def _case(timeout_s: float = 10.0, memory_mb: int = 2048) -> EvalCase:
    return EvalCase(
        id="hostile",
        inputs={"prompt": ""},
        grader={
            "kind": "python_tests",
            "entry_point": "f",
            "test": "def check(candidate):\n    assert candidate(1) == 2\n",
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
        },
    )


def _hostile(name: str, **fill: object) -> tuple[str, Status]:
    text = (HOSTILE / f"{name}.py.txt").read_text()
    expect = Status(text.splitlines()[0].removeprefix("# expect:").strip())
    for key, value in fill.items():
        text = text.replace("{" + key + "}", str(value))
    return text, expect


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry))
    return found


def _assert_harness_fine() -> None:
    # The grader still works afterwards: a correct program passes.
    assert grade("def f(x):\n    return x + 1\n", _case()).status is Status.passed


@pytest.fixture(scope="module")
def suite():
    return humaneval_suite()


def test_all_humaneval_canonical_solutions_pass(suite) -> None:
    verdicts = {case.id: grade(case.reference, case) for case in suite.cases}
    failing = {cid: v.detail for cid, v in verdicts.items() if not v.passed}
    assert len(verdicts) == 164
    assert failing == {}


def test_humaneval_bodies_replaced_by_pass_fail(suite) -> None:
    statuses = {case.id: grade("    pass\n", case).status for case in suite.cases}
    assert set(statuses.values()) == {Status.failed}


def test_empty_output_is_empty_not_run(suite) -> None:
    verdict = grade("  \n", suite.cases[0])
    assert verdict.status is Status.empty and not verdict.passed


def test_trace_records_what_protected_the_run(suite, mode: str) -> None:
    trace = SampleTrace()
    grade(suite.cases[0].reference, suite.cases[0], trace)
    assert trace.python_tests.completed is True
    assert trace.python_tests.isolation == mode


def test_printing_passed_does_not_forge_completion() -> None:
    program = "import os, sys\nprint('passed')\nsys.stdout.flush()\nos._exit(0)\n"
    assert grade(program, _case()).status is Status.failed


# Each hostile program: (name, what to fill into its template).
@pytest.mark.parametrize(
    "name",
    [
        "infinite_loop",
        "sys_exit_in_function",
        "os_exit_module",
        "systemexit_module",
        "deep_recursion",
        "big_allocation",
        "kill_parent",
    ],
)
def test_hostile_program_is_not_passed(name: str) -> None:
    program, expect = _hostile(name)
    # Short only where a timeout is expected (the program never ends, so any limit is reached):
    # a 10^5-deep recursion takes 2 s on a busy machine.
    verdict = grade(program, _case(timeout_s=1.0 if expect is Status.timeout else 10.0))
    assert (verdict.status, verdict.passed) == (expect, False), verdict.detail
    _assert_harness_fine()


def test_fork_storm_is_contained_and_leaves_nothing() -> None:
    program, expect = _hostile("fork_storm")
    assert grade(program, _case(timeout_s=1.0)).status is expect
    # On a dedicated server: after the storm only the server (and bubblewrap) remain.
    server = ForkServer(Limits())
    try:
        run = server.run(build_program(program, _case()), Limits(timeout_s=1.0))
        assert run.result.timed_out and not run.completed
        if server.cgroup is not None:
            assert int((server.cgroup.path / "pids.current").read_text()) <= 3
    finally:
        server.close()
    _assert_harness_fine()


def test_setsid_grandchild_does_not_linger() -> None:
    marker = f"evalpipe-linger-{uuid.uuid4().hex}"
    program, expect = _hostile("setsid_linger", marker=marker)
    verdict = grade(program, _case())
    assert verdict.status is expect
    assert _processes_with(marker) == []


def test_tcp_connect_to_the_host_is_refused(mode: str) -> None:
    bwrap_only(mode, "a network namespace")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        program, expect = _hostile("tcp_connect", port=listener.getsockname()[1])
        verdict = grade(program, _case())
        assert verdict.status is expect
        assert "ConnectionRefusedError" in verdict.detail
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_write_outside_the_work_dir_does_not_appear(tmp_path: Path, mode: str) -> None:
    bwrap_only(mode, "a read-only root")
    targets = [tmp_path / "escaped.txt", ROOT / f".escaped-{uuid.uuid4().hex}"]
    program, expect = _hostile("write_outside", paths=[str(p) for p in targets])
    verdict = grade(program, _case())
    assert verdict.status is expect
    assert [p for p in targets if p.exists()] == []


def test_fifty_megabytes_of_output_are_captured_and_capped() -> None:
    program, expect = _hostile("big_output")
    trace = SampleTrace()
    verdict = grade(program, _case(), trace)
    assert verdict.status is expect
    assert trace.python_tests.stdout_truncated is True
    assert set(trace.python_tests.stdout) == {"x"}


def test_non_utf8_stdout_is_kept_as_text() -> None:
    program, expect = _hostile("non_utf8_stdout")
    trace = SampleTrace()
    verdict = grade(program, _case(), trace)
    assert verdict.status is expect
    assert "not utf-8" in trace.python_tests.stdout
    assert "\ufffd" in trace.python_tests.stdout


def test_parent_environment_does_not_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVALPIPE_TEST_SECRET", "2")
    program, expect = _hostile("read_parent_env")
    verdict = grade(program, _case())
    assert verdict.status is expect
    assert "KeyError" in verdict.detail


def test_program_cannot_see_files_left_by_the_previous_one(mode: str) -> None:
    bwrap_only(mode, "a private /tmp (the fallback shares the machine's)")
    write = "open('/tmp/left-behind', 'w').write('x')\ndef f(x):\n    return x + 1\n"
    read = "import os\ndef f(x):\n    return x + 1 + os.path.exists('/tmp/left-behind')\n"
    assert grade(write, _case()).status is Status.passed
    assert grade(read, _case()).status is Status.passed


def test_bad_grader_parameters_are_errors() -> None:
    case = _case().model_copy(update={"grader": {**_case().grader, "timeout_s": -1}})
    assert grade("def f(x):\n    return 2\n", case).status is Status.error
