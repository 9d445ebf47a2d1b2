"""`--fresh` (`RunConfig.fresh`): every sample is drawn from the agent again, whatever the
cache holds; what it draws is kept, and a later run without it reuses that."""

from __future__ import annotations

import evalpipe
from storage.store import Store

AGENT = """
import pathlib
CALLS = pathlib.Path(__file__).with_name("calls.txt")

def answer(inputs, ctx):
    with CALLS.open("a") as fh:
        fh.write(f"{inputs['q']}\\n")
    return "yes"
"""
CASES = [{"id": f"c{i}", "inputs": {"q": i}, "reference": "yes", "grader": {"kind": "exact"}} for i in range(3)]


def test_a_fresh_run_draws_every_sample_again_and_a_later_run_reuses_what_it_drew(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    calls = tmp_path / "calls.txt"
    spec, home = f"python:{tmp_path / 'agent.py'}:answer", tmp_path / "home"

    first = evalpipe.evaluate(CASES, spec, n=2, home=home)
    assert len(calls.read_text().splitlines()) == 6 and first.cached_samples == 0
    again = evalpipe.evaluate(CASES, spec, n=2, home=home)
    assert len(calls.read_text().splitlines()) == 6 and again.cached_samples == 6  # the cache, as ever

    fresh = evalpipe.evaluate(CASES, spec, n=2, home=home, fresh=True)
    assert len(calls.read_text().splitlines()) == 12 and fresh.cached_samples == 0
    assert fresh.pass_at_k["1"] == 1.0
    assert Store(home).runs.get(fresh.run_id)["config"]["fresh"] is True
    assert "fresh" not in Store(home).runs.get(first.run_id)["config"]
    later = evalpipe.evaluate(CASES, spec, n=2, home=home)
    assert len(calls.read_text().splitlines()) == 12 and later.cached_samples == 6
