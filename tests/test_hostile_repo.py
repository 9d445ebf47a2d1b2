"""`repo_tests` against hostile candidates, round two: each test is an exploit that got a
false pass, hung the harness or filled the disk before, on repositories built here."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import git
import pytest
from support.git_repos import commit

from tasks.graders.repo_tests import grade_repo_tests
from tasks.models import EvalCase
from tasks.repos.worktrees import RepoError, checkout, run_git
from tasks.sandbox import bwrap_available
from tasks.trace import SampleTrace

CALC = "def add(a, b):\n    return abs(a) + b\n"
FIX = "calc.py\n<<<<<<< SEARCH\n    return abs(a) + b\n=======\n    return a + b\n>>>>>>> REPLACE\n"
TESTS = (
    "from calc import add\n\n\n"
    "def test_positive():\n    assert add(2, 3) == 5\n\n\n"
    "def test_negative():\n    assert add(-2, 3) == 1\n"
)
TEST_FILE = "pkg/tests/test_calc.py"
FORCE_PASS = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
# What a stand-in for pytest writes: both tests passed, in the report it was asked for.
FAKE_REPORT = f"""import sys
path = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml=")][0]
with open(path, "w") as fh:
    fh.write('<testsuite tests="2">'
             '<testcase classname="pkg.tests.test_calc" name="test_positive" file="{TEST_FILE}"/>'
             '<testcase classname="pkg.tests.test_calc" name="test_negative" file="{TEST_FILE}"/>'
             '</testsuite>')
import os
os._exit(0)
"""


def block(path: str, search: str, replace: str) -> str:
    return f"{path}\n<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n"


def added(path: str, text: str) -> str:
    return block(path, "", text)


def at_import(code: str) -> str:
    """A patch that fixes `add` and runs `code` when the tests import calc.py."""
    return block("calc.py", "    return abs(a) + b\n", f"    return a + b\n\n\n{code}")


@pytest.fixture(scope="module")
def nested(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The calc bug with its tests two levels down, in `pkg/tests/`."""
    root = tmp_path_factory.mktemp("nested") / "repo"
    repo = git.Repo.init(root, initial_branch="main")
    files = {"calc.py": CALC, "pkg/__init__.py": "", "pkg/tests/__init__.py": "", TEST_FILE: TESTS}
    return root, commit(repo, files, "base")


def case_for(repo: tuple[Path, str], **grader: object) -> EvalCase:
    root, sha = repo
    spec = {
        "kind": "repo_tests",
        "repo": str(root),
        "base_commit": sha,
        "fail_to_pass": [f"{TEST_FILE}::test_negative"],
        "pass_to_pass": [f"{TEST_FILE}::test_positive"],
        **grader,
    }
    return EvalCase(
        id="hostile", inputs={}, grader={k: v for k, v in spec.items() if v is not None}
    )


def _grade_into(queue, output: str, case: EvalCase) -> None:
    trace = SampleTrace()
    verdict = grade_repo_tests(output, case, case.params, trace=trace)
    queue.put((verdict.status.value, verdict.detail, (trace.repo_tests and trace.repo_tests.steps) or []))


