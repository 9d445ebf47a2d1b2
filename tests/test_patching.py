"""Patch application: exact, atomic, confined to the root. Diffs come from real `git diff`."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tasks.repos.patching import apply_patch

CALC = '''def add(a, b):
    """Return the sum of a and b."""
    return abs(a) + b


def sub(a, b):
    return a - b
'''

FIX = """calc.py
<<<<<<< SEARCH
    return abs(a) + b
=======
    return a + b
>>>>>>> REPLACE
"""


def git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under root (outside .git) with its content and mode."""
    out = {}
    for path in sorted(root.rglob("*")):
        if ".git" in path.relative_to(root).parts or path.is_dir():
            continue
        out[str(path.relative_to(root))] = (path.read_bytes(), path.lstat().st_mode)
    return out


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def diff_between(repo: Path, base: dict[str, str], target: dict[str, str]) -> str:
    """The `git diff` taking `base` to `target`; leaves the work tree at `base`."""
    for child in repo.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    write_tree(repo, base)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", "base")
    for rel in base:
        (repo / rel).unlink()
    write_tree(repo, target)
    git(repo, "add", "-A")
    diff = git(repo, "diff", "--cached", "-M", "HEAD")
    git(repo, "reset", "-q", "--hard", "HEAD")
    git(repo, "clean", "-fdxq")
    return diff


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    return root


