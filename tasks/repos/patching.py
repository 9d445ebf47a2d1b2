"""Apply a candidate patch to a tree, fail closed: all of it exactly, or nothing.

Two formats (docs/contract.md §4): unified diffs (git-style `a/` `b/` prefixes, new, deleted and
renamed files) and search/replace blocks (a `path` line, `<<<<<<< SEARCH`, old text,
`=======`, new text, `>>>>>>> REPLACE`). Both are parsed here first, which refuses what
is not allowed (paths out of the tree or through a symlink, binary patches, symlinks,
copies) before anything is written.

Diffs are then read by `git apply --numstat --summary` and every path and mode git found
is checked again (a crafted header can read differently to git and to this parser), then
applied by `git apply`, which checks every hunk before writing any: a
hunk's context and removed lines must equal the file's lines (no fuzz; a hunk may sit at
a different line than its header says). Search/replace blocks are computed in memory and
written only when every block matched exactly once, starting at a line start.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tasks.fences import is_fence_line, unwrap_fenced_lines
from tasks.files import atomic_write

SEARCH, DIVIDER, REPLACE = "<<<<<<< SEARCH", "=======", ">>>>>>> REPLACE"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


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
    prefixed: bool = True  # paths carry git's a/ b/ prefixes


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
                prefixed=git_style,
            )
            if git is not None:
                _refuse_special(git.get("new") or git.get("mode"))
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
    _refuse_special(git.get("new") or git.get("mode"))
    return fp


def _refuse_special(mode: str | None) -> None:
    if mode is not None and mode.startswith("120"):
        raise PatchError("symbolic links in patches are not supported")
    if mode is not None and mode.startswith("160"):
        raise PatchError("submodules in patches are not supported")


def _parse_hunks(lines: list[str], i: int, fp: _FilePatch) -> int:
    """Check the hunks' line counts and record their headers (for messages)."""
    name = fp.new_path or fp.old_path
    while i < len(lines):
        match = _HUNK.match(lines[i])
        if not match:
            break
        old_n = 1 if match.group(2) is None else int(match.group(2))
        new_n = 1 if match.group(4) is None else int(match.group(4))
        hunk = _Hunk(old_start=int(match.group(1)), header=match.group(0))
        i += 1
        while old_n > 0 or new_n > 0:
            if i >= len(lines):
                raise PatchError(f"{name}: hunk {hunk.header} is truncated")
            line = lines[i]
            tag = " " if line == "\n" else line[:1]  # git reads a bare newline as context
            if tag == " " and old_n > 0 and new_n > 0:
                old_n, new_n = old_n - 1, new_n - 1
            elif tag == "-" and old_n > 0:
                old_n -= 1
            elif tag == "+" and new_n > 0:
                new_n -= 1
            elif tag != "\\":  # "\ No newline at end of file"
                raise PatchError(
                    f"{name}: hunk {hunk.header} has a malformed line: {line.rstrip()!r}"
                )
            i += 1
        if i < len(lines) and lines[i].startswith("\\"):
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


def _parse_blocks(text: str) -> list[_FilePatch]:
    lines = _lines(text)
    patches: list[_FilePatch] = []
    path: str | None = None
    number = 0
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped != SEARCH:
            if stripped and not is_fence_line(lines[i]):
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


def parse_patch(patch: str) -> list[_FilePatch]:
    """The file edits a patch describes. Raises `PatchError` when it is neither format."""
    text = unwrap_fenced_lines(patch)  # an answer wrapped in a fence is the patch inside
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
        self.overlay: dict[str, bytes] = {}

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
    """Search/replace blocks applied in memory."""
    tree = _Tree(root)
    for fp in patches:
        old = tree.read(fp.new_path)
        text = _apply_blocks(fp.new_path, None if old is _ABSENT else _decode(old), fp.blocks)
        tree.overlay[fp.new_path] = _encode(text)
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
            atomic_write(path, data, 0o644 if mode is None else mode, durable=False)  # a scratch tree
    except OSError as exc:
        for path, before, mode in reversed(undo):
            if before is None:
                path.unlink(missing_ok=True)
            else:
                atomic_write(path, before, mode or 0o644, durable=False)
        raise PatchError(f"cannot write the patch: {exc}") from None


