"""`gate --metric NAME` (issue 30, item 6): the gate compares any registered per-case metric,
paired by case, and decides on that paired CI.

The runs: 30 cases, 4 samples each; a case's value of the plugin metric `perfect` is 1 when all
four samples pass. The candidate breaks one sample of q10-q14 (perfect before, not after) and
mends one of q20-q24 (two of four pass instead of one): its pass rate does not move (the
-25 and +25 point changes cancel), while `perfect` drops by 5 cases in 30. Paired, that drop
is evidence (every other case is unchanged); unpaired, 10 of 30 against 15 of 30 is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evalpipe import evaluate
from tasks import registry
from tasks.metrics.percent import signed_points
from tasks.models import InputError

ROOT = Path(__file__).resolve().parent.parent
N = 4
BEFORE = [4] * 15 + [3] * 5 + [1] * 10  # samples passing per case, q00-q29
AFTER = [4] * 10 + [3] * 5 + [3] * 5 + [2] * 5 + [1] * 5

PLUGIN = '''
from tasks.registry import metric


@metric("perfect", per_case=True)
def perfect(tallies):
    """Whether every sample of the case passed."""
    return (tallies.passes == tallies.n).astype(float)


@metric("perfect_share")
def perfect_share(tallies):
    return float((tallies.passes == tallies.n).mean())


@metric("nothing", per_case=True)
def nothing(tallies):
    return None
'''


def v1(inputs, ctx) -> str:  # two functions: an agent's fingerprint is its code
    return "yes" if ctx.index < BEFORE[inputs["q"]] else "no"


def v2(inputs, ctx) -> str:
    return "yes" if ctx.index < AFTER[inputs["q"]] else "no"


def cases() -> list[dict]:
    return [{"id": f"q{i:02d}", "inputs": {"q": i}, "reference": "yes", "grader": {"kind": "exact"},
             "slices": ["hard"] if i >= 20 else ["easy"]} for i in range(len(BEFORE))]


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin metrics, registered here for the test (undone after it) and named by
    EVALPIPE_PLUGINS for the commands it starts."""
    path = tmp_path / "perfect_metric.py"
    path.write_text(PLUGIN)
    monkeypatch.setattr(registry, "_METRICS", dict(registry.metrics()))
    exec(compile(PLUGIN, str(path), "exec"), {})
    monkeypatch.setenv("EVALPIPE_PLUGINS", str(path))
    return path


def evalpipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def unpaired_ci(before: np.ndarray, after: np.ndarray, seed: int = 0, n_boot: int = 10_000) -> tuple[float, float]:
    """The CI of after's mean minus before's with the two runs resampled apart, as if unpaired."""
    rng = np.random.default_rng(seed)
    a = after[rng.integers(0, after.size, (n_boot, after.size))].mean(axis=1)
    b = before[rng.integers(0, before.size, (n_boot, before.size))].mean(axis=1)
    lo, hi = np.quantile(a - b, [0.025, 0.975])
    return float(lo), float(hi)


