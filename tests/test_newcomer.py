"""The path a new user takes: the README's first screen, the suite-format doc's examples,
docs that stay inside the repository, and the calc example on a fresh clone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.suites.dataset import build_suite, parse_suite_text

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FIRST_SCREEN = 30  # lines


def tracked(under: str) -> list[str]:
    """The files a clone of the project has under `under` (tracked or new, not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", under],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


def test_readme_first_screen_starts_with_make_and_says_where_things_are():
    lines = README.read_text().splitlines()
    commands = [line.split("#")[0].strip() for line in lines if line.startswith("make ")]
    assert commands[:2] == ["make demo", "make test"]
    first = "\n".join(lines[:FIRST_SCREEN])
    assert "EVALPIPE_HOME" in first
    assert "(docs/suites.md)" in first and "(docs/contract.md)" in first


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_docs_link_only_inside_the_repository(doc: Path):
    text = doc.read_text()
    assert "SPEC" not in text.replace("--agent SPEC", "").replace("--judge SPEC", "")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"{doc.name} links {target}"


def test_code_cites_the_contract_not_an_outside_file():
    for name in tracked("."):
        if name.endswith((".py", ".md", ".yaml", ".toml")) and name != "tests/test_newcomer.py":
            text = (ROOT / name).read_text()
            assert "SPEC §" not in text and "shared/SPEC" not in text, name


def yaml_blocks(text: str) -> list:
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def test_every_suite_example_in_the_format_doc_loads():
    text = (ROOT / "docs/suites.md").read_text()
    blocks = yaml_blocks(text)
    whole = [b for b in blocks if isinstance(b, dict) and "cases" in b]
    assert len(whole) == 1
    suite = parse_suite_text("example", yaml.safe_dump(whole[0]), "yaml", "docs/suites.md")
    assert suite.cases[0].grader == {"kind": "exact", "normalize": True}  # grader_defaults merged
    cases = [case for b in blocks if isinstance(b, list) for case in b]
    kinds = {c["grader"]["kind"] for c in cases}
    assert kinds == {"exact", "contains", "regex", "numeric", "json", "predicate", "python_tests",
                     "repo_tests", "judge", "human"}
    build_suite("doc-examples", [(c["id"], c) for c in cases], {}, source="docs/suites.md")
    for line in re.findall(r"```json\n(.*?)```", text, re.S):
        build_suite("jsonl", [("line 1", yaml.safe_load(line))], {}, source="docs/suites.md")


def test_calc_example_grades_on_a_fresh_clone(tmp_path, home, monkeypatch):
    """No `make demo`, no build script: the suite's repository comes with the project."""
    from tasks.graders import grade
    from tasks.models import Status
    from tasks.suites.dataset import load_suite

    clone = tmp_path / "clone"
    for name in tracked("examples"):
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, clone / name)
    assert not (clone / "examples/calc/repo").exists()
    monkeypatch.chdir(clone)
    case = load_suite(Path("examples/calc/calc.yaml")).case("add-bug")
    assert grade(case.reference, case).status is Status.passed
    assert grade("", case).status is Status.empty


def test_the_calc_bundle_is_what_the_build_script_builds(calc_repo, tmp_path):
    _, sha = calc_repo
    heads = subprocess.run(["git", "ls-remote", str(ROOT / "examples/calc/calc.bundle")],
                           capture_output=True, text=True, check=True).stdout.split()
    assert heads[0] == sha


def test_the_readmes_line_after_make_puts_evalpipe_on_path_for_the_commands_below(tmp_path):
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests run outside a virtual environment: there is no .venv to activate")
    lines = README.read_text().splitlines()
    first_block = lines[lines.index("```") + 1:lines.index("```", lines.index("```") + 1)]
    [instruction] = [line.split("#")[0].strip() for line in first_block if ".venv/bin" in line]
    assert any(line.startswith("evalpipe ") for line in lines)  # the commands it is for
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(sys.prefix)  # what `make demo` made, in a clone elsewhere
    bare = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not Path(p, "evalpipe").exists())  # a fresh shell: evalpipe not on PATH
    shell = subprocess.run(["bash", "-c", f"command -v evalpipe && exit 9; {instruction} && evalpipe --help"],
                           cwd=clone, env={**os.environ, "PATH": bare}, capture_output=True, text=True, timeout=120)
    assert shell.returncode == 0, shell.stderr
    assert "Usage: evalpipe" in shell.stdout


def test_the_first_make_says_it_is_installing_before_it_installs(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    # `true` stands in for the interpreters: the rule's steps run, the venv's creation (3.5 s of
    # CPU) and the install itself are skipped.
    make = ["make", "--no-print-directory", f"VENV={venv}", "PY=true", "PYTHON=true", f"{venv}/.installed"]
    first = subprocess.run(make, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("evalpipe: installing evalpipe and its dependencies into "), first.stdout
    again = subprocess.run(make, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "installing" not in again.stdout  # installed: nothing to say
