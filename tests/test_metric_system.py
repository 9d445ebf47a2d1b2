"""One metric system (issue #46, item 4): pass@k, pass^k and the mean score are registered
metrics, and the run's headline figures are theirs."""

from __future__ import annotations

from dataclasses import replace
from math import comb
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from numpy.typing import NDArray
from pytest import approx

from tasks import registry
from tasks.metrics.aggregate import aggregate
from tasks.metrics.tallies import SampleRecord, Tallies, metric_values

# Eight cases, each case's samples (passed, score); case "h" has 4 samples, the rest 5.
TABLE: dict[str, list[tuple[bool, float]]] = {
    "a": [(True, 1.0)] * 5,
    "b": [(True, 0.8), (False, 0.2), (True, 0.9), (False, 0.0), (False, 0.4)],
    "c": [(False, 0.0)] * 5,
    "d": [(True, 1.0), (True, 0.7), (True, 1.0), (True, 0.6), (False, 0.1)],
    "e": [(False, 0.3), (True, 1.0), (False, 0.0), (False, 0.5), (False, 0.0)],
    "f": [(True, 0.9), (True, 1.0), (False, 0.2), (True, 1.0), (True, 0.8)],
    "g": [(False, 0.0), (False, 0.1), (True, 0.6), (True, 0.7), (False, 0.0)],
    "h": [(True, 1.0), (False, 0.0), (True, 1.0), (True, 0.5)],
}
SLICES = {"a": ["easy"], "b": ["hard"], "c": ["hard"], "d": ["easy", "tools"], "e": ["hard"],
          "f": ["easy"], "g": ["hard", "tools"], "h": ["solo"]}


def table() -> pa.Table:
    rows = [(cid, i, ok, score) for cid, samples in TABLE.items() for i, (ok, score) in enumerate(samples)]
    return pa.table({
        "case_id": pa.array([r[0] for r in rows], pa.string()),
        "sample_index": pa.array([r[1] for r in rows], pa.int64()),
        "passed": pa.array([r[2] for r in rows], pa.bool_()),
        "status": ["passed" if r[2] else "failed" for r in rows],
        "safety": pa.array([[] for _ in rows], pa.list_(pa.string())),
        "score": pa.array([r[3] for r in rows], pa.float64()),
    })


SEED, N_BOOT = 5, 500
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by the test are undone after it."""
    monkeypatch.setattr(registry, "_METRICS", dict(registry.metrics()))
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))


def test_the_headline_figures_are_the_numbers_the_code_before_registered_metrics_gave() -> None:
    # Pinned from main before pass@k and pass^k became registered metrics (seed 5, 500 resamples).
    agg = aggregate(table(), SLICES, [4, 2], seed=SEED, n_boot=N_BOOT)
    m = agg.overall
    assert m.pass_at_k == approx({1: 0.54375, 2: 0.725, 4: 0.85})
    assert flat(m.pass_at_k_ci) == approx([0.325, 0.76875, 0.4875, 0.9446875, 0.625, 1.0])
    assert m.pass_hat_k == approx({1: 0.54375, 2: 0.3625, 4: 0.175})
    assert flat(m.pass_hat_k_ci) == approx([0.325, 0.76875, 0.1625, 0.6125, 0.011875, 0.45])
    assert m.pass_at_1_se == approx(0.1222692798118738)
    assert flat((m.mean_score, m.mean_score_ci)) == approx([0.523125, 0.338, 0.723484375])
    hard = agg.slices["hard"]
    assert flat((hard.pass_at_k, hard.pass_at_k_ci)) == approx([0.25, 0.45, 0.7, 0.1, 0.4, 0.175, 0.7, 0.25, 1.0])
    assert flat((hard.pass_hat_k, hard.pass_hat_k_ci)) == approx([0.25, 0.05, 0.0, 0.1, 0.4, 0.0, 0.1, 0.0, 0.0])
    assert agg.slices["solo"].pass_hat_k == approx({1: 0.75, 2: 0.5, 4: 0.0})
    assert agg.metrics["pass@1"] == {"value": approx(0.54375), "ci": approx([0.325, 0.76875]), "percent": True}
    assert "pass@2" not in agg.metrics and "pass^2" not in agg.metrics  # the headline's keys report them

    beyond = aggregate(table(), SLICES, [5], seed=SEED, n_boot=N_BOOT)  # case "h" has 4 samples
    assert beyond.overall.pass_at_k[5] is None and beyond.overall.pass_hat_k_ci[5] is None
    assert beyond.pass_at_k_notes == {5: "k=5 > n=4"}


def test_a_plugin_family_over_sample_records_computes_as_the_built_in_pass_at_k(scratch_registry) -> None:
    @registry.metric("any_of@{k}", per_case=True)
    def any_of(tallies: Tallies, k: int) -> list[float] | None:
        """pass@k from each sample's record, counting the k-subsets that hold a pass."""
        if any(k > len(t.samples) for t in tallies):
            return None
        return [1.0 - comb(sum(not s.passed for s in t.samples), k) / comb(len(t.samples), k) for t in tallies]

    agg = aggregate(table(), SLICES, [2, 4], seed=SEED, n_boot=N_BOOT)
    for k in (1, 2, 4):
        mine = agg.metrics[f"any_of@{k}"]  # listed at every k the run asks
        assert mine["value"] == approx(agg.overall.pass_at_k[k], abs=1e-12)
        assert mine["ci"] == approx(list(agg.overall.pass_at_k_ci[k]), abs=1e-12)
    assert "any_of@3" not in agg.metrics
    # The same numbers through the registry's own entry point, on tallies made by hand.
    t = _tallies()
    assert metric_values(t, (2,), seed=SEED, n_boot=N_BOOT)["any_of@2"] == agg.metrics["any_of@2"]
    assert aggregate(table(), SLICES, [5], seed=SEED, n_boot=N_BOOT).metrics["any_of@5"] == {
        "value": None, "ci": None, "percent": True}  # k > some case's n: no value, as pass@5 has none