def test_the_gate_decides_on_a_registered_metric_s_case_paired_ci(home, plugin, tmp_path):
    base = evaluate(cases(), v1, name="story", n=N, seed=1)
    run = evaluate(cases(), v2, name="story", n=N, seed=1, baseline=base.run_id, metric="perfect")
    decided = run.gate
    perfect_before = np.array([float(p == N) for p in BEFORE])
    perfect_after = np.array([float(p == N) for p in AFTER])
    # The figures are the metric's own, as `run --json` reports it under `metrics`.
    assert base.metrics["perfect"].value == pytest.approx(perfect_before.mean())
    assert run.metrics["perfect"].value == pytest.approx(perfect_after.mean())
    assert decided.metric == "perfect" and decided.delta_pass_at_1 == pytest.approx(-5 / 30)
    lo, hi = decided.delta_ci
    assert hi < 0 and decided.verdict == "regressed" and decided.decision == "block", decided.reasons
    assert decided.reasons[0].startswith("regression: the whole 95% CI")
    assert any(r.startswith("regressed: perfect changed by -16.7 pts") for r in decided.reasons), decided.reasons
    u_lo, u_hi = unpaired_ci(perfect_before, perfect_after)
    assert u_lo < 0 < u_hi  # unpaired, the same change is inconclusive: pairing is what decides
    assert hi - lo < u_hi - u_lo

    # The same runs on pass@1: the changes cancel, and the gate passes.
    by_pass = json.loads(evalpipe("gate", run.run_id, "--baseline", base.run_id, "--metric", "pass", "--json").stdout)
    assert (by_pass["decision"], by_pass["verdict"], by_pass["delta_pass_at_1"]) == ("pass", "inconclusive", 0.0)

    # `gate --metric perfect` shows the decision stored at run time; given a rule, decides anew to the same CI.
    for extra, decided_when in (((), "at run time"), (("--max-drop", "0"), "now")):
        done = evalpipe("gate", run.run_id, "--baseline", base.run_id, "--metric", "perfect", "--json", *extra)
        assert done.returncode == 1, done.stderr
        doc = json.loads(done.stdout)
        assert doc["decided"] == decided_when and doc["metric"] == "perfect" and doc["decision"] == "block"
        assert doc["delta_ci"] == pytest.approx([lo, hi], abs=1e-6)
    comment = evalpipe("gate", run.run_id, "--baseline", base.run_id, "--metric", "perfect", "--format", "markdown").stdout
    assert f"**perfect** {100 * perfect_before.mean():.1f}% → {100 * perfect_after.mean():.1f}%" in comment, comment
    assert "q10" in comment and "| 1.00 (4/4) | 0.00 (3/4) |" in comment
    page = tmp_path / "diff.html"
    done = evalpipe("report", run.run_id, "--baseline", base.run_id, "--metric", "perfect", "--out", str(page))
    assert done.returncode == 0, done.stderr
    assert f"{signed_points(lo)} to {signed_points(hi)}" in page.read_text()  # the same CI on the page
    assert f"{signed_points(lo)} to {signed_points(hi)}" in comment

    # A slice rule on the metric reads the slice's mean value of it; a sequential run decides on it too.
    sliced = evaluate(cases(), v2, name="story", n=N, seed=1, baseline=base.run_id, metric="perfect",
                      min_slice={"easy": 0.8})
    assert any(r.startswith("slice easy: perfect 50.0% is below the required 80.0%") for r in sliced.gate.reasons)
    seq = evaluate(cases(), v2, name="story", n=N, seed=1, baseline=base.run_id, metric="perfect",
                   sequential=True)
    assert seq.gate.decision == "block" and seq.sequential["decision"] in ("block", None)


@pytest.mark.parametrize(("metric", "message"), [
    ("nope", "--metric: unknown metric 'nope' (expected pass, score or a registered per-case metric: mean_score,"
             " nothing, pass@1, perfect, pass@{k}, pass^{k})"),
    ("perfect_share", "--metric perfect_share: it has no per-case values (it is computed over the whole run)"),
    ("nothing", "--metric nothing: it has no per-case values on run "),
])
def test_a_metric_the_gate_cannot_pair_is_one_line_and_exit_2(home, plugin, metric, message):
    base = evaluate(cases(), v1, name="story", n=N, seed=1)
    run = evaluate(cases(), v2, name="story", n=N, seed=1)
    done = evalpipe("gate", run.run_id, "--baseline", base.run_id, "--metric", metric)
    assert done.returncode == 2 and done.stdout == "", done
    assert message in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_a_registered_metric_s_values_are_computed_on_each_run_s_own_samples(monkeypatch):
    """A plugin's per-case metric of the sample scores pairs as the gate's `score` does: the
    same changes, the same CI. The built-ins by name are the headline comparisons themselves
    (one comparison, one CI, however asked). A side without sample scores has no values of
    it, and says so."""
    from tasks.metrics.diff import CaseResult, check_metric, diff_runs

    monkeypatch.setattr(registry, "_METRICS", dict(registry.metrics()))
    registry.metric("scored", per_case=True)(lambda tallies: tallies.mean_scores)

    def run(scores: list[tuple[float, ...]]) -> list[CaseResult]:
        return [CaseResult(f"c{i}", f"h{i}", len(s), sum(x == 1.0 for x in s), sum(s) / len(s), (), s)
                for i, s in enumerate(scores)]

    before = run([(1.0, 0.5), (0.0, 0.0), (0.25, 0.75), (1.0, 1.0)])
    after = run([(0.5, 0.5), (0.5, 0.0), (1.0, 0.75), (1.0, 0.0)])
    by_name, by_score = (diff_runs(after, before, metric=m, seed=3) for m in ("scored", "score"))
    assert by_name.metric == "scored" and by_score.metric == "score"
    assert by_name.overall.delta == pytest.approx(by_score.overall.delta) == pytest.approx(-0.125 / 4)
    assert by_name.overall.ci == pytest.approx(by_score.overall.ci)
    assert [c.change for c in by_name.cases] == pytest.approx([c.change for c in by_score.cases])
    assert (check_metric("pass@1"), check_metric("mean_score")) == ("pass", "score")
    assert diff_runs(after, before, metric="mean_score", seed=3).to_json() == by_score.to_json()
    unscored = [CaseResult(r.case_id, r.case_hash, r.n, r.c, r.score) for r in before]
    with pytest.raises(InputError, match="--metric scored: it has no per-case values on baseline"):
        diff_runs(after, unscored, metric="scored")
