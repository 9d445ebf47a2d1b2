"""Mining a repository's history into a suite (`evalpipe suite mine`, docs/mining.md): a real
repository built here holds a fix with its test, a commit whose only new test is flaky, one
whose tests already pass before the fix, and commits that are not candidates; what is kept,
and why the rest is dropped, is read from what the tests did in the sandbox."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import git
import pytest
import yaml
from support.cli import in_process
from support.git_repos import commit
from support.waiting import serve_in_background

from tasks.graders.derivation import classify, runnable_files
from tasks.graders.junit import Report
from tasks.graders.repo_tests import is_test_file
from tasks.graders.validation import check_case
from tasks.models import InputError
from tasks.repos.env_inference import assign_environments, infer_environment, load_environment_rules
from tasks.repos.issues import GitHubIssues, github_repo_of, issue_refs, issue_source, linked_text
from tasks.repos.mining import Candidate, mine_history
from tasks.repos.worktrees import mirror
from tasks.sandbox import bwrap_available
from tasks.suites.dataset import load_suite
from tasks.suites.importers import swebench_suite

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("build_pricing", ROOT / "examples/pricing/build_repo.py")
pricing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pricing)

# pytest from wheels in the repository: the environment builds offline.
OFFLINE = {"install": ["pip install --no-index --find-links vendor " + " ".join(pricing.PYTEST_DISTS)]}

CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a + b\n"
CALC_FIXED = CALC.replace("def sub(a, b):\n    return a + b", "def sub(a, b):\n    return a - b")
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
TESTS_SUB = "from calc import add, sub\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"
# A test that passes only when it runs before the polluting file's test: flaky with the fix,
# since the mine runs the files in one order, then the other.
POLLUTE = "import calc\n\n\ndef test_pollute():\n    calc.POLLUTED = True\n"
RESET = textwrap.dedent("""\
    import calc


    def test_reset():
        assert not getattr(calc, "POLLUTED", False)
        assert calc.reset() == "clean"
""")
NEGATIVE = TESTS_SUB + "\n\ndef test_add_negative():\n    assert add(-2, -3) == -5\n"


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The repository's path and its commits by name: root, fix, flaky, passing, code_only."""
    path = tmp_path_factory.mktemp("mined") / "calc"
    repo = git.Repo.init(path, initial_branch="main")
    wheels = dict(pricing.wheel_of_installed(d) for d in pricing.PYTEST_DISTS)
    for name, data in wheels.items():
        (path / "vendor").mkdir(exist_ok=True)
        (path / "vendor" / name).write_bytes(data)
    repo.index.add([f"vendor/{n}" for n in wheels])
    shas = {"path": str(path)}
    shas["root"] = commit(repo, {"calc.py": CALC, "tests/test_calc.py": TESTS, "README.md": "calc\n"}, "calc")
    shas["fix"] = commit(repo, {"calc.py": CALC_FIXED, "tests/test_calc.py": TESTS_SUB,
                                "CHANGES.md": "- sub subtracts\n"}, "Fix sub: it added (fixes #7)")
    shas["flaky"] = commit(repo, {"calc.py": CALC_FIXED + "\n\ndef reset():\n    return 'clean'\n",
                                  "tests/test_a_pollute.py": POLLUTE, "tests/test_reset.py": RESET}, "Add reset")
    shas["passing"] = commit(repo, {"calc.py": CALC_FIXED.replace("a + b", "b + a") + "\n\ndef reset():\n    return 'clean'\n",
                                    "tests/test_calc.py": NEGATIVE}, "Refactor add")
    shas["code_only"] = commit(repo, {"calc.py": "# calc\n" + (path / "calc.py").read_text()}, "Comment calc")
    return shas


@pytest.fixture(scope="module")
def mine_home(tmp_path_factory: pytest.TempPathFactory):
    """One EVALPIPE_HOME for the module: the environment is built once."""
    path = tmp_path_factory.mktemp("mine-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVALPIPE_HOME", str(path))
        yield path


def _mined(history: dict[str, str], home: Path, **options) -> tuple[list[Candidate], list]:
    return mine_history(mirror(history["path"], home), is_test=is_test_file, **options)