def test_the_headline_reads_the_registered_family(scratch_registry, monkeypatch) -> None:
    """Whatever the registry holds as pass@{k} is what the headline reports: one code path."""
    def halved(tallies: Tallies, k: int) -> NDArray:
        return np.full(len(tallies), 0.5 / k)

    monkeypatch.setitem(registry._FAMILIES, "pass@{k}", replace(registry.metric_family("pass@{k}"), fn=halved))
    agg = aggregate(table(), SLICES, [2], seed=SEED, n_boot=N_BOOT)
    assert agg.overall.pass_at_k == {1: 0.5, 2: 0.25} and agg.slices["easy"].pass_at_k == {1: 0.5, 2: 0.25}
    assert agg.overall.pass_at_1_se == 0.0 and agg.overall.pass_hat_k[2] == approx(0.3625)


def test_a_family_is_checked_when_registered_and_a_failing_member_is_reported(scratch_registry) -> None:
    with pytest.raises(ValueError, match="takes no `k` parameter"):
        registry.metric("broken@{k}")(lambda tallies: 0.0)

    @registry.metric("hidden@{k}", per_case=True, listed=False)
    def hidden(tallies: Tallies, k: int) -> NDArray:
        return tallies.passes / tallies.n

    @registry.metric("fails@{k}", percent=False)
    def fails(tallies: Tallies, k: int) -> float:
        raise RuntimeError(f"no figure at k={k}")

    assert set(registry.metrics((1, 3))) >= {"hidden@1", "hidden@3", "fails@3", "pass^3"}
    assert "hidden@3" not in registry.metrics()  # members only at the k values asked
    out = metric_values(_tallies(), (3,), seed=SEED, n_boot=50)
    assert "hidden@3" not in out and "pass@3" not in out and "pass@1" in out
    assert out["fails@3"] == {"value": None, "ci": None, "percent": False,
                              "error": "metric fails@3 raised RuntimeError: no figure at k=3"}