def test_search_replace_applies_exactly(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text(CALC)
    result = apply_patch(tmp_path, FIX)
    assert result.applied and result.paths == ("calc.py",)
    assert (tmp_path / "calc.py").read_text() == CALC.replace("abs(a) + b", "a + b")


def test_fenced_answer_and_prose_around_blocks(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text(CALC)
    answer = "Here is the fix:\n\n```python\n" + FIX + "```\n"
    assert apply_patch(tmp_path, answer).applied
    assert "return a + b" in (tmp_path / "calc.py").read_text()


@pytest.mark.parametrize(
    ("patch", "detail"),
    [
        (
            FIX.replace("abs(a) + b\n=", "abs(a) - b\n="),
            "calc.py: search/replace block 1 does not match",
        ),
        (FIX.replace("    return abs(a) + b\n=", "return abs(a) + b\n="), "block 1 does not match"),
        (
            "calc.py\n<<<<<<< SEARCH\n\n=======\n# gap\n>>>>>>> REPLACE\n",
            "block 1 matches 2 places",
        ),
        (FIX.replace("calc.py", "nope.py"), "nope.py: search/replace block 1: no such file"),
        (FIX.replace(">>>>>>> REPLACE\n", ""), "has no '>>>>>>> REPLACE' line"),
        ("I could not find the bug, sorry.", "no unified diff hunks or search/replace blocks"),
    ],
)
def test_non_matching_block_is_not_applied(tmp_path: Path, patch: str, detail: str) -> None:
    (tmp_path / "calc.py").write_text(CALC)
    (tmp_path / "other.py").write_text("x = 1\n")
    before = snapshot(tmp_path)
    result = apply_patch(tmp_path, patch)
    assert not result.applied and not result.empty
    assert detail in result.detail
    assert snapshot(tmp_path) == before


def test_second_file_failing_leaves_first_untouched(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text(CALC)
    (tmp_path / "other.py").write_text("x = 1\n")
    before = snapshot(tmp_path)
    patch = FIX + "other.py\n<<<<<<< SEARCH\nx = 2\n=======\nx = 3\n>>>>>>> REPLACE\n"
    result = apply_patch(tmp_path, patch)
    assert not result.applied and result.detail == "other.py: search/replace block 2 does not match"
    assert snapshot(tmp_path) == before


def test_search_replace_creates_file_and_keeps_missing_final_newline(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo")
    patch = (
        "a.txt\n<<<<<<< SEARCH\ntwo\n=======\nTWO\n>>>>>>> REPLACE\n"
        "pkg/new.py\n<<<<<<< SEARCH\n=======\nprint('hi')\n>>>>>>> REPLACE\n"
    )
    result = apply_patch(tmp_path, patch)
    assert result.applied and result.paths == ("a.txt", "pkg/new.py")
    assert (tmp_path / "a.txt").read_text() == "one\nTWO"
    assert (tmp_path / "pkg/new.py").read_text() == "print('hi')\n"


@pytest.mark.parametrize("patch", ["", "  \n\n", "```diff\n```\n"])
def test_empty_patch_is_reported_distinctly(tmp_path: Path, patch: str) -> None:
    result = apply_patch(tmp_path, patch)
    assert result.empty and not result.applied and result.detail == "empty patch"


def test_git_diff_new_deleted_renamed_and_modes(repo: Path) -> None:
    base = {
        "keep.py": "a\nb\nc\n",
        "gone.py": "bye\n",
        "old/name.py": "".join(f"l{i}\n" for i in range(20)),
    }
    target = {
        "keep.py": "a\nB\nc",  # also drops the final newline
        "old/name.py": None,
        "new/name.py": "".join(f"l{i}\n" for i in range(20)).replace("l7", "L7"),
        "fresh/run.sh": "#!/bin/sh\necho hi\n",
        "empty.txt": "",
    }
    diff = diff_between(
        repo, base, {k: v for k, v in target.items() if v is not None and k != "fresh/run.sh"}
    )
    # Add an executable new file to the diff the way git writes it.
    write_tree(repo, {"fresh/run.sh": target["fresh/run.sh"]})
    os.chmod(repo / "fresh/run.sh", 0o755)
    git(repo, "add", "-N", "fresh/run.sh")
    diff += git(repo, "diff", "--", "fresh/run.sh")
    git(repo, "rm", "-q", "--cached", "fresh/run.sh")
    shutil.rmtree(repo / "fresh")
    assert (
        "rename from old/name.py" in diff and "deleted file mode" in diff and "No newline" in diff
    )

    result = apply_patch(repo, diff)
    assert result.applied, result.detail
    assert set(result.paths) == {
        "keep.py",
        "gone.py",
        "old/name.py",
        "new/name.py",
        "fresh/run.sh",
        "empty.txt",
    }
    assert (repo / "keep.py").read_text() == "a\nB\nc"
    assert not (repo / "gone.py").exists() and not (repo / "old").exists()
    assert (repo / "new/name.py").read_text() == target["new/name.py"]
    assert (repo / "empty.txt").read_text() == ""
    assert os.access(repo / "fresh/run.sh", os.X_OK)


def test_hunk_applies_at_shifted_position_but_never_with_fuzz(repo: Path) -> None:
    lines = "".join(f"line {i}\n" for i in range(30))
    diff = diff_between(repo, {"f.txt": lines}, {"f.txt": lines.replace("line 20\n", "LINE 20\n")})
    (repo / "f.txt").write_text("header\n" * 5 + lines)  # the hunk now sits 5 lines lower
    assert apply_patch(repo, diff).applied
    assert "LINE 20" in (repo / "f.txt").read_text()

    (repo / "f.txt").write_text(
        lines.replace("line 18\n", "line 18 changed\n")
    )  # one context line differs
    before = snapshot(repo)
    result = apply_patch(repo, diff)
    assert not result.applied and result.detail.startswith("f.txt: hunk 1 (@@ -")
    assert snapshot(repo) == before


def test_new_file_that_exists_and_deletion_that_does_not_match(repo: Path) -> None:
    diff = diff_between(repo, {}, {"n.py": "x\n"})
    (repo / "n.py").write_text("mine\n")
    assert apply_patch(repo, diff).detail == "n.py: already exists"
    diff = diff_between(repo, {"d.py": "x\n"}, {})
    (repo / "d.py").write_text("x\ny\n")
    result = apply_patch(repo, diff)
    assert not result.applied and (repo / "d.py").read_text() == "x\ny\n"


@pytest.mark.parametrize(
    "target",
    [
        "../outside.py",
        "/tmp/evalpipe-abs.py",
        "sub/../../outside.py",
        ".git/hooks/pre-commit",
        "link/x.py",
        "filelink",
    ],
)
def test_paths_escaping_the_root_are_refused(tmp_path: Path, target: str) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (outside / "x.py").write_text("x = 1\n")
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "filelink").symlink_to(outside / "x.py")
    (root / ".git").mkdir()
    before_root, before_out = snapshot(root), snapshot(outside)
    block = f"{target}\n<<<<<<< SEARCH\nx = 1\n=======\nx = 2\n>>>>>>> REPLACE\n"
    diff = f"--- a/{target}\n+++ b/{target}\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    new = f"--- /dev/null\n+++ b/{target}\n@@ -0,0 +1 @@\n+x = 2\n"
    for patch in (block, diff, new):
        result = apply_patch(root, patch)
        assert not result.applied and target.lstrip("/").split("/")[0] in result.detail
    assert snapshot(root) == before_root and snapshot(outside) == before_out
    assert not (tmp_path / "outside.py").exists() and not Path("/tmp/evalpipe-abs.py").exists()


# ---------------------------------------------------------------- properties

NAMES = st.sampled_from(["a.py", "b.txt", "pkg/c.py", "pkg/sub/d.py", "e.cfg"])
LINE = st.sampled_from(["", "x = 1", "y = 2", "def f():", "    return x", "# note", "pass", "\tz"])
TEXT = st.builds(
    lambda lines, newline: "\n".join(lines) + ("\n" if newline and lines else ""),
    st.lists(LINE, max_size=25),
    st.booleans(),
)
TREES = st.dictionaries(NAMES, TEXT, max_size=5)


@st.composite
def edits(draw: st.DrawFn) -> tuple[dict[str, str], dict[str, str]]:
    """A base tree and a target tree reached by modifying, deleting, adding and moving files."""
    base = draw(TREES)
    target: dict[str, str] = {}
    for name, text in base.items():
        action = draw(st.sampled_from(["keep", "edit", "delete", "move"]))
        if action == "keep":
            target[name] = text
        elif action == "edit":
            lines = text.split("\n")
            at = draw(st.integers(0, len(lines)))
            cut = draw(st.integers(0, 3))
            target[name] = "\n".join(
                lines[:at] + draw(st.lists(LINE, max_size=4)) + lines[at + cut :]
            )
        elif action == "move":
            target["moved/" + name] = text + "# moved\n"
    for name, text in draw(
        st.dictionaries(NAMES.map(lambda n: "new/" + n), TEXT, max_size=2)
    ).items():
        target[name] = text
    return base, target


@pytest.fixture(scope="module")
def scratch_repo() -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        git(root, "init", "-q")
        yield root


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(edits())
def test_applying_a_git_diff_reproduces_the_edit(
    scratch_repo: Path, case: tuple[dict, dict]
) -> None:
    base, target = case
    diff = diff_between(scratch_repo, base, target)
    result = apply_patch(scratch_repo, diff)
    if not diff.strip():
        assert result.empty
        return
    assert result.applied, (result.detail, diff)
    assert {k: v[0].decode() for k, v in snapshot(scratch_repo).items()} == target


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(edits(), st.data())
def test_a_mismatching_hunk_changes_nothing(
    scratch_repo: Path, case: tuple[dict, dict], data: st.DataObject
) -> None:
    base, target = case
    modified = sorted(n for n in base if n in target and base[n] != target[n] and base[n].strip())
    assume(modified)
    diff = diff_between(scratch_repo, base, target)
    victim = data.draw(st.sampled_from(modified))
    # Every line of one patched file now differs, so none of its hunks can match.
    drifted = "".join(
        line.replace("\n", "~\n") for line in (scratch_repo / victim).read_text().splitlines(True)
    )
    (scratch_repo / victim).write_text(drifted + ("" if drifted.endswith("\n") else "~"))
    before = snapshot(scratch_repo)
    result = apply_patch(scratch_repo, diff)
    assert not result.applied and result.detail.startswith(f"{victim}: hunk ")
    assert snapshot(scratch_repo) == before


def test_a_diff_names_the_hunk_that_does_not_match(repo: Path) -> None:
    lines = "".join(f"line {i}\n" for i in range(40))
    target = lines.replace("line 3\n", "LINE 3\n").replace("line 30\n", "LINE 30\n")
    diff = diff_between(repo, {"f.txt": lines}, {"f.txt": target})
    (repo / "f.txt").write_text(lines.replace("line 31\n", "line 31 drifted\n"))
    before = snapshot(repo)
    result = apply_patch(repo, diff)
    assert result.detail == "f.txt: hunk 2 (@@ -28,7 +28,7 @@) does not match"
    assert snapshot(repo) == before  # hunk 1 matched, and was not written either


def test_a_diff_aimed_at_a_directory_is_refused(repo: Path) -> None:
    # git apply itself reports such a patch "applied cleanly" and changes nothing.
    (repo / "dd").mkdir()
    result = apply_patch(repo, "--- a/dd\n+++ b/dd\n@@ -1 +1 @@\n-x = 1\n+x = 2\n")
    assert not result.applied and result.detail == "dd: is a directory"


def test_git_configuration_does_not_change_what_a_diff_writes(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user's `apply.whitespace=fix` would strip the trailing blanks the patch adds.
    (tmp_path / "gitconfig").write_text("[apply]\n\twhitespace = fix\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    diff = diff_between(repo, {"w.py": "x = 1\n"}, {"w.py": "x = 1   \ny = 2\t\n"})
    assert apply_patch(repo, diff).applied
    assert (repo / "w.py").read_text() == "x = 1   \ny = 2\t\n"


@pytest.mark.parametrize(
    ("header", "detail"),
    [
        ("new file mode 120000\n", "symbolic links in patches are not supported"),
        ("new file mode 160000\n", "submodules in patches are not supported"),
        ("old mode 100644\nnew mode 120000\n", "symbolic links in patches are not supported"),
    ],
)
def test_links_and_submodules_are_refused(repo: Path, header: str, detail: str) -> None:
    body = "--- /dev/null\n+++ b/ln\n"
    if "old mode" in header:
        (repo / "ln").write_text("x\n")
        body = "--- a/ln\n+++ b/ln\n"
    body += "@@ -0,0 +1 @@\n+/etc/passwd\n\\ No newline at end of file\n"
    before = snapshot(repo)
    result = apply_patch(repo, f"diff --git a/ln b/ln\n{header}index 0000000..1234567\n{body}")
    assert not result.applied and result.detail == detail
    assert snapshot(repo) == before


def test_binary_patches_are_refused(repo: Path) -> None:
    patch = (
        "diff --git a/b.bin b/b.bin\nnew file mode 100644\nindex 0000000..1234567\n"
        "GIT binary patch\nliteral 3\nKcmZ>3$N&HP00002\n\nliteral 0\nHcmV?d00001\n"
    )
    result = apply_patch(repo, patch)
    assert not result.applied and result.detail == "b.bin: binary patches are not supported"
    assert not (repo / "b.bin").exists()


# Headers our parser and git may read differently: git's own reading is what is checked.
DESYNC = {
    "mode-after-plus": ("diff --git a/ln b/ln\n--- /dev/null\n+++ b/ln\nnew file mode 120000\n"
                        "@@ -0,0 +1 @@\n+/etc/passwd\n\\ No newline at end of file\n",
                        "symbolic links in patches are not supported"),
    "rename-out": ("diff --git a/f.py b/f.py\nsimilarity index 100%\nrename from f.py\n"
                   "rename to ../outside.py\n", "escapes the repository"),
    "rename-into-git": ("diff --git a/f.py b/.git/hooks/post-checkout\nsimilarity index 100%\n"
                        "rename from f.py\nrename to .git/hooks/post-checkout\n", "touches .git"),
    "rename-then-edit": ("diff --git a/f.py b/../g.py\nsimilarity index 90%\nrename from f.py\n"
                         "rename to ../g.py\n--- a/f.py\n+++ b/../g.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n",
                         "escapes the repository"),
}


@pytest.mark.parametrize("name", sorted(DESYNC))
def test_headers_git_reads_otherwise_are_refused(repo: Path, name: str) -> None:
    (repo / "f.py").write_text("x = 1\n")
    patch, detail = DESYNC[name]
    before = snapshot(repo)
    result = apply_patch(repo, patch)
    assert not result.applied and detail in result.detail, result.detail
    assert snapshot(repo) == before
    assert not (repo.parent / "outside.py").exists() and not (repo.parent / "g.py").exists()
