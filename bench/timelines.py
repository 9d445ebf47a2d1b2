"""What does the timelines artifact add to publishing a run's failing cases? (printed, not asserted)

For each of MAX_TIMELINES failing cases, the rows of its sample table (`sample_rows`, what a
flow run already publishes for it: the peer) and its first failing sample's timeline
(`timeline_section`), both from the same stored rows (trace as stored JSON text) of
`--samples` samples a case whose trajectories have `--steps` steps, one in four with a tool
result long enough to be folded. Medians of `--repeats` passes, alternating the two.

Usage: python bench/timelines.py [--samples 10] [--steps 40] [--repeats 21]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tasks.report import sample_table as tables


def _trace(steps: int) -> str:
    entries = []
    for i in range(steps // 2):
        entries.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": str(i), "type": "function", "function": {"name": "search", "arguments": json.dumps({"q": f"q{i}"})}}]})
        entries.append({"role": "tool", "tool_call_id": str(i), "name": "search",
                        "content": ("long result " * 60) if i % 4 == 0 else f"result {i}"})
    return json.dumps({"trajectory": {"entries": entries}})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    cases = [[{"case_id": f"c{c}", "sample_index": i, "status": "failed", "passed": False, "detail": "wrong",
               "safety": [], "trace": _trace(args.steps), "output": "an answer", "input_tokens": 10,
               "output_tokens": 5, "latency_s": 0.1} for i in range(args.samples)]
             for c in range(tables.MAX_TIMELINES)]
    spent: dict[str, list[float]] = {"sample tables (peer)": [], "timelines": []}
    for _ in range(args.repeats):
        began = time.perf_counter()
        for samples in cases:
            tables.sample_rows(samples, "exact")
        spent["sample tables (peer)"].append(time.perf_counter() - began)
        began = time.perf_counter()
        sections = [tables.timeline_section(s[0]["case_id"], s[0], "exact", "run") for s in cases]
        doc = tables.timelines_markdown("run", sections, 0)
        spent["timelines"].append(time.perf_counter() - began)
    print(f"{tables.MAX_TIMELINES} cases x {args.samples} samples, {args.steps} steps a trajectory;"
          f" timelines artifact {len(doc):,} characters")
    for what, times in spent.items():
        print(f"{what:22s} median {statistics.median(times) * 1e3:8.2f} ms  (of {args.repeats})")


if __name__ == "__main__":
    main()
