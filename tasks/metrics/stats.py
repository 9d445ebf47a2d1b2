"""The estimators behind every number a run reports (docs/contract.md §6): pass@k, bootstrap CIs, SEs.

Pure numpy, no imports from the rest of the package. Every function takes per-case
arrays: the case, not the sample, is the unit of resampling, because samples of one case
are correlated (they share the case's difficulty).
"""

from __future__ import annotations

import hashlib
import threading
from typing import overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

DEFAULT_N_BOOT = 2000
DEFAULT_LEVEL = 0.95

# Above this many array elements per chunk a bootstrap works in slices of the resamples,
# so a 100,000-case suite does not need a 2,000 × 100,000 matrix at once.
_CHUNK_ELEMENTS = 1 << 22


@overload
def pass_at_k(n: int, c: int, k: int) -> float: ...
@overload
def pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> NDArray[np.float64]: ...
def pass_at_k(n, c, k):
    """Unbiased pass@k of one case (or of each case, element-wise): ``1 - C(n-c,k)/C(n,k)``.

    Exactly 1.0 when ``n - c < k`` (every k-subset holds a success). The ratio is taken as
    the product ``prod_{i=n-c+1}^{n} (1 - k/i)`` (Chen et al. 2021), which never forms the
    huge binomials, so it is stable for any n. Raises ``ValueError`` when k < 1, k > n or
    c is outside 0..n: the caller decides how to report an undefined pass@k.
    """
    return _per_case(n, c, k, _pass_at_k_one)


@overload
def pass_hat_k(n: int, c: int, k: int) -> float: ...
@overload
def pass_hat_k(n: ArrayLike, c: ArrayLike, k: int) -> NDArray[np.float64]: ...
def pass_hat_k(n, c, k):
    """Unbiased pass^k of one case (or of each case): ``C(c, k) / C(n, k)``, the chance that
    k samples drawn without replacement from the n all pass (tau-bench's reliability
    measure; pass^1 = pass@1). Exactly 0.0 when c < k. Taken as the product
    ``prod_{i=0}^{k-1} (c - i) / (n - i)``, stable for any n. Raises like `pass_at_k`."""
    return _per_case(n, c, k, _pass_hat_k_one)


def _per_case(n, c, k: int, one):
    scalar = np.ndim(n) == 0 and np.ndim(c) == 0
    n_arr, c_arr = np.broadcast_arrays(np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64))
    _check_counts(n_arr, c_arr, k)
    if n_arr.size == 0:
        return np.empty(n_arr.shape, dtype=np.float64)
    # Cases share few distinct (n, c) pairs (c ranges over 0..n), so the product is taken
    # once per pair and scattered back: cost independent of the number of cases.
    # One int64 key per pair (c <= n) sorts far faster than unique rows of a 2-column array.
    base = int(n_arr.max()) + 1
    keys, inverse = np.unique(n_arr.ravel() * base + c_arr.ravel(), return_inverse=True)
    values = np.array([one(int(key // base), int(key % base), k) for key in keys])
    out = values[inverse].reshape(n_arr.shape)
    return float(out) if scalar else out


def _pass_at_k_one(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def _pass_hat_k_one(n: int, c: int, k: int) -> float:
    if c < k:
        return 0.0
    i = np.arange(k, dtype=np.float64)
    return float(np.prod((c - i) / (n - i)))


def _check_counts(n: NDArray[np.int64], c: NDArray[np.int64], k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n.size == 0:
        return
    if (n < 1).any():
        raise ValueError("every case needs n >= 1 samples")
    if ((c < 0) | (c > n)).any():
        raise ValueError("c must lie in 0..n for every case")
    if k > n.min():
        raise ValueError(f"k={k} > n={int(n.min())}")


def bootstrap_mean_ci(
    values: ArrayLike,
    *,
    seed: int = 0,
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of per-case ``values`` (clustered by case).

    Each resample draws as many cases as there are, with replacement, and takes the mean
    of their values. Seeded: the same values and seed give the same interval.

    When the values take few distinct levels (per-case pass rates c/n do), the number of
    draws that land on each level is Multinomial(m, level frequencies) — the same
    distribution as drawing case indices, at a cost of levels instead of cases per
    resample. Otherwise the case indices are drawn directly, in chunks.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    # The same figure is asked for twice in a run (a registered metric equal to a headline
    # key, e.g. mean_score): the interval is a function of its arguments, so keep the last few.
    key = (hashlib.blake2b(x.tobytes(), digest_size=16).digest(), x.size, seed, n_boot, level)
    with _RECENT_LOCK:
        ci = _RECENT_CIS.get(key)
    if ci is None:
        ci = _bootstrap_mean_ci(x, seed, n_boot, level)
        with _RECENT_LOCK:
            _RECENT_CIS[key] = ci
            while len(_RECENT_CIS) > 8:
                del _RECENT_CIS[next(iter(_RECENT_CIS))]
    return ci


_RECENT_CIS: dict[tuple, tuple[float, float]] = {}
_RECENT_LOCK = threading.Lock()


def _bootstrap_mean_ci(x: NDArray[np.float64], seed: int, n_boot: int, level: float) -> tuple[float, float]:
    m = x.size
    if m == 0:
        raise ValueError("bootstrap of an empty set of cases")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    levels, counts = np.unique(x, return_counts=True)
    if levels.size * 10 <= m:
        draws = rng.multinomial(m, counts / m, size=n_boot)
        means = draws @ levels / m
    else:
        means = resampled_sums(x, rng, n_boot) / m
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    # Rounding in the mean can put a degenerate interval a hair off the point estimate.
    point = float(x.mean())
    return min(float(lo), point), max(float(hi), point)


def resampled_sums(
    per_case: NDArray[np.float64], rng: np.random.Generator, n_boot: int
) -> NDArray[np.float64]:
    """The sum over the cases of each of `n_boot` resamples (as many cases as there are,
    drawn with replacement); `per_case` holds one value, or one row of values, per case.
    Drawn in chunks of resamples, so a large set never needs an n_boot × cases array."""
    m = per_case.shape[0]
    rows = max(1, _CHUNK_ELEMENTS // per_case.size)
    chunks = [
        per_case[rng.integers(0, m, size=(min(rows, n_boot - start), m))].sum(axis=1)
        for start in range(0, n_boot, rows)
    ]
    return np.concatenate(chunks)


def standard_error(values: ArrayLike) -> float | None:
    """Analytic standard error of the mean of per-case values: ``sqrt(s² / m)``.

    Miller (2024), "Adding Error Bars to Evals": with several samples per case, the
    per-case mean is the unit, so within-case correlation is already accounted for.
    ``None`` for fewer than two cases, where the sample variance is undefined.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size < 2:
        return None
    return float(np.sqrt(x.var(ddof=1) / x.size))
