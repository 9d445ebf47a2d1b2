"""Mirrors and per-sample trees, on real git repositories built in the tests."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import git
import pytest
from support.git_repos import commit

from tasks.repos.worktrees import RepoError, checkout, mirror


@pytest.fixture
def source(tmp_path: Path) -> tuple[git.Repo, str]:
    repo = git.Repo.init(tmp_path / "src", initial_branch="main")
    sha = commit(repo, {"a.py": "A = 1\n", ".gitignore": "*.log\n", "pkg/b.py": "B = 1\n"}, "one")
    return repo, sha


def tree_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def test_checkout_is_a_clean_tree_at_the_commit_and_never_the_working_copy(
    source: tuple[git.Repo, str], home: Path
) -> None:
    repo, sha = source
    src = Path(repo.working_tree_dir)
    (src / "a.py").write_text("A = 'uncommitted'\n")
    (src / "scratch.txt").write_text("user's own file\n")
    with checkout(str(src), sha, home) as tree:
        assert tree.is_relative_to(home / "repos") and not tree.is_relative_to(src)
        assert tree_files(tree) == {
            ".gitignore": "*.log\n",
            "a.py": "A = 1\n",
            "pkg/b.py": "B = 1\n",
        }
        (tree / "a.py").write_text("A = 'edited in the sample'\n")
    assert (src / "a.py").read_text() == "A = 'uncommitted'\n"
    assert (src / "scratch.txt").exists() and repo.head.commit.hexsha == sha


def test_a_reused_tree_is_reset_and_cleaned(source: tuple[git.Repo, str], home: Path) -> None:
    repo, sha = source
    with checkout(repo.working_tree_dir, sha, home) as first:
        (first / "a.py").write_text("changed\n")
        (first / "pkg/b.py").unlink()
        (first / "new.py").write_text("added\n")
        (first / "debug.log").write_text("ignored\n")
        (first / "pkg/__pycache__").mkdir()
        (first / "pkg/__pycache__/b.pyc").write_bytes(b"\0")
        (first / "a.py").chmod(0o755)
    with checkout(repo.working_tree_dir, sha, home) as second:
        assert second == first  # the pooled tree is reused ...
        assert tree_files(second) == {
            ".gitignore": "*.log\n",
            "a.py": "A = 1\n",
            "pkg/b.py": "B = 1\n",
        }
        assert not (second / "a.py").stat().st_mode & 0o111  # ... and reset completely
        assert git.Repo(second).git.status("--porcelain", "--ignored") == ""


def test_a_tampered_tree_is_rebuilt(source: tuple[git.Repo, str], home: Path) -> None:
    repo, sha = source
    with checkout(repo.working_tree_dir, sha, home) as tree:
        (tree / ".git").write_text("gitdir: /nonexistent\n")
    with checkout(repo.working_tree_dir, sha, home) as tree:
        assert tree_files(tree)["a.py"] == "A = 1\n"
    with checkout(repo.working_tree_dir, sha, home) as tree:
        (tree / ".git").unlink()
        (tree / ".git").mkdir()
    with checkout(repo.working_tree_dir, sha, home) as tree:
        assert git.Repo(tree).head.commit.hexsha == sha


def test_mirror_is_fetched_once_and_again_only_for_a_missing_commit(
    source: tuple[git.Repo, str], home: Path
) -> None:
    repo, first = source
    path = mirror(repo.working_tree_dir, home)
    assert mirror(repo.working_tree_dir, home) == path
    second = commit(repo, {"a.py": "A = 2\n"}, "two")
    mirrored = git.Repo(path)
    assert second not in {c.hexsha for c in mirrored.iter_commits("--all")}  # not fetched eagerly
    with checkout(repo.working_tree_dir, first, home) as tree:
        assert (tree / "a.py").read_text() == "A = 1\n"
    assert second not in {c.hexsha for c in mirrored.iter_commits("--all")}
    with checkout(repo.working_tree_dir, second, home) as tree:  # missing: fetched now
        assert (tree / "a.py").read_text() == "A = 2\n"
    # A commit no branch points at is fetched by its sha.
    repo.git.checkout("--detach")
    dangling = commit(repo, {"a.py": "A = 3\n"}, "three")
    repo.git.checkout("main")
    with checkout(repo.working_tree_dir, dangling, home) as tree:
        assert (tree / "a.py").read_text() == "A = 3\n"


def test_git_urls_and_relative_paths(
    source: tuple[git.Repo, str], home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, sha = source
    src = Path(repo.working_tree_dir)
    with checkout(src.as_uri(), sha, home) as tree:
        assert (tree / "a.py").read_text() == "A = 1\n"
    monkeypatch.chdir(src.parent)
    assert mirror("src", home) == mirror(str(src), home)


@pytest.mark.parametrize(
    ("repo", "commit_", "message"),
    [
        ("missing-dir", None, "missing-dir: no such repository"),
        ("not-a-repo", None, "not-a-repo: cannot mirror"),
        ("file:///nonexistent/evalpipe.git", None, "cannot mirror"),
        (None, "0" * 40, f"commit {'0' * 40} not found"),
        (None, "--upload-pack=touch /tmp/x", "is not a commit"),
    ],
)
def test_bad_repositories_and_commits_raise_repo_error(
    source: tuple[git.Repo, str],
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    repo: str | None,
    commit_: str | None,
    message: str,
) -> None:
    src, sha = source
    monkeypatch.chdir(Path(src.working_tree_dir).parent)
    Path("not-a-repo").mkdir()
    with pytest.raises(RepoError, match="^.*" + message.replace("(", r"\(")):
        with checkout(repo or src.working_tree_dir, commit_ or sha, home):
            pass


def test_concurrent_threads_get_separate_clean_trees(
    source: tuple[git.Repo, str], home: Path
) -> None:
    repo, sha = source
    barrier = threading.Barrier(4, timeout=60)
    seen: list[tuple[Path, dict[str, str]]] = []

    def sample(i: int) -> None:
        with checkout(repo.working_tree_dir, sha, home) as tree:
            files = tree_files(tree)
            (tree / "a.py").write_text(f"A = {i}\n")
            barrier.wait()  # all four hold a tree at the same time
            seen.append((tree, files))

    threads = [threading.Thread(target=sample, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({tree for tree, _ in seen}) == 4
    assert all(files["a.py"] == "A = 1\n" for _, files in seen)


def _process_sample(src: str, sha: str, home: str, barrier, out) -> None:
    with checkout(src, sha, Path(home)) as tree:
        out.put((str(tree), (tree / "a.py").read_text()))
        (tree / "a.py").write_text("scribbled\n")
        barrier.wait()


def test_concurrent_processes_get_separate_clean_trees(
    source: tuple[git.Repo, str], home: Path
) -> None:
    repo, sha = source
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(3, timeout=60), ctx.Queue()
    procs = [
        ctx.Process(
            target=_process_sample, args=(repo.working_tree_dir, sha, str(home), barrier, out)
        )
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    assert len({tree for tree, _ in results}) == 3
    assert all(text == "A = 1\n" for _, text in results)
