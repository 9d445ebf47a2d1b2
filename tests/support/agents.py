"""Deterministic agents for the flow tests. Each call can be counted in a file, so a test
can tell drawn samples from cached ones."""

from __future__ import annotations

import os
import random
import time


def _count(ctx) -> None:
    path = os.environ.get("EVALPIPE_TEST_CALLS")
    if path:
        with open(path, "a") as fh:
            fh.write(f"{ctx.case_id}#{ctx.index}\n")


def flaky(inputs, ctx) -> str:
    """Right with a per-case probability, decided by the sample's seed."""
    _count(ctx)
    p = inputs.get("p", 0.5)
    return "yes" if random.Random(ctx.seed).random() < p else "no"


def better(inputs, ctx) -> str:
    _count(ctx)
    return "yes" if random.Random(ctx.seed).random() < 0.95 else "no"


def worse(inputs, ctx) -> str:
    _count(ctx)
    return "yes" if random.Random(ctx.seed).random() < 0.2 else "no"


def boom(inputs, ctx) -> str:
    """Raises on cases whose id has 'boom' in it."""
    _count(ctx)
    if "boom" in ctx.case_id:
        raise RuntimeError(f"cannot answer {ctx.case_id}")
    return "yes"


def slow(inputs, ctx) -> str:
    time.sleep(float(os.environ.get("EVALPIPE_TEST_SLEEP", "0.05")))
    return flaky(inputs, ctx)


def v1(inputs, ctx) -> str:
    """Agent version 1 of the diff story: answers what the case's `v1` input says."""
    return inputs.get("v1", "")


def v2(inputs, ctx) -> str:
    """Agent version 2: answers what the case's `v2` input says."""
    return inputs.get("v2", "")


def metered(inputs, ctx) -> str:
    """Counts its calls and reports the tokens of each: `inputs.tokens` in (default 1000),
    10 out, counted by `toy-model` (priced by a test's price file)."""
    _count(ctx)
    ctx.report_usage(input_tokens=inputs.get("tokens", 1000), output_tokens=10, model="toy-model")
    return "yes" if random.Random(ctx.seed).random() < inputs.get("p", 0.5) else "no"


def logged(inputs, ctx) -> str:
    """Logs each call's start (`S CASE#INDEX`) and return (`R ...`) to the file $CALLS, one
    write each, around `EVALPIPE_TEST_SLEEP` seconds (default 0.05): calls started again
    after a stop are told from those that had returned (tests/test_resume.py, bench/resume.py)."""
    key = f"{ctx.case_id}#{ctx.index}"
    with open(os.environ["CALLS"], "a") as fh:
        fh.write(f"S {key}\n")
    time.sleep(float(os.environ.get("EVALPIPE_TEST_SLEEP", "0.05")))
    with open(os.environ["CALLS"], "a") as fh:
        fh.write(f"R {key}\n")
    return "yes"


def hang_once(inputs, ctx) -> str:
    """`logged`, except that the first call of any sample 1 hangs (an hour)."""
    if ctx.index == 1:
        try:
            os.close(os.open(os.environ["CALLS"] + ".hung", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            time.sleep(3600)
    return logged(inputs, ctx)
