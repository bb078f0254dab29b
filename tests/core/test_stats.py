"""grpo_jax.core.stats: intervals by hand, against scipy.stats, and their coverage by simulation."""

import itertools
import math

import numpy as np
import pytest
import scipy.special
import scipy.stats

from grpo_jax.core import problems, stats


def test_wilson_by_hand_and_against_scipy():
    # 8 of 10 at 95%: z = 1.959964; by hand (p + z^2/2n -+ z sqrt(p q/n + z^2/4n^2)) / (1 + z^2/n).
    z = 1.959963984540054
    p, n = 0.8, 10
    centre, half = p + z * z / 20, z * math.sqrt(p * (1 - p) / n + z * z / 400)
    want = ((centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n))
    assert stats.wilson_interval(8, 10) == pytest.approx(want, abs=1e-12)
    assert want == pytest.approx((0.4901624, 0.9433178), abs=1e-6)
    for c, m, conf in [(0, 20, 0.95), (20, 20, 0.95), (37, 512, 0.9), (300, 512, 0.99)]:
        ci = scipy.stats.binomtest(c, m).proportion_ci(conf, method="wilson")
        assert stats.wilson_interval(c, m, conf) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_clopper_pearson_against_scipy():
    for c, m, conf in [
        (0, 10, 0.95),
        (10, 10, 0.95),
        (3, 10, 0.95),
        (137, 512, 0.95),
        (5, 96, 0.9),
    ]:
        ci = scipy.stats.binomtest(c, m).proportion_ci(conf, method="exact")
        got = stats.clopper_pearson_interval(c, m, conf)
        assert got == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="successes <= n"):
        stats.wilson_interval(5, 4)
    with pytest.raises(ValueError, match="confidence"):
        stats.wilson_interval(1, 4, 1.5)
    with pytest.raises(ValueError, match="one shape"):
        stats.paired_bootstrap_interval(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="non-empty"):
        stats.bootstrap_interval(np.zeros(0))


def test_mcnemar_by_hand_and_against_scipy():
    # a solves 1, 2, 5; b solves 2, 3, 4, 5, 6: only_a = 1 (problem 1), only_b = 3.
    a = np.array([0, 1, 1, 0, 0, 1, 0, 0], bool)
    b = np.array([0, 0, 1, 1, 1, 1, 1, 0], bool)
    got = stats.mcnemar_exact(a, b)
    # Two-sided: 2 P(X <= 1), X ~ Bin(4, 1/2) = 2 (1 + 4) / 16 = 0.625.
    assert (got["only_a"], got["only_b"]) == (1, 3)
    assert got["p_value"] == pytest.approx(0.625, abs=1e-12)
    assert stats.mcnemar_exact(a, a)["p_value"] == 1.0
    rng = np.random.default_rng(0)
    for _ in range(20):
        x, y = rng.random(60) < 0.5, rng.random(60) < 0.7
        got = stats.mcnemar_exact(x, y)
        n = got["only_a"] + got["only_b"]
        want = scipy.stats.binomtest(got["only_a"], n, 0.5).pvalue if n else 1.0
        assert got["p_value"] == pytest.approx(want, abs=1e-12)


def test_paired_bootstrap_by_hand():
    # Every difference equal: the interval is that value exactly.
    a = np.array([0.0, 1.0, 0.5, 0.25])
    assert stats.paired_bootstrap_interval(a, a + 0.5) == pytest.approx((0.5, 0.5))
    # Two problems, differences 0 and 1: the resampled means are 0, 1/2, 1 with
    # probabilities 1/4, 1/2, 1/4, so the 95% percentile interval is [0, 1].
    lo, hi = stats.paired_bootstrap_interval(np.zeros(2), np.array([0.0, 1.0]))
    assert (lo, hi) == (0.0, 1.0)
    # Against the textbook estimate: a large sample's interval is mean -+ 1.96 sd / sqrt(P).
    rng = np.random.default_rng(1)
    x, y = rng.random(2000), rng.random(2000) + 0.1
    d = y - x
    lo, hi = stats.paired_bootstrap_interval(x, y, seed=3)
    se = d.std(ddof=1) / math.sqrt(d.size)
    assert (lo, hi) == pytest.approx((d.mean() - 1.96 * se, d.mean() + 1.96 * se), abs=3e-3)
    # Paired is narrower than unpaired when the two evaluations share problem difficulty.
    base = rng.random(300)
    a2, b2 = base, base + rng.normal(0.05, 0.05, 300)
    paired = np.subtract(*stats.paired_bootstrap_interval(a2, b2)[::-1])
    unpaired = 1.96 * 2 * math.sqrt(a2.var() / 300 + b2.var() / 300)
    assert paired < unpaired / 4


