"""What does the judge grader cost beyond the judge itself? (printed, not asserted)

The same trivial decision function graded as a `predicate` (the peer: one call, no
draws) and as a `judge` with J = 1 and J = 5 (seed derivation, J calls, majority,
trace). With a real model the endpoint's latency dwarfs both; this shows the harness's
own share per output. Also: `calibrate` on 10,000 labelled outputs of 2,000 cases.

Usage: python bench/judge_overhead.py [--outputs 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from tasks.graders import grade
from tasks.metrics.calibration import calibrate
from tasks.models import EvalCase

SOURCE = """
def predicate(output, case):
    return "yes" in output

def judge(output, case, seed):
    return "yes" in output
"""


def per_output_us(case: EvalCase, outputs: list[str]) -> float:
    grade(outputs[0], case)  # load the module once, as a run's planning step does
    started = time.perf_counter()
    for output in outputs:
        grade(output, case, {})
    return (time.perf_counter() - started) / len(outputs) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--outputs", type=int, default=2000)
    args = parser.parse_args()
    outputs = [f"answer {i}: {'yes' if i % 3 else 'no'}" for i in range(args.outputs)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decide.py"
        path.write_text(SOURCE)
        peer = per_output_us(
            EvalCase(id="p", grader={"kind": "predicate", "function": f"{path}:predicate"}), outputs
        )
        print(f"predicate (peer)   {peer:8.1f} µs/output")
        for j in (1, 5):
            case = EvalCase(
                id="j", grader={"kind": "judge", "function": f"{path}:judge", "samples": j}
            )
            us = per_output_us(case, outputs)
            print(f"judge J={j}          {us:8.1f} µs/output  ratio {us / peer:5.2f}x")
    rng = np.random.default_rng(0)
    truth = rng.random(10_000) < 0.6
    judge = np.where(rng.random(10_000) < 0.85, truth, ~truth)
    cases = [f"c{i // 5}" for i in range(10_000)]
    started = time.perf_counter()
    cal = calibrate(judge, truth, cases)
    print(
        f"calibrate 10,000 outputs / 2,000 cases, 2,000 resamples: "
        f"{time.perf_counter() - started:.3f} s (kappa {cal.values['kappa']:.3f})"
    )


if __name__ == "__main__":
    main()