def test_the_history_splits_into_candidates(history, mine_home: Path) -> None:
    candidates, skipped = _mined(history, mine_home)
    assert [c.commit for c in candidates] == [history["passing"], history["flaky"], history["fix"]]
    assert {s.commit: s.reason for s in skipped} == {
        history["code_only"]: "changes no test file",
        history["root"]: "the root commit (no parent to start from)",
    }
    fix = candidates[-1]
    assert (fix.parent, fix.code_files, fix.test_files) == (history["root"], ("CHANGES.md", "calc.py"),
                                                            ("tests/test_calc.py",))
    assert "calc.py" in fix.patch and "CHANGES.md" in fix.patch and "tests/" not in fix.patch
    assert "+def test_sub" in fix.test_patch
    assert [ln for ln in fix.test_patch.splitlines() if ln.startswith("diff --git")] == [
        "diff --git a/tests/test_calc.py b/tests/test_calc.py"]
    assert fix.message == "Fix sub: it added (fixes #7)" and fix.issues == ("#7",)
    assert fix.provenance()["files"] == {"code": ["CHANGES.md", "calc.py"], "tests": ["tests/test_calc.py"]}
    assert runnable_files(candidates[1]) == ["tests/test_a_pollute.py", "tests/test_reset.py"]
    # The range and the cap: --since is left out, --max counts walked commits.
    since, _ = _mined(history, mine_home, since=history["fix"])
    assert [c.commit for c in since] == [history["passing"], history["flaky"]]
    capped, capped_skipped = _mined(history, mine_home, max_commits=2)
    assert [c.commit for c in capped] == [history["passing"]] and len(capped_skipped) == 1
    none, why = _mined(history, mine_home, code_paths=("src/*",))
    assert none == [] and {s.reason for s in why} >= {"changes no code file matching src/*"}