def test_pass_at_k_values_by_hand():
    c = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    # n = 4, k = 2: 1 - C(4 - c, 2) / C(4, 2) = 1 - C(4 - c, 2) / 6.
    want = [1 - 3 / 6, 1 - 1 / 6, 0.0, 1.0]
    np.testing.assert_allclose(stats.pass_at_k_values(c, 2), want, atol=1e-12)
    np.testing.assert_allclose(stats.pass_at_k_values(c, 1), c.mean(axis=1), atol=1e-12)


def test_proportion_coverage_by_simulation():
    """2,000 synthetic evaluations at known rates: Wilson's 95% intervals cover the truth
    93-97% of the time (Clopper-Pearson, exact, at least 95%)."""
    rng = np.random.default_rng(2026)
    sims, n = 2000, 200
    for p in (0.1, 0.35, 0.7):
        c = rng.binomial(n, p, size=sims)
        wilson = np.array([stats.wilson_interval(int(x), n) for x in c])
        cover = np.mean((wilson[:, 0] <= p) & (p <= wilson[:, 1]))
        assert 0.93 <= cover <= 0.97, (p, cover)
    cp = np.array([stats.clopper_pearson_interval(int(x), n) for x in c[:300]])
    assert np.mean((cp[:, 0] <= 0.7) & (0.7 <= cp[:, 1])) >= 0.94


@pytest.mark.slow
def test_bootstrap_coverage_by_simulation():
    """2,000 synthetic evaluations: the bootstrap's 95% intervals cover 93-97% (10 s)."""
    rng = np.random.default_rng(2026)
    # Sampled pass@1 and pass@k, bootstrap over problems: each problem has its own
    # rate (Beta(1, 2)), 8 samples each, 100 problems; the truth is the mean rate's
    # pass@k over the population of problems, computed exactly.
    sims, P, S, k = 2000, 100, 8, 4
    rates = rng.beta(1, 2, size=(sims, P))
    correct = rng.random((sims, P, S)) < rates[..., None]
    # E[1 - (1 - r)^k] for r ~ Beta(1, 2) = 1 - 2 / (k + 2); E[r] = 1/3.
    truth = {1: 1 / 3, k: 1 - 2 / (k + 2)}
    for kk, want in truth.items():
        hits = 0
        for i in range(sims):
            v = stats.pass_at_k_values(correct[i], kk)
            lo, hi = stats.bootstrap_interval(v, num_resamples=400, seed=i)
            hits += lo <= want <= hi
        assert 0.93 <= hits / sims <= 0.97, (kk, hits / sims)


def test_figures_pool_seeds_with_problems_as_unit():
    # 3 problems, 2 seeds x 2 samples: pooled per problem over its 4 samples.
    sc = np.array([[[1, 0], [0, 0], [1, 1]], [[1, 1], [0, 1], [1, 1]]], bool)  # [S=2, P=3, n=2]
    prob = problems.Problems(
        ids=("a", "b", "c"),
        greedy_correct=np.array([1, 0, 1], bool),
        greedy_length=np.array([3, 4, 5]),
        greedy_truncated=np.zeros(3, bool),
        seeds=(0, 1),
        sampled_correct=sc,
        sampled_length=np.ones((2, 3, 2), int),
    )
    f = problems.figures(prob, 2)
    assert f["eval/pass_at_1"] == pytest.approx(2 / 3)
    assert (f["eval/pass_at_1_lo"], f["eval/pass_at_1_hi"]) == stats.wilson_interval(2, 3)
    per = np.array([3 / 4, 1 / 4, 1.0])
    assert f["eval/sampled_pass_at_1"] == pytest.approx(per.mean())
    # pass@2 from n = 4 samples: 1 - C(4 - c, 2) / 6 with c = 3, 1, 4.
    assert f["eval/pass_at_2"] == pytest.approx(np.mean([1.0, 1 - 3 / 6, 1.0]))
    assert f["eval/pass_at_k"] == f["eval/pass_at_2"]
    assert f["eval/sampled_pass_at_1_lo"] <= f["eval/sampled_pass_at_1"]
    assert f["eval/num_seeds"] == 2
    with pytest.raises(ValueError, match="sampled_correct has shape"):
        problems.Problems(("a",), np.ones(1, bool), np.ones(1), np.zeros(1, bool), (0,), sc, sc)


