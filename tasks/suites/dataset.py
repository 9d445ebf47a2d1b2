"""Suite files: load YAML or JSONL into an `EvalSuite`, validating with one-line errors.

Type decision for YAML: suites are read with the YAML 1.2 core schema's idea of scalars,
so only `true`/`false` are booleans and dates stay strings. `yes`, `on`, `2024-01-01` are
strings, exactly as they would be in the equivalent JSON. A file therefore hashes the same
whichever of the two formats it is written in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tasks.models import EvalCase, EvalSuite, InputError
from tasks.params import parameter_names
from tasks.suites.input_limits import LimitedLoader, LimitError
from tasks.suites.jsonl import object_lines


class SuiteError(InputError):
    """Bad suite input. The message is one line naming the file, case or line, and problem."""


class _Yaml12Loader(LimitedLoader):
    """SafeLoader (within the input limits) without YAML 1.1's surprise booleans (yes/no/on/off) and timestamps."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp"}]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)

SUITE_SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".jsonl": "jsonl"}

# Keys a suite file may set for every case; a case's own value wins.
SUITE_DEFAULT_KEYS = ("safety", "grader_defaults")


def load_suite(path: str | Path) -> EvalSuite:
    """Read a `.yaml`/`.yml` or `.jsonl` suite file. Raises `SuiteError` on any bad input."""
    path = Path(path)
    if not path.is_file():
        raise SuiteError(f"{path}: no such suite file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SuiteError(f"{path}: cannot read: {exc}") from None
    if path.suffix.lower() not in SUITE_SUFFIXES:
        raise SuiteError(f"{path}: unknown suite format {path.suffix.lower()!r} (expected .yaml, .yml or .jsonl)")
    key = (str(path.resolve()), text)
    suite = _last_parsed.get(key)
    if suite is None:
        suite = parse_suite_text(path.stem, text, SUITE_SUFFIXES[path.suffix.lower()], str(path))
        for case in suite.cases:
            case.located_at(path.parent)
        _last_parsed.clear()
        _last_parsed[key] = suite
    return suite


# `evalpipe run` reads its suite before the flow starts (bad input exits 2 before Prefect
# does) and the flow reads it again in the same process: the same file with the same text
# is one suite, parsed once (~0.3 s at 2,000 cases). Suites are immutable.
_last_parsed: dict[tuple[str, str], EvalSuite] = {}


def parse_suite_text(name: str, text: str, fmt: str, source: str) -> EvalSuite:
    """Parse suite text in `fmt` ("yaml" or "jsonl"): `name` is the name unless the YAML
    gives one, `source` (a path, or a pinned git URL) names the origin in error messages."""
    if fmt == "jsonl":
        return build_suite(name, _parse_jsonl(source, text), {}, source=source)
    suite_name, raw_cases, defaults = _parse_yaml(source, name, text)
    return build_suite(suite_name, raw_cases, defaults, source=source)


def _parse_yaml(path: str, stem: str, text: str) -> tuple[str, list[tuple[str, Any]], dict[str, Any]]:
    try:
        doc = yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SuiteError(f"{path}:{where} malformed YAML: {problem}") from None
    except LimitError as exc:
        where = f" line {exc.line}:" if exc.line is not None else ""
        raise SuiteError(f"{path}:{where} {exc}") from None
    if not isinstance(doc, dict):
        raise SuiteError(f"{path}: a YAML suite is a mapping with 'name' and 'cases'")
    unknown = set(doc) - {"name", "cases", "description", *SUITE_DEFAULT_KEYS}
    if unknown:
        raise SuiteError(f"{path}: unknown top-level key(s): {', '.join(sorted(map(str, unknown)))}")
    name = doc.get("name", stem)
    if not isinstance(name, str) or not name:
        raise SuiteError(f"{path}: 'name' must be a non-empty string")
    cases = doc.get("cases")
    if not isinstance(cases, list):
        raise SuiteError(f"{path}: 'cases' must be a list")
    defaults = {k: doc[k] for k in SUITE_DEFAULT_KEYS if k in doc}
    return name, [(f"case #{i + 1}", c) for i, c in enumerate(cases)], defaults


def _parse_jsonl(path: str, text: str) -> list[tuple[str, Any]]:
    return [(f"line {lineno}", case) for lineno, case in object_lines(text, path, SuiteError)]


def build_suite(
    name: str, raw_cases: list[tuple[str, Any]], defaults: dict[str, Any], source: str
) -> EvalSuite:
    """Validate raw case mappings (each with a location label) into a suite."""
    cases: list[EvalCase] = []
    seen: dict[str, str] = {}
    for where, raw in raw_cases:
        case = _build_case(raw, defaults, f"{source}: {where}")
        if case.id in seen:
            raise SuiteError(f"{source}: {where}: duplicate case id {case.id!r} (first at {seen[case.id]})")
        seen[case.id] = where
        cases.append(case)
    if not cases:
        raise SuiteError(f"{source}: the suite has no cases")
    return EvalSuite(name=name, cases=tuple(cases))


def _build_case(raw: Any, defaults: dict[str, Any], where: str) -> EvalCase:
    if not isinstance(raw, dict):
        raise SuiteError(f"{where}: a case must be a mapping, got {type(raw).__name__}")
    case_id = raw.get("id")
    if case_id is None:
        raise SuiteError(f"{where}: missing 'id'")
    if not isinstance(case_id, str) or not case_id:
        raise SuiteError(f"{where}: 'id' must be a non-empty string, got {case_id!r}")
    where = f"{where} (id {case_id!r})"
    if "grader" not in raw:
        raise SuiteError(f"{where}: missing 'grader'")
    if not isinstance(raw["grader"], dict):
        raise SuiteError(f"{where}: 'grader' must be a mapping with a 'kind'")
    data = dict(raw)
    # Suite-level settings are folded into each case so that a case describes itself
    # completely: its hash, and so the suite version, covers them.
    if "grader_defaults" in defaults:
        # A default applies to the kinds that take it (a suite-wide `timeout_s` is not
        # an unknown key of its `exact` cases).
        data["grader"] = _with_defaults(data["grader"], defaults["grader_defaults"])
        if isinstance(data.get("extra_graders"), list):
            data["extra_graders"] = [_with_defaults(g, defaults["grader_defaults"]) if isinstance(g, dict) else g
                                     for g in data["extra_graders"]]
    if "safety" in defaults and "safety" not in data:
        data["safety"] = defaults["safety"]
    try:
        return EvalCase.model_validate(data, strict=False)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "case"
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            # Worded as a misspelled grader parameter is: what is wrong and what would be right.
            raise SuiteError(f"{where}: {field}: not a case field (known: {', '.join(EvalCase.model_fields)})") from None
        msg = err["msg"].removeprefix("Value error, ")
        # Grader parameter messages name their own field (grader.KEY), as do the case's own
        # checks across its fields (its tools: `inputs.world.NAME: ...`).
        named = msg.startswith(f"{field}.") or (not err["loc"] and re.match(r"[\w.-]+: ", msg))
        raise SuiteError(f"{where}: {msg}" if named else f"{where}: {field}: {msg}") from None


def _with_defaults(grader: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    kind_keys = parameter_names(grader.get("kind"))
    return {**{k: v for k, v in defaults.items() if kind_keys is None or k in kind_keys}, **grader}


@dataclass(frozen=True)
class SuiteDiff:
    added: list[str]
    removed: list[str]
    changed: list[str]

    def to_json(self) -> dict[str, list[str]]:
        return {"added": self.added, "removed": self.removed, "changed": self.changed}


def diff_suites(old: EvalSuite, new: EvalSuite) -> SuiteDiff:
    """Which case ids were added, removed, or changed in content between two suites."""
    a = {c.id: c.case_hash for c in old.cases}
    b = {c.id: c.case_hash for c in new.cases}
    return SuiteDiff(
        added=sorted(b.keys() - a.keys()),
        removed=sorted(a.keys() - b.keys()),
        changed=sorted(i for i in a.keys() & b.keys() if a[i] != b[i]),
    )
