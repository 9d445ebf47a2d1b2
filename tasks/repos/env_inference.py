"""The environment of an old commit: inferred from the repository as it was then, or given by
the user per date range.

Inferred from, in order: test requirements files (`requirements/test*.txt`,
`requirements-test*.txt`, `test-requirements.txt`, ...), the package itself when it has
metadata (`pyproject.toml` with a `[project]` or `[build-system]`, `setup.py`, `setup.cfg`)
installed editable with its test extras (`test`, `tests`, `testing`) and tox's `extras`/`deps`,
PEP 735 dependency groups of those names, and pytest. Without any of those, the stated
fallback: pytest alone, the tree first on `sys.path` (as the default test command puts it).
A `requires-python` this machine has no interpreter for makes the commit unbuildable here,
with the reason: never graded against the wrong interpreter.

Commits whose inferred specs are equal, down to the content of every file read, share one
environment: its `fingerprint` is the grouping key, and the caller builds it once.
"""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import sys
import tomllib
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from tasks.models import InputError, canonical_json, sha256_hex
from tasks.params import Environment
from tasks.repos.environments import parse_environment, read_environment_file
from tasks.repos.worktrees import RepoError, run_git

TEST_EXTRAS = ("test", "tests", "testing")
_REQUIREMENTS = re.compile(
    r"^(?:requirements[-_](?:test|tests|testing|dev)\w*|(?:test|tests|dev)[-_]requirements)\.txt$")
_REQUIREMENTS_DIR = re.compile(r"^(?:test|tests|testing)\w*\.txt$")
# Interpreters looked for on PATH when a commit's requires-python excludes this one.
_PYTHONS = tuple(f"python3.{minor}" for minor in range(6, 16))
FALLBACK = "pytest only, the tree first on sys.path"


@dataclass(frozen=True)
class Inferred:
    """An environment for a commit (None: it cannot be built here), what it came from, and
    the key of the commits that share it."""

    spec: Environment | None
    source: str
    fingerprint: str
    read: dict[str, str] = field(default_factory=dict, compare=False)  # what each file read gave


def _read(mirror_path: Path, commit: str, path: str) -> str | None:
    try:
        return run_git(mirror_path, "show", f"{commit}:{path}")
    except RepoError:
        return None


def _listing(mirror_path: Path, commit: str, folder: str = "") -> list[str]:
    try:
        out = run_git(mirror_path, "ls-tree", "--name-only", commit, *([f"{folder}/"] if folder else []))
    except RepoError:
        return []
    return [line.rsplit("/", 1)[-1] for line in out.splitlines()]


def infer_environment(mirror_path: Path, commit: str) -> Inferred:
    """The environment the repository at `commit` describes (see the module's text)."""
    top = _listing(mirror_path, commit)
    read: dict[str, str] = {}

    def load(path: str) -> str | None:
        text = _read(mirror_path, commit, path)
        if text is not None:
            read[path] = text
        return text

    requirements = [name for name in top if _REQUIREMENTS.match(name)]
    if "requirements" in top:
        requirements += [f"requirements/{n}" for n in _listing(mirror_path, commit, "requirements")
                         if _REQUIREMENTS_DIR.match(n)]
    for path in requirements:
        load(path)
    pyproject = _toml(load("pyproject.toml") if "pyproject.toml" in top else None)
    if pyproject:  # what decides the install, not the version or the tools' settings
        read["pyproject.toml"] = canonical_json(_install_relevant(pyproject)).decode()
    setup_py = load("setup.py") if "setup.py" in top else None
    setup_cfg = _ini(load("setup.cfg") if "setup.cfg" in top else None)
    tox = _ini(load("tox.ini") if "tox.ini" in top else None)

    packaged = setup_py is not None or setup_cfg.has_section("metadata") or (
        "project" in pyproject or "build-system" in pyproject)
    extras = sorted(_extras(pyproject, setup_cfg, setup_py) | _tox_extras(tox))
    install = [f"pip install -r {shlex.quote(path)}" for path in requirements]
    deps = _groups(pyproject) + _tox_deps(tox)
    if deps:
        install.append(shlex.join(["pip", "install", *deps]))
    if packaged:
        install.append("pip install -e " + shlex.quote("." + (f"[{','.join(extras)}]" if extras else "")))
    sources = [*requirements, *(p for p in ("pyproject.toml", "setup.py", "setup.cfg", "tox.ini") if p in read)]
    if not install and "requirements.txt" in top and load("requirements.txt") is not None:
        install.append("pip install -r requirements.txt")  # no package: its runtime requirements
        sources.append("requirements.txt")
    source = ", ".join(sources) if install else (
        f"no pyproject.toml, setup.py, setup.cfg, requirements or tox.ini: {FALLBACK}")
    if "pip install pytest" not in install:
        install.append("pip install pytest")  # a no-op when a requirement already brought it
    python, why = _python(_requires_python(pyproject, setup_cfg, setup_py))
    fingerprint = sha256_hex(canonical_json({"install": install, "python": python, "read": read}))
    if why:
        return Inferred(None, f"{source}: {why}", fingerprint, read)
    return Inferred(Environment(python=python, install=tuple(install)), source, fingerprint, read)


