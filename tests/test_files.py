"""Atomic replacement: the target holds the old content or the new, and no temporary stays."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.files import atomic_path, atomic_write


def test_atomic_write_replaces_the_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.txt"
    atomic_write(target, "é\n")
    assert target.read_bytes() == "é\n".encode()
    atomic_write(target, b"\x00\xff", mode=0o600)
    assert target.read_bytes() == b"\x00\xff" and target.stat().st_mode & 0o777 == 0o600
    assert os.listdir(target.parent) == ["out.txt"]


@pytest.mark.parametrize("failure", ["unencodable", "rename"])
def test_a_failed_write_leaves_the_target_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")
    data = "lone \ud800 surrogate"
    if failure == "rename":
        data = "new"

        def refuse(src: object, dst: object) -> None:
            raise OSError("no rename")

        monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises((UnicodeEncodeError, OSError)):
        atomic_write(target, data)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_a_directory_built_at_the_atomic_path_is_removed_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "repo.git"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        (tmp / "objects").mkdir(parents=True)
        raise RuntimeError("clone failed")
    assert os.listdir(tmp_path) == []
    with atomic_path(target) as tmp:
        (tmp / "objects").mkdir(parents=True)
    assert (target / "objects").is_dir() and os.listdir(tmp_path) == ["repo.git"]
