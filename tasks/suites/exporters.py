"""Exporters: a suite's cases in public formats (SWE-bench's instances), so that a suite
evalpipe grades (an imported or a mined one) runs in that format's own harness as well."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tasks.files import atomic_write
from tasks.models import EvalSuite, InputError

FORMATS = ("swebench",)
_GITHUB = re.compile(r"^(?:https://github\.com/|git@github\.com:)([\w.-]+/[\w.-]+?)(?:\.git)?/?$")


def swebench_instances(suite: EvalSuite) -> list[dict[str, Any]]:
    """One SWE-bench instance per `repo_tests` case (ordered by id); any other kind is bad input."""
    for case in sorted(suite.cases, key=lambda c: c.id):
        if case.kind != "repo_tests":
            raise InputError(f"suite {suite.name}: case {case.id} is graded by {case.kind}: only repo_tests"
                             " cases have a SWE-bench form")
    return [_instance(case) for case in sorted(suite.cases, key=lambda c: c.id)]


def _instance(case) -> dict[str, Any]:
    grader = case.grader
    provenance = (case.metadata or {}).get("provenance") or {}
    environment = grader.get("environment") or {}
    setup_commit = environment.get("setup_commit") or grader["base_commit"]
    return {
        "instance_id": case.id,
        "repo": _repo_name(grader["repo"]),
        "base_commit": grader["base_commit"],
        "patch": case.reference if isinstance(case.reference, str) else "",
        "test_patch": grader.get("test_patch") or "",
        "problem_statement": case.inputs.get("problem_statement", ""),
        "hints_text": case.inputs.get("hints_text", ""),
        "created_at": provenance.get("date", ""),
        "version": setup_commit[:12],
        "environment_setup_commit": setup_commit,
        "FAIL_TO_PASS": list(grader.get("fail_to_pass") or []),
        "PASS_TO_PASS": list(grader.get("pass_to_pass") or []),
    }


def _repo_name(repo: str) -> str:
    """`owner/name` for a GitHub repository; otherwise the path or URL as the case has it
    (SWE-bench's harness then needs it mapped; `suite import swebench` reads it back as is)."""
    found = _GITHUB.match(repo)
    return found.group(1) if found else repo


def write_instances(instances: list[dict[str, Any]], out: Path) -> None:
    """JSON Lines, one instance per line, written atomically."""
    atomic_write(out, "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in instances))