def test_a_run_reports_a_plugin_family_at_each_k_it_asks_beside_the_headline(scratch_registry, tmp_path) -> None:
    import evalpipe
    from tasks.report.text import summary_text

    @registry.metric("all_of^{k}", per_case=True)
    def all_of(tallies: Tallies, k: int) -> list[float]:
        """pass^k from each sample's record: the share of k-subsets that all pass."""
        return [comb(sum(s.passed for s in t.samples), k) / comb(len(t.samples), k) for t in tallies]

    run = evalpipe.evaluate(str(ROOT / "examples/qa.yaml"), f"python:{ROOT}/examples/agents/demo_agent.py:answer",
                            n=5, k=[1, 3], seed=7, home=tmp_path / "home")
    assert 0 < run.pass_hat_k["3"] < run.pass_at_k["1"] < 1  # the demo agent is right only some of the time
    for k in ("1", "3"):
        assert run.metrics[f"all_of^{k}"].value == approx(run.pass_hat_k[k], abs=1e-12)
    assert "all_of^5" not in run.metrics and "pass@3" not in run.metrics and "pass^3" not in run.metrics
    doc = run.to_json()
    assert list(doc["metrics"])[:2] == ["pass@1", "mean_score"] and list(doc["metrics"])[-2:] == ["all_of^1", "all_of^3"]
    figure = run.metrics["all_of^3"]
    assert f"all_of^3 {100 * figure.value:.1f}%  [{100 * figure.ci[0]:.1f}%, {100 * figure.ci[1]:.1f}%]" in summary_text(doc)


def flat(figures: object) -> list[float]:
    """Numbers nested in dicts (by k, in order) and tuples, as one list for `approx`."""
    if isinstance(figures, dict):
        figures = [figures[k] for k in sorted(figures)]
    if isinstance(figures, list | tuple):
        return [x for f in figures for x in flat(f)]
    return [figures]


def _tallies() -> Tallies:
    """The table's tallies, made without the aggregate."""
    ids = list(TABLE)
    n = np.array([len(TABLE[c]) for c in ids])
    passes = np.array([sum(ok for ok, _ in TABLE[c]) for c in ids])
    records = [SampleRecord(i, ok, "passed" if ok else "failed", score)
               for c in ids for i, (ok, score) in enumerate(TABLE[c])]
    scores = np.array([r.score for r in records])
    return Tallies.of_samples(ids, np.repeat(np.arange(len(ids)), n), n, passes, scores, lambda: records)


def test_diff_and_gate_name_a_plugin_family_s_member(scratch_registry, tmp_path) -> None:
    """`--metric all_of^3`: a member of a plugin family at the k it names pairs case by case
    (its values computed on each case's samples); a k that is not a whole number >= 1 is not one."""
    import evalpipe
    from storage.store import Store
    from tasks.metrics.diff import check_metric, with_metric
    from tasks.models import InputError

    @registry.metric("all_of^{k}", per_case=True)
    def all_of(tallies: Tallies, k: int) -> list[float]:
        return [comb(sum(s.passed for s in t.samples), k) / comb(len(t.samples), k) for t in tallies]

    home = tmp_path / "home"
    agent = f"python:{ROOT}/examples/agents/demo_agent.py:answer"
    base = evalpipe.evaluate(str(ROOT / "examples/qa.yaml"), agent, n=5, seed=7, home=home)
    run = evalpipe.evaluate(str(ROOT / "examples/qa.yaml"), agent, n=5, seed=8, home=home)
    assert check_metric("all_of^3") == "all_of^3"  # k=3 was never asked by the runs
    # Computed on each case's sample records, as the run's own figures are (the plugin reads
    # `t.samples`: with counts alone it would have none).
    results = with_metric(Store(home).samples.case_results(run.run_id, records=True), "all_of^3", "run")
    assert [r.values["all_of^3"] for r in results] == approx([comb(r.c, 3) / comb(r.n, 3) for r in results])
    assert len({r.values["all_of^3"] for r in results}) > 1
    # The gate's and diff's path: both sides paired on the member.
    from service.gate import pair_runs

    diff = pair_runs(run.run_id, base.run_id, metric="all_of^3", store=Store(home)).diff
    assert diff.metric == "all_of^3" and len(diff.cases) == len(results)
    assert [c.after.values["all_of^3"] for c in diff.cases if c.after] == approx(
        [comb(c.after.c, 3) / comb(c.after.n, 3) for c in diff.cases if c.after])
    for bad in ("all_of^0", "all_of^x", "all_of^03", "all_of^", "any_of^2"):
        with pytest.raises(InputError, match="unknown metric"):
            check_metric(bad)
    with pytest.raises(InputError, match=r"all_of\^\{k\}"):  # the families are listed with the choices
        check_metric("nope")
