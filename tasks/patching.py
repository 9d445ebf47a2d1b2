"""Apply a candidate patch to a tree, fail closed: all of it exactly, or nothing.

Two formats (docs/contract.md §4): unified diffs (git-style `a/` `b/` prefixes, new, deleted and
renamed files) and search/replace blocks (a `path` line, `<<<<<<< SEARCH`, old text,
`=======`, new text, `>>>>>>> REPLACE`). Every edit is computed in memory first; the disk
is written only when every hunk and block matched, so a failure leaves the tree untouched.

"Exactly" means the hunk's old lines (context and removals) equal the file's lines byte
for byte. Like `git apply`, a hunk may sit at a different line than its header claims
(the nearest exact match wins, hunks in order); unlike `patch --fuzz`, no context line is
ever ignored. A search block must match exactly once, starting at a line start.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

SEARCH, DIVIDER, REPLACE = "<<<<<<< SEARCH", "=======", ">>>>>>> REPLACE"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_FENCE = re.compile(r"^\s*(```|~~~)")


class PatchError(Exception):
    """A patch that cannot be applied; the message names the file and hunk or block."""


@dataclass(frozen=True)
class PatchResult:
    """What `apply_patch` did. `applied` and `empty` are never both true."""

    applied: bool
    empty: bool = False
    detail: str = ""
    paths: tuple[str, ...] = ()  # the files the patch wrote or deleted, root-relative


# ---------------------------------------------------------------- parsing


@dataclass
class _Hunk:
    old_start: int
    old: list[str]  # lines with their endings, as the file must contain them
    new: list[str]
    header: str


@dataclass
class _Block:
    number: int  # 1-based position in the patch, for error messages
    search: str
    replace: str


@dataclass
class _FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: list[_Hunk] = field(default_factory=list)
    blocks: list[_Block] = field(default_factory=list)
    executable: bool | None = None  # a git mode line, when present


def _lines(text: str) -> list[str]:
    """Split on "\\n" only, keeping endings: str.splitlines would also split on \\f, \\r..."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _unquote(path: str) -> str:
    # git quotes paths with unusual bytes C-style: "a/sp\303\244ce"
    if len(path) >= 2 and path[0] == path[-1] == '"' and path.isascii():
        raw = path[1:-1].encode("ascii").decode("unicode_escape")
        return raw.encode("latin-1").decode("utf-8", "surrogateescape")
    return path


def _header_path(line: str) -> str:
    value = line[4:].rstrip("\n").rstrip("\r")
    if not value.startswith('"'):
        value = value.split("\t", 1)[0]  # diff(1) puts a timestamp after a tab
    return _unquote(value.strip())


def _strip_prefix(path: str, prefix: str, git_style: bool) -> str:
    return path[len(prefix) :] if git_style and path.startswith(prefix) else path


def _parse_diff(text: str) -> list[_FilePatch]:
    lines = _lines(text)
    patches: list[_FilePatch] = []
    i = 0
    # State of the current `diff --git` section before its ---/+++ lines (if any).
    git: dict[str, str | None] | None = None

    def flush_git() -> None:
        # A git section with no hunks: a pure rename, mode change, or empty new/deleted file.
        nonlocal git
        if git is not None and any(git.get(k) for k in ("rename_from", "new", "deleted", "mode")):
            patches.append(_git_file_patch(git))
        git = None

    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            flush_git()
            git = _parse_git_header(line)
        elif git is not None and line.startswith(("rename from ", "rename to ")):
            key = "rename_from" if line.startswith("rename from ") else "rename_to"
            git[key] = _unquote(line.split(" ", 2)[2].rstrip("\r\n"))
        elif git is not None and line.startswith("copy from "):
            raise PatchError(f"{git['b']}: copies are not supported")
        elif git is not None and line.startswith(("new file mode ", "new mode ")):
            git["new" if line.startswith("new file") else "mode"] = line.split()[-1]
        elif git is not None and line.startswith("deleted file mode "):
            git["deleted"] = "1"
        elif line.startswith(("GIT binary patch", "Binary files ")):
            raise PatchError(f"{git['b'] if git else 'patch'}: binary patches are not supported")
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _header_path(line), _header_path(lines[i + 1])
            git_style = git is not None or (
                all(p.startswith(pre) for p, pre in ((old, "a/"), (new, "b/")) if p != "/dev/null")
            )
            fp = _FilePatch(
                old_path=None if old == "/dev/null" else _strip_prefix(old, "a/", git_style),
                new_path=None if new == "/dev/null" else _strip_prefix(new, "b/", git_style),
            )
            if git is not None:
                fp.executable = _mode_executable(git.get("new") or git.get("mode"))
                if git.get("rename_from"):
                    fp.old_path = git["rename_from"]
            git = None
            i = _parse_hunks(lines, i + 2, fp)
            patches.append(fp)
            continue
        i += 1
    flush_git()
    return patches


