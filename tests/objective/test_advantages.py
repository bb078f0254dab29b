"""Group advantages on hand-computed groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.core import sharding
from grpo_jax.objective import advantages

nan = float("nan")


def test_two_member_group_by_hand():
    # mean 0.5, population std 0.5 -> A = +-0.5 / (0.5 + eps).
    a = advantages.group_advantages(jnp.array([[0.0, 1.0]]), eps=1e-4)
    np.testing.assert_allclose(a, [[-0.5 / 0.5001, 0.5 / 0.5001]], rtol=1e-6)


def test_population_std_not_sample_std():
    r = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    std = np.sqrt(((np.array([1, 2, 3, 4]) - 2.5) ** 2).mean())  # sqrt(1.25), divides by G
    want = (np.array([1, 2, 3, 4]) - 2.5) / (std + 1e-6)
    np.testing.assert_allclose(advantages.group_advantages(r, eps=1e-6), [want], rtol=1e-5)


def test_equal_rewards_give_zero_never_nan():
    a = advantages.group_advantages(jnp.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), eps=0.0)
    assert np.all(np.asarray(a) == 0.0)


def test_nan_reward_is_left_out_and_gets_zero():
    r = jnp.array([[0.0, nan, 1.0, 1.0], [nan, nan, nan, nan], [nan, 3.0, nan, nan]])
    a = np.asarray(advantages.group_advantages(r, eps=1e-6))
    # Row 0: stats over {0, 1, 1}: mean 2/3, std sqrt(2)/3.
    mean, std = 2 / 3, np.sqrt(((np.array([0, 1, 1]) - 2 / 3) ** 2).mean())
    np.testing.assert_allclose(
        a[0],
        [(0 - mean) / (std + 1e-6), 0, (1 - mean) / (std + 1e-6), (1 - mean) / (std + 1e-6)],
        rtol=1e-5,
    )
    assert np.all(a[1] == 0) and np.all(a[2] == 0)
    assert np.all(np.isfinite(a))


def test_variants_by_hand():
    r = jnp.array([[0.0, 1.0, 1.0, 2.0], [1.0, 1.0, 1.0, 3.0]])
    centered = np.array([[-1.0, 0, 0, 1], [-0.5, -0.5, -0.5, 1.5]])
    np.testing.assert_allclose(advantages.group_advantages(r, scale="none"), centered)
    all_r = np.array([0, 1, 1, 2, 1, 1, 1, 3.0])
    np.testing.assert_allclose(
        advantages.group_advantages(r, scale="batch", eps=0.0), centered / all_r.std(), rtol=1e-6
    )
    # RLOO: r_i - mean of the others = G/(G-1) (r_i - mean).
    loo = np.array([[0 - 4 / 3, 1 - 1, 1 - 1, 2 - 2 / 3], [1 - 5 / 3, 1 - 5 / 3, 1 - 5 / 3, 3 - 1]])
    np.testing.assert_allclose(advantages.rloo_advantages(r), loo, rtol=1e-6)
    np.testing.assert_allclose(advantages.compute_advantages(r, estimator="rloo"), loo, rtol=1e-6)
    # RLOO with a NaN: two finite rewards {0, 2} -> +-2; one finite reward -> 0.
    np.testing.assert_allclose(
        advantages.rloo_advantages(jnp.array([[0.0, nan, 2.0], [nan, 1.0, nan]])),
        [[-2.0, 0.0, 2.0], [0.0, 0.0, 0.0]],
    )
    with pytest.raises(ValueError, match="advantage estimator 'ppo' is not one of"):
        advantages.compute_advantages(r, estimator="ppo")
    with pytest.raises(ValueError, match="scale='std' is not one of"):
        advantages.group_advantages(r, scale="std")


def test_group_reward_stats():
    r = jnp.array([[0.0, 1.0], [1.0, 1.0], [nan, 0.0]])
    s = advantages.group_reward_stats(r)
    np.testing.assert_allclose(s["group_reward_var"], (0.25 + 0 + 0) / 3, rtol=1e-6)
    np.testing.assert_allclose(s["frac_zero_var_groups"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(s["frac_unscored"], 1 / 6, rtol=1e-6)


def test_sharded_advantages_equal_single_device():
    rewards = jnp.asarray(np.random.default_rng(0).integers(0, 3, (16, 4)), jnp.float32)
    mesh = sharding.make_mesh({"data": 8})
    f = jax.jit(
        advantages.group_advantages,
        in_shardings=sharding.batch_sharding(mesh),
        out_shardings=sharding.batch_sharding(mesh),
    )
    np.testing.assert_allclose(f(rewards), advantages.group_advantages(rewards), rtol=1e-6)


def _formula_BxG(rewards_BxG, eps, estimator):
    """The estimators' formulas, op for op, for groups whose rewards vary."""
    valid = jnp.isfinite(rewards_BxG)
    r = jnp.where(valid, rewards_BxG, 0.0)
    n = valid.sum(axis=1, keepdims=True)
    denom = jnp.maximum(n, 1)
    mean = r.sum(axis=1, keepdims=True) / denom
    centered = jnp.where(valid, r - mean, 0.0)
    if estimator == "dr_grpo":
        return jnp.where(valid, centered, 0.0)
    if estimator == "rloo":
        return jnp.where(valid, centered * jnp.where(n > 1, n / jnp.maximum(n - 1, 1), 0.0), 0.0)
    n_all = jnp.maximum(valid.sum(), 1)
    if estimator == "reinforce_pp":
        batch_centered = jnp.where(valid, r - r.sum() / n_all, 0.0)
        std = jnp.sqrt((batch_centered**2).sum() / n_all)
        return jnp.where(valid, jnp.where(std > 0, batch_centered / (std + eps), 0.0), 0.0)
    if estimator == "reinforce_pp_baseline":
        # The batch std is over all groups: constant ones add exactly 0, not rounding.
        hi = jnp.where(valid, rewards_BxG, -jnp.inf).max(axis=1, keepdims=True)
        lo = jnp.where(valid, rewards_BxG, jnp.inf).min(axis=1, keepdims=True)
        std = jnp.sqrt((jnp.where(hi != lo, centered, 0.0) ** 2).sum() / n_all)
        return jnp.where(valid, jnp.where(std > 0, centered / (std + eps), 0.0), 0.0)
    if estimator == "grpo":
        std = jnp.sqrt((centered**2).sum(axis=1, keepdims=True) / denom)
    else:
        n_all = jnp.maximum(valid.sum(), 1)
        batch_mean = r.sum() / n_all
        std = jnp.sqrt((jnp.where(valid, r - batch_mean, 0.0) ** 2).sum() / n_all)
    return jnp.where(valid, jnp.where(std > 0, centered / (std + eps), 0.0), 0.0)


