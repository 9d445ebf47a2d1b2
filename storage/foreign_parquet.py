"""Parquet files from elsewhere (a `runs import` archive's members), decoded without trusting
what they say of their size.

A file's footer declares its uncompressed sizes, but nothing makes it true: a crafted footer
says a few bytes while a page inflates to gigabytes (a 40 KB archive took `runs import` to
2.2 GB resident), and the decoder allocates each page whole before a byte of it can be
counted. So each file is first decoded in a child process (`probe`: this file run as a
script, importing pyarrow alone) that caps its own address space once pyarrow is loaded, at
what it holds then plus `HEADROOM` times the cap on the decoded size, and counts the
decoded bytes batch by batch (`batches`, `BATCH_ROWS` rows at a time). Only a file it
decoded within both is decoded here (`read`), the same way: this process never meets an
allocation the child did not survive.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

BATCH_ROWS = 64  # rows decoded at a time, so that one batch stays small beside the cap
# The child's address space beyond what it holds with pyarrow loaded and warmed up: `SLACK`
# and `HEADROOM` caps. Decoding one large value takes about 5 times its size (its compressed
# and decompressed pages, the array built with doubling buffers), measured.
HEADROOM = 6
SLACK = 64 << 20
_PROBE_TIMEOUT_S = 600.0
_MEMORY_EXIT = 3


@dataclass(frozen=True)
class Probe:
    """What decoding a file in the child found: `decoded` bytes (past the cap: it stopped
    there), or `memory`: it needed more than `limit` bytes of address space, or `error`:
    the decoder's (a damaged file)."""

    decoded: int = 0
    memory: bool = False
    limit: int = 0
    error: str = ""


def declared_size(file: Path) -> int:
    """The uncompressed size the footer declares: its row groups' or their column chunks',
    the larger."""
    meta = pq.ParquetFile(file).metadata
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    return max(sum(g.total_byte_size for g in groups),
               sum(g.column(j).total_uncompressed_size for g in groups for j in range(meta.num_columns)))


def batches(file: Path | pa.BufferReader) -> Iterator[pa.RecordBatch]:
    return pq.ParquetFile(file).iter_batches(batch_size=BATCH_ROWS)


def read(file: Path) -> pa.Table:
    """The whole file, as the child decoded it (`probe` first)."""
    return pa.Table.from_batches(list(batches(file)), schema=pq.ParquetFile(file).schema_arrow)


def probe(files: list[Path], cap: int) -> list[Probe]:
    """Decode each of `files` in a child process whose memory is bounded by `cap`, up to
    `cap` decoded bytes each (see the module); one `Probe` each, those after the first that
    failed repeating its failure."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C",
           # The system's allocator: no allocator's own reservations in the address space it caps.
           "ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "1"}
    try:
        done = subprocess.run([sys.executable, "-I", __file__, str(cap), *map(str, files)], env=env,
                              capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return [Probe(error=f"decoding took over {_PROBE_TIMEOUT_S:g} s")] * len(files)
    lines = [json.loads(line) for line in done.stdout.decode("utf-8", "replace").splitlines()]
    limit = lines[0]["limit"] if lines else 0
    found = [Probe(limit=limit, **doc) for doc in lines[1:]]
    if len(found) < len(files):
        if done.returncode == _MEMORY_EXIT or done.returncode < 0:  # a failed allocation, or one that aborted it
            found.append(Probe(memory=True, limit=limit))
        else:
            err = done.stderr.decode("utf-8", "replace").strip().splitlines()
            found.append(Probe(error=(err or [f"exit {done.returncode}"])[-1]))
    return found + [found[-1]] * (len(files) - len(found))


def _address_space() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) << 10 for line in fh if line.startswith("VmSize:"))


def _warm_up() -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": ["x"]}), sink)
    for _ in batches(pa.BufferReader(sink.getvalue())):
        pass


def _child(cap: int, files: list[str]) -> int:
    """The child's part: its address-space limit, then one JSON line per file as it is
    decoded; exit `_MEMORY_EXIT` when an allocation fails."""
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    _warm_up()  # its threads and first buffers are part of what it holds, not of the headroom
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = _address_space() + SLACK + HEADROOM * cap
    limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(json.dumps({"limit": limit}), flush=True)
    for name in files:
        decoded = 0
        try:
            for batch in batches(Path(name)):
                decoded += batch.nbytes
                if decoded > cap:
                    break
            found = {"decoded": decoded}
        except MemoryError:
            return _MEMORY_EXIT
        except (pa.ArrowException, OSError, ValueError) as exc:
            found = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(int(sys.argv[1]), sys.argv[2:]))
