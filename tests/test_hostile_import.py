"""Issue 33, items 4 and 6: `runs import` of a hostile archive. A crafted archive's verdicts
never serve this home's cache (they once made a fresh run report pass@1 100 % without calling
the agent), and the import reads only the members it knows, refusing sparse, oversized, extra
or repeated ones from their headers, before reading them: exit 2, one line, nothing written."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from support.cli import as_process, in_process
from support.parquet_lies import understate_sizes

from evalpipe import evaluate
from storage.export import FORMAT, FORMAT_VERSION
from storage.store import Store

ROOT = Path(__file__).resolve().parent.parent
CASES = [{"id": f"c{i}", "inputs": {"a": i}, "reference": str(i + 1), "grader": {"kind": "exact"}} for i in range(3)]
CALLS: list[int] = []


def wrong(inputs, ctx):
    CALLS.append(inputs["a"])
    return "no"


def members_of(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def write_archive(path: Path, members: dict[str, bytes], *, manifest: dict | None = None) -> Path:
    """A tar of `members` after a manifest that lists each one's checksum (an attacker can
    always make the checksums agree: they prove integrity, not origin)."""
    import hashlib

    doc = manifest or json.loads(members.pop("manifest.json"))
    doc["files"] = {name: hashlib.sha256(data).hexdigest() for name, data in members.items()}
    with tarfile.open(path, "w") as tar:
        for name, data in {"manifest.json": json.dumps(doc).encode(), **members}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _env(home: Path, env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "EVALPIPE_HOME": str(home), "PYTHONPATH": str(ROOT), **env}


def cli(args: list[str], home: Path, **env: str) -> subprocess.CompletedProcess:
    return as_process(args, _env(home, env))


def here(args: list[str], home: Path, **env: str) -> subprocess.CompletedProcess:
    """`cli` in this process (support.cli.in_process): for the commands that read what an
    import wrote, the import itself staying a process of its own."""
    return in_process(args, _env(home, env))


@pytest.fixture
def exported(tmp_path) -> Path:
    """A real run of the failing agent, exported."""
    source = Store(tmp_path / "theirs")
    run = evaluate(CASES, wrong, name="arith", n=1, home=source.home)
    assert run.to_json()["status_counts"] == {"failed": 3}
    return source.exports.export_run(run.run_id, tmp_path / "run.tar") and tmp_path / "run.tar"


FORGED = "99999999-999999-ffffff"  # sorts after every real run id


def forge(exported: Path, out: Path) -> Path:
    """The exported run with every verdict `passed`, every output the reference, and a run
    id that sorts last: what an attacker hands over as a baseline."""
    members = members_of(exported)
    samples = pq.read_table(pa.BufferReader(members["samples.parquet"]))
    run_doc = json.loads(members["run.json"])
    answers = {c["id"]: c["reference"] for c in CASES}
    for column, values in (("status", ["passed"] * samples.num_rows), ("run_id", [FORGED] * samples.num_rows),
                           ("output", [answers[c] for c in samples["case_id"].to_pylist()])):
        samples = samples.set_column(samples.schema.get_field_index(column), column, pa.array(values))
    buf = io.BytesIO()
    pq.write_table(samples, buf)
    run_doc["run"]["run_id"] = FORGED
    manifest = json.loads(members.pop("manifest.json"))
    manifest["run_id"] = FORGED
    return write_archive(out, {**members, "samples.parquet": buf.getvalue(), "run.json": json.dumps(run_doc).encode()},
                         manifest=manifest)


def test_a_crafted_archive_of_passing_verdicts_never_serves_the_cache(tmp_path, exported):
    crafted = forge(exported, tmp_path / "crafted.tar")
    forged = FORGED
    mine = Store(tmp_path / "mine")
    assert mine.exports.import_run(crafted)["imported"] is True
    CALLS.clear()
    run = evaluate(CASES, wrong, name="arith", n=1, home=mine.home).to_json()
    assert sorted(CALLS) == [0, 1, 2]  # the agent was asked: nothing came from the import
    assert run["status_counts"] == {"failed": 3} and run["cached_samples"] == 0
    # The imported run itself is still there to gate against.
    assert pc.all(pc.equal(mine.samples.of_run(forged)["status"], "passed")).as_py()


def test_a_sparse_member_is_refused_from_its_header(tmp_path):
    """10 KB on disk, 4 GiB when read: refused before a byte of it is read."""
    work = tmp_path / "w"
    work.mkdir()
    (work / "manifest.json").write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION}))
    with open(work / "samples.parquet", "wb") as fh:
        fh.truncate(4 << 30)
    for fmt in ("gnu", "posix"):
        archive = tmp_path / f"sparse-{fmt}.tar"
        subprocess.run(["tar", "--sparse", f"--format={fmt}", "-cf", str(archive), "manifest.json",
                        "samples.parquet"], cwd=work, check=True)
        assert archive.stat().st_size < 1 << 20
        proc = cli(["runs", "import", str(archive)], tmp_path / "home")
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip()
        assert "\n" not in line and str(archive) in line and "samples.parquet" in line and "sparse" in line
        assert not (tmp_path / "home" / "evalpipe.duckdb").exists()


@pytest.mark.parametrize("extra", ["notes.txt", "../run.json", "samples.parquet"])
def test_an_extra_or_repeated_member_is_refused(tmp_path, exported, extra):
    members = members_of(exported)
    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        for name, data in [*members.items(), (extra, b"x" * 10)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    proc = cli(["runs", "import", str(tmp_path / "bad.tar")], tmp_path / "home")
    assert proc.returncode == 2, proc.stderr
    assert "\n" not in proc.stderr.strip() and repr(extra) in proc.stderr
    assert not (tmp_path / "home" / "evalpipe.duckdb").exists()


def test_a_link_or_directory_member_is_refused(tmp_path, exported):
    members = members_of(exported)
    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        for name, data in members.items():
            if name == "snapshot.parquet":
                info = tarfile.TarInfo(name)
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
                continue
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    proc = cli(["runs", "import", str(tmp_path / "bad.tar")], tmp_path / "home")
    assert proc.returncode == 2 and "'snapshot.parquet'" in proc.stderr and "not a regular file" in proc.stderr


def test_members_over_the_size_cap_are_refused_before_reading(tmp_path, exported):
    size = sum(len(d) for d in members_of(exported).values())
    proc = cli(["runs", "import", str(exported)], tmp_path / "home", EVALPIPE_IMPORT_MAX_BYTES=str(size // 2))
    assert proc.returncode == 2, proc.stderr
    assert "EVALPIPE_IMPORT_MAX_BYTES" in proc.stderr and "\n" not in proc.stderr.strip()
    assert not (tmp_path / "home" / "evalpipe.duckdb").exists()
    ok = cli(["runs", "import", str(exported), "--json"], tmp_path / "home", EVALPIPE_IMPORT_MAX_BYTES=str(size * 4))
    assert ok.returncode == 0, ok.stderr


def test_a_samples_file_that_inflates_past_the_cap_is_refused_before_reading(tmp_path, exported):
    """Parquet compresses: 20 MB of one repeated character is a few KB in the archive."""
    members = members_of(exported)
    samples = pq.read_table(pa.BufferReader(members["samples.parquet"]))
    samples = samples.set_column(samples.schema.get_field_index("output"), "output",
                                 pa.array(["y" * (20 << 20)] * samples.num_rows))
    buf = io.BytesIO()
    pq.write_table(samples, buf, compression="zstd")
    assert len(buf.getvalue()) < 1 << 20
    bomb = write_archive(tmp_path / "bomb.tar", {**members, "samples.parquet": buf.getvalue()})
    proc = cli(["runs", "import", str(bomb)], tmp_path / "home", EVALPIPE_IMPORT_MAX_BYTES=str(8 << 20))
    assert proc.returncode == 2, proc.stderr
    assert "samples.parquet" in proc.stderr and "EVALPIPE_IMPORT_MAX_BYTES" in proc.stderr
    assert not (tmp_path / "home" / "evalpipe.duckdb").exists()


def test_a_samples_file_whose_footer_understates_its_size_never_inflates_in_the_importer(tmp_path, exported):
    """A footer is the file's own word: here it says each column chunk is 1 byte while one
    output inflates to 256 MB (a 40 KB archive). The decoder allocates a page whole before
    it can be counted: with 384 MB this took `runs import` to 2.2 GB resident with an 8 MB
    cap. Now the members are decoded first in a child whose memory is bounded from the cap:
    exit 2, one line, nothing written, and neither the importer nor that child (their peak
    resident size, read by a parent that waits on both) ever holds the output."""
    members = members_of(exported)
    samples = pq.read_table(pa.BufferReader(members["samples.parquet"]))
    big = 256 << 20  # twice the importer's own peak (~120 MB); each MB made costs time here
    # The column from its buffers (pa.array would check 256 MB of UTF-8 first: 4.5 s of CPU).
    values = [b"y" * big, *[b"n"] * (samples.num_rows - 1)]
    offsets = pa.array(itertools.accumulate(map(len, values), initial=0), pa.int32())
    outputs = pa.Array.from_buffers(pa.string(), len(values), [None, offsets.buffers()[1], pa.py_buffer(b"".join(values))])
    samples = samples.set_column(samples.schema.get_field_index("output"), "output", outputs)
    buf = io.BytesIO()
    # No dictionary and no statistics for the output: its one huge value would be hashed and
    # copied, and scanned for its min and max (10 s of CPU), first. zstd's fastest level: 0.1 s
    # for the 256 MB where its default took 7.7 s, to the same 9 KB.
    pq.write_table(samples, buf, compression="zstd", compression_level=-5, use_dictionary=False,
                   write_statistics=False)
    del samples, outputs
    lying = understate_sizes(buf.getvalue(), to=1)
    meta = pq.ParquetFile(pa.BufferReader(lying)).metadata
    assert meta.row_group(0).total_byte_size == 1  # what the footer now says
    liar = write_archive(tmp_path / "liar.tar", {**members, "samples.parquet": lying})
    assert liar.stat().st_size < 1 << 20
    measure = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]);"
               " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss << 10, file=sys.stderr);"
               " sys.exit(done.returncode)")
    proc = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "flows.cli", "runs", "import",
                           str(liar)], text=True, capture_output=True, timeout=300,
                          env={**os.environ, "EVALPIPE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT),
                               "EVALPIPE_IMPORT_MAX_BYTES": str(8 << 20)})
    line, peak = proc.stderr.strip().rsplit("\n", 1)
    assert proc.returncode == 2, proc.stderr
    assert "\n" not in line and str(liar) in line and "'samples.parquet'" in line, line
    assert "memory" in line and "EVALPIPE_IMPORT_MAX_BYTES" in line, line
    assert int(peak) < big, f"peak resident size {int(peak) >> 20} MB"
    assert not (tmp_path / "home" / "evalpipe.duckdb").exists()


def test_a_rescore_of_an_import_serves_no_cache_and_a_gate_against_it_says_where_it_came_from(
        prefect_harness, tmp_path, exported):
    """Re-graded here, the forged outputs (each the reference) pass honestly; they are still
    the file's outputs, never a draw of this home's agent. A gate against the import names
    its file and manifest hash in every output."""
    import hashlib

    crafted = forge(exported, tmp_path / "crafted.tar")
    mine = tmp_path / "mine"
    env = {"PREFECT_API_URL": prefect_harness}
    assert cli(["runs", "import", str(crafted)], mine, **env).returncode == 0
    version = Store(mine).runs.find(FORGED)["suite_version"]
    rescored = here(["rescore", FORGED, version, "--json"], mine, **env)
    assert rescored.returncode == 0, rescored.stderr
    rescored_id = json.loads(rescored.stdout)["run_id"]
    assert json.loads(rescored.stdout)["status_counts"] == {"passed": 3}

    CALLS.clear()
    run = evaluate(CASES, wrong, name="arith", n=1, home=mine)
    assert sorted(CALLS) == [0, 1, 2] and run.to_json()["status_counts"] == {"failed": 3}

    manifest = hashlib.sha256(members_of(crafted)["manifest.json"]).hexdigest()
    for baseline in (FORGED, rescored_id):
        gate = here(["gate", run.run_id, "--baseline", baseline, "--json"], mine, **env)
        doc = json.loads(gate.stdout)
        assert doc["baseline_import"] == {"file": str(crafted.resolve()), "manifest_sha256": manifest}
        text = here(["gate", run.run_id, "--baseline", baseline], mine, **env).stdout
        assert str(crafted.resolve()) in text and manifest[:12] in text
        markdown = here(["gate", run.run_id, "--baseline", baseline, "--format", "markdown"], mine, **env).stdout
        assert "crafted.tar" in markdown and manifest[:12] in markdown
    # A run of this home as the baseline: nothing is said.
    local = evaluate(CASES, wrong, name="arith", n=1, home=mine)
    assert "baseline_import" not in json.loads(here(["gate", local.run_id, "--baseline", run.run_id, "--json"], mine,
                                                   **env).stdout)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


DEEP = "(100,000 levels)"


def tampered(exported: Path, out: Path, change) -> Path:
    """The exported run with `change(manifest, run_doc)` applied (a `DEEP` string becomes
    brackets nested 100,000 deep), its checksums made to agree."""
    members = members_of(exported)
    manifest, doc = json.loads(members.pop("manifest.json")), json.loads(members["run.json"])
    change(manifest, doc)
    text = json.dumps(doc).replace(json.dumps(DEEP), nested(100_000))
    return write_archive(out, {**members, "run.json": text.encode()}, manifest=manifest)


def _set(obj: dict, key: str, value) -> None:
    obj[key] = value


CRAFTED = {  # (#45 item 7) each was a traceback and exit 1, or a row DuckDB refused half way
    "manifest nested 100,000 deep": lambda exported, out: write_raw(out, {**members_of(exported),
                                                                         "manifest.json": nested(100_000).encode()}),
    "manifest files a list": lambda exported, out: write_raw(out, {**members_of(exported), "manifest.json": json.dumps(
        {"format": FORMAT, "format_version": FORMAT_VERSION, "run_id": "r", "suite_version": "v", "files": []}
    ).encode()}),
    "run a list": lambda exported, out: tampered(exported, out, lambda m, d: _set(d, "run", [d["run"]])),
    "run.json nested 100,000 deep": lambda exported, out: tampered(
        exported, out, lambda m, d: _set(d["run"], "config", {"x": DEEP})),
    "a case's slices objects": lambda exported, out: tampered(
        exported, out, lambda m, d: _set(d["cases"][0], "slices", [{"a": 1}])),
    "n a word": lambda exported, out: tampered(exported, out, lambda m, d: _set(d["run"], "n", "many")),
    "summary of another shape": lambda exported, out: tampered(
        exported, out, lambda m, d: _set(d["run"]["summary"], "cases", [1])),
}


def write_raw(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_field_is_one_line_exit_2_and_nothing_written(tmp_path, exported, name):
    archive = CRAFTED[name](exported, tmp_path / "crafted.tar")
    home = tmp_path / "home"
    proc = cli(["runs", "import", str(archive)], home)
    line = proc.stderr.strip()
    assert proc.returncode == 2, proc.stderr
    assert "\n" not in line and str(archive) in line, line
    if (home / "evalpipe.duckdb").exists():
        with Store(home).db.connect(read_only=True) as con:
            for table in ("runs", "suites", "cases", "aggregates", "samples", "imported_runs"):
                assert con.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,), table
    assert not list(home.glob("snapshots/*")), "a snapshot of a refused import"
