"""Confidence intervals and paired tests for evaluation figures (numpy and the standard library).

The unit of every interval is the problem: a problem's samples share its
difficulty, so they are not independent draws and intervals that treated them
so would be too narrow. The same holds for training seeds that evaluate the same
problems: their results on one problem are correlated, so the problem, with all
its seeds, is what is resampled.

One evaluation (one trained model):

  * :func:`wilson_interval`, :func:`clopper_pearson_interval`: a proportion of
    independent trials (greedy pass@1, one completion per problem).
  * :func:`bootstrap_interval`: the mean of per-problem values (sampled pass@1,
    the per-problem pass@k of Chen et al.), percentile bootstrap over problems.
  * :func:`paired_bootstrap_interval`: the mean per-problem difference of two
    evaluations on the same problems.
  * :func:`mcnemar_exact`: McNemar's exact test of two paired pass/fail
    vectors, the two-sided binomial test of the discordant pairs at p = 1/2.

Several training seeds, each (seed, problem) a unit:

  * :func:`cluster_bootstrap_interval`: the mean over units, problems (clusters)
    resampled with all their seeds; seeds with problems of their own resampled
    each on its own (strata). Covers the evaluation's problems and samples for
    these trained models (and a paired difference, given the differences).
  * :func:`cluster_sign_flip_test`: the paired test that respects clusters (each
    problem's difference summed over its seeds, its sign flipped); McNemar's
    exact test when each problem has one unit.
  * :func:`across_seeds_interval`: the mean over training seeds with an interval
    that also covers the spread from one training seed to the next.
  * :func:`probability_of_improvement`, :func:`interquartile_mean`,
    :func:`stratified_bootstrap_interval`: rliable's summaries over runs and
    tasks (Agarwal et al., NeurIPS 2021).

``benchmarks/interval_coverage.py`` measures the coverage of these intervals and
the size of the test on correlated problems (docs/evaluation.md quotes it).

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


# ---------------------------------------------------------------------------
# Several training seeds: units (seed, problem), clustered by problem.
#
# When several runs are pooled, each (seed, problem) pair is a unit, but units are not
# always independent: seeds that evaluate the same problems share each problem's
# difficulty, so one problem's units are correlated. ``clusters_U`` names each unit's
# problem (units of one problem form a cluster, resampled or sign-flipped together) and
# ``strata_U`` its seed when seeds evaluate problems of their own (each seed keeps its
# number of problems in every resample).


def _values(name: str, values) -> np.ndarray:
    """A non-empty finite float vector; ValueError naming the first non-finite value."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"need a non-empty vector of {name}, got shape {v.shape}")
    bad = np.flatnonzero(~np.isfinite(v))
    if bad.size:
        i = int(bad[0])
        why = " (unscored)" if np.isnan(v[i]) else ""
        raise ValueError(
            f"{name} must be finite: unit {i} is {v[i]}{why} ({bad.size} of {v.size} not finite)"
        )
    return v


def _labels(name: str, labels, size: int) -> np.ndarray:
    """Integer codes 0..K-1 of ``labels`` (any hashable values), one per unit."""
    arr = np.asarray(labels)
    if arr.shape != (size,):
        raise ValueError(f"{name} needs one label per unit ({size}), got shape {arr.shape}")
    return np.unique(arr, return_inverse=True)[1].reshape(-1)


