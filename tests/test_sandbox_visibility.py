"""The sandbox shows candidate code only what it needs: the system's programs and libraries,
the runtimes and its own tree. Not home directories (SSH keys, cloud credentials), not
EVALPIPE_HOME (the database, every reference, other samples' outputs and trees), not other
projects on the machine, not /etc's password hashes. Checked against the real paths."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tasks.graders import grade
from tasks.models import EvalCase, Status
from tasks.sandbox import Limits, policy, run_command

pytestmark = pytest.mark.usefixtures("needs_bwrap")

PROBE = """
import json, os, sys
seen = {}
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as fh:
            seen[path] = fh.read(64).decode("latin-1")
    except OSError as exc:
        seen[path] = type(exc).__name__
print(json.dumps(seen))
"""


@pytest.fixture
def needs_bwrap():
    policy._bwrap_problem.cache_clear()
    if not policy.bwrap_available():
        pytest.skip("bubblewrap does not run here")


@pytest.fixture
def secrets(home: Path, tmp_path: Path):
    """Real files where a hostile program would look: the user's home directory, the
    database in EVALPIPE_HOME, a sibling project. Removed afterwards."""
    tag = uuid.uuid4().hex[:8]
    files = {
        "home": Path.home() / f".evalpipe-test-credentials-{tag}",
        "database": home / "evalpipe.duckdb",
        "other sample": home / "worktrees" / f"sample-{tag}" / "answer.txt",
        "other project": Path(__file__).resolve().parents[2] / f"evalpipe-test-other-{tag}" / "secret.txt",
    }
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"SECRET-{tag}")
    yield files, tag
    files["home"].unlink(missing_ok=True)
    files["other project"].unlink()
    files["other project"].parent.rmdir()


def test_a_command_sees_no_secret_of_the_host(secrets, tmp_path: Path) -> None:
    files, tag = secrets
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("mine")
    paths = [*map(str, files.values()), "/etc/shadow", "/etc/passwd", str(work / "mine.txt")]
    result = run_command(["python3", "-c", PROBE, *paths], workdir=work, limits=Limits(timeout_s=30))
    seen = json.loads(result.stdout)
    for name, path in files.items():
        assert f"SECRET-{tag}" not in seen[str(path)], name
    assert ":" not in seen["/etc/shadow"]  # no password hashes
    assert seen["/etc/passwd"].startswith("root:")  # the system's configuration is there
    assert seen[str(work / "mine.txt")] == "mine"  # and so is its own tree


def test_a_graded_program_sees_no_secret_of_the_host(secrets) -> None:
    files, tag = secrets
    paths = [str(p) for p in files.values()]
    test = ("def check(candidate):\n"
            f"    for path in {paths!r}:\n"
            "        try:\n"
            "            data = open(path).read()\n"
            "        except OSError:\n"
            "            continue\n"
            f"        assert 'SECRET-{tag}' not in data, path\n")
    case = EvalCase(id="peek", inputs={"prompt": "def f():\n"}, grader={
        "kind": "python_tests", "entry_point": "f", "test": test, "timeout_s": 10})
    verdict = grade("    return 1\n", case)
    assert verdict.status is Status.passed, verdict.detail