def test_clopper_pearson_at_a_million_trials_against_scipy():
    """The ends come from the regularized incomplete beta function, not from an n-long
    binomial table per bisection step: a million trials agree with scipy to 1e-10."""
    n = 1_000_000
    for c, conf in [(0, 0.95), (1, 0.95), (37, 0.95), (500_000, 0.95), (999_990, 0.99), (n, 0.9)]:
        ci = scipy.stats.binomtest(c, n).proportion_ci(conf, method="exact")
        got = stats.clopper_pearson_interval(c, n, conf)
        assert got == pytest.approx((ci.low, ci.high), abs=1e-10, rel=1e-9), (c, conf)


def test_regularized_incomplete_beta_against_scipy():
    for a, b in [(0.5, 0.5), (1.0, 3.0), (7.0, 2.0), (37.0, 999_964.0), (5e5, 5e5 + 1)]:
        for x in (1e-6, 3.7e-5, 0.01, 0.3, 0.4999, 0.5, 0.7, 0.999):
            want = scipy.special.betainc(a, b, x)
            assert stats.betainc(a, b, x) == pytest.approx(want, abs=1e-13, rel=1e-9), (a, b, x)


def test_counts_must_be_integers():
    with pytest.raises(ValueError, match=r"successes = 2\.5 must be an integer count"):
        stats.wilson_interval(2.5, 4)
    with pytest.raises(ValueError, match="successes = True must be an integer count"):
        stats.clopper_pearson_interval(True, 4)
    with pytest.raises(ValueError, match=r"n = 4\.5 must be an integer"):
        stats.wilson_interval(2, 4.5)
    with pytest.raises(ValueError, match="successes=-1, n=4"):
        stats.clopper_pearson_interval(-1, 4)
    # Integer-valued numbers of any type count alike.
    assert stats.wilson_interval(np.int64(2), 4) == stats.wilson_interval(2.0, 4.0)
    assert stats.wilson_interval(2.0, 4) == stats.wilson_interval(2, 4)


def test_nan_correctness_is_unscored_and_refused():
    # NaN is a result nobody scored: never a pass, never a fail.
    with pytest.raises(ValueError, match=r"unscored \(NaN\) result at problem 0, sample 0"):
        stats.pass_at_k_values(np.array([[np.nan, 0.0]]), 1)
    with pytest.raises(ValueError, match="problem 1, sample 1 is 0.5"):
        stats.pass_at_k_values(np.array([[1.0, 0.0], [0.0, 0.5]]), 1)
    np.testing.assert_array_equal(stats.pass_at_k_values(np.array([[1.0, 0.0]]), 1), [0.5])
    with pytest.raises(ValueError, match=r"b_correct has an unscored \(NaN\) result at problem 2"):
        stats.mcnemar_exact(np.ones(3, bool), np.array([1.0, 0.0, np.nan]))
    with pytest.raises(ValueError, match="a_correct: problem 0 is 2.0"):
        stats.mcnemar_exact(np.array([2.0]), np.array([1.0]))
    assert stats.mcnemar_exact(np.array([1.0, 0.0]), np.array([0, 0]))["only_a"] == 1


def test_bootstrap_refuses_non_finite_values():
    with pytest.raises(ValueError, match=r"problem 1 is nan \(unscored\)"):
        stats.bootstrap_interval(np.array([0.5, np.nan, 1.0]))
    with pytest.raises(ValueError, match="problem 0 is -inf"):
        stats.paired_bootstrap_interval(np.array([np.inf, 0.0]), np.zeros(2))


def test_ragged_sample_counts_name_the_problem():
    with pytest.raises(ValueError, match="problem 2 has 3, problem 0 has 2"):
        stats.pass_at_k_values([[1, 0], [0, 0], [1, 0, 1]], 1)


def _pass_at_k_bruteforce(n, c, k):
    # Fraction of k-subsets of n samples (c correct) holding at least one correct.
    items = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(items[i] for i in s) for s in subsets) / len(subsets)


def _one(n, c, k):
    return float(stats.pass_at_k_values(np.array([[1.0] * c + [0.0] * (n - c)]), k)[0])