# "passk" takes binary rewards only: test_losses_objectives.py checks its constant groups;
# "gae" gives rows none (the update computes its advantages per token from the critic).
# Every pair of estimator and G, of estimator and eps, and of G and eps (eps alternates with
# the other two's indices): 24 cases instead of all 48 triples, each compiling its own program.
_ESTIMATORS = sorted(set(advantages.ESTIMATORS) - {"passk", "gae"})  # gae: the critic's
_GS = (3, 4, 8, 16)


@pytest.mark.parametrize(
    "estimator, eps, G",
    [
        (est, (0.0, 1e-4)[(i + j) % 2], G)
        for i, est in enumerate(_ESTIMATORS)
        for j, G in enumerate(_GS)
    ],
)
def test_groups_without_variance_get_exactly_zero(estimator, eps, G):
    # r_i - mean(r) is 0 for every member of a group whose rewards all agree, so
    # every estimator's advantage is 0 there, although float32 rounds mean(r)
    # of 1.1, 0.1 or 0.3 away from the value itself.
    rng = np.random.default_rng(G)
    const = [[v] * G for v in (1.1, 0.1, 0.3, 0.7, 1e-3, -0.9)]
    const.append([0.3] * (G - 1) + [nan])  # the finite members agree
    varying = [list(rng.choice([0.0, 0.1, 1.0, 1.1], G)) for _ in range(3)]
    varying[0][:2] = [0.1, 1.1]  # make sure each varying group does vary
    varying[1][:2] = [0.0, 1.0]
    varying[2][:2] = [0.3, 0.30000001]
    r = jnp.asarray(const + varying, jnp.float32)
    a = np.asarray(advantages.compute_advantages(r, estimator=estimator, eps=eps))
    k = len(const)
    assert np.all(a[:k] == 0.0), a[:k]
    # Groups that vary keep the formula's values, to float32 rounding: the estimator is
    # jitted, and XLA's fused division may round the last bit differently from op-by-op.
    np.testing.assert_allclose(
        a[k:], np.asarray(_formula_BxG(r, eps, estimator))[k:], rtol=3e-7, atol=0
    )


def test_group_reward_stats_count_constant_float_groups_as_zero_variance():
    r = jnp.asarray([[0.1] * 8, [1.1] * 8, [0.0, 1.0] * 4], jnp.float32)
    s = advantages.group_reward_stats(r)
    assert float(s["frac_zero_var_groups"]) == pytest.approx(2 / 3)
    assert int(s["groups_with_signal"]) == 1
    np.testing.assert_allclose(s["group_reward_var"], 0.25 / 3, rtol=1e-6)
