"""A mined candidate's tests, derived by running them, never guessed from the diff.

At the candidate's parent commit, in its environment, the touched test files run exactly as
`repo_tests` runs a sample's (`report_of`): with the test patch alone ("before") and with
the gold patch applied as a candidate's output would be ("after"), each side `reps` times,
the file order reversed on every other run (a test that passes only after another file's
tests ran is flaky too). Then, per test id:

- FAIL_TO_PASS: never passed before (failed, errored or not collected, every time alike) and
  passed after, every time;
- PASS_TO_PASS: passed on every run of both sides;
- dropped: a test whose outcome varies within a side (flaky), one skipped, and one that does
  not pass with the fix (it errors or fails: the environment, or a test the fix does not
  make pass).

A candidate is kept only when FAIL_TO_PASS is not empty; by construction its gold patch then
resolved every graded test on every run. Every dropped candidate carries its reason.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.graders.junit import ERROR, FAILED, MISSING, PASSED, SKIPPED, Report
from tasks.graders.repo_tests import report_of
from tasks.models import EvalCase, canonical_json, sha256_hex
from tasks.repos.mining import Candidate, Skipped

# pytest's default `python_files`: the touched files that hold tests to run (a conftest.py,
# an __init__.py or test data is applied with the test patch, not run on its own).
TEST_MODULES = ("test_", "_test.py")
_NOT_PASSED = {FAILED, ERROR, MISSING}
# Part of every stored result's key: a change to what the runs decide makes a mine run them again.
DERIVATION_VERSION = 2  # 2: inferred environments install as of the commit's date


@dataclass(frozen=True)
class Derivation:
    """What running a candidate's tests showed: kept with its tests, or dropped with why."""

    commit: str
    kept: bool
    reason: str  # why it was dropped; for a kept one, what it grades
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    dropped_tests: dict[str, str] = field(default_factory=dict)  # test id -> why
    runs: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"commit": self.commit, "kept": self.kept, "reason": self.reason,
                "fail_to_pass": list(self.fail_to_pass), "pass_to_pass": list(self.pass_to_pass),
                "dropped_tests": self.dropped_tests, "runs": self.runs, "seconds": self.seconds}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Derivation:
        return cls(commit=doc["commit"], kept=doc["kept"], reason=doc["reason"],
                   fail_to_pass=tuple(doc["fail_to_pass"]), pass_to_pass=tuple(doc["pass_to_pass"]),
                   dropped_tests=dict(doc["dropped_tests"]), runs=doc["runs"], seconds=doc["seconds"])


def runnable_files(candidate: Candidate) -> list[str]:
    """The touched files that pytest collects tests from and that the commit leaves in place."""
    present = _present(candidate.test_patch)
    return [p for p in candidate.test_files if p in present and _is_test_module(p)]


def _present(test_patch: str) -> set[str]:
    """The files a patch leaves in place (all it touches but its `deleted file` entries)."""
    present, current = set(), None
    for line in test_patch.splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[-1]
            present.add(current)
        elif line.startswith("deleted file mode") and current:
            present.discard(current)
    return present


def _is_test_module(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith(TEST_MODULES[0]) or name.endswith(TEST_MODULES[1]))


def probe_case(candidate: Candidate, repo: str, environment: dict | None, files: list[str]) -> EvalCase:
    """A `repo_tests` case that runs `files` (in that order) at the candidate's parent."""
    grader: dict[str, Any] = {"kind": "repo_tests", "repo": repo, "base_commit": candidate.parent,
                              "fail_to_pass": files, "test_patch": candidate.test_patch}
    if environment is not None:
        grader["environment"] = environment
    return EvalCase(id=f"probe-{candidate.commit[:12]}", grader=grader)


def derive(candidate: Candidate, repo: str, environment: dict | None, reps: int = 2) -> Derivation:
    """Run the candidate's test files before and after its fix, `reps` times each."""
    start = time.monotonic()
    files = runnable_files(candidate)
    if not files:
        return Derivation(candidate.commit, False, "its test changes hold no test module (only "
                          f"{', '.join(candidate.test_files)})")
    before: list[Report] = []
    after: list[Report] = []
    runs = 0
    for rep in range(reps):
        case = probe_case(candidate, repo, environment, files if rep % 2 == 0 else files[::-1])
        for side, patch, reports in (("before the fix", None, before), ("with the fix", candidate.patch, after)):
            verdict, report = report_of(case, patch)
            runs += 1
            if report is None:
                return Derivation(candidate.commit, False, f"{side}, the tests did not run: {verdict.detail}",
                                  runs=runs, seconds=round(time.monotonic() - start, 3))
            reports.append(report)
    return Derivation(candidate.commit, **classify(before, after), runs=runs,
                      seconds=round(time.monotonic() - start, 3))