@pytest.mark.parametrize(
    "n,c,k", [(5, 0, 1), (5, 1, 1), (5, 2, 3), (6, 3, 2), (8, 5, 4), (4, 4, 2)]
)
def test_pass_at_k_matches_enumeration(n, c, k):
    assert _one(n, c, k) == pytest.approx(_pass_at_k_bruteforce(n, c, k), abs=1e-12)


def test_pass_at_k_golden_values():
    assert _one(10, 3, 1) == pytest.approx(0.3, abs=1e-12)  # pass@1 = c/n
    # 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert _one(10, 3, 5) == pytest.approx(1 - 21 / 252, abs=1e-12)
    assert _one(10, 8, 3) == 1.0  # fewer than k wrong samples
    assert _one(200, 0, 100) == 0.0


# ---------------------------------------------------------------------------
# Units of several training seeds: clusters, strata, the sign-flip test, across seeds.


def test_cluster_bootstrap_resamples_a_problem_with_all_its_seeds():
    rng = np.random.default_rng(3)
    v = (rng.random(40) < 0.6).astype(float)
    ids = [f"p{i}" for i in range(40)]
    one = stats.cluster_bootstrap_interval(v, ids)
    # Three seeds that agree on every problem carry no more information than one seed: the
    # cluster bootstrap's interval is the same, the pooled one (120 "independent" units)
    # about sqrt(3) narrower.
    three = stats.cluster_bootstrap_interval(np.tile(v, 3), ids * 3)
    assert three == pytest.approx(one, abs=1e-12)
    pooled = stats.bootstrap_interval(np.tile(v, 3))
    assert (one[1] - one[0]) / (pooled[1] - pooled[0]) == pytest.approx(math.sqrt(3), rel=0.2)
    # Percentiles expanded for 40 clusters: at the level of sqrt(40 / 39) t_39 (Hesterberg).
    means, _ = stats.cluster_bootstrap(v, ids)
    z = math.sqrt(40 / 39) * scipy.stats.t.ppf(0.975, 39)
    a = scipy.stats.norm.cdf(-z)
    assert one == pytest.approx(tuple(np.quantile(means, [a, 1 - a])), abs=1e-12)
    # One unit per cluster: the ordinary bootstrap over problems, up to its resampling noise.
    plain = stats.bootstrap_interval(v)
    assert one == pytest.approx(plain, abs=0.03)
    with pytest.raises(ValueError, match="one label per unit"):
        stats.cluster_bootstrap_interval(v, ids[:-1])
    with pytest.raises(ValueError, match=r"unit 2 is nan \(unscored\)"):
        stats.cluster_bootstrap_interval([0.0, 1.0, float("nan")], [0, 1, 2])


def test_strata_keep_their_number_of_problems():
    # Seed 0 solves none of its problems, seed 1 all of its own: resampled within each seed
    # every resample's mean is 0.5; resampled across seeds it varies.
    v = np.array([0.0] * 10 + [1.0] * 10)
    ids, seeds = np.arange(20), np.repeat([0, 1], 10)
    assert stats.cluster_bootstrap_interval(v, ids, seeds) == (0.5, 0.5)
    lo, hi = stats.cluster_bootstrap_interval(v, ids)
    assert lo < 0.35 and hi > 0.65
    means, by_seed = stats.cluster_bootstrap(v, ids, seeds, seeds, num_resamples=50)
    np.testing.assert_array_equal(by_seed, np.tile([0.0, 1.0], (50, 1)))


def test_sign_flip_test_by_enumeration_and_mcnemar():
    rng = np.random.default_rng(0)
    # Singleton clusters of 0/1 differences: McNemar's exact test.
    for _ in range(10):
        a, b = rng.random(30) < 0.5, rng.random(30) < 0.65
        got = stats.cluster_sign_flip_test(b.astype(float) - a, np.arange(30))
        want = stats.mcnemar_exact(a, b)
        assert got["p_value"] == pytest.approx(want["p_value"], abs=1e-12) and got["exact"]
        assert (got["negative"], got["positive"]) == (want["only_a"], want["only_b"])
    # Clusters of three seeds: every one of the 2^10 sign vectors.
    d = rng.integers(-1, 2, size=(10, 3)).astype(float)
    clusters = np.repeat(np.arange(10), 3)
    got = stats.cluster_sign_flip_test(d.ravel(), clusters)
    sums = d.sum(axis=1)
    flips = np.array(list(itertools.product([-1, 1], repeat=10)))
    want = np.mean(np.abs(flips @ sums) >= abs(sums.sum()) - 1e-9)
    assert got["exact"] and got["p_value"] == pytest.approx(want, abs=1e-12)
    # Non-integer differences: random flips, close to the exact value.
    mc = stats.cluster_sign_flip_test(d.ravel() * 0.37, clusters)
    assert not mc["exact"] and mc["p_value"] == pytest.approx(want, abs=0.02)
    assert stats.cluster_sign_flip_test(np.zeros(6), np.arange(6))["p_value"] == 1.0


