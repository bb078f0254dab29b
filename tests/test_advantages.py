"""Group advantages on hand-computed groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import advantages, sharding

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
