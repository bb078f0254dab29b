"""Coverage of compare's intervals and size of its paired test, by simulation.

    .venv/bin/python benchmarks/interval_coverage.py [--sims 1000] [--problems 100] [--workers 2]

Simulated evaluations of several training seeds (S = 3 and 5) on P problems, either the
same problems for every seed ("shared") or problems of each seed's own ("per seed").
Problem j is solved by seed s with probability p = expit(mu + tau u_j + a_s): u_j the
problem's difficulty, shared by every seed that evaluates it, so that one problem's results
are correlated across seeds with intra-class correlation ICC (on the 0/1 scale; tau and mu
are set for the ICC and a mean accuracy of 0.6), and a_s ~ N(0, seed_sd^2) the training
seed's own level. A second configuration B has mu + 0.4 and a third, N, the same mu as the
base A; each has its own part of every problem's difficulty (correlation 0.5 with A's), as
two methods find different problems hard, and seed s of B or N is paired with seed s of A.
Greedy results are one draw per problem; sampled pass@1 the share of 4 draws.

What each column counts (nominal 95% coverage, 5% size), over --sims simulations:

  Wilson pooled       the old interval: Wilson over all (seed, problem) units as independent
  group greedy        compare's interval of a group's greedy pass@1 (cluster bootstrap for
                      shared problems, stratified by seed for per-seed problems)
  group sampled       the same for sampled pass@1
  paired diff         compare's interval of B - A (the differences resampled the same way)
  test size           compare's paired test of N against A rejecting at 5% (the sign-flip
                      test over problems; McNemar's exact test for per-seed problems)
  McNemar pooled      the old test, McNemar's exact test over all units, rejecting at 5%
  across seeds        compare's interval across training seeds (stats.across_seeds_interval)
                      of A's mean and of B - A, against their means over training seeds

The first five cover the figures of these trained models (a_s fixed): with seed_sd = 0
that is also the mean over seeds. The across-seeds intervals cover the mean over the
population of training seeds. The script prints a Markdown table; docs/evaluation.md
quotes it.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import time

import numpy as np

from grpo_jax import compare
from grpo_jax.core import stats

MEAN = 0.6
EFFECT = 0.4  # B's shift on the logit scale
METHOD_CORR = 0.5  # correlation of two configurations' difficulty of one problem
SAMPLES = 4
_X, _W = np.polynomial.hermite_e.hermegauss(96)
_W = _W / _W.sum()


def expit(x):
    return 1.0 / (1.0 + np.exp(-x))


def mean_accuracy(mu: float, tau: float, shift=0.0) -> np.ndarray:
    """E[expit(mu + shift + tau Z)], Z ~ N(0, 1), for each shift (Gauss-Hermite)."""
    shift = np.atleast_1d(np.asarray(shift, float))
    return (expit(mu + shift[:, None] + tau * _X[None, :]) * _W).sum(axis=1)


def _solve(f, lo, hi, target):
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def calibrate(icc: float) -> tuple[float, float]:
    """(mu, tau) with mean accuracy MEAN and intra-class correlation ``icc`` on 0/1."""

    def mu_for(tau):
        return _solve(lambda m: mean_accuracy(m, tau)[0], -20, 20, MEAN)

    def icc_of(tau):
        mu = mu_for(tau)
        p = expit(mu + tau * _X)
        var = (_W * p * p).sum() - MEAN**2
        return var / (MEAN * (1 - MEAN))

    tau = _solve(icc_of, 0.0, 20.0, icc)
    return mu_for(tau), tau


def simulate(layout, num_seeds, icc, *, sims, num_problems=100, seed_sd=0.0, rng_seed=0):
    """The coverage and rejection rates of one setting (module doc), as a dict of shares."""
    mu, tau = calibrate(icc)
    rng = np.random.default_rng(rng_seed)
    S, P = num_seeds, num_problems
    hits = {k: 0 for k in ("wilson", "greedy", "sampled", "diff", "test", "mcnemar",
                           "across", "across_diff")}  # fmt: skip
    # The means over the population of training seeds.
    pop_a = mean_accuracy(mu, math.sqrt(tau**2 + seed_sd**2))[0]
    pop_b = mean_accuracy(mu + EFFECT, math.sqrt(tau**2 + seed_sd**2))[0]
    seeds_U = np.repeat(np.arange(S), P)
    if layout == "shared":
        ids = [f"p{j}" for j in range(P)] * S
    else:
        ids = [f"s{s}p{j}" for s in range(S) for j in range(P)]
    units = compare.Units(seeds=seeds_U, ids=np.asarray(ids), layout=layout)
    assert compare.layout_of([ids[s * P : (s + 1) * P] for s in range(S)]) == layout
    for _ in range(sims):
        rows = 1 if layout == "shared" else S
        z = rng.standard_normal((rows, P))
        own = lambda: (
            METHOD_CORR**0.5 * z + (1 - METHOD_CORR) ** 0.5 * rng.standard_normal((rows, P))
        )
        u = {g: np.broadcast_to(own(), (S, P)) for g in "ABN"}
        shift = {"A": 0.0, "B": EFFECT, "N": 0.0}
        a = {g: seed_sd * rng.standard_normal(S) for g in "ABN"}
        p = {g: expit(mu + shift[g] + tau * u[g] + a[g][:, None]) for g in "ABN"}
        greedy = {g: (rng.random((S, P)) < p[g]).astype(float).ravel() for g in "ABN"}
        sampled_a = rng.binomial(SAMPLES, p["A"]).ravel() / SAMPLES
        # These trained models' figures: the mean over their seeds (a_s fixed).
        t_a = mean_accuracy(mu, tau, a["A"]).mean()
        t_b = mean_accuracy(mu + EFFECT, tau, a["B"]).mean()

        inside = lambda ci, t: ci[0] <= t <= ci[1]
        y = greedy["A"]
        hits["wilson"] += inside(stats.wilson_interval(int(y.sum()), y.size), t_a)
        hits["greedy"] += inside(compare.interval(units, "greedy pass@1", y), t_a)
        hits["sampled"] += inside(compare.interval(units, "sampled pass@1", sampled_a), t_a)
        d = greedy["B"] - greedy["A"]
        diff = stats.cluster_bootstrap_interval(d, units.ids, units.strata)
        hits["diff"] += inside(diff, t_b - t_a)
        if seed_sd == 0 or S == 1:  # A and N are equally good: the null holds
            null = greedy["N"] - greedy["A"]
            hits["test"] += compare.paired_test(units, null, 1)["p_value"] < 0.05
            mc = stats.mcnemar_exact(greedy["A"].astype(bool), greedy["N"].astype(bool))
            hits["mcnemar"] += mc["p_value"] < 0.05
        if S >= compare.MIN_SEEDS_ACROSS:
            acr = compare.across_seeds(units, y)
            hits["across"] += acr["lo"] <= pop_a <= acr["hi"]
            acr = compare.across_seeds(units, d, diff=True)
            hits["across_diff"] += acr["lo"] <= pop_b - pop_a <= acr["hi"]
    out = {k: v / sims for k, v in hits.items()}
    if seed_sd and S > 1:
        out["test"] = out["mcnemar"] = None  # no null: the trained seeds differ
    if S < compare.MIN_SEEDS_ACROSS:
        out["across"] = out["across_diff"] = None
    return out


SETTINGS = [  # (layout, seeds, ICC, seed_sd)
    ("shared", 3, 0.5, 0.0),
    ("shared", 3, 0.33, 0.0),
    ("shared", 5, 0.5, 0.0),
    ("shared", 5, 0.33, 0.0),
    ("per seed", 3, 0.5, 0.0),
    ("per seed", 5, 0.33, 0.0),
    ("shared", 3, 0.5, 0.3),
    ("shared", 5, 0.33, 0.3),
    ("per seed", 3, 0.5, 0.3),
    ("per seed", 5, 0.33, 0.3),
]
COLUMNS = [
    ("wilson", "Wilson pooled (old)"),
    ("greedy", "group greedy"),
    ("sampled", "group sampled"),
    ("diff", "paired diff"),
    ("test", "test size"),
    ("mcnemar", "McNemar pooled (old) size"),
    ("across", "across seeds"),
    ("across_diff", "across seeds, diff"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sims", type=int, default=1000)
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--workers", type=int, default=1, help="processes, one row at a time each")
    a = ap.parse_args(argv)
    t0 = time.time()
    print(f"{a.sims} simulations per row, {a.problems} problems per seed, mean accuracy {MEAN}")
    print()
    print("| problems | seeds | ICC | seed sd | " + " | ".join(n for _, n in COLUMNS) + " |")
    print("|---|---|---|---|" + "---|" * len(COLUMNS))
    jobs = [(setting, a.sims, a.problems, i) for i, setting in enumerate(SETTINGS)]
    with multiprocessing.Pool(a.workers) as pool:
        for (layout, S, icc, sd), r in zip(SETTINGS, pool.imap(_row, jobs), strict=True):
            cells = ["-" if r[k] is None else f"{r[k]:.3f}" for k, _ in COLUMNS]
            print(f"| {layout} | {S} | {icc} | {sd} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n{time.time() - t0:.0f} s")
    return 0


def _row(job):
    (layout, S, icc, sd), sims, problems, i = job
    return simulate(layout, S, icc, sims=sims, num_problems=problems, seed_sd=sd, rng_seed=i)


if __name__ == "__main__":
    sys.exit(main())
