"""The issue's story through the CLI: an 8-case suite, agent v1 then v2; v2 fixed two cases
(0/5 -> 5/5) and broke one (5/5 -> 0/5). The gate's paired CI alone is inconclusive; the
case-level rules block and name the broken case, `diff` shows every flip, and a baseline
exported from one home gates the same way in another."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from support.cli import as_process, in_process

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ROOT / "tests/support/agents.py"
# case id -> (v1's answer, v2's answer); the reference is "yes".
STORY = {"c1": ("no", "yes"), "c2": ("no", "yes"), "c3": ("yes", "no"), "c4": ("yes", "yes"),
         "c5": ("yes", "yes"), "c6": ("yes", "yes"), "c7": ("no", "no"), "c8": ("yes", "yes")}


def write_story(path: Path, must_pass: tuple[str, ...] = ()) -> Path:
    lines = ["name: story", "cases:"]
    for i, (cid, (a1, a2)) in enumerate(STORY.items()):
        flag = ", must_pass: true" if cid in must_pass else ""
        lines.append(f"  - {{id: {cid}, inputs: {{v1: '{a1}', v2: '{a2}'}}, reference: 'yes', grader: {{kind: exact}},"
                     f" slices: [{'even' if i % 2 else 'odd'}]{flag}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


def cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`evalpipe ARGS` in this process, with the same output and exit status
    (support.cli.in_process), but `runs export` (run so nowhere else) in a process of its own.
    Each command runs as a process of its own elsewhere: tests/test_cli_run.py (run),
    test_first_hour.py (run, rescore), test_one_decision.py (gate, diff, report),
    test_gate_metric.py (gate, report), test_storage_failures.py (runs list),
    test_mini_swe_agent.py (runs show), test_hostile_import.py (runs import)."""
    if args[:2] != ["runs", "export"]:
        return in_process(args, env)
    return as_process(args, env)


def run(suite: Path, version: str, env: dict, *extra: str) -> dict:
    proc = cli(["run", str(suite), "--agent", f"python:{AGENTS}:{version}", "-n", "5", "--json", *extra], env)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def env(prefect_harness, home) -> dict:
    return {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}


