"""Files replaced whole: a reader, or the machine after a crash, finds the old content or
the new, never a part. The new content is built at a temporary name beside the target (the
same file system, so the rename is atomic) and renamed onto it; on any failure the
temporary is removed and the target is left as it was."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path, *, durable: bool = True) -> Iterator[Path]:
    """A fresh path beside `path` for the caller to build the new file (or directory) at:
    renamed onto `path` when the block ends, removed when it raises. `durable=False` skips
    the fsync, for scratch trees where only readers, not crashes, matter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unpredictable, so a name planted in the directory (a symlink) cannot be written through.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        if durable and tmp.is_file():
            _fsync(tmp)  # the data reaches the disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: Path, data: bytes | str, mode: int | None = None, *, durable: bool = True) -> None:
    """Replace `path` with `data` (a str as UTF-8); `mode` sets its permission bits, else
    the umask does."""
    with atomic_path(path, durable=durable) as tmp:
        with open(tmp, "xb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        if mode is not None:
            os.chmod(tmp, mode)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