def cluster_bootstrap(
    values_U: np.ndarray,
    clusters_U: np.ndarray,
    strata_U: np.ndarray | None = None,
    seeds_U: np.ndarray | None = None,
    *,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Resampled means of the units: clusters drawn with replacement within each stratum.

    Returns (the mean over units of each resample, float [R]; with ``seeds_U``, the mean
    of each seed's units in each resample, float [R, S] in the order of ``np.unique``,
    else None). Every unit of a drawn cluster enters the resample, so units that share
    a problem are never split; a stratum keeps its number of clusters.
    """
    v = _values("per-unit values", values_U)
    c = _labels("clusters_U", clusters_U, v.size)
    h = np.zeros(v.size, np.int64) if strata_U is None else _labels("strata_U", strata_U, v.size)
    if num_resamples < 1:
        raise ValueError(f"num_resamples = {num_resamples} must be positive")
    s = None if seeds_U is None else _labels("seeds_U", seeds_U, v.size)
    num_seeds = 1 if s is None else int(s.max()) + 1
    rng = np.random.default_rng(seed)
    sums = np.zeros((num_resamples, num_seeds))
    counts = np.zeros((num_resamples, num_seeds))
    for stratum in range(int(h.max()) + 1):
        in_h = h == stratum
        ids, local = np.unique(c[in_h], return_inverse=True)
        col = np.zeros(in_h.sum(), np.int64) if s is None else s[in_h]
        # Each cluster's sum and size per seed: [C, S].
        key = local * num_seeds + col
        size = ids.size * num_seeds
        csum = np.bincount(key, v[in_h], minlength=size).reshape(ids.size, num_seeds)
        cnum = np.bincount(key, minlength=size).reshape(ids.size, num_seeds).astype(float)
        # How often each cluster is drawn in each resample: [R, C], C draws with replacement.
        pick = rng.integers(0, ids.size, size=(num_resamples, ids.size))
        rows = np.arange(num_resamples)[:, None] * ids.size
        times = np.bincount((rows + pick).ravel(), minlength=num_resamples * ids.size)
        times = times.reshape(num_resamples, ids.size).astype(np.float64)
        sums += times @ csum
        counts += times @ cnum
    means = sums.sum(axis=1) / counts.sum(axis=1)
    if s is None:
        return means, None
    with np.errstate(invalid="ignore", divide="ignore"):  # a seed absent from a resample
        return means, sums / counts


def cluster_bootstrap_interval(
    values_U: np.ndarray,
    clusters_U: np.ndarray,
    strata_U: np.ndarray | None = None,
    confidence: float = 0.95,
    *,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Expanded percentile interval of the mean over units, clusters (problems) resampled
    whole within strata (seeds with problems of their own): :func:`cluster_bootstrap`.

    The bootstrap's spread of a mean of m clusters is sqrt((m - 1) / m) times the true one
    and its tails are normal ones where Student's t with m - 1 degrees of freedom fits, so
    plain percentiles undercover with few clusters (about 94% at 100). The percentiles are
    taken at the level whose normal quantile is sqrt(m / (m - 1)) t_{m-1} (Hesterberg,
    "What teachers should know about the bootstrap", 2015): m the clusters per stratum,
    the degrees of freedom the clusters less the strata.
    """
    means, _ = cluster_bootstrap(
        values_U, clusters_U, strata_U, num_resamples=num_resamples, seed=seed
    )
    c = _labels("clusters_U", clusters_U, np.size(values_U))
    h = np.zeros(c.size, np.int64) if strata_U is None else _labels("strata_U", strata_U, c.size)
    clusters = np.unique(h * (int(c.max()) + 1) + c).size
    strata = int(h.max()) + 1
    per_stratum = clusters / strata
    if per_stratum <= 1 or clusters - strata < 1:
        return _percentile_interval(means, confidence)
    q = 1.0 - (1.0 - _check_confidence(confidence)) / 2.0
    z = math.sqrt(per_stratum / (per_stratum - 1)) * _t_quantile(q, clusters - strata)
    return _percentile_interval(means, 1.0 - 2.0 * statistics.NormalDist().cdf(-z))


def _sign_flip_pmf(magnitudes: np.ndarray) -> np.ndarray:
    """The exact distribution of sum(e_c m_c), e_c = +-1 with probability 1/2 each, for
    integer magnitudes m_c >= 1: probabilities of -T..T (T = sum m_c), index x + T."""
    total = int(magnitudes.sum())
    pmf = np.zeros(2 * total + 1)
    pmf[total] = 1.0
    width = 0
    for m, count in zip(*np.unique(magnitudes, return_counts=True), strict=True):
        # count clusters of magnitude m: m (2X - count), X ~ Binomial(count, 1/2).
        k = np.arange(count + 1)
        log_b = (
            math.lgamma(count + 1)
            - np.array([math.lgamma(x + 1) + math.lgamma(count - x + 1) for x in k])
            - count * math.log(2.0)
        )
        step = np.zeros(2 * int(m) * count + 1)
        step[(2 * k * int(m))] = np.exp(log_b)
        new_width = width + int(m) * count
        core = np.convolve(pmf[total - width : total + width + 1], step)
        pmf[:] = 0.0
        pmf[total - new_width : total + new_width + 1] = core
        width = new_width
    return pmf


def cluster_sign_flip_test(
    diffs_U: np.ndarray,
    clusters_U: np.ndarray,
    *,
    num_flips: int = 20000,
    seed: int = 0,
) -> dict:
    """A paired test that respects clusters: is the mean per-unit difference zero?

    Each cluster's (problem's) summed difference D_c keeps its size and gets a random
    sign, which under the null (the two runs exchangeable on each problem, all seeds of
    it together) leaves the distribution unchanged. The two-sided p-value is
    P(|sum e_c D_c| >= |sum D_c|). Exact when the D_c are integers (0/1 correctness, or
    shares of a fixed number of samples scaled by it): by convolution, and with one unit
    per cluster it is McNemar's exact test. Otherwise ``num_flips`` random sign vectors,
    p = (1 + hits) / (1 + num_flips) (``flips`` in the result), never below 1 / (1 + num_flips).

    Returns ``p_value``, ``clusters`` (how many), ``positive`` and ``negative`` (clusters
    whose difference is above or below zero) and ``exact``.
    """
    d = _values("per-unit differences", diffs_U)
    c = _labels("clusters_U", clusters_U, d.size)
    dc = np.bincount(c, d)
    dc[np.abs(dc) < 1e-9 * max(1.0, float(np.abs(dc).max()))] = 0.0
    out = {"clusters": int(dc.size), "positive": int((dc > 0).sum())}
    out["negative"] = int((dc < 0).sum())
    nz = np.abs(dc[dc != 0])
    observed = abs(float(dc.sum()))
    if nz.size == 0:
        return {**out, "p_value": 1.0, "exact": True}
    integral = np.allclose(nz, np.round(nz), rtol=0, atol=1e-9) and nz.sum() <= 2_000_000
    if integral:
        m = np.round(nz).astype(np.int64)
        pmf = _sign_flip_pmf(m)
        total, t = int(m.sum()), int(round(observed))
        p = float(pmf[: total - t + 1].sum() + pmf[total + t :].sum()) if t else 1.0
        return {**out, "p_value": min(1.0, p), "exact": True}
    if num_flips < 1:
        raise ValueError(f"num_flips = {num_flips} must be positive")
    rng = np.random.default_rng(seed)
    hits = 0
    for lo in range(0, num_flips, 1000):
        signs = rng.integers(0, 2, size=(min(1000, num_flips - lo), nz.size)) * 2 - 1
        hits += int((np.abs(signs @ nz) >= observed * (1 - 1e-12)).sum())
    return {**out, "p_value": (1 + hits) / (1 + num_flips), "exact": False, "flips": num_flips}


def _t_quantile(q: float, df: float) -> float:
    """The q quantile of Student's t with ``df`` > 0 degrees of freedom (bisection on its
    cdf, 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2 for t > 0)."""
    if df > 1e6:  # the normal quantile, within 3e-6
        return statistics.NormalDist().inv_cdf(q)
    upper = lambda t: 0.5 * betainc(df / 2, 0.5, df / (df + t * t))  # P(T > t), t >= 0
    tail = 1.0 - q if q >= 0.5 else q
    lo, hi = 0.0, 1.0
    while upper(hi) > tail:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if upper(mid) > tail else (lo, mid)
    t = (lo + hi) / 2
    return t if q >= 0.5 else -t


def across_seeds_interval(
    values_U: np.ndarray,
    seeds_U: np.ndarray,
    clusters_U: np.ndarray,
    strata_U: np.ndarray | None = None,
    confidence: float = 0.95,
    *,
    bounds: tuple[float, float] | None = None,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = 0,
) -> dict:
    """An interval for the mean over training seeds that covers the spread from one
    training seed to the next as well as the evaluation's problems and samples.

    The figure is the mean of the S seeds' means m_s. Its variance is that from the
    problems, V_p (the cluster bootstrap's variance of the mean), plus sigma_a^2 / S,
    sigma_a^2 the variance between training seeds. The seed means' sample variance s^2
    estimates sigma_a^2 plus the part of their problem noise they do not share (W: the mean
    bootstrap variance of a seed mean less the mean covariance between two of them, which
    is large when seeds evaluate the same problems); so sigma_a^2 = max(0, s^2 - W). The
    interval is mean -+ t sqrt(V_p + sigma_a^2 / S), t Student's with Satterthwaite's
    degrees of freedom (S - 1 when the seeds' spread dominates). A bootstrap over three
    seeds would see 10 distinct resamples and shrink their spread by (S - 1) / S.

    ``bounds``: the range the mean cannot leave ((0, 1) for a share, (-1, 1) for a difference
    of shares); the interval is cut to it, which changes no coverage.

    Returns ``mean``, ``lo``, ``hi``, ``df``, ``between`` (sigma_a, the standard deviation
    between seeds) and ``seeds``. Needs two seeds or more.
    """
    v = _values("per-unit values", values_U)
    s = _labels("seeds_U", seeds_U, v.size)
    num_seeds = int(s.max()) + 1
    if num_seeds < 2:
        raise ValueError("an interval across training seeds needs two seeds or more")
    means = np.bincount(s, v) / np.bincount(s)
    _, by_seed = cluster_bootstrap(
        v, clusters_U, strata_U, s, num_resamples=num_resamples, seed=seed
    )
    ok = np.all(np.isfinite(by_seed), axis=1)
    by_seed = by_seed[ok]
    cov = np.cov(by_seed, rowvar=False)
    grand = by_seed.mean(axis=1)
    v_p = float(np.var(grand, ddof=1))
    off = (cov.sum() - np.trace(cov)) / (num_seeds * (num_seeds - 1))
    within = float(np.trace(cov) / num_seeds - off)
    s2 = float(np.var(means, ddof=1))
    between = max(0.0, s2 - within)
    var = v_p + between / num_seeds
    num_clusters = np.unique(np.asarray(clusters_U)).size
    if between > 0:
        seed_part, problem_part = s2 / num_seeds, abs(v_p - within / num_seeds)
        denom = seed_part**2 / (num_seeds - 1) + problem_part**2 / max(1, num_clusters - 1)
        df = var**2 / denom if denom > 0 else float(num_seeds - 1)
    else:
        df = float(max(1, num_clusters - 1))
    df = max(df, float(num_seeds - 1))
    half = _t_quantile(1.0 - (1.0 - _check_confidence(confidence)) / 2.0, df) * math.sqrt(var)
    m = float(means.mean())
    lo, hi = m - half, m + half
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return {
        "mean": m,
        "lo": lo,
        "hi": hi,
        "df": float(df),
        "between": math.sqrt(between),
        "seeds": num_seeds,
    }


def probability_of_improvement(base_runs: np.ndarray, other_runs: np.ndarray) -> float:
    """P(X > Y) + P(X = Y) / 2 for X a random run of ``other`` and Y one of ``base``: the
    share of (other, base) pairs of runs in which the other run scores higher, ties half
    (Agarwal et al., NeurIPS 2021). 0.5: neither tends to be better."""
    y, x = _values("base figures", base_runs), _values("other figures", other_runs)
    diff = x[:, None] - y[None, :]
    return float(((diff > 0) + 0.5 * (diff == 0)).mean())


def interquartile_mean(values: np.ndarray) -> float:
    """The mean of the middle half of ``values``: floor(n / 4) values cut from each end, as
    ``scipy.stats.trim_mean(values, 0.25)`` and rliable's IQM (Agarwal et al. 2021); robust
    to one task or run far off the others."""
    v = np.sort(_values("values", values))
    cut = v.size // 4
    return float(v[cut : v.size - cut].mean())


def stratified_bootstrap_interval(
    scores_by_task: list[np.ndarray],
    statistic=interquartile_mean,
    confidence: float = 0.95,
    *,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval of ``statistic`` of all runs' scores, each task's runs resampled
    with replacement on their own (rliable's stratified bootstrap, Agarwal et al. 2021)."""
    tasks = [_values("scores", t) for t in scores_by_task]
    rng = np.random.default_rng(seed)
    out = np.empty(num_resamples)
    for r in range(num_resamples):
        out[r] = statistic(np.concatenate([t[rng.integers(0, t.size, t.size)] for t in tasks]))
    return _percentile_interval(out, confidence)


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