def bounded(target, args: tuple, timeout: float, what: str):
    """`target(queue, *args)` in a child process, and what it put on the queue: a harness
    that hangs fails the test instead of hanging it."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=target, args=(queue, *args))
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"{what} hung (> {timeout:g}s)")
    return queue.get(timeout=10)


def bounded_grade(output: str, case: EvalCase, timeout: float = 120) -> tuple[str, str, list]:
    return bounded(_grade_into, (output, case), timeout, "grading")


# ---------------------------------------------------------------- class 1: false passes


PLUGIN = added("force_pass.py", FORCE_PASS)


@pytest.mark.parametrize(
    "exploit",
    [
        added("pkg/tests/pytest.ini", "[pytest]\naddopts = -p force_pass\n") + PLUGIN,
        added("pkg/tests/.pytest.ini", "[pytest]\naddopts = -p force_pass\n") + PLUGIN,
        added("pkg/tox.ini", "[pytest]\naddopts = -p force_pass\n") + PLUGIN,
        added("pkg/setup.cfg", "[tool:pytest]\naddopts = -p force_pass\n") + PLUGIN,
        added("pkg/tests/pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-p force_pass"\n')
        + PLUGIN,
        added("pkg/tests/conftest.py", FORCE_PASS),
        added("pkg/conftest.py", "pytest_plugins = ['force_pass']\n") + PLUGIN,
        # An entry point pytest would load from the tree's own metadata.
        added("evil-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
        + added("evil-1.0.dist-info/entry_points.txt", "[pytest11]\nevil = force_pass\n")
        + PLUGIN,
        # Stand-ins for pytest itself, found first on sys.path when the tree is.
        added("pytest.py", FAKE_REPORT),
        added("_pytest/__init__.py", FAKE_REPORT),
    ],
    ids=[
        "nested-pytest.ini", "nested-.pytest.ini", "nested-tox.ini", "nested-setup.cfg",
        "nested-pyproject", "nested-conftest", "conftest-pytest_plugins", "dist-info-entry-point",
        "pytest.py-shadow", "_pytest-shadow",
    ],
)  # fmt: skip
def test_the_candidate_cannot_change_how_pytest_starts(
    nested: tuple[Path, str], home: Path, exploit: str
) -> None:
    # test_files without conftest.py: runner files are restored whatever test_files says.
    case = case_for(nested, test_files=["pkg/tests/test_*.py"])
    status, detail, steps = bounded_grade(exploit, case)
    assert status == "failed", detail
    assert detail == f"FAIL_TO_PASS failed: {TEST_FILE}::test_negative (failed)"
    # ... while the honest fix passes on the same case.
    assert bounded_grade(FIX, case)[0] == "passed"


# ---------------------------------------------------------------- class 2: the report


REPORT_TO_FIFO = """import atexit, os, sys

def _swap():
    path = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml=")][0]
    os.unlink(path)
    os.mkfifo(path)

atexit.register(_swap)
"""
REPORT_TO_LINK = REPORT_TO_FIFO.replace("os.mkfifo(path)", "os.symlink('/dev/zero', path)")


@pytest.mark.parametrize("swap", [REPORT_TO_FIFO, REPORT_TO_LINK], ids=["fifo", "symlink"])
def test_a_report_swapped_for_a_special_file_is_no_report(
    nested: tuple[Path, str], home: Path, swap: str
) -> None:
    status, detail, _ = bounded_grade(at_import(swap), case_for(nested), timeout=60)
    assert status == "failed"
    assert detail.startswith("no JUnit report")


# ---------------------------------------------------------------- class 3: pooled trees


TRAP_THE_TREE = """import os

for name in (".git", "calc.py", ".gitattributes", "pkg/.gitignore"):
    try:
        os.unlink(name)
    except OSError:
        pass
    os.mkfifo(name)