def _parse_git_header(line: str) -> dict[str, str | None]:
    rest = line[len("diff --git ") :].rstrip("\n").rstrip("\r")
    if rest.startswith('"'):
        end = rest.index('"', 1)
        while rest[end - 1] == "\\":
            end = rest.index('"', end + 1)
        a, b = _unquote(rest[: end + 1]), _unquote(rest[end + 1 :].strip())
    else:
        # "a/x b/x": the two halves are equal for anything but a rename, which has
        # rename from/to lines anyway; split in the middle to allow spaces in names.
        half = len(rest) // 2
        a, b = rest[:half], rest[half + 1 :]
        if not (a.startswith("a/") and b.startswith("b/")):
            a, _, b = rest.partition(" b/")
            b = "b/" + b
    return {"a": a.removeprefix("a/"), "b": b.removeprefix("b/")}


def _git_file_patch(git: dict[str, str | None]) -> _FilePatch:
    if git.get("new"):
        fp = _FilePatch(old_path=None, new_path=git["b"])
    elif git.get("deleted"):
        fp = _FilePatch(old_path=git["a"], new_path=None)
    else:
        fp = _FilePatch(
            old_path=git.get("rename_from") or git["a"], new_path=git.get("rename_to") or git["b"]
        )
    fp.executable = _mode_executable(git.get("new") or git.get("mode"))
    return fp


def _mode_executable(mode: str | None) -> bool | None:
    if mode is None:
        return None
    if mode.startswith("120"):
        raise PatchError("symbolic links in patches are not supported")
    return mode.endswith("755")


def _parse_hunks(lines: list[str], i: int, fp: _FilePatch) -> int:
    name = fp.new_path or fp.old_path
    while i < len(lines):
        match = _HUNK.match(lines[i])
        if not match:
            break
        old_n = 1 if match.group(2) is None else int(match.group(2))
        new_n = 1 if match.group(4) is None else int(match.group(4))
        hunk = _Hunk(old_start=int(match.group(1)), old=[], new=[], header=match.group(0))
        i += 1
        while old_n > 0 or new_n > 0:
            if i >= len(lines):
                raise PatchError(f"{name}: hunk {hunk.header} is truncated")
            line = lines[i]
            tag, body = line[:1], line[1:]
            if line in ("\n", "\r\n"):  # an editor stripped the space of an empty context line
                tag, body = " ", line
            if tag == " " and old_n > 0 and new_n > 0:
                hunk.old.append(body)
                hunk.new.append(body)
                old_n, new_n = old_n - 1, new_n - 1
            elif tag == "-" and old_n > 0:
                hunk.old.append(body)
                old_n -= 1
            elif tag == "+" and new_n > 0:
                hunk.new.append(body)
                new_n -= 1
            elif tag == "\\":
                _no_newline(hunk, lines[i - 1][:1])
            else:
                raise PatchError(
                    f"{name}: hunk {hunk.header} has a malformed line: {line.rstrip()!r}"
                )
            i += 1
        if i < len(lines) and lines[i].startswith("\\"):
            _no_newline(hunk, lines[i - 1][:1])
            i += 1
        fp.hunks.append(hunk)
    if (
        not fp.hunks
        and fp.old_path is not None
        and fp.new_path is not None
        and fp.old_path == fp.new_path
    ):
        raise PatchError(f"{name}: a file section with no hunks")
    return i


def _no_newline(hunk: _Hunk, tag: str) -> None:
    """`\\ No newline at end of file`: the previous line of that side has no line ending."""
    sides = {" ": (hunk.old, hunk.new), "-": (hunk.old,), "+": (hunk.new,)}.get(tag, ())
    for side in sides:
        if side:
            side[-1] = side[-1].removesuffix("\n")


