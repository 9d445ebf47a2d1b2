"""Peak memory where candidates choose the size: a stored run of 1,000 samples whose outputs
are 1 MB each, read back by the reduce step and `report`, and used again by a fully cached
re-run, a regrade (the graders changed: every output graded anew from the store) and a
rescore (`evalpipe rescore`: another suite graded on the run's outputs), each the whole run
loop on thread pools, and by the judges' commands that read every output (`labels export`,
`compare` of the run with itself, a python pairwise judge); and a JUnit report of millions
of nested elements. Each figure is the
peak RSS of a fresh process doing only that step, beside the peer: the same step reading
whole rows / the whole XML tree (measured on fewer samples where the whole would not fit,
and scaled).

    .venv/bin/python bench/memory.py [--samples 1000] [--output-mb 1]

Run it with PYTHONPATH naming an older checkout to measure that one's steps (before/after).
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


N = 5  # samples per case


def suite(samples: int, reference: str = "yes"):
    """The stored run's suite: `samples` / N cases, exact-graded against `reference`."""
    from tasks.suites.dataset import build_suite

    return build_suite("memory", [(f"c{i:05d}", {"id": f"c{i:05d}", "inputs": {"i": i}, "reference": reference,
                                                 "grader": {"kind": "exact"}}) for i in range(samples // N)], {},
                       "bench")


def spec_of(suite, *, rescored_from: str | None = None):
    from tasks.run import RunSpec

    return RunSpec(suite_version=suite.version, suite_name=suite.name, agent="bench", agent_fingerprint="bench",
                   n=N, ks=[1], seed=0, config={"rescored_from": rescored_from} if rescored_from else {})


def make_run(home: Path, samples: int, output_bytes: int) -> str:
    """A stored, finished run of `samples` samples (N per case) with the keys a run of the
    bench's suite plans, each output `output_bytes` long and its own (a stored text is kept
    once, so equal outputs would be one)."""
    import pyarrow as pa

    from storage.store import Store
    from tasks.run import RunStatus, plan
    from tasks.run.samples import SAMPLE_SCHEMA

    store = Store(home)
    ran = suite(samples)
    spec = spec_of(ran)
    store.runs.start(spec)
    store.snapshots.save(ran)
    planned = plan(ran, spec)
    for start in range(0, len(planned), 20):  # a transaction a slice: DuckDB holds uncommitted rows whole
        part = planned[start:start + 20]
        rows = [{"run_id": spec.run_id, "case_id": p.case_id, "sample_index": p.index, "seed": p.seed,
                 "output": f"{start + i:08d}".ljust(output_bytes, "x"), "status": "failed", "passed": False,
                 "score": 0.0, "detail": "wrong", "safety": [], "trace": "{}", "duration_s": 0.0,
                 "cache_key": p.cache_key, "cached": False, "case_hash": p.case_hash, "output_key": p.output_key}
                for i, p in enumerate(part)]
        store.samples.insert(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA))
    store.runs.finish(spec.run_id, RunStatus.completed, None)
    return spec.run_id


def loop(home: Path, source: str, samples: int, step: str) -> None:
    """One step as a run does it: the whole run loop, on thread pools (`local_stages`)."""
    from storage.store import Store
    from tasks.run import RunConfig, plan
    from tasks.run.loop import local_stages, run_loop
    from tasks.run.rescore import rescore_plan

    store = Store(home)
    ran = suite(samples)
    graded = ran if step == "cached re-run" else suite(samples, reference="no")  # new graders: graded anew
    spec = spec_of(graded, rescored_from=source if step == "rescore" else None)
    config = RunConfig(suite="memory", agent="bench", n=N, workers=2)
    rescoring = None
    if step == "rescore":
        store.snapshots.save(graded)
        source_rows = store.samples.of_run(source, whole_outputs=False)
        rescoring = rescore_plan(spec.run_id, plan(graded, spec), graded, ran, source, source_rows, store.db)
    with local_stages(config) as stages:
        summary = run_loop(spec, config, graded, None, store, stages, rescoring=rescoring)
    assert summary.samples == samples, summary.samples


STEPS = {
    "reduce": "from storage.store import Store; from tasks.run import RunSpec, summary_columns\n"
              "Store(HOME).samples.of_run(RUN, summary_columns(RunSpec(suite_version='0'*64, suite_name='m',"
              " agent='b', agent_fingerprint='b', n=5, ks=[1], seed=0)))",
    "report": "from flows.report import read_case_rows; from storage.store import Store\n"
              "read_case_rows(RUN, Store(HOME))",
    # The stored run used again by the run loop: copied whole, graded anew, rescored.
    **{step: f"from bench.memory import loop; loop(HOME, RUN, SAMPLES, {step!r})"
       for step in ("cached re-run", "regrade", "rescore")},
    # The readers of every output, whole: a label file of the run, the run compared with itself.
    "labels export": "from flows.judging import export_labels; from storage.store import Store\n"
                     "export_labels(RUN, HOME.parent / 'labels.jsonl', Store(HOME))",
    "compare": "from flows.judging import compare_runs; from storage.store import Store\n"
               f"compare_runs(RUN, RUN, '{ROOT}/tests/support/judges.py:prefers_reference', store=Store(HOME))",
    "whole rows": "from storage.store import Store; Store(HOME).samples.of_run(RUN)",
    "junit stream": "from tasks.graders.junit import parse_junit, JUnitError\n"
                    "try:\n    parse_junit(XML)\nexcept JUnitError:\n    pass",
    "junit tree": "import xml.etree.ElementTree as ET; ET.fromstring(XML)",
}


def peak(step: str, run_id: str, home: Path, xml_depth: int = 0, samples: int = 0) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of a fresh process doing one step."""
    prelude = (f"from pathlib import Path\nRUN = {run_id!r}\nHOME = Path({str(home)!r})\nSAMPLES = {samples}\n"
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
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--output-mb", type=float, default=1.0)
    parser.add_argument("--xml-depth", type=int, default=2_000_000)
    parser.add_argument("--steps", default="reduce,report,cached re-run,regrade,rescore,labels export,compare",
                        help="which uses of the big run to measure, in this order (each adds a run to its home)")
    args = parser.parse_args()
    out_bytes = int(args.output_mb * (1 << 20))
    with tempfile.TemporaryDirectory() as tmp:
        home, peer_home = Path(tmp, "big"), Path(tmp, "peer")
        t = time.perf_counter()
        big = make_run(home, args.samples, out_bytes)
        small = make_run(peer_home, PEER_SAMPLES, out_bytes)
        print(f"stored {args.samples} + {PEER_SAMPLES} samples of {args.output_mb:g} MB outputs in "
              f"{time.perf_counter() - t:.1f} s (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
        rows = {}
        for step in args.steps.split(","):
            rows[f"evalpipe {step}, {args.samples} samples"] = peak(step, big, home, samples=args.samples)
        mb, s = peak("whole rows", small, peer_home)
        rows[f"peer: whole rows, {PEER_SAMPLES} samples"] = (mb, s)
        rows[f"peer: whole rows, scaled to {args.samples}"] = (mb * args.samples / PEER_SAMPLES, None)
        rows[f"evalpipe JUnit stream, {args.xml_depth:,} nested"] = peak("junit stream", big, home, args.xml_depth)
        rows[f"peer: ElementTree tree, {args.xml_depth:,} nested"] = peak("junit tree", big, home, args.xml_depth)
    for name, (mb, s) in rows.items():
        print(f"{name:48s} peak {mb:9.0f} MB" + (f"  {s:6.2f} s" if s is not None else ""))
    print(json.dumps({"load": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
