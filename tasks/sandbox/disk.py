"""A cap on the disk a sandboxed command fills through the directories it may write
(`DiskCap`), held while it runs: `DiskWatch` measures them and stops the command's whole
sandbox once they hold more.

Measuring is a walk of the directories (each entry's apparent size or its allocated blocks,
the larger, and at least one block of its file system: a flood of empty files counts too), which costs about a microsecond or two per entry, so it is not repeated on a
timer alone. Between walks the watcher reads the used space of their file systems
(`statvfs`, microseconds) every `TICK_S`, sooner as they fill faster (down to `MIN_TICK_S`,
so that half the room left is not used up between two reads): that grows at least as fast as the directories do,
so once it has grown by the room left under the cap at the last walk, the directories may be
over and are walked at once; by half that room, walked again unless the last walk was recent
(`PACE` times its own cost ago); and at least every `WALK_EVERY_S` anyway (another writer's
deletions on the same file system could hide growth from `statvfs`). So a writer gets past
the cap by what it writes in about a tick and two walks; a directory the walk cannot list
(the command locked it) counts as all the growth of its file system since the start.

A file deleted while the command holds it open is in no directory but still fills the disk
(8 such files held 320 MB against a 16 MB cap): each walk adds the files the command's
processes hold open that have no name left, on the capped directories' file systems.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

TICK_S = 0.02
MIN_TICK_S = 0.001
WALK_EVERY_S = 1.0
PACE = 10  # a walk not urgent waits this many times the last one's cost: at most 1/PACE of a core


@dataclass(frozen=True)
class DiskCap:
    """`paths` (directories the command may write) hold at most `max_bytes` in all."""

    paths: tuple[str, ...]
    max_bytes: int


def disk_use(paths: Iterable[str], ended: threading.Event | None = None) -> tuple[int, bool]:
    """What the files and directories under `paths` take (each entry's apparent size or its
    allocated blocks, the larger, at least a block; links not followed), and whether every directory could
    be listed. Cut short once `ended` is set."""
    total, complete = 0, True
    pending = list(paths)
    while pending and not (ended is not None and ended.is_set()):
        directory = pending.pop()
        try:
            entries = os.scandir(directory)
        except FileNotFoundError:
            continue
        except OSError:
            complete = False
            continue
        with entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:  # gone meanwhile
                    continue
                total += max(info.st_size if stat.S_ISREG(info.st_mode) else 0, info.st_blocks * 512, info.st_blksize)
                if stat.S_ISDIR(info.st_mode):
                    pending.append(entry.path)
    return total, complete


def held_deleted(pids: Iterable[int], devices: Iterable[int]) -> int:
    """What the files the processes `pids` hold open with no name left (deleted) take, on
    the file systems `devices` (st_dev), each file once."""
    seen: dict[tuple[int, int], int] = {}
    wanted = set(devices)
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fds)
        except OSError:  # gone meanwhile
            continue
        for name in names:
            try:
                info = os.stat(f"{fds}/{name}")  # the open file itself, named or not
            except OSError:
                continue
            if info.st_nlink == 0 and info.st_dev in wanted and stat.S_ISREG(info.st_mode):
                seen[(info.st_dev, info.st_ino)] = max(info.st_size, info.st_blocks * 512)
    return sum(seen.values())


def _used(devices: Iterable[str]) -> int:
    """The used bytes of the file systems holding `devices` (one path each)."""
    used = 0
    for path in devices:
        try:
            fs = os.statvfs(path)
        except OSError:
            continue
        used += (fs.f_blocks - fs.f_bfree) * fs.f_frsize
    return used


class DiskWatch:
    """A thread holding `cap` while a command runs: over it, `stop_sandbox()` is called once
    and `over` is the size measured then. `processes()`: the command's processes now, whose
    deleted open files count too. `start()` after the command started, `stop()` once it
    ended."""

    def __init__(self, cap: DiskCap, stop_sandbox: Callable[[], None],
                 processes: Callable[[], Iterable[int]] = tuple):
        self.cap = cap
        self.over: int | None = None
        self._stop_sandbox = stop_sandbox
        self._processes = processes
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="evalpipe-disk-cap", daemon=True)
        # One path per file system, for statvfs.
        devices: dict[int, str] = {}
        for path in cap.paths:
            try:
                devices.setdefault(os.stat(path).st_dev, path)
            except OSError:
                pass
        self._devices = tuple(devices.values())
        self._device_ids = tuple(devices)

    def start(self) -> DiskWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._ended.set()
        self._thread.join()

    def _watch(self) -> None:
        start_used = fs_then = last = _used(self._devices)
        last_at = time.monotonic()
        walked_at: float | None = None
        cost, room = 0.0, 0
        while not self._ended.is_set():
            now, used = time.monotonic(), _used(self._devices)
            rate, last, last_at = (used - last) / max(now - last_at, 1e-6), used, now
            since = now - walked_at if walked_at is not None else None
            grown = used - fs_then
            if (since is None or (grown >= room and since >= cost) or (grown >= room / 2 and since >= PACE * cost)
                    or since >= max(WALK_EVERY_S, PACE * cost)):
                fs_then = _used(self._devices)
                size, complete = disk_use(self.cap.paths, self._ended)
                if not complete:
                    size = max(size, fs_then - start_used)
                size += held_deleted(self._processes(), self._device_ids)
                walked_at = time.monotonic()
                cost = walked_at - now
                if size > self.cap.max_bytes:
                    self.over = size
                    self._stop_sandbox()
                    return
                room, grown = self.cap.max_bytes - size, 0
            # Sooner as the file systems fill faster: before half the room left is used at this rate.
            left = room - grown
            self._ended.wait(TICK_S if rate <= 0 else min(TICK_S, max(MIN_TICK_S, left / rate / 2)))
