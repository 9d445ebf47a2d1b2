"""Peak memory where candidates choose the size: reading back a run of 5,000 samples whose
outputs are at the output cap (the reduce step, `report` and a fully cached re-run), and a JUnit report of millions
of nested elements. Each figure is the peak RSS of a fresh process doing only that step,
beside the peer: the same step reading whole rows / the whole XML tree, as evalpipe did
before (measured on fewer samples where the whole would not fit, and scaled).

    .venv/bin/python bench/memory.py [--samples 5000] [--output-mb 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_SAMPLES = 200


def make_run(home: Path, samples: int, output_bytes: int) -> str:
    """A stored run of `samples` samples (5 per case), each output `output_bytes` long
    (written by DuckDB itself: identical outputs compress to little on disk, and are full
    size again in memory when read)."""
    from storage import db
    from storage.store import Store
    from tasks.run import RunSpec

    store = Store(home)
    spec = RunSpec(suite_version="0" * 64, suite_name="memory", agent="bench", agent_fingerprint="bench",
                   n=5, ks=[1], seed=0)
    store.start_run(spec)
    for start in range(0, samples, 50):  # a transaction a slice: DuckDB holds uncommitted rows whole
        with store.connect() as con:
            con.execute("SET memory_limit = '6GB'")  # this writer's cache is not what is measured
            con.execute(
                "INSERT INTO samples (run_id, case_id, sample_index, seed, output, status, passed, score, detail,"
                " safety, trace, duration_s, cache_key, cached, case_hash, output_key, output_head)"
                " SELECT ?, printf('c%05d', i // 5), i % 5, 0, repeat('x', ?), 'failed', false, 0, 'wrong',"
                " []::VARCHAR[], '{}', 0, printf('%s-%d', ?, i), false, '', printf('%s-%d', ?, i), repeat('x', ?)"
                " FROM range(?, ?) r(i)",
                [spec.run_id, output_bytes, spec.run_id, spec.run_id, min(output_bytes, db.OUTPUT_HEAD_CHARS), start,
                 min(samples, start + 50)])
    return spec.run_id


STEPS = {
    "reduce": "from storage.store import Store; from tasks.run import RunSpec, summary_columns\n"
              "Store(HOME).run_samples(RUN, summary_columns(RunSpec(suite_version='0'*64, suite_name='m',"
              " agent='b', agent_fingerprint='b', n=5, ks=[1], seed=0)))",
    "report": "from flows.report import read_case_rows; from storage.store import Store\n"
              "read_case_rows(RUN, Store(HOME))",
    # A fully cached re-run of the stored run: its samples found and copied as a new run's.
    "cached re-run": "from storage.store import Store; from tasks.run import RunSpec\n"
                     "from tasks.run.loop import reuse_cached; from tasks.run.sampling import PlannedSample\n"
                     "keys = Store(HOME).run_samples(RUN, ['case_id', 'sample_index', 'cache_key', 'output_key'])\n"
                     "planned = [PlannedSample(r['case_id'], r['sample_index'], 0, r['cache_key'], '',"
                     " output_key=r['output_key']) for r in keys.to_pylist()]\n"
                     "spec = RunSpec(suite_version='0'*64, suite_name='m', agent='b', agent_fingerprint='b', n=5,"
                     " ks=[1], seed=0)\n"
                     "assert reuse_cached(spec, planned, Store(HOME)) == []",
    "whole rows": "from storage.store import Store; Store(HOME).run_samples(RUN)",
    "junit stream": "from tasks.graders.junit import parse_junit, JUnitError\n"
                    "try:\n    parse_junit(XML)\nexcept JUnitError:\n    pass",
    "junit tree": "import xml.etree.ElementTree as ET; ET.fromstring(XML)",
}


def peak(step: str, run_id: str, home: Path, xml_depth: int = 0) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of a fresh process doing one step."""
    prelude = (f"from pathlib import Path\nRUN = {run_id!r}\nHOME = Path({str(home)!r})\n"
               f"XML = b'<testsuites><testsuite>' + b'<x>' * {xml_depth} + b'</x>' * {xml_depth} "
               "+ b'</testsuite></testsuites>'\n")
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec.
    code = (prelude + "import re, time\nt = time.perf_counter()\n" + STEPS[step] +
            "\nhwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]"
            "\nprint(hwm, time.perf_counter() - t)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "EVALPIPE_HOME": str(home)})
    rss_kb, seconds = out.stdout.split()[-2:]  # after anything the step printed
    return int(rss_kb) / 1024, float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--output-mb", type=float, default=4.0)
    parser.add_argument("--xml-depth", type=int, default=2_000_000)
    parser.add_argument("--steps", default="reduce,report,cached re-run",
                        help="which reads of the big run to measure (a cached re-run reads outputs a"
                             " DuckDB vector at a time: about 2,048 outputs' worth of memory)")
    args = parser.parse_args()
    out_bytes = int(args.output_mb * (1 << 20))
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        t = time.perf_counter()
        big = make_run(home, args.samples, out_bytes)
        small = make_run(home, PEER_SAMPLES, out_bytes)
        print(f"stored {args.samples} + {PEER_SAMPLES} samples of {args.output_mb:g} MB outputs in "
              f"{time.perf_counter() - t:.1f} s (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
        rows = {}
        for step in args.steps.split(","):
            rows[f"evalpipe {step}, {args.samples} samples"] = peak(step, big, home)
        mb, s = peak("whole rows", small, home)
        rows[f"peer: whole rows, {PEER_SAMPLES} samples"] = (mb, s)
        rows[f"peer: whole rows, scaled to {args.samples}"] = (mb * args.samples / PEER_SAMPLES, None)
        rows[f"evalpipe JUnit stream, {args.xml_depth:,} nested"] = peak("junit stream", big, home, args.xml_depth)
        rows[f"peer: ElementTree tree, {args.xml_depth:,} nested"] = peak("junit tree", big, home, args.xml_depth)
    for name, (mb, s) in rows.items():
        print(f"{name:48s} peak {mb:9.0f} MB" + (f"  {s:6.2f} s" if s is not None else ""))
    print(json.dumps({"load": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