# git as `git apply` sees it here: no user or system configuration (an
# `apply.whitespace=fix` would rewrite lines), no repository above the root.
def _git_env(root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CEILING_DIRECTORIES": str(root.resolve().parent),
    }


GIT_APPLY_TIMEOUT_S = 120.0
_PATCH_FAILED = re.compile(r"^error: patch failed: (.+):(\d+)$")
_GIT_MESSAGES = (
    (re.compile(r"^error: (.+): already exists in working directory$"), "{}: already exists"),
    (re.compile(r"^error: (.+): No such file or directory$"), "{}: no such file"),
)


def _git_apply(root: Path, text: str, patches: list[_FilePatch]) -> None:
    for fp in patches:
        for rel in (fp.old_path, fp.new_path):
            if rel is not None and safe_path(root, rel).is_dir():
                raise PatchError(f"{rel}: is a directory")
    if len({fp.prefixed for fp in patches}) > 1:
        raise PatchError("the diff mixes a/ b/ prefixed and bare paths")
    strip = f"-p{1 if patches[0].prefixed else 0}"
    # What git itself reads in the patch, checked before it writes anything: our parser
    # and git's may disagree on a crafted header (a mode line after `+++`, a rename).
    _check_git_reading(root, _run_git_apply(root, text, [strip, "--numstat", "--summary", "-z"], patches))
    _run_git_apply(root, text, [strip, "--whitespace=nowarn"], patches)


def _run_git_apply(root: Path, text: str, options: list[str], patches: list[_FilePatch]) -> str:
    try:
        done = subprocess.run(
            ["git", "apply", *options, "-"],
            cwd=root,
            input=_encode(text),
            capture_output=True,
            env=_git_env(root),
            timeout=GIT_APPLY_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PatchError(f"git apply failed to run: {exc}") from None
    if done.returncode != 0:
        raise PatchError(_git_apply_error(_decode(done.stderr), patches))
    return _decode(done.stdout)


_SPECIAL_MODE = re.compile(r"\b(120|160)\d{3}\b")


def _check_git_reading(root: Path, preview: str) -> None:
    """Refuse what `git apply --numstat --summary -z` says the patch would do beyond plain
    files inside the tree: a path outside it (or through a symlink, or into .git), a
    symbolic link or submodule created or changed into, a copy."""
    *records, summary = preview.split("\0")
    for record in records:
        rel = record.split("\t", 2)[-1] if record.count("\t") >= 2 else record
        if rel:  # a rename's record is empty; its two paths follow as records of their own
            safe_path(root, rel)
    for line in summary.splitlines():
        if line.lstrip().startswith("copy "):
            raise PatchError("copies are not supported")
        if _SPECIAL_MODE.search(line):
            _refuse_special(_SPECIAL_MODE.search(line).group(0))


def _git_apply_error(stderr: str, patches: list[_FilePatch]) -> str:
    """git's complaint in this module's words: which file, which hunk."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if failed := _PATCH_FAILED.match(line):
            rel, at = failed.group(1), int(failed.group(2))
            hunks = [fp.hunks for fp in patches if rel in (fp.new_path, fp.old_path)]
            for n, hunk in enumerate(hunks[0] if hunks else [], start=1):
                if hunk.old_start == at:
                    return f"{rel}: hunk {n} ({hunk.header}) does not match"
            return f"{rel}: hunk at line {at} does not match"
        for pattern, message in _GIT_MESSAGES:
            if known := pattern.match(line):
                return message.format(known.group(1))
    return (lines or ["git apply failed"])[0].removeprefix("error: ")


def apply_patch(root: Path, patch: str) -> PatchResult:
    """Apply `patch` under `root` exactly and atomically (see the module docstring)."""
    text = unwrap_fenced_lines(patch)
    if not text.strip():
        return PatchResult(applied=False, empty=True, detail="empty patch")
    try:
        patches = parse_patch(patch)
        if patches[0].blocks:
            _commit(_plan(root, patches))
        else:
            _git_apply(root, text, patches)
    except PatchError as exc:
        return PatchResult(applied=False, detail=str(exc))
    paths = {p for fp in patches for p in (fp.old_path, fp.new_path) if p is not None}
    return PatchResult(applied=True, paths=tuple(sorted(paths)))