def _parse_blocks(text: str) -> list[_FilePatch]:
    lines = _lines(text)
    patches: list[_FilePatch] = []
    path: str | None = None
    number = 0
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped != SEARCH:
            if stripped and not _FENCE.match(lines[i]):
                path = stripped.strip("`*").strip()
            i += 1
            continue
        number += 1
        if not path:
            raise PatchError(f"search/replace block {number}: no path line before {SEARCH}")
        search, i = _block_part(lines, i + 1, DIVIDER, number, path)
        replace, i = _block_part(lines, i, REPLACE, number, path)
        if patches and patches[-1].new_path == path:
            patches[-1].blocks.append(_Block(number, search, replace))
        else:
            patches.append(
                _FilePatch(old_path=path, new_path=path, blocks=[_Block(number, search, replace)])
            )
    return patches


def _block_part(lines: list[str], i: int, end: str, number: int, path: str) -> tuple[str, int]:
    start = i
    while i < len(lines) and lines[i].rstrip("\r\n") != end:
        i += 1
    if i == len(lines):
        raise PatchError(f"{path}: search/replace block {number} has no {end!r} line")
    return "".join(lines[start:i]), i + 1


def _strip_fences(text: str) -> str:
    """An answer wrapped in one markdown code fence is the patch inside it."""
    lines = text.strip("\n").split("\n")
    if len(lines) >= 2 and _FENCE.match(lines[0]) and _FENCE.match(lines[-1]):
        return "\n".join(lines[1:-1]) + "\n"
    return text


def parse_patch(patch: str) -> list[_FilePatch]:
    """The file edits a patch describes. Raises `PatchError` when it is neither format."""
    text = _strip_fences(patch)
    if any(line.strip() == SEARCH for line in text.split("\n")):
        patches = _parse_blocks(text)
    else:
        patches = _parse_diff(text)
    if not patches:
        raise PatchError("no unified diff hunks or search/replace blocks found")
    return patches


# ---------------------------------------------------------------- paths


def safe_path(root: Path, rel: str) -> Path:
    """`root/rel`, refusing anything that could land outside `root` or inside `.git`."""
    pure = PurePosixPath(rel)
    if not rel or "\0" in rel or pure.is_absolute() or "\\" in rel:
        raise PatchError(f"{rel!r}: not a relative path inside the repository")
    if any(part in ("..", ".git") for part in pure.parts) or pure.parts in ((), (".",)):
        raise PatchError(f"{rel}: escapes the repository or touches .git")
    path = root
    for part in pure.parts:
        if part == ".":
            continue
        path = path / part
        if path.is_symlink():
            raise PatchError(f"{rel}: goes through a symbolic link ({path.relative_to(root)})")
    return path


# ---------------------------------------------------------------- applying


_ABSENT = None  # overlay value of a file that does not exist