def test_t_quantile_against_scipy():
    for q, df in [(0.975, 1), (0.975, 2), (0.025, 4), (0.975, 7.3), (0.9, 150), (0.975, 1e4)]:
        assert stats._t_quantile(q, df) == pytest.approx(scipy.stats.t.ppf(q, df), abs=1e-9)


def test_across_seeds_interval_by_hand():
    rng = np.random.default_rng(1)
    # Each seed its own problems (strata): the t interval over the seeds' means, S - 1 df.
    levels = [0.3, 0.6, 0.8]
    v = np.concatenate([(rng.random(200) < p).astype(float) for p in levels])
    seeds, ids = np.repeat([0, 1, 2], 200), np.arange(600)
    got = stats.across_seeds_interval(v, seeds, ids, seeds)
    m = v.reshape(3, 200).mean(axis=1)
    half = scipy.stats.t.ppf(0.975, 2) * m.std(ddof=1) / math.sqrt(3)
    assert got["df"] == pytest.approx(2.0, abs=0.05)
    assert (got["lo"], got["hi"]) == pytest.approx((m.mean() - half, m.mean() + half), rel=0.01)
    # Seeds that agree on shared problems: no spread between seeds, and an interval about
    # as wide as the problems' alone.
    w = np.tile((rng.random(100) < 0.5).astype(float), 3)
    got = stats.across_seeds_interval(w, np.repeat([0, 1, 2], 100), np.tile(np.arange(100), 3))
    lo, hi = stats.cluster_bootstrap_interval(w, np.tile(np.arange(100), 3))
    assert got["between"] == 0.0 and got["hi"] - got["lo"] == pytest.approx(hi - lo, rel=0.15)
    # A share's interval stays within [0, 1]: three seeds far apart reach past it unbounded.
    far = np.concatenate([np.full(50, 1.0), np.full(50, 1.0), (np.arange(50) < 20) * 1.0])
    args = (far, np.repeat([0, 1, 2], 50), np.arange(150), np.repeat([0, 1, 2], 50))
    assert stats.across_seeds_interval(*args)["hi"] > 1.0
    assert stats.across_seeds_interval(*args, bounds=(0.0, 1.0))["hi"] == 1.0
    with pytest.raises(ValueError, match="two seeds or more"):
        stats.across_seeds_interval(w[:100], np.zeros(100), np.arange(100))


def test_probability_of_improvement_and_iqm():
    assert stats.probability_of_improvement([0.5, 0.6], [0.55, 0.6]) == pytest.approx(
        (1 + 0 + 1 + 0.5) / 4
    )
    x = np.random.default_rng(2).random(13)
    assert stats.interquartile_mean(x) == pytest.approx(scipy.stats.trim_mean(x, 0.25))
    # Stratified: each task keeps its runs; a task whose runs agree adds no spread.
    tasks = [np.array([0.2, 0.2, 0.2]), np.array([0.8, 0.8, 0.8])]
    assert stats.stratified_bootstrap_interval(tasks, np.mean) == pytest.approx((0.5, 0.5))


def _coverage_script():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "interval_coverage.py"
    spec = importlib.util.spec_from_file_location("interval_coverage", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_intervals_cover_correlated_problems_by_simulation():
    """benchmarks/interval_coverage.py, reduced: 3 seeds on 60 shared problems, ICC 0.5.

    Nominal 95% / 5%. With 300 simulations a rate's standard error is about 0.013: the
    bounds are 3-4 of them. The old pooled Wilson interval and McNemar test fail them."""
    r = _coverage_script().simulate("shared", 3, 0.5, sims=300, num_problems=60, rng_seed=11)
    for k in ("greedy", "sampled", "diff", "across", "across_diff"):
        assert 0.91 <= r[k] <= 0.99, (k, r)
    assert r["test"] <= 0.09, r
    assert r["wilson"] < 0.91 and r["mcnemar"] > 0.09, r  # what the old units gave