def classify(before: list[Report], after: list[Report]) -> dict[str, Any]:
    """FAIL_TO_PASS, PASS_TO_PASS and the dropped tests (with why) from the runs of each
    side; kept or not, and the reason."""
    ids = sorted({t for r in [*before, *after] for t in r.outcomes})
    f2p, p2p, dropped = [], [], {}
    for test in ids:
        b = [r.outcomes.get(test, MISSING) for r in before]
        a = [r.outcomes.get(test, MISSING) for r in after]
        if len(set(b)) > 1 or len(set(a)) > 1:
            dropped[test] = f"flaky: {', '.join(b)} before the fix; {', '.join(a)} with it"
        elif a[0] == PASSED and b[0] == PASSED:
            p2p.append(test)
        elif a[0] == PASSED and b[0] in _NOT_PASSED:
            f2p.append(test)
        elif a[0] == PASSED:
            dropped[test] = f"{b[0]} before the fix"
        elif a[0] == MISSING:
            dropped[test] = "removed by the fix"
        elif a[0] == SKIPPED:
            dropped[test] = "skipped with the fix"
        else:
            dropped[test] = f"{a[0]} with the fix"
    if f2p:
        reason = f"{len(f2p)} FAIL_TO_PASS, {len(p2p)} PASS_TO_PASS"
        return {"kept": True, "reason": reason, "fail_to_pass": tuple(f2p), "pass_to_pass": tuple(p2p),
                "dropped_tests": dropped}
    if not ids:  # pytest stops at a file it cannot collect, which JUnit names as a module
        broken = sorted({name for r in [*before, *after] for (_cls, name), o in r.by_address.items() if o == ERROR})
        reason = (f"no test ran, before the fix or with it: collecting {_names(broken)} failed" if broken
                  else "its test files hold no test")
        return {"kept": False, "reason": reason}
    return {"kept": False, "reason": no_fail_to_pass(p2p, dropped), "pass_to_pass": tuple(p2p),
            "dropped_tests": dropped}


def no_fail_to_pass(p2p: list[str], dropped: dict[str, str]) -> str:
    """Why a candidate whose tests ran has no FAIL_TO_PASS test, in one line."""
    parts = []
    if p2p:
        parts.append(f"{len(p2p)} pass before and after")
    groups: dict[str, list[str]] = {}
    for test, why in dropped.items():
        groups.setdefault(why.split(":", 1)[0], []).append(test)
    parts += [f"{len(tests)} {why} ({_names(tests)})" for why, tests in groups.items()]
    return "no test fails before the fix and passes with it every time: " + "; ".join(parts)


def _names(tests: list[str], shown: int = 3) -> str:
    more = f", +{len(tests) - shown} more" if len(tests) > shown else ""
    return ", ".join(tests[:shown]) + more


def mined_case(candidate: Candidate, derivation: Derivation, *, case_id: str, repo: str, repo_name: str,
               environment: dict | None, environment_source: str,
               linked: tuple[str, list[dict]] | None = None) -> dict[str, Any]:
    """The suite case of a kept candidate: SWE-style, with its provenance in `metadata`.
    `linked`: the problem statement with the linked issues' text and what became of each
    (`tasks.repos.issues.linked_text`); None: the message alone."""
    statement, issue_text = linked if linked is not None else (candidate.message, [])
    grader: dict[str, Any] = {
        "kind": "repo_tests", "repo": repo, "base_commit": candidate.parent,
        "fail_to_pass": list(derivation.fail_to_pass), "pass_to_pass": list(derivation.pass_to_pass),
        "test_patch": candidate.test_patch,
    }
    if environment is not None:
        grader["environment"] = environment
    return {
        "id": case_id,
        "inputs": {"problem_statement": statement, "repo": repo_name},
        "reference": candidate.patch,
        "grader": grader,
        "slices": [repo_name],
        "tags": ["mined"],
        "metadata": {"provenance": candidate.provenance(), "environment": environment_source,
                     **({"issue_text": issue_text} if issue_text else {})},
    }


def result_key(repo: str, commit: str, environment: str, reps: int) -> str:
    """What a candidate's derivation depends on: the repository, the commit, its environment's
    fingerprint and the runs per side (and this derivation's rules, by their version)."""
    return sha256_hex(canonical_json({"derivation": DERIVATION_VERSION, "repo": repo, "commit": commit,
                                      "environment": environment, "reps": reps}))


def mining_report(derived: list[Derivation], skipped: list[Skipped], environments: list[dict[str, Any]], *,
                  seconds: float, reused: int, issues: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What a mine found: every walked commit counted, every dropped candidate with its reason,
    the environments, what candidates and builds cost, and the issues the kept ones link
    (`issues`: each `{commit, issue, source, title}` or `{commit, issue, not_fetched}`)."""
    reasons: dict[str, int] = {}
    for s in skipped:
        reason = s.reason.split(" (", 1)[0]  # "changes a binary file (x.png), ..." counts as one reason
        reasons[reason] = reasons.get(reason, 0) + 1
    timed = [d.seconds for d in derived if d.runs]
    builds = [e["build_s"] for e in environments if e.get("built")]
    return {
        "commits": len(derived) + len(skipped),
        "candidates": len(derived),
        "kept": sum(d.kept for d in derived),
        "cases": [{"commit": d.commit, "fail_to_pass": len(d.fail_to_pass), "pass_to_pass": len(d.pass_to_pass)}
                  for d in derived if d.kept],
        "dropped": [{"commit": d.commit, "reason": d.reason} for d in derived if not d.kept],
        "skipped": reasons,
        "reused": reused,
        "environments": environments,
        "seconds": seconds,
        "seconds_per_candidate": round(sum(timed) / len(timed), 3) if timed else None,
        "seconds_per_build": round(sum(builds) / len(builds), 3) if builds else None,
        "issues": {"linked": len(issues), "fetched": sum("source" in i for i in issues),
                   "not_fetched": [i for i in issues if "not_fetched" in i]},
    }