class _Tree:
    """The root's files as the patch sees them: disk underneath, pending edits on top."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.overlay: dict[str, bytes | None] = {}
        self.modes: dict[str, bool] = {}

    def read(self, rel: str) -> bytes | None:
        if rel in self.overlay:
            return self.overlay[rel]
        path = safe_path(self.root, rel)
        if path.is_dir():
            raise PatchError(f"{rel}: is a directory")
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return _ABSENT


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _apply_hunks(rel: str, text: str, hunks: list[_Hunk]) -> str:
    lines = _lines(text)
    out: list[str] = []
    pos = 0  # lines[:pos] are already consumed
    for n, hunk in enumerate(hunks, start=1):
        at = _find_hunk(lines, hunk, pos)
        if at is None:
            raise PatchError(f"{rel}: hunk {n} ({hunk.header}) does not match")
        out += lines[pos:at] + hunk.new
        pos = at + len(hunk.old)
    return "".join(out + lines[pos:])


def _find_hunk(lines: list[str], hunk: _Hunk, pos: int) -> int | None:
    size = len(hunk.old)
    # The header's line number: 1-based, and for pure insertions the line *after which*.
    stated = hunk.old_start - 1 if size else hunk.old_start
    if size == 0:
        return stated if pos <= stated <= len(lines) else None
    candidates = (k for k in range(pos, len(lines) - size + 1) if lines[k : k + size] == hunk.old)
    return min(candidates, key=lambda k: (abs(k - stated), k), default=None)


def _apply_blocks(rel: str, text: str | None, blocks: list[_Block]) -> str:
    for block in blocks:
        if text is None:
            if block.search:
                raise PatchError(f"{rel}: search/replace block {block.number}: no such file")
            text = block.replace
            continue
        # Match against a text whose last line is terminated, like the block's lines are.
        padded = text if text.endswith("\n") or not text else text + "\n"
        starts = (
            [m.start() for m in re.finditer(re.escape(block.search), padded)]
            if block.search
            else []
        )
        starts = [s for s in starts if s == 0 or padded[s - 1] == "\n"]
        if len(starts) != 1:
            why = "does not match" if not starts else f"matches {len(starts)} places"
            raise PatchError(f"{rel}: search/replace block {block.number} {why}")
        s = starts[0]
        new = padded[:s] + block.replace + padded[s + len(block.search) :]
        text = new if padded is text or not new.endswith("\n") else new[:-1]
    return text or ""


def _plan(root: Path, patches: list[_FilePatch]) -> _Tree:
    tree = _Tree(root)
    for fp in patches:
        name = fp.new_path or fp.old_path or "?"
        old = tree.read(fp.old_path) if fp.old_path is not None else _ABSENT
        if (
            fp.old_path is not None
            and old is _ABSENT
            and not (fp.blocks and fp.old_path == fp.new_path)
        ):
            raise PatchError(f"{fp.old_path}: no such file")
        if (
            fp.new_path is not None
            and fp.new_path != fp.old_path
            and tree.read(fp.new_path) is not _ABSENT
        ):
            raise PatchError(f"{fp.new_path}: already exists")
        if fp.blocks:
            text = _apply_blocks(name, None if old is _ABSENT else _decode(old), fp.blocks)
        else:
            text = _apply_hunks(name, "" if old is _ABSENT else _decode(old), fp.hunks)
        if fp.new_path is None:
            if text:
                raise PatchError(f"{fp.old_path}: the deletion does not match the whole file")
        else:
            tree.overlay[fp.new_path] = _encode(text)
            if fp.executable is not None:
                tree.modes[fp.new_path] = fp.executable
        if fp.old_path is not None and fp.old_path != fp.new_path:
            tree.overlay[fp.old_path] = _ABSENT
    return tree


def _commit(tree: _Tree) -> None:
    """Write the overlay; on an OS error, put back what was already written."""
    undo: list[tuple[Path, bytes | None, int | None]] = []
    try:
        for rel, data in tree.overlay.items():
            path = safe_path(tree.root, rel)
            before = path.read_bytes() if path.exists() else None
            mode = path.stat().st_mode & 0o7777 if before is not None else None
            undo.append((path, before, mode))
            if data is _ABSENT:
                path.unlink(missing_ok=True)
                _prune_empty_dirs(tree.root, path.parent)
                continue
            _write(path, data, _new_mode(mode, tree.modes.get(rel)))
    except OSError as exc:
        for path, before, mode in reversed(undo):
            if before is None:
                path.unlink(missing_ok=True)
            else:
                _write(path, before, mode or 0o644)
        raise PatchError(f"cannot write the patch: {exc}") from None


def _new_mode(mode: int | None, executable: bool | None) -> int:
    mode = 0o644 if mode is None else mode
    if executable is None:
        return mode
    return mode | 0o111 if executable else mode & ~0o111


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.evalpipe-tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _prune_empty_dirs(root: Path, directory: Path) -> None:
    while directory != root and not any(directory.iterdir()):
        directory.rmdir()
        directory = directory.parent


def apply_patch(root: Path, patch: str) -> PatchResult:
    """Apply `patch` under `root` exactly and atomically (see the module docstring)."""
    if not _strip_fences(patch).strip():
        return PatchResult(applied=False, empty=True, detail="empty patch")
    try:
        tree = _plan(root, parse_patch(patch))
        _commit(tree)
    except PatchError as exc:
        return PatchResult(applied=False, detail=str(exc))
    return PatchResult(applied=True, paths=tuple(sorted(tree.overlay)))