def _toml(text: str | None) -> dict[str, Any]:
    try:
        return tomllib.loads(text) if text else {}
    except tomllib.TOMLDecodeError:
        return {}


def _ini(text: str | None) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read_string(text or "")
    except configparser.Error:
        return configparser.ConfigParser(interpolation=None)
    return parser


def _extras(pyproject: dict, setup_cfg: configparser.ConfigParser, setup_py: str | None) -> set[str]:
    declared = set((pyproject.get("project") or {}).get("optional-dependencies") or {})
    if setup_cfg.has_section("options.extras_require"):
        declared |= set(setup_cfg["options.extras_require"])
    if setup_py:
        declared |= {m for m in re.findall(r"""["'](\w+)["']\s*:""", setup_py) if m in TEST_EXTRAS}
    return declared & set(TEST_EXTRAS)


def _tox_extras(tox: configparser.ConfigParser) -> set[str]:
    if not tox.has_section("testenv"):
        return set()
    return {e for e in re.split(r"[\s,]+", tox["testenv"].get("extras", "")) if re.fullmatch(r"[\w.-]+", e)}


def _tox_deps(tox: configparser.ConfigParser) -> list[str]:
    """tox's plain requirement lines (substitutions, options and conditions are tox's own)."""
    if not tox.has_section("testenv"):
        return []
    lines = [ln.strip() for ln in tox["testenv"].get("deps", "").splitlines()]
    return [ln for ln in lines if ln and not re.search(r"[{}:]|^-", ln)]


def _install_relevant(pyproject: dict) -> dict:
    project = pyproject.get("project") or {}
    return {"build-system": pyproject.get("build-system"), "dependency-groups": pyproject.get("dependency-groups"),
            **{k: project.get(k) for k in ("dependencies", "optional-dependencies", "requires-python")}}


def _groups(pyproject: dict) -> list[str]:
    """The requirements of the test dependency groups (PEP 735); `dev` only without one."""
    groups = pyproject.get("dependency-groups") or {}
    names = [n for n in TEST_EXTRAS if n in groups] or [n for n in ("dev",) if n in groups]
    found = [r for name in names for r in groups[name] if isinstance(r, str)]
    return list(dict.fromkeys(found))


def _requires_python(pyproject: dict, setup_cfg: configparser.ConfigParser, setup_py: str | None) -> str | None:
    spec = (pyproject.get("project") or {}).get("requires-python")
    if spec is None and setup_cfg.has_option("options", "python_requires"):
        spec = setup_cfg["options"]["python_requires"]
    if spec is None and setup_py:
        found = re.search(r"""python_requires\s*=\s*["']([^"']+)["']""", setup_py)
        spec = found.group(1) if found else None
    return spec


def _python(requires: str | None) -> tuple[str | None, str]:
    """(None for this interpreter, or the name of one on PATH; why none fits, or "")."""
    if not requires:
        return None, ""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        specifier = SpecifierSet(requires)
    except InvalidSpecifier:
        return None, ""  # unreadable: the build says whether this interpreter does
    here = ".".join(map(str, sys.version_info[:3]))
    if specifier.contains(here, prereleases=True):
        return None, ""
    for name in reversed(_PYTHONS):
        if shutil.which(name) and specifier.contains(name.removeprefix("python") + ".0", prereleases=True):
            return name, ""
    return None, f"requires-python {requires}, and this machine has no interpreter for it (python {here} here)"


# ------------------------------------------------------------------ given by the user