"""


def test_a_run_that_plants_fifos_does_not_hang_the_next_sample(
    nested: tuple[Path, str], home: Path
) -> None:
    case = case_for(nested)
    bounded_grade(at_import(TRAP_THE_TREE), case, timeout=60)
    # The same pooled slot serves the next samples, which start from a clean base.
    assert bounded_grade(FIX, case, timeout=60)[0] == "passed"
    status, detail, _ = bounded_grade(FIX.replace("a + b", "a + b + 0"), case, timeout=60)
    assert status == "passed", detail


def _plant_fifo(tree: Path, name: str) -> None:
    (tree / name).unlink(missing_ok=True)
    os.mkfifo(tree / name)


def _symlink_git(tree: Path, _name: str) -> None:
    # A .git pointing at a gitdir the candidate wrote, whose config runs a command.
    (tree / ".git").unlink()
    evil = tree / "evil.git"
    git.Repo.init(evil, bare=True)
    with (evil / "config").open("a") as fh:
        fh.write(f"[core]\n\tfsmonitor = touch {tree.parent / 'pwned'}\n")
    (tree / ".git").symlink_to(evil)


def _unreadable_dir(tree: Path, name: str) -> None:
    (tree / name).mkdir()
    (tree / name / "x").write_text("x")
    (tree / name).chmod(0)


def _reuse(queue, src: str, sha: str, home: str) -> None:
    with checkout(src, sha, Path(home)) as tree:
        files = sorted(
            str(p.relative_to(tree))
            for p in tree.rglob("*")
            if p.relative_to(tree).parts[0] != ".git"
        )
        queue.put((str(tree), files, git.Repo(tree).head.commit.hexsha))


@pytest.mark.parametrize(
    ("trap", "name"),
    [
        (_plant_fifo, ".git"),
        (_plant_fifo, ".gitattributes"),
        (_plant_fifo, "pkg/.gitignore"),
        (_plant_fifo, "calc.py"),
        (_symlink_git, ".git"),
        (_unreadable_dir, "locked"),
    ],
    ids=["git-fifo", "gitattributes-fifo", "gitignore-fifo", "file-fifo", "git-symlink", "locked"],
)
def test_a_trapped_pooled_tree_is_rebuilt_without_blocking(
    nested: tuple[Path, str], home: Path, trap, name: str
) -> None:
    root, sha = nested
    with checkout(str(root), sha, home) as tree:
        trap(tree, name)
    again, files, head = bounded(_reuse, (str(root), sha, str(home)), 60, "resetting the tree")
    assert Path(again) == tree and head == sha
    assert files == ["calc.py", "pkg", "pkg/__init__.py", "pkg/tests", "pkg/tests/__init__.py",
                     TEST_FILE]  # fmt: skip
    assert not (tree.parent / "pwned").exists()


@pytest.mark.parametrize("attributes", [".gitattributes", "pkg/.gitattributes"])
def test_attributes_a_sample_left_never_shape_the_next_checkout(
    nested: tuple[Path, str], home: Path, attributes: str
) -> None:
    """(#45 item 2) The slot was checked out (`--force`) before it was cleaned: a candidate's
    untracked `.gitattributes` still applied, and the next sample got calc.py in UTF-16."""
    root, sha = nested
    with checkout(str(root), sha, home) as tree:
        (tree / attributes).write_text("*.py working-tree-encoding=UTF-16LE\n")
        for name in ("calc.py", TEST_FILE):  # what the sample changed: rewritten at the reset
            (tree / name).write_text("# changed\n")
    with checkout(str(root), sha, home) as again:
        assert again == tree
        assert (tree / "calc.py").read_bytes() == CALC.encode()
        assert (tree / TEST_FILE).read_bytes() == TESTS.encode()
        assert not (tree / attributes).exists()


def test_git_on_a_tree_is_bounded_in_time(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(RepoError, match="did not complete in 1 secs"):
        run_git(tmp_path, "hash-object", "fifo", timeout=1)


# ---------------------------------------------------------------- class 4: disk


WRITE_MB = """import os

for i in range({files}):
    with open(f"big-{{i}}.bin", "wb") as fh:
        for _ in range({mb}):
            fh.write(b"0" * (1 << 20))
"""

needs_bwrap = pytest.mark.skipif(
    not bwrap_available(), reason="the disk cap is a tmpfs inside bubblewrap"
)


@needs_bwrap
def test_tests_that_write_past_disk_mb_fail_and_leave_nothing(
    nested: tuple[Path, str], home: Path
) -> None:
    case = case_for(nested, disk_mb=40)
    status, detail, _ = bounded_grade(at_import(WRITE_MB.format(files=3, mb=20)), case)
    assert status == "failed"
    assert detail.startswith("the tests filled the work tree: over disk_mb=40")
    assert not list(home.rglob("big-*.bin"))  # the writes never reached the real tree
    # Under the cap the same writes are fine.
    status, detail, _ = bounded_grade(at_import(WRITE_MB.format(files=1, mb=10)), case)
    assert status == "passed", detail


def test_setup_that_writes_past_disk_mb_is_an_error(nested: tuple[Path, str], home: Path) -> None:
    write = "python3 -c \"open('big.bin','wb').write(b'0' * (30 << 20))\""
    status, detail, _ = bounded_grade(FIX, case_for(nested, disk_mb=20, setup=[write]))
    assert status == "error" and detail.startswith("setup wrote 30 MB, over disk_mb=20")
    assert not list(home.rglob("big.bin"))
