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

Correctness is a bool or a 0/1 number. NaN means a result nobody scored, which
is neither a pass nor a fail: every function here refuses it (ValueError naming
the problem) rather than counting it, as it refuses a non-finite per-problem
value. Counts (``successes``, ``n``) are integers.
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


def _integer(name: str, value) -> int:
    """``value`` as an int: an integer, or a number equal to one (2.0); bools are not counts."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )
    if not ok or not math.isfinite(value) or value != int(value):
        raise ValueError(f"{name} = {value!r} must be an integer count")
    return int(value)


def _check_counts(successes, n) -> tuple[int, int]:
    s, n = _integer("successes", successes), _integer("n", n)
    if n < 1 or not 0 <= s <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got successes={s}, n={n}")
    return s, n


def _correct(name: str, values) -> np.ndarray:
    """``values`` (bools or 0/1 numbers) as a bool array; ValueError naming the first other
    value, NaN (unscored) included, by its position (problem, sample)."""
    v = np.asarray(values)
    if v.dtype == bool:
        return v
    if not np.issubdtype(v.dtype, np.number):
        raise ValueError(f"{name} must be bools or 0/1 numbers, got dtype {v.dtype}")
    bad = np.argwhere(np.isnan(v))
    if bad.size:
        raise ValueError(
            f"{name} has an unscored (NaN) result at {_where(bad[0])}: score it, or leave the "
            "problem out; it is neither a pass nor a fail"
        )
    bad = np.argwhere((v != 0) & (v != 1))
    if bad.size:
        at = tuple(bad[0])
        raise ValueError(f"{name}: {_where(at)} is {v[at].item()!r}; correctness is a bool or 0/1")
    return v.astype(bool)


def _where(index) -> str:
    """ "problem i" of a [P] vector, "problem i, sample j" of a [P, S] matrix."""
    names = ("problem", "sample")
    return ", ".join(f"{names[min(j, 1)]} {int(i)}" for j, i in enumerate(index))


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval for a proportion of ``successes`` in ``n`` independent trials.

    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), p = successes / n,
    z the normal quantile of 1 - (1 - confidence) / 2 (Wilson 1927).
    """
    successes, n = _check_counts(successes, n)
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


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), a, b > 0, x in [0, 1].

    The continued fraction of Numerical Recipes (2nd ed., 6.4) by the modified Lentz method,
    on x or on 1 - x, whichever side converges; it needs O(sqrt(max(a, b))) terms.
    """
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100 + 20 * int(math.sqrt(max(a, b)))):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"the incomplete beta fraction did not converge (a={a}, b={b}, x={x})")


def _beta_quantile(q: float, a: float, b: float) -> float:
    """The x in [0, 1] with I_x(a, b) = q (bisection to the float resolution)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if betainc(a, b, mid) < q:
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
    As P(X >= s | p) = I_p(s, n - s + 1), the ends are beta quantiles: the alpha / 2 one of
    Beta(s, n - s + 1) and the 1 - alpha / 2 one of Beta(s + 1, n - s).
    """
    successes, n = _check_counts(successes, n)
    a = (1.0 - _check_confidence(confidence)) / 2.0
    lo = 0.0 if successes == 0 else _beta_quantile(a, successes, n - successes + 1)
    hi = 1.0 if successes == n else _beta_quantile(1.0 - a, successes + 1, n - successes)
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
    bad = np.flatnonzero(~np.isfinite(v))
    if bad.size:
        i = int(bad[0])
        why = " (unscored)" if np.isnan(v[i]) else ""
        raise ValueError(
            f"per-problem values must be finite: problem {i} is {v[i]}{why} "
            f"({bad.size} of {v.size} not finite)"
        )
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
    a, b = _correct("a_correct", a_correct), _correct("b_correct", b_correct)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired results need one 1-d shape, got {a.shape} and {b.shape}")
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(b & ~a))
    n = only_a + only_b
    p = 1.0 if n == 0 else min(1.0, 2.0 * binom_cdf(min(only_a, only_b), n, 0.5))
    return {"only_a": only_a, "only_b": only_b, "p_value": p}


def pass_at_k_values(correct_PxS: np.ndarray, k: int) -> np.ndarray:
    """Chen et al.'s unbiased pass@k of each problem (bool [P, S] -> float [P]).

    1 - C(n - c, k) / C(n, k) with n = S samples, c of them correct, in the
    stable product form 1 - prod_{i = n-c+1}^{n} (1 - k / i). Every problem has the
    same S samples; a ragged list is refused naming the first problem whose count differs.
    """
    if isinstance(correct_PxS, (list, tuple)) and correct_PxS:
        counts = [len(row) for row in correct_PxS]
        odd = next((i for i, c in enumerate(counts) if c != counts[0]), None)
        if odd is not None:
            raise ValueError(
                f"every problem needs the same number of samples: problem {odd} has "
                f"{counts[odd]}, problem 0 has {counts[0]}"
            )
    c_PxS = _correct("correct", correct_PxS)
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