@dataclass(frozen=True)
class Rule:
    """An environment the user gives for the commits dated in [since, until]."""

    environment: Environment
    since: date | None = None
    until: date | None = None

    def covers(self, when: date) -> bool:
        return (self.since is None or when >= self.since) and (self.until is None or when <= self.until)


def load_environment_rules(path: Path) -> list[Rule]:
    """`--environment FILE`: one environment (python, install, ...) for every commit, or a
    list of `{since: DATE, until: DATE, environment: {...}}`, the first that covers a
    commit's date winning (a commit none covers gets the inferred one). Raises `InputError`."""
    doc = read_environment_file(path)
    if isinstance(doc, dict):
        return [Rule(_spec(doc, f"{path}"))]
    if not isinstance(doc, list) or not doc:
        raise InputError(f"{path}: expected an environment (python, install) or a list of"
                         " {since, until, environment}")
    rules = []
    for i, item in enumerate(doc):
        where = f"{path}: item {i + 1}"
        if not isinstance(item, dict) or set(item) - {"since", "until", "environment"} or "environment" not in item:
            raise InputError(f"{where}: expected a mapping of since, until (dates) and environment")
        rules.append(Rule(_spec(item["environment"], where), _date(item.get("since"), f"{where}: since"),
                          _date(item.get("until"), f"{where}: until")))
    return rules


def _spec(value: Any, where: str) -> Environment:
    spec = parse_environment(value, f"{where}: environment") if isinstance(value, dict) else None
    if spec is None:
        raise InputError(f"{where}: an environment is a mapping (python, install)")
    return spec


def _date(value: Any, where: str) -> date | None:
    if value is None or isinstance(value, date):
        return value.date() if isinstance(value, datetime) else value
    try:
        return date.fromisoformat(str(value))
    except ValueError:
        raise InputError(f"{where}: {value!r} is not a date (YYYY-MM-DD)") from None


def given_environment(rules: list[Rule], committed: str) -> Inferred | None:
    """The user's environment for a commit dated `committed` (ISO 8601), or None."""
    when = datetime.fromisoformat(committed).date()
    for rule in rules:
        if rule.covers(when):
            spec = rule.environment
            return Inferred(spec, "given (--environment)",
                            sha256_hex(canonical_json(spec.model_dump(mode="json"))))
    return None


@dataclass(frozen=True)
class Assigned:
    """The environment a candidate is mined and graded in: the `environment` mapping of its
    cases (None: it cannot be built here, `source` says why), shared by every candidate with
    the same `fingerprint` and built at one commit of theirs (`setup_commit`)."""

    fingerprint: str
    environment: dict[str, Any] | None
    source: str


def assign_environments(mirror_path: Path, parents: list[tuple[str, str, str]],
                        rules: list[Rule] | None = None) -> dict[str, Assigned]:
    """For each (commit, parent, date), newest first: the user's environment for its date,
    else the one inferred at its parent. Equal specs share one environment, built at the
    newest parent among them; an inferred one installs the packages as they were at the
    newest commit's date (uv's `--exclude-newer`), not today's."""
    found: dict[str, Inferred] = {}
    newest: dict[str, tuple[str, str]] = {}  # fingerprint -> (parent, date) of its newest commit
    for commit, parent, committed in parents:
        given = given_environment(rules, committed) if rules else None
        inferred = given or infer_environment(mirror_path, parent)
        found[commit] = inferred
        newest.setdefault(inferred.fingerprint, (parent, "" if given else committed))
    assigned = {}
    for commit, inferred in found.items():
        environment = None
        if inferred.spec is not None:
            parent, committed = newest[inferred.fingerprint]
            environment = inferred.spec.model_dump(mode="json", exclude_defaults=True)
            environment.setdefault("setup_commit", parent)
            if committed:
                environment["install"] = as_of(environment["install"], committed)
        assigned[commit] = Assigned(inferred.fingerprint, environment, inferred.source)
    return assigned


def as_of(install: list[str], committed: str) -> list[str]:
    """Each `pip install` resolving only what was published by `committed` (ISO 8601): a
    commit of two years ago gets the pytest of two years ago, whose deprecations its tests
    were written against. `pip` in a build is uv's (`tasks.repos.environments`)."""
    when = datetime.fromisoformat(committed).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return [re.sub(r"^pip install ", f"pip install --exclude-newer {when} ", command) for command in install]