def test_the_story_blocks_on_the_broken_case_and_diff_names_every_flip(env, home, tmp_path):
    suite = write_story(tmp_path / "story.yaml")
    first = run(suite, "v1", env, "--baseline", "previous")
    assert "gate" not in first and first["no_baseline"].startswith("no baseline: no completed run of suite 'story'")
    v1 = first["run_id"]
    # `previous` is the latest completed run of the suite whatever the agent: v2 is gated against v1.
    v2 = run(suite, "v2", env, "--baseline", "previous")
    assert v2["gate"]["baseline"] == v1 and v2["gate"]["decision"] == "pass"
    assert v2["pass_hat_k"]["1"] == v2["pass_at_k"]["1"] == 6 / 8 and first["pass_at_k"]["1"] == 5 / 8

    # The paired CI alone: +12.5 points, inconclusive, a pass.
    plain = cli(["gate", v2["run_id"], "--baseline", v1, "--json"], env)
    doc = json.loads(plain.stdout)
    assert plain.returncode == 0 and (doc["decision"], doc["verdict"]) == ("pass", "inconclusive")
    assert doc["delta_pass_at_1"] == pytest.approx(0.125) and doc["blocks"] == []
    # What would decide it: the smallest drop 8 cases x 5 samples catch, the case rules not stated.
    assert doc["reasons"][-1].startswith("to decide: these 8 cases x 5 samples catch a drop of about")
    assert "--max-new-failures N" in doc["reasons"][-1] and "`must_pass: true`" in doc["reasons"][-1]

    # A rule the team can state: nothing that always passed may now fail.
    strict = cli(["gate", v2["run_id"][:-1], "--baseline", v1, "--max-new-failures", "0", "--json"], env)
    doc = json.loads(strict.stdout)
    assert strict.returncode == 1 and doc["decision"] == "block"
    assert doc["blocks"] == [{"rule": "new_failures", "cases": ["c3"], "message": doc["reasons"][0]}]
    assert "c3" in doc["reasons"][0]
    text = cli(["gate", v2["run_id"], "--baseline", v1, "--max-new-failures", "0"], env)
    assert text.returncode == 1 and text.stdout.startswith("BLOCK (inconclusive)") and "c3" in text.stdout
    sliced = cli(["gate", v2["run_id"], "--baseline", v1, "--min-slice", "odd=0.8", "--json"], env)
    assert sliced.returncode == 1 and json.loads(sliced.stdout)["blocks"][0]["slice"] == "odd"
    unknown = cli(["gate", v2["run_id"], "--baseline", v1, "--min-slice", "nope=0.8"], env)
    assert unknown.returncode == 2 and "no slice 'nope'" in unknown.stderr

    # Which cases: the diff, regressions first.
    diff = json.loads(cli(["diff", v2["run_id"], v1, "--json"], env).stdout)
    assert [(c["case_id"], c["label"]) for c in diff["cases"][:3]] == [
        ("c3", "regressed"), ("c1", "improved"), ("c2", "improved")]
    assert diff["counts"] == {"regressed": 1, "improved": 2, "new": 0, "removed": 0, "unchanged": 5}
    assert diff["cases"][0]["before"]["passes"] == 5 and diff["cases"][0]["after"]["passes"] == 0
    assert set(diff["slices"]) == {"odd", "even"} and diff["dropped_cases"] == 0
    shown = cli(["diff", v2["run_id"], v1], env).stdout.splitlines()
    assert shown[1] == "regressed 1  improved 2  new 0  removed 0  unchanged 5"
    assert shown[3].split()[:2] == ["regressed", "c3"] and "5/5 -> 0/5" in shown[3]
    markdown = cli(["gate", v2["run_id"], "--baseline", v1, "--max-new-failures", "0", "--format", "markdown"], env)
    assert markdown.returncode == 1 and markdown.stdout.startswith("## evalpipe gate: **BLOCK**")
    assert "| `c3` | 5/5 | 0/5 | -100.0 pts |" in markdown.stdout
    # Why it fails, from its first failing sample: the grader and its detail, fenced.
    assert ("### Newly failing (1)\n\n**`c3`** (5/5 → 0/5): grader `exact` gave `failed` on sample 0\n"
            "```text\nexpected 'yes', got 'no'\n```\n") in markdown.stdout
    assert "Newly failing" in cli(["diff", v2["run_id"], v1, "--format", "markdown"], env).stdout

    # The reviewer's page: the gate on top, the broken case with each run's output side by side.
    page = tmp_path / "diff.html"
    assert cli(["report", v2["run_id"], "--baseline", v1, "--out", str(page)], env).returncode == 0
    html = page.read_text()
    regressed = html[html.index('<section id="regressed"'):html.index('<section id="improved"')]
    assert "<b>c3</b>" in regressed and "5/5 → 0/5" in regressed
    assert "baseline: sample 0, passed" in regressed and "run: sample 0, failed" in regressed

    # What the agent said on the broken case.
    case = cli(["runs", "show", v2["run_id"], "--case", "c3"], env)
    assert case.returncode == 0 and case.stdout.count("output: 'no'") == 5 and "failed" in case.stdout
    doc = json.loads(cli(["runs", "show", v2["run_id"], "--case", "c3", "--json"], env).stdout)
    assert (doc["n"], doc["c"]) == (5, 0) and [s["output"] for s in doc["samples"]] == ["no"] * 5
    assert doc["samples"][0]["detail"] and doc["samples"][0]["duration_s"] is not None
    missing = cli(["runs", "show", v2["run_id"], "--case", "nope"], env)
    assert missing.returncode == 2 and "no case 'nope'" in missing.stderr

    # Scores: pass/fail graders score 1 or 0, so the score gate agrees with the pass@1 one.
    scored = json.loads(cli(["gate", v2["run_id"], "--baseline", v1, "--metric", "score", "--json"], env).stdout)
    assert scored["metric"] == "score" and scored["delta_pass_at_1"] == pytest.approx(0.125)
    assert scored["reasons"][-2].startswith("inconclusive: mean score changed by +12.5 pts")
    assert scored["reasons"][-1].startswith("to decide: rules that block on cases whatever the CI")

    # Marking c3 must-pass changes the suite's version but not the case's hash: the runs
    # before and after the marking still pair on every case, and the must-pass case blocks.
    marked = write_story(tmp_path / "marked.yaml", must_pass=("c3",))
    v2m = run(marked, "v2", env)
    must = cli(["gate", v2m["run_id"], "--baseline", v1, "--shared-only", "--json"], env)
    doc = json.loads(must.stdout)
    assert must.returncode == 1 and doc["shared_cases"] == 8 and doc["dropped_cases"] == 0
    assert doc["blocks"][0]["rule"] == "must_pass" and doc["blocks"][0]["cases"] == ["c3"]
    refused = cli(["gate", v2m["run_id"], "--baseline", v1], env)
    assert refused.returncode == 2 and "different suite versions" in refused.stderr

    # An edited suite: c8 dropped, c9 added, c7's reference changed (a new case hash). The diff
    # pairs the shared cases only and says what it left out.
    edited = tmp_path / "edited.yaml"
    edited.write_text(suite.read_text().replace("  - {id: c8,", "  - {id: c9,").replace(
        "{v1: 'no', v2: 'no'}, reference: 'yes'", "{v1: 'no', v2: 'no'}, reference: 'no'"))
    v2e = run(edited, "v2", env)
    doc = json.loads(cli(["diff", v2e["run_id"], v1, "--json"], env).stdout)
    labels = {(c["case_id"], c["label"]) for c in doc["cases"]}
    assert {("c9", "new"), ("c8", "removed"), ("c7", "new"), ("c7", "removed")} <= labels
    assert doc["counts"] == {"regressed": 1, "improved": 2, "new": 2, "removed": 2, "unchanged": 3}
    assert (doc["shared_cases"], doc["dropped_cases"]) == (6, 4)
    assert "(4 measured by one run only: new or removed)" in cli(["diff", v2e["run_id"], v1], env).stdout

    # `previous` survives the edit: the latest completed run of the suite by name (v2m, on
    # another version), compared on the shared cases, and every output says which and how many.
    chosen = cli(["gate", v2e["run_id"], "--baseline", "previous", "--json"], env)
    doc = json.loads(chosen.stdout)
    assert chosen.returncode == 0 and doc["baseline"] == v2m["run_id"]
    assert (doc["shared_cases"], doc["added_cases"], doc["removed_cases"]) == (6, 2, 2)
    assert doc["baseline_choice"] == "previous: the latest completed run of suite 'story'"
    text = cli(["gate", v2e["run_id"], "--baseline", "previous"], env).stdout.splitlines()
    assert text[1] == (f"  against {v2m['run_id']} (previous: the latest completed run of suite 'story'): 6 shared,"
                       " 2 added, 2 removed cases; rules: max drop 0.0%; decided now")
    markdown = cli(["gate", v2e["run_id"], "--baseline", "previous", "--format", "markdown"], env).stdout
    assert "6 shared, 2 added, 2 removed cases" in markdown

    # A suite nothing ran before: said on one line and in JSON, and not exit 1 (which is *blocked*).
    lonely_suite = tmp_path / "lonely.yaml"
    lonely_suite.write_text(suite.read_text().replace("name: story", "name: lonely"))
    lonely_run = run(lonely_suite, "v2", env)
    lonely = cli(["gate", lonely_run["run_id"], "--baseline", "previous", "--json"], env)
    doc = json.loads(lonely.stdout)
    assert lonely.returncode == 0 and doc["decision"] is None
    assert doc["no_baseline"] == f"no baseline: no completed run of suite 'lonely' before {lonely_run['run_id']}; nothing was compared"
    said = cli(["gate", lonely_run["run_id"], "--baseline", "previous"], env)
    assert said.returncode == 0 and said.stdout == "" and said.stderr.startswith("evalpipe: no baseline")


