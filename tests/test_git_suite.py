"""Suites read from git (`URL[@REF]#PATH`), on real repositories built in the test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import git
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.cli import in_process
from support.git_repos import commit

from storage.store import Store
from storage.suites import resolve_suite
from tasks.models import InputError
from tasks.suites.dataset import SuiteError, load_suite
from tasks.suites.git_suite import GitSuiteRef, parse_git_ref

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def evals(tmp_path: Path) -> tuple[git.Repo, str, str]:
    """A repository of suites: qa.yaml at v1 (tagged), then with one reference changed."""
    repo = git.Repo.init(tmp_path / "evals", initial_branch="main")
    qa = (ROOT / "examples/qa.yaml").read_text()
    first = commit(repo, {"suites/qa.yaml": qa}, "qa v1")
    repo.create_tag("v1")
    second = commit(repo, {"suites/qa.yaml": qa.replace("reference: Paris", "reference: Lyon")}, "qa v2")
    return repo, first, second


def url(repo: git.Repo) -> str:
    return Path(repo.working_tree_dir).as_uri()


@pytest.mark.parametrize(("text", "expected"), [
    ("https://github.com/acme/evals.git#suites/qa.yaml",
     GitSuiteRef("https://github.com/acme/evals.git", "HEAD", "suites/qa.yaml")),
    ("git@github.com:acme/evals.git@v1.4#qa.jsonl", GitSuiteRef("git@github.com:acme/evals.git", "v1.4", "qa.jsonl")),
    ("git@github.com:evals.git#qa.yml", GitSuiteRef("git@github.com:evals.git", "HEAD", "qa.yml")),
    ("https://bot@host/org/evals#a/b.yaml", GitSuiteRef("https://bot@host/org/evals", "HEAD", "a/b.yaml")),
    ("https://host/evals.git@release/2026#qa.yaml", GitSuiteRef("https://host/evals.git", "release/2026", "qa.yaml")),
    ("examples/qa.yaml", None),
])
def test_parse_git_ref(text: str, expected: GitSuiteRef | None) -> None:
    assert parse_git_ref(text) == expected


@given(rev=st.from_regex(r"[A-Za-z0-9_.][A-Za-z0-9_./-]{0,20}", fullmatch=True),
       path=st.from_regex(r"[a-z0-9_]{1,8}(/[a-z0-9_]{1,8}){0,2}\.(yaml|jsonl)", fullmatch=True))
def test_pinned_refs_parse_back(rev: str, path: str) -> None:
    # What a run records (URL@SHA#PATH) must name the same file when given back.
    for base in ("https://host/org/evals.git", "git@host:org/evals", "file:///srv/evals"):
        ref = GitSuiteRef(base, rev, path)
        assert parse_git_ref(ref.pinned(rev)) == ref


@pytest.mark.parametrize(("text", "message"), [
    ("https://host/evals.git", "name the suite file in the repository: URL#path"),
    ("https://host/evals.git#../qa.yaml", "must be relative to the repository root"),
    ("https://host/evals.git#qa.txt", "unknown suite format '.txt'"),
    ("https://host/evals.git@-x#qa.yaml", "'-x' is not a branch, tag or commit"),
])
def test_bad_git_refs_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(SuiteError, match=message):
        parse_git_ref(text)


def test_suite_from_git_is_the_file_at_the_ref(evals, home: Path, tmp_path: Path) -> None:
    repo, first, second = evals
    local = tmp_path / "qa.yaml"
    head, pinned = resolve_suite(f"{url(repo)}#suites/qa.yaml", Store(home).snapshots)
    local.write_text(repo.git.show(f"{second}:suites/qa.yaml"))
    assert head == load_suite(local) and head.version == load_suite(local).version
    assert pinned == f"{url(repo)}@{second}#suites/qa.yaml"
    assert head.case("capital-france").reference == "Lyon"

    # A tag and a commit name the older file; the same content has the same version.
    tagged, _ = resolve_suite(f"{url(repo)}@v1#suites/qa.yaml", Store(home).snapshots)
    by_sha, pinned_sha = resolve_suite(f"{url(repo)}@{first}#suites/qa.yaml", Store(home).snapshots)
    assert tagged.version == by_sha.version == load_suite(ROOT / "examples/qa.yaml").version != head.version
    assert pinned_sha == f"{url(repo)}@{first}#suites/qa.yaml"


def test_a_branch_is_fetched_again_a_sha_is_not(evals, home: Path) -> None:
    repo, first, second = evals
    ref = f"{url(repo)}@main#suites/qa.yaml"
    assert resolve_suite(ref, Store(home).snapshots)[1].endswith(f"@{second}#suites/qa.yaml")
    third = commit(repo, {"suites/qa.yaml": "name: qa\ncases:\n  - {id: one, reference: x, grader: {kind: exact}}\n"},
                   "qa v3")
    moved, pinned = resolve_suite(ref, Store(home).snapshots)
    assert pinned.endswith(f"@{third}#suites/qa.yaml") and [c.id for c in moved.cases] == ["one"]
    # Pinned to a commit, the suite reads without reaching the source at all.
    shutil.rmtree(repo.working_tree_dir)
    old, _ = resolve_suite(f"{url(repo)}@{first}#suites/qa.yaml", Store(home).snapshots)
    assert old.version == load_suite(ROOT / "examples/qa.yaml").version
    with pytest.raises(InputError, match="cannot fetch: git fetch: fatal: Could not read from remote repository"):
        resolve_suite(ref, Store(home).snapshots)


def test_missing_file_commit_or_repository(evals, home: Path) -> None:
    repo, first, _ = evals
    with pytest.raises(SuiteError, match=rf"@{first}#suites/nope.yaml: no such file in the repository"):
        resolve_suite(f"{url(repo)}@{first}#suites/nope.yaml", Store(home).snapshots)
    with pytest.raises(InputError, match="commit nosuchbranch not found"):
        resolve_suite(f"{url(repo)}@nosuchbranch#suites/qa.yaml", Store(home).snapshots)
    with pytest.raises(InputError, match="cannot mirror"):
        resolve_suite("file:///nonexistent/evals.git#qa.yaml", Store(home).snapshots)


def test_malformed_suite_in_git_names_the_pinned_source(evals, home: Path) -> None:
    repo, _, _ = evals
    sha = commit(repo, {"bad.jsonl": '{"id": "a", "grader": {"kind": "exact"}}\n{"id": "a", "grader": {"kind": "exact"}}\n'},
                 "dup")
    with pytest.raises(SuiteError) as err:
        resolve_suite(f"{url(repo)}#bad.jsonl", Store(home).snapshots)
    assert str(err.value).startswith(f"{url(repo)}@{sha}#bad.jsonl: line 2") and "duplicate case id" in str(err.value)


def test_cli_hashes_a_suite_in_git(evals, home: Path) -> None:
    repo, first, _ = evals
    env = {"PATH": "/usr/bin:/bin", "EVALPIPE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "flows.cli", "suite", "hash", f"{url(repo)}@v1#suites/qa.yaml",
                         "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["version"] == load_suite(ROOT / "examples/qa.yaml").version
    bad = subprocess.run([sys.executable, "-m", "flows.cli", "suite", "hash", f"{url(repo)}#missing.yaml"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "missing.yaml: no such file in the repository" in bad.stderr and "Traceback" not in bad.stderr


def test_a_run_on_a_suite_in_git_records_the_commit(prefect_harness, evals, home: Path) -> None:
    from flows.evaluate import evaluate

    repo, first, _ = evals
    out = evaluate(suite=f"{url(repo)}@v1#suites/qa.yaml", agent="reference", n=1)
    assert out["suite_version"] == load_suite(ROOT / "examples/qa.yaml").version
    assert out["samples"] == out["cases"] == 10
    config = Store(home).runs.get(out["run_id"])["config"]
    assert config["suite_source"] == f"{url(repo)}@{first}#suites/qa.yaml"
    # The pinned source given back is the same suite: that is what makes it provenance.
    assert resolve_suite(config["suite_source"], Store(home).snapshots)[0].version == out["suite_version"]


def test_cli_runs_the_commit_it_checked(prefect_harness, evals, home: Path) -> None:
    repo, _, second = evals
    env = {"PATH": "/usr/bin:/bin", "EVALPIPE_HOME": str(home), "PYTHONPATH": str(ROOT),
           "PREFECT_API_URL": prefect_harness, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = in_process(["run", f"{url(repo)}@main#suites/qa.yaml", "--agent", "reference", "--json"], env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    config = Store(home).runs.get(out["run_id"])["config"]
    # The branch was resolved once, by the command, and the flow was handed that commit.
    assert config["suite_ref"] == config["suite_source"] == f"{url(repo)}@{second}#suites/qa.yaml"
    assert out["suite_name"] == "qa" and out["samples"] == 10