def test_a_history_of_huge_files_and_messages_is_mined_in_bounded_memory(tmp_path: Path, home: Path) -> None:
    """(#45 item 5) A fix adding a 200 MB text file took the mine to 1.5 GB: its diff and
    message were read whole. Now a file over the patch cap is not diffed, a diff or a message
    is read no further than its cap, and each such commit is skipped with the reason; the
    walk stays within 400 MB, measured on the process that mines and the git it runs."""
    from tasks.repos.mining import MAX_MESSAGE_BYTES, MAX_PATCH_BYTES

    path = tmp_path / "huge"
    repo = git.Repo.init(path, initial_branch="main")
    shas = {"root": commit(repo, {"calc.py": CALC, "tests/test_calc.py": TESTS}, "calc")}
    with (path / "data.py").open("w") as fh:
        for _ in range(200):
            fh.write("x = 1\n" * 174_762 + "###\n")  # 1 MiB
    repo.git.add("data.py")
    shas["big"] = commit(repo, {"tests/test_calc.py": TESTS + "\n"}, "add 200 MB of data")
    wide = {f"wide{i}.py": f"# {i}\n" + "y = 2\n" * (MAX_PATCH_BYTES // 6 // 3 + 1000) for i in range(3)}
    shas["wide"] = commit(repo, {**wide, "tests/test_calc.py": TESTS + "\n\n"}, "three files, each under the cap")
    shas["long"] = commit(repo, {"calc.py": CALC + "\n", "tests/test_calc.py": TESTS}, "m" * (MAX_MESSAGE_BYTES + 1))
    shas["fix"] = commit(repo, {"calc.py": CALC_FIXED, "tests/test_calc.py": TESTS_SUB}, "Fix sub")
    assert (path / "data.py").stat().st_size == 200 << 20
    mirror_path = mirror(str(path), home)
    walk = ("import json, sys; from pathlib import Path; from tasks.graders.repo_tests import is_test_file;"
            " from tasks.repos.mining import mine_history;"
            " kept, skipped = mine_history(Path(sys.argv[1]), is_test=is_test_file);"
            " print(json.dumps([[c.commit for c in kept], {s.commit: s.reason for s in skipped}]))")
    measure = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]);"
               " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss << 10, file=sys.stderr);"
               " sys.exit(done.returncode)")
    proc = subprocess.run([sys.executable, "-c", measure, sys.executable, "-c", walk, str(mirror_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    kept, skipped = json.loads(proc.stdout)
    peak = int(proc.stderr.strip().splitlines()[-1])
    assert kept == [shas["fix"]]
    assert skipped[shas["big"]] == (f"changes data.py (209,715,200 bytes), over the {MAX_PATCH_BYTES:,}-byte cap on a"
                                    " mined patch: not read")
    assert skipped[shas["wide"]] == f"its patch is over the {MAX_PATCH_BYTES:,}-byte cap on a mined patch"
    assert skipped[shas["long"]] == f"its message is over the {MAX_MESSAGE_BYTES:,}-byte cap"
    assert peak < 400 << 20, f"peak resident size {peak >> 20} MB"


def _report(outcomes: dict[str, str]) -> Report:
    return Report(outcomes=outcomes)


def test_classify_reads_each_test_across_the_runs() -> None:
    before = [_report({"t::f2p": "failed", "t::p2p": "passed", "t::flaky": "failed", "t::broken": "passed"}),
              _report({"t::f2p": "failed", "t::p2p": "passed", "t::flaky": "failed", "t::broken": "passed"})]
    after = [_report({"t::f2p": "passed", "t::p2p": "passed", "t::flaky": "passed", "t::broken": "error",
                      "t::new": "passed"}),
             _report({"t::f2p": "passed", "t::p2p": "passed", "t::flaky": "failed", "t::broken": "error",
                      "t::new": "passed"})]
    found = classify(before, after)
    assert found["kept"] and found["fail_to_pass"] == ("t::f2p", "t::new")  # not collected before: fails
    assert found["pass_to_pass"] == ("t::p2p",)
    assert found["dropped_tests"] == {"t::flaky": "flaky: failed, failed before the fix; passed, failed with it",
                                      "t::broken": "error with the fix"}
    uncollected = Report(outcomes={}, by_address={("", "tests.test_x"): "error"})
    assert classify([uncollected], [uncollected])["reason"] == (
        "no test ran, before the fix or with it: collecting tests.test_x failed")
    nothing = classify(before[:1], before[:1])
    assert not nothing["kept"] and nothing["reason"].startswith("no test fails before the fix")
    assert "2 pass before and after" in nothing["reason"]


def _write(root: Path, files: dict[str, str]) -> str:
    repo = git.Repo.init(root, initial_branch="main")
    commit(repo, {"README": "x\n"}, "root")
    return commit(repo, files, "layout")


def test_environments_are_inferred_from_the_commit(tmp_path: Path) -> None:
    pyproject = tmp_path / "src-layout"
    sha = _write(pyproject, {"pyproject.toml": '[project]\nname = "p"\nrequires-python = ">=3.8"\n'
                             '[project.optional-dependencies]\ntests = ["pytest>=7"]\ndocs = ["sphinx"]\n',
                             "src/p/__init__.py": ""})
    found = infer_environment(mirror(str(pyproject), tmp_path / "home"), sha)
    assert found.spec.install == ("pip install -e '.[tests]'", "pip install pytest")
    assert found.source == "pyproject.toml" and found.spec.python is None
    flat = tmp_path / "flat"
    sha = _write(flat, {"requirements/tests.txt": "pytest==8.0.0\n", "requirements/docs.txt": "sphinx\n",
                        "lib.py": ""})
    found = infer_environment(mirror(str(flat), tmp_path / "home"), sha)
    assert found.spec.install == ("pip install -r requirements/tests.txt", "pip install pytest")
    bare = tmp_path / "bare"
    sha = _write(bare, {"lib.py": ""})
    found = infer_environment(mirror(str(bare), tmp_path / "home"), sha)
    assert found.spec.install == ("pip install pytest",) and "pytest only" in found.source
    ancient = tmp_path / "ancient"
    sha = _write(ancient, {"setup.py": "setup(name='a', python_requires='<3.0')\n"})
    found = infer_environment(mirror(str(ancient), tmp_path / "home"), sha)
    assert found.spec is None and "requires-python <3.0" in found.source


def test_equal_environments_are_shared_and_the_users_win_by_date(history, mine_home: Path, tmp_path: Path) -> None:
    candidates, _ = _mined(history, mine_home)
    rows = [(c.commit, c.parent, c.date) for c in candidates]
    assigned = assign_environments(mirror(history["path"], mine_home), rows)
    # No package metadata at any commit: one inferred environment, built at the newest parent.
    assert len({a.fingerprint for a in assigned.values()}) == 1
    assert {a.environment["setup_commit"] for a in assigned.values()} == {candidates[0].parent}
    # As of the newest commit's date: uv resolves what was published by then.
    when = datetime.fromisoformat(candidates[0].date).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert {tuple(a.environment["install"]) for a in assigned.values()} == {
        (f"pip install --exclude-newer {when} pytest",)}
    rules_file = tmp_path / "envs.yaml"
    rules_file.write_text(yaml.safe_dump([{"until": "1999-12-31", "environment": {"install": ["pip install old"]}},
                                          {"since": "2000-01-01", "environment": OFFLINE}]))
    given = assign_environments(mirror(history["path"], mine_home), rows, load_environment_rules(rules_file))
    assert {a.source for a in given.values()} == {"given (--environment)"}
    assert {tuple(a.environment["install"]) for a in given.values()} == {tuple(OFFLINE["install"])}
    for text, where in (("[unclosed", "malformed YAML"), ("- {since: never, environment: {}}", "not a date"),
                        ("- {environment: {install: 3}}", "install")):
        rules_file.write_text(text)
        with pytest.raises(InputError, match=where):
            load_environment_rules(rules_file)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`evalpipe ARGS` in this process (support.cli.in_process); the mine killed below is a
    process of its own."""
    return in_process(list(args), {**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.mark.skipif(not bwrap_available(), reason="environments are built in bubblewrap")
def test_mine_keeps_the_fix_says_why_the_rest_is_dropped_and_resumes(
        history, mine_home: Path, tmp_path: Path, prefect_harness) -> None:
    envs = tmp_path / "env.yaml"
    envs.write_text(yaml.safe_dump(OFFLINE))
    suite = tmp_path / "mined.yaml"
    env = {"PREFECT_API_URL": prefect_harness, "EVALPIPE_HOME": str(mine_home)}
    args = ["suite", "mine", history["path"], "--out", str(suite), "--environment", str(envs), "--json"]
    # A mine killed (SIGKILL, no chance to tidy up) once its first candidate is done.
    killed = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not list((mine_home / "mining").glob("*.json")) and killed.poll() is None:
            time.sleep(0.05)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert not suite.exists()
    # Run again, it resumes: what was stored is not run again.
    mined = _cli(*args, env=env)
    assert mined.returncode == 0, mined.stderr
    report = json.loads(mined.stdout)
    assert (report["commits"], report["candidates"], report["kept"]) == (5, 3, 1)
    assert report["reused"] >= 1
    # The environment the killed mine built is reused, not built again.
    (environment,) = report["environments"]
    assert environment["candidates"] == 3 - report["reused"] and environment["built"] is False
    # Progress: one line per candidate run, counted on from those reused.
    assert len(re.findall(r"mine: \[\d/3\]", mined.stderr)) == 3 - report["reused"]
    assert report["skipped"] == {"changes no test file": 1, "the root commit": 1}
    dropped = {d["commit"]: d["reason"] for d in report["dropped"]}
    assert "1 flaky (tests/test_reset.py::test_reset)" in dropped[history["flaky"]]
    assert dropped[history["passing"]] == ("no test fails before the fix and passes with it every time:"
                                           " 3 pass before and after")
    (case,) = load_suite(suite).cases
    assert case.grader["fail_to_pass"] == ["tests/test_calc.py::test_sub"]
    assert case.grader["pass_to_pass"] == ["tests/test_calc.py::test_add"]
    assert case.grader["base_commit"] == history["root"] and case.inputs["problem_statement"].startswith("Fix sub")
    assert case.metadata["provenance"]["commit"] == history["fix"]
    assert case.metadata["provenance"]["issues"] == ["#7"]
    # The suite is sound: the reference resolves R/R, the tests at the base fail.
    assert check_case(case, 2).problem is None
    validated = _cli("suite", "validate", str(suite), "--reps", "2", "--json", env=env)
    assert validated.returncode == 0 and json.loads(validated.stdout)["valid"], validated.stdout + validated.stderr

    # Again: nothing is run, the same suite is written.
    again = _cli(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["reused"] == 3 and "mine: [" not in again.stderr
    assert load_suite(suite).version == report["version"]

    # And out again, as SWE-bench instances that import back to the same case.
    instances = tmp_path / "instances.jsonl"
    exported = _cli("suite", "export", str(suite), "--format", "swebench", "--out", str(instances), env=env)
    assert exported.returncode == 0, exported.stderr
    (instance,) = [json.loads(line) for line in instances.read_text().splitlines()]
    assert instance["FAIL_TO_PASS"] == case.grader["fail_to_pass"] and instance["patch"] == case.reference
    assert instance["environment_setup_commit"] == case.grader["environment"]["setup_commit"]
    (back,) = swebench_suite(instances, repo_root=Path(history["path"]).parent).cases
    assert {k: back.grader[k] for k in ("repo", "base_commit", "test_patch", "fail_to_pass", "pass_to_pass")} == {
        k: case.grader[k] for k in ("repo", "base_commit", "test_patch", "fail_to_pass", "pass_to_pass")}
    assert (back.id, back.reference) == (case.id, case.reference) and case.id == f"mined-{history['fix'][:12]}"


def test_bad_input_exits_2_with_one_line(history, tmp_path: Path, home: Path) -> None:
    env = {"EVALPIPE_HOME": str(home)}
    envs = tmp_path / "env.yaml"
    envs.write_text("install: 3\n")
    for args, where in (
        (["suite", "mine", str(tmp_path / "nowhere"), "--out", str(tmp_path / "s.yaml")], "no such repository"),
        (["suite", "mine", history["path"], "--out", str(tmp_path / "s.txt")], "unknown suite format"),
        (["suite", "mine", history["path"], "--out", str(tmp_path / "s.yaml"), "--environment", str(envs)], "install"),
        (["suite", "mine", history["path"], "--out", str(tmp_path / "s.yaml"), "--reps", "1"], "--reps"),
        (["suite", "mine", history["path"], "--out", str(tmp_path / "s.yaml"), "--issues", "github"],
         "give --github-repo"),
        (["suite", "mine", history["path"], "--out", str(tmp_path / "s.yaml"), "--issues", str(envs)], "line 1"),
        (["suite", "mine", history["path"], "--out", str(tmp_path / "s.yaml"), "--issues", "github",
          "--github-repo", "acme/calc", "--github-api", "ftp://x"], "--github-api"),
    ):
        done = _cli(*args, env=env)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and where in done.stderr, done.stderr
    assert not (tmp_path / "s.yaml").exists()
    qa = tmp_path / "qa.yaml"
    qa.write_text(yaml.safe_dump({"name": "qa", "cases": [{"id": "a", "reference": "x", "grader": {"kind": "exact"}}]}))
    done = _cli("suite", "export", str(qa), "--out", str(tmp_path / "i.jsonl"), env=env)
    assert done.returncode == 2 and "case a is graded by exact" in done.stderr
    done = _cli("suite", "export", str(qa), "--format", "inspect", "--out", str(tmp_path / "i.jsonl"), env=env)
    assert done.returncode == 2 and "--format" in done.stderr and not (tmp_path / "i.jsonl").exists()


def test_metadata_is_content_and_survives_a_snapshot(tmp_path: Path) -> None:
    from storage.store import Store
    from tasks.suites.dataset import build_suite

    raw = {"id": "m", "reference": "x", "grader": {"kind": "exact"}}
    plain = build_suite("s", [("1", raw)], {}, source="t")
    marked = build_suite("s", [("1", {**raw, "metadata": {"provenance": {"commit": "abc"}}})], {}, source="t")
    assert plain.version != marked.version and "metadata" not in plain.cases[0].content()
    store = Store(tmp_path)
    for suite in (plain, marked):
        back = store.snapshots.read(Path(store.snapshots.write(suite)).stem)
        assert back.version == suite.version and back.cases[0].metadata == suite.cases[0].metadata


@pytest.mark.skipif(not bwrap_available(), reason="environments are built in bubblewrap")
def test_an_environment_that_does_not_build_drops_its_candidates_with_the_reason(
        history, mine_home: Path, tmp_path: Path, prefect_harness) -> None:
    envs = tmp_path / "env.yaml"
    envs.write_text(yaml.safe_dump({"install": ["pip install --no-index --find-links vendor no-such-package"]}))
    suite = tmp_path / "none.yaml"
    env = {"PREFECT_API_URL": prefect_harness, "EVALPIPE_HOME": str(mine_home)}
    done = _cli("suite", "mine", history["path"], "--out", str(suite), "--environment", str(envs), "--json", env=env)
    assert done.returncode == 1 and not suite.exists(), done.stderr
    report = json.loads(done.stdout)
    assert report["kept"] == 0 and len(report["dropped"]) == 3
    (environment,) = report["environments"]
    assert "no-such-package" in environment["failed"]
    assert {d["reason"] for d in report["dropped"]} == {f"environment: {environment['failed']}"}
    # Not stored: a build that failed (say, for want of the network) is tried again next time.
    again = _cli("suite", "mine", history["path"], "--out", str(suite), "--environment", str(envs), "--json", env=env)
    retried = json.loads(again.stdout)
    assert retried["reused"] == 0 and "no-such-package" in retried["environments"][0]["failed"]


class _FakeGitHub(ThreadingHTTPServer):
    """A local stdlib HTTP server standing in for api.github.com: `issues` by path
    (/repos/OWNER/NAME/issues/N -> {title, body}, or bytes sent as they are), 404 for the
    rest, 500 for `failing` paths, a 302 to the URL `redirects` gives; every request's path
    and Authorization header is kept."""

    def __init__(self, issues: dict[str, dict | bytes], failing: tuple[str, ...] = (), delay_s: float = 0.0,
                 redirects: dict[str, str] | None = None) -> None:
        self.issues, self.failing, self.delay_s, self.redirects = issues, failing, delay_s, redirects or {}
        self.seen: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                server.seen.append((self.path, self.headers.get("Authorization")))
                time.sleep(server.delay_s)
                code, doc = ((500, {"message": "boom"}) if self.path in server.failing else
                             (302, {}) if self.path in server.redirects else
                             (200, server.issues[self.path]) if self.path in server.issues else
                             (404, {"message": "Not Found"}))
                body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
                try:
                    self.send_response(code)
                    if code == 302:
                        self.send_header("Location", server.redirects[self.path])
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a client that stopped waiting (the timeout under test)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> _FakeGitHub:
        serve_in_background(self)
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SUB_ISSUE = {"/repos/acme/calc/issues/7": {"title": "sub(5, 3) returns 8", "body": "Expected 2.\n\n```\n>>> sub(5, 3)\n8\n```"}}


def test_a_message_s_issue_references_and_a_remote_s_repository(tmp_path: Path) -> None:
    refs = issue_refs("Fix x (#12), fixes #13; see pallets/click#14, https://github.com/o/r/issues/15,"
                      " https://github.com/o/r/pull/16#issuecomment-3, #12 again; not &#39; nor a#5")
    assert [r.label for r in refs] == ["#12", "#13", "pallets/click#14", "o/r#15", "o/r#16"]
    for url, name in (("https://github.com/pallets/click.git", "pallets/click"),
                      ("git@github.com:pallets/click.git", "pallets/click"),
                      ("ssh://git@ghe.example.com/org/tool", "org/tool"), ("/srv/git/calc", None)):
        assert github_repo_of(url) == name, url
    clone = git.Repo.init(tmp_path / "clone")
    clone.create_remote("origin", "https://github.com/acme/calc.git")
    found = issue_source("github", str(tmp_path / "clone"), cache_dir=tmp_path / "cache")
    assert isinstance(found, GitHubIssues) and found.repo == "acme/calc"
    git.Repo.init(tmp_path / "lonely")
    with pytest.raises(InputError, match="give --github-repo"):
        issue_source("github", str(tmp_path / "lonely"), cache_dir=tmp_path / "cache")
    for text, where in (("{not json", "line 1: not JSON"), ('{"number": "7", "title": "t"}', "line 1: expected"),
                        ('\n{"number": 7}', "line 2: expected")):
        (tmp_path / "issues.jsonl").write_text(text)
        with pytest.raises(InputError, match=where):
            issue_source(str(tmp_path / "issues.jsonl"), str(tmp_path / "clone"), cache_dir=tmp_path / "cache")


def test_the_api_s_answers_are_cached_and_its_failures_named_not_raised(tmp_path: Path) -> None:
    issues = {**SUB_ISSUE, "/repos/pallets/click/issues/3": {"title": "other repo", "body": None}}
    with _FakeGitHub(issues, failing=("/repos/acme/calc/issues/9",)) as api:
        source = GitHubIssues(api.url, "acme/calc", tmp_path / "cache", token="t0ken", other_repos=True)
        statement, record = linked_text("Fix sub (fixes #7, see #8, #9 and pallets/click#3)", source)
        assert statement == ("Fix sub (fixes #7, see #8, #9 and pallets/click#3)\n\n"
                             "Issue #7: sub(5, 3) returns 8\n\nExpected 2.\n\n```\n>>> sub(5, 3)\n8\n```\n\n"
                             "Issue pallets/click#3: other repo")
        assert record[0] == {"issue": "#7", "source": f"{api.url}/repos/acme/calc/issues/7",
                             "title": "sub(5, 3) returns 8"}
        assert "HTTP 404" in record[1]["not_fetched"] and "HTTP 500" in record[2]["not_fetched"]
        assert {auth for _, auth in api.seen} == {"Bearer t0ken"} and len(api.seen) == 4
        # Again, from a fresh source: answers (the issue, the 404) are not asked twice; the 500 is.
        again = GitHubIssues(api.url, "acme/calc", tmp_path / "cache", other_repos=True)
        assert linked_text("Fix sub (fixes #7, see #8, #9 and pallets/click#3)", again) == (statement, record)
        assert [path for path, _ in api.seen[4:]] == ["/repos/acme/calc/issues/9"]
    # An API that does not answer in time, or not at all: named, and not waited on twice.
    with _FakeGitHub(SUB_ISSUE, delay_s=2) as slow:
        late = GitHubIssues(slow.url, "acme/calc", tmp_path / "other-cache", timeout_s=0.3)
        _, record = linked_text("fixes #7 and #8", late)
        assert "unreachable" in record[0]["not_fetched"] and "timed out" in record[0]["not_fetched"]
        assert record[1]["not_fetched"] == record[0]["not_fetched"] and len(slow.seen) == 1
    refused = GitHubIssues(f"http://127.0.0.1:{_closed_port()}", "acme/calc", tmp_path / "cache")
    assert "refused" in linked_text("fixes #8", refused)[1][0]["not_fetched"]


def test_a_hostile_history_or_issue_server_never_fails_a_lookup_nor_poisons_the_cache(tmp_path: Path) -> None:
    """(#45 items 3 and 4) A 300-character reference crashed every mine (a cache file name too
    long); a body that is not text was cached, then crashed building the statement; 100,000
    nested brackets raised RecursionError. Each is now a lookup not fetched, with the reason."""
    long_ref = f"{'a' * 300}/b#4"
    hostile = {"/repos/acme/calc/issues/5": {"title": "t", "body": 5},
               "/repos/acme/calc/issues/6": b"[" * 100_000 + b"]" * 100_000}
    with _FakeGitHub(hostile) as api:
        source = GitHubIssues(api.url, "acme/calc", tmp_path / "cache", other_repos=True)
        _, record = linked_text(f"fix (see {long_ref}, #5 and #6)", source)
        assert [r["issue"] for r in record] == [long_ref, "#5", "#6"]
        assert "HTTP 404" in record[0]["not_fetched"]
        assert "body is a int, not text" in record[1]["not_fetched"]
        assert "nested too deeply" in record[2]["not_fetched"]
        assert all(len(p.name) < 100 for p in (tmp_path / "cache").iterdir())
        # The server fixed: #5 is asked again (nothing was cached), and read.
        api.issues["/repos/acme/calc/issues/5"] = {"title": "t", "body": "text"}
        statement, record = linked_text("fix #5", GitHubIssues(api.url, "acme/calc", tmp_path / "cache"))
        assert statement == "fix #5\n\nIssue #5: t\n\ntext" and "source" in record[0]
        # A cache file of another shape (an older evalpipe cached such a body) is asked again.
        for cached in (tmp_path / "cache").iterdir():
            cached.write_text(json.dumps({"title": "t", "body": 5}))
        asked = len(api.seen)
        assert linked_text("fix #5", GitHubIssues(api.url, "acme/calc", tmp_path / "cache"))[0] == statement
        assert len(api.seen) == asked + 1


def test_the_token_goes_to_the_api_s_origin_only(tmp_path: Path) -> None:
    """(#45 item 4) urllib followed a 302 to another host or port with the token."""
    with _FakeGitHub({}) as elsewhere, _FakeGitHub(SUB_ISSUE) as api:
        api.redirects = {"/repos/acme/calc/issues/8": f"{elsewhere.url}/repos/acme/calc/issues/8",
                         "/repos/acme/calc/issues/9": f"{api.url}/repos/acme/calc/issues/7"}  # same origin: followed
        source = GitHubIssues(api.url, "acme/calc", tmp_path / "cache", token="t0ken")
        _, record = linked_text("fixes #8 and #9", source)
        assert elsewhere.seen == []
        assert "HTTP 302" in record[0]["not_fetched"] and "another origin" in record[0]["not_fetched"]
        assert record[1]["title"] == "sub(5, 3) returns 8"
        assert api.seen[-1] == ("/repos/acme/calc/issues/7", "Bearer t0ken")
    for api_url in ("http://api.example.com", "http://10.0.0.1:8080/api/v3"):
        with pytest.raises(InputError, match="plain http only to this machine's loopback"):
            issue_source("github", "/nowhere", api=api_url, github_repo="acme/calc", cache_dir=tmp_path)
    for api_url in ("https://ghe.example.com/api/v3", "http://127.0.0.1:9", "http://[::1]:9", "http://localhost:9"):
        assert isinstance(issue_source("github", "/nowhere", api=api_url, github_repo="acme/calc",
                                       cache_dir=tmp_path), GitHubIssues)
    for name in ("../etc", "acme/.."):
        with pytest.raises(InputError, match="expected OWNER/NAME"):
            issue_source("github", "/nowhere", github_repo=name, cache_dir=tmp_path)


def test_only_the_mined_repository_s_issues_and_at_most_20_a_message(tmp_path: Path) -> None:
    """(#45 item 4) A history's `org/private-repo#12` copied a private issue into a suite a token
    holder's mine wrote; nothing bounded how many references a message made it fetch."""
    with _FakeGitHub({"/repos/org/private-repo/issues/12": {"title": "secret", "body": "private"}}) as api:
        _, (record,) = linked_text("see org/private-repo#12",
                                   GitHubIssues(api.url, "acme/calc", tmp_path / "a", token="t"))
        assert "another repository's issue" in record["not_fetched"] and api.seen == []
        _, (record,) = linked_text("see org/private-repo#12",
                                   GitHubIssues(api.url, "acme/calc", tmp_path / "b", token="t", other_repos=True))
        assert record["title"] == "secret"
        # The mined repository's own, however a reference spells it, is fetched.
        _, record = linked_text("Acme/Calc#3 https://github.com/acme/calc/issues/4",
                                GitHubIssues(api.url, "acme/calc", tmp_path / "c"))
        assert all("HTTP 404" in r["not_fetched"] for r in record)
        asked = len(api.seen)
        message = " ".join(f"#{n}" for n in range(1, 51))
        _, record = linked_text(message, GitHubIssues(api.url, "acme/calc", tmp_path / "d"))
        assert len(api.seen) - asked == 20 and record[-1] == {
            "issue": "30 more", "not_fetched": "over the 20 issues a message may link: not looked up"}
        capped = GitHubIssues(api.url, "acme/calc", tmp_path / "e", max_lookups=25)
        records = [r for m in (message, message.replace("#", "#10")) for r in linked_text(m, capped)[1]]
        assert capped.asked == 25 and sum("over the 25 issues a mine may ask" in r["not_fetched"] for r in records) == 15


@pytest.mark.skipif(not bwrap_available(), reason="environments are built in bubblewrap")
def test_mine_adds_the_linked_issue_s_text_or_says_why_not(
        history, mine_home: Path, tmp_path: Path, prefect_harness) -> None:
    envs = tmp_path / "env.yaml"
    envs.write_text(yaml.safe_dump(OFFLINE))
    suite = tmp_path / "issued.yaml"
    env = {"PREFECT_API_URL": prefect_harness, "EVALPIPE_HOME": str(mine_home), "GITHUB_TOKEN": "s3cret"}
    args = ["suite", "mine", history["path"], "--out", str(suite), "--environment", str(envs),
            "--github-repo", "acme/calc", "--json"]
    with _FakeGitHub(SUB_ISSUE) as api:
        mined = _cli(*args, "--issues", "github", "--github-api", api.url, env=env)
        assert mined.returncode == 0, mined.stderr
        (case,) = load_suite(suite).cases
        assert case.inputs["problem_statement"] == ("Fix sub: it added (fixes #7)\n\nIssue #7: sub(5, 3) returns 8"
                                                    "\n\nExpected 2.\n\n```\n>>> sub(5, 3)\n8\n```")
        assert case.metadata["issue_text"] == [{"issue": "#7", "source": f"{api.url}/repos/acme/calc/issues/7",
                                                "title": "sub(5, 3) returns 8"}]
        assert json.loads(mined.stdout)["issues"] == {"linked": 1, "fetched": 1, "not_fetched": []}
        assert api.seen == [("/repos/acme/calc/issues/7", "Bearer s3cret")]
        # The token is not a flow parameter: it is nowhere in what the mine wrote.
        assert "s3cret" not in suite.read_text() and "s3cret" not in mined.stdout + mined.stderr
        version = load_suite(suite).version
        # A re-mine asks the API nothing: the same suite from the cache.
        again = _cli(*args, "--issues", "github", "--github-api", api.url, env=env)
        assert again.returncode == 0 and len(api.seen) == 1 and load_suite(suite).version == version
    # The API unreachable: the mine goes on, the case keeps the message and says why.
    gone = f"http://127.0.0.1:{_closed_port()}"
    offline = _cli(*args[:-1], "--issues", "github", "--github-api", gone, env=env)  # text output, not --json
    assert offline.returncode == 0, offline.stderr
    (case,) = load_suite(suite).cases
    assert case.inputs["problem_statement"] == "Fix sub: it added (fixes #7)"
    (why,) = case.metadata["issue_text"]
    assert why["issue"] == "#7" and why["not_fetched"].startswith(f"{gone} unreachable:")
    assert f"not fetched {history['fix'][:12]} #7: {gone} unreachable" in offline.stdout
    # From an export file instead.
    export = tmp_path / "issues.jsonl"
    export.write_text(json.dumps({"number": 7, "title": "sub adds", "body": "from the export"}) + "\n")
    filed = _cli(*args, "--issues", str(export), env=env)
    assert filed.returncode == 0, filed.stderr
    (case,) = load_suite(suite).cases
    assert case.inputs["problem_statement"].endswith("Issue #7: sub adds\n\nfrom the export")
    assert case.metadata["issue_text"] == [{"issue": "#7", "source": str(export), "title": "sub adds"}]