def test_an_exported_baseline_gates_the_same_in_a_fresh_home(env, home, tmp_path):
    suite = write_story(tmp_path / "story.yaml")
    v1, v2 = run(suite, "v1", env)["run_id"], run(suite, "v2", env)["run_id"]
    gate = ["gate", v2, "--baseline", v1, "--max-new-failures", "0", "--json"]
    here = cli(gate, env)
    for run_id in (v1, v2):
        assert cli(["runs", "export", run_id[:-1], "--out", str(tmp_path / f"{run_id}.tar")], env).returncode == 0

    fresh = {**env, "EVALPIPE_HOME": str(tmp_path / "ci-home")}
    damaged = tmp_path / "damaged.tar"
    data = bytearray((tmp_path / f"{v1}.tar").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte in a member's content
    damaged.write_bytes(bytes(data))
    refused = cli(["runs", "import", str(damaged)], fresh)
    assert refused.returncode == 2 and "damaged evalpipe export" in refused.stderr
    foreign = tmp_path / "foreign.tar"
    foreign.write_text("name: not a run\n")
    assert cli(["runs", "import", str(foreign)], fresh).returncode == 2
    assert json.loads(cli(["runs", "list", "--json"], fresh).stdout) == []  # nothing half-written

    first = json.loads(cli(["runs", "import", str(tmp_path / f"{v1}.tar"), "--json"], fresh).stdout)
    again = json.loads(cli(["runs", "import", str(tmp_path / f"{v1}.tar"), "--json"], fresh).stdout)
    assert (first["imported"], again["imported"]) == (True, False) and first["samples"] == again["samples"] == 40
    import duckdb

    with duckdb.connect(str(tmp_path / "ci-home/evalpipe.duckdb"), read_only=True) as con:
        (snapshot,) = con.execute("SELECT snapshot_path FROM suites").fetchone()
        (headless,) = con.execute("SELECT count(*) FROM samples WHERE output_head IS DISTINCT FROM output").fetchone()
    assert headless == 0  # what `report` shows of each output was derived on import
    assert Path(snapshot).is_file() and Path(snapshot).is_relative_to(tmp_path / "ci-home")
    assert cli(["runs", "import", str(tmp_path / f"{v2}.tar")], fresh).returncode == 0
    there = cli(gate, fresh)
    # The same gate, but for saying that its baseline is an import (issue 33): its file and manifest.
    there_doc = json.loads(there.stdout)
    origin = there_doc.pop("baseline_import")
    assert origin["file"].endswith(f"{v1}.tar") and len(origin["manifest_sha256"]) == 64
    assert there_doc["reasons"].pop().startswith(f"baseline {v1} is imported from {origin['file']}")
    assert (there.returncode, there_doc) == (here.returncode, json.loads(here.stdout)) == (1, json.loads(here.stdout))
    assert json.loads(there.stdout)["blocks"][0]["cases"] == ["c3"]
    assert cli(["diff", v2, v1, "--json"], fresh).stdout == cli(["diff", v2, v1, "--json"], env).stdout

    # The CI loop: a fresh run of the changed agent, gated against the imported baseline.
    ci = run(suite, "v2", fresh, "--baseline", v1, "--max-new-failures", "0")
    assert ci["gate"]["decision"] == "block" and ci["gate"]["blocks"][0]["cases"] == ["c3"]


def test_a_plain_run_blocks_on_the_rules_that_need_no_baseline(env, home, tmp_path):
    """Issue 47: a CI step with no baseline used to exit 0 on `SAFETY FAILED`. A safety
    violation, a failing must-pass case or a missed --min-pass-at-1 now blocks a plain run
    (exit 1, named), as a gated one; the paired rules still need a baseline (exit 2)."""
    suite = write_story(tmp_path / "story.yaml", must_pass=("c7",))  # v1 answers c7 wrong
    args = ["run", str(suite), "--agent", f"python:{AGENTS}:v1", "-n", "2"]
    first = cli([*args, "--baseline", "previous", "--json"], env)  # none yet: nothing to compare with
    assert first.returncode == 1, first.stderr
    doc = json.loads(first.stdout)
    assert doc["no_baseline"].endswith("; nothing was compared")
    assert (doc["gate"]["decision"], doc["gate"]["verdict"], doc["gate"]["baseline"]) == ("block", "no baseline", None)
    assert doc["gate"]["blocks"] == [{"rule": "must_pass", "message": "must-pass: 1 must-pass case(s) failed in some"
                                      " sample: c7 (0/2)", "cases": ["c7"]}]

    text = cli(args, env)
    assert text.returncode == 1
    assert "gate: BLOCK (no baseline)\n  without a baseline; rules: 1 must-pass case(s)\n" in text.stdout
    assert "  - must-pass: 1 must-pass case(s) failed" in text.stdout

    safe = write_story(tmp_path / "safe.yaml")  # no must-pass case: the threshold and the veto alone
    proc = cli(["run", str(safe), "--agent", f"python:{AGENTS}:v1", "-n", "2", "--min-pass-at-1", "0.9", "--json"], env)
    assert proc.returncode == 1 and json.loads(proc.stdout)["gate"]["reasons"][0] == (
        "threshold: pass@1 62.5% is below the required 90.0%")
    proc = cli(["run", str(safe), "--agent", f"python:{AGENTS}:v1", "-n", "2", "--json"], env)
    assert proc.returncode == 0 and "gate" not in json.loads(proc.stdout)  # no rule, safe: nothing decided
    text = safe.read_text().replace("cases:", "safety: {forbidden_patterns: ['^no$']}\ncases:")
    (tmp_path / "unsafe.yaml").write_text(text)
    proc = cli(["run", str(tmp_path / "unsafe.yaml"), "--agent", f"python:{AGENTS}:v1", "-n", "2"], env)
    assert proc.returncode == 1
    assert "SAFETY FAILED" in proc.stdout and "gate: BLOCK (no baseline)" in proc.stdout
    assert re.search(r"  - safety: \d+ case\(s\) broke a safety rule in some sample \(a veto, whatever the rates\): c\d \(2/2\)", proc.stdout)

    proc = cli([*args, "--max-new-failures", "0"], env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("evalpipe: run: --max-drop, --max-new-failures and --max-increase compare with a baseline:"
                                   " they go with --baseline")
