"""How long do `diff` and the diff report take on a 5,000-case suite? (printed, not asserted)

Two runs of 5,000 cases × 5 samples, 40 slices, a third of the cases flipped either way.
Measured: the case-by-case diff (labels, per-slice paired bootstrap CIs), the Markdown
comment, and the HTML diff page with its expanded cases. The peer, in the same run on the
same cases: the single-run HTML report (`render_report`) of the newer run.

Usage: python bench/diff_report.py [--cases 5000] [--n 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tasks.metrics.aggregate import aggregate
from tasks.metrics.diff import CaseResult, diff_runs
from tasks.report import render_report
from tasks.report.diff_html import expanded, render_diff_report
from tasks.report.markdown import comparison_markdown


def runs(cases: int, n: int) -> tuple[list[CaseResult], list[CaseResult]]:
    rng = np.random.default_rng(0)
    before_c = rng.integers(0, n + 1, cases)
    after_c = np.where(rng.random(cases) < 0.33, rng.integers(0, n + 1, cases), before_c)
    make = lambda cs: [CaseResult(f"case-{i:05d}", f"h{i}", n, int(c), c / n, (f"slice-{i % 40}",))  # noqa: E731
                       for i, c in enumerate(cs)]
    return make(after_c), make(before_c)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--n", type=int, default=5)
    args = parser.parse_args()
    after, before = runs(args.cases, args.n)
    diff, t_diff = timed(lambda: diff_runs(after, before))
    sample = {"index": 0, "status": "failed", "output": "x" * 2000, "detail": "expected 'yes'"}
    details = {c.case_id: {"inputs": {"prompt": "p" * 500}, "reference": "r", "before": sample, "after": sample}
               for c in expanded(diff)}
    gate = {"decision": "block", "verdict": "regressed", "reasons": ["bench"]}
    page, t_page = timed(lambda: render_diff_report(diff, gate, None, None, details))
    markdown, t_md = timed(lambda: comparison_markdown(diff, gate))

    import pyarrow as pa

    table = pa.table({"case_id": [r.case_id for r in after for _ in range(args.n)],
                      "sample_index": [i for _ in after for i in range(args.n)],
                      "passed": [i < r.c for r in after for i in range(args.n)],
                      "status": ["passed" if i < r.c else "failed" for r in after for i in range(args.n)],
                      "safety": pa.array([[] for _ in range(len(after) * args.n)], pa.list_(pa.string()))})
    agg = aggregate(table, {r.case_id: list(r.slices) for r in after}, [1])
    summary = {"run_id": "r", "suite_version": "0" * 64, "suite_name": "bench", "agent": "a", "n": args.n,
               "cases": args.cases, "samples": table.num_rows, "cached_samples": 0, **agg.to_json(),
               "flow_run_id": None, "duration_s": None}
    cases = [{"case_id": r.case_id, "n": r.n, "c": r.c, "slices": list(r.slices), "statuses": {},
              "details": ["expected 'yes'"], "safety": [], "outputs": ["x" * 2000]} for r in after]
    _, t_peer = timed(lambda: render_report(summary, cases))
    print(f"{args.cases} cases x n={args.n}: {diff.counts()}")
    print(f"diff (labels + {len(diff.slices)} slice CIs): {t_diff:.3f} s")
    print(f"diff page: {t_page:.3f} s, {len(page) / 1e6:.2f} MB, {len(expanded(diff))} cases expanded")
    print(f"markdown comment: {t_md:.3f} s, {len(markdown)} chars (limit 65,536)")
    print(f"peer, single-run report of the same run: {t_peer:.3f} s")


if __name__ == "__main__":
    main()
