"""Confidence intervals and paired tests for evaluation figures (numpy and the standard library).

The unit of every interval is the problem: a problem's samples share its
difficulty, so they are not independent draws and intervals that treated them
so would be too narrow.

  * :func:`wilson_interval`, :func:`clopper_pearson_interval`: a proportion of
    independent trials (greedy pass@1, one completion per problem).
  * :func:`bootstrap_interval`: the mean of per-problem values (sampled pass@1,
    the per-problem pass@k of Chen et al.), percentile bootstrap over problems.
  * :func:`paired_bootstrap_interval`: the mean per-problem difference of two
    evaluations on the same problems.
  * :func:`mcnemar_exact`: McNemar's exact test of two paired pass/fail
    vectors, the two-sided binomial test of the discordant pairs at p = 1/2.

Confidence levels are two-sided (0.95: 2.5% in each tail). Resampling draws
from ``numpy.random.default_rng(seed)``, so a figure is reproducible.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

NUM_RESAMPLES = 2000


def _check_confidence(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence = {confidence!r} must lie strictly between 0 and 1")
    return float(confidence)


def _check_counts(successes: int, n: int) -> None:
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval for a proportion of ``successes`` in ``n`` independent trials.

    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), p = successes / n,
    z the normal quantile of 1 - (1 - confidence) / 2 (Wilson 1927).
    """
    _check_counts(successes, n)
    z = statistics.NormalDist().inv_cdf(1.0 - (1.0 - _check_confidence(confidence)) / 2.0)
    p, z2 = successes / n, z * z
    centre = p + z2 / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    lo, hi = (centre - half) / (1 + z2 / n), (centre + half) / (1 + z2 / n)
    # The exact ends at 0 and n (the formula gives them up to rounding).
    return (0.0 if successes == 0 else lo, 1.0 if successes == n else hi)


def binom_cdf(x: int, n: int, p: float) -> float:
    """P(X <= x) for X ~ Binomial(n, p), summed in log space (exact to rounding)."""
    if x < 0:
        return 0.0
    if x >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    i = np.arange(x + 1)
    log_c = log_fact[n] - log_fact[i] - log_fact[n - i] + i * math.log(p) + (n - i) * math.log1p(-p)
    m = log_c.max()
    return float(min(1.0, math.exp(m) * np.exp(log_c - m).sum()))


def _solve_decreasing(f, target: float) -> float:
    """The p in [0, 1] with f(p) = target for f decreasing in p (bisection, 1e-12)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson_interval(
    successes: int, n: int, confidence: float = 0.95
) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval: the p's that a two-sided binomial test at
    level 1 - ``confidence`` (equal tails) does not reject; covers at least ``confidence``.

    Lower end: P(X >= successes | p) = alpha / 2; upper: P(X <= successes | p) = alpha / 2.
    """
    _check_counts(successes, n)
    a = (1.0 - _check_confidence(confidence)) / 2.0
    lo = 0.0
    if successes > 0:  # P(X >= s | p) = 1 - cdf(s - 1) rises with p
        lo = _solve_decreasing(lambda p: binom_cdf(successes - 1, n, p), 1.0 - a)
    hi = 1.0
    if successes < n:
        hi = _solve_decreasing(lambda p: binom_cdf(successes, n, p), a)
    return lo, hi


def _percentile_interval(resampled: np.ndarray, confidence: float) -> tuple[float, float]:
    a = (1.0 - _check_confidence(confidence)) / 2.0
    lo, hi = np.quantile(resampled, [a, 1.0 - a])
    return float(lo), float(hi)


def bootstrap_means(
    values_P: np.ndarray, *, num_resamples: int = NUM_RESAMPLES, seed: int = 0
) -> np.ndarray:
    """Means of ``num_resamples`` resamples of the P problems (with replacement): float [R]."""
    v = np.asarray(values_P, dtype=np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"need a non-empty vector of per-problem values, got shape {v.shape}")
    if num_resamples < 1:
        raise ValueError(f"num_resamples = {num_resamples} must be positive")
    idx_RxP = np.random.default_rng(seed).integers(0, v.size, size=(num_resamples, v.size))
    return v[idx_RxP].mean(axis=1)


def bootstrap_interval(
    values_P: np.ndarray,
    confidence: float = 0.95,
    *,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-problem values, problems resampled."""
    means = bootstrap_means(values_P, num_resamples=num_resamples, seed=seed)
    return _percentile_interval(means, confidence)


def paired_bootstrap_interval(
    a_P: np.ndarray,
    b_P: np.ndarray,
    confidence: float = 0.95,
    *,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Interval of mean(b - a) over problems, the same problems resampled for both."""
    a, b = np.asarray(a_P, np.float64), np.asarray(b_P, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need one shape, got {a.shape} and {b.shape}")
    return bootstrap_interval(b - a, confidence, num_resamples=num_resamples, seed=seed)


def mcnemar_exact(a_correct: np.ndarray, b_correct: np.ndarray) -> dict:
    """McNemar's exact test of paired pass/fail results on the same problems.

    Returns ``only_a`` (problems a solves and b does not), ``only_b`` and
    ``p_value``: two-sided, min(1, 2 P(X <= min(only_a, only_b))) for
    X ~ Binomial(only_a + only_b, 1/2); 1.0 when no pair is discordant.
    """
    a, b = np.asarray(a_correct, bool), np.asarray(b_correct, bool)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired results need one 1-d shape, got {a.shape} and {b.shape}")
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(b & ~a))
    n = only_a + only_b
    p = 1.0 if n == 0 else min(1.0, 2.0 * binom_cdf(min(only_a, only_b), n, 0.5))
    return {"only_a": only_a, "only_b": only_b, "p_value": p}


def pass_at_k_values(correct_PxS: np.ndarray, k: int) -> np.ndarray:
    """Chen et al.'s unbiased pass@k of each problem (bool [P, S] -> float [P]).

    1 - C(n - c, k) / C(n, k) with n = S samples, c of them correct, in the
    stable product form 1 - prod_{i = n-c+1}^{n} (1 - k / i).
    """
    c_PxS = np.asarray(correct_PxS, bool)
    if c_PxS.ndim != 2 or c_PxS.shape[0] == 0:
        raise ValueError(f"correct must be [problems, samples], got shape {c_PxS.shape}")
    n = c_PxS.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    out = np.ones(c_PxS.shape[0])
    for p, c in enumerate(c_PxS.sum(axis=1)):
        if n - c >= k:
            out[p] = 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))
    return out
