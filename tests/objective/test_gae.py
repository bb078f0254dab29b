"""GAE, whitening, the clipped value loss and explained variance against hand-worked numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.objective import gae

GAMMA, LAM = 0.9, 0.5


def hand_case():
    """Four rows of T = 4: a single-turn row, a transcript whose tokens 1-2 are the
    environment's, an empty row, an unscored (NaN) row."""
    rewards = np.array([1.0, -1.0, 5.0, np.nan])
    values = np.array(
        [[0.5, 0.2, 0.8, 9.0], [0.3, 7.0, 7.0, 0.6], [1.0, 1.0, 1.0, 1.0], [0.1, 0.2, 3.0, 3.0]]
    )
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 0, 0]], np.float32)
    return rewards, values, mask


def test_gae_hand_worked():
    # Row 0, from the last token back:
    #   t=2: delta = 1 - 0.8 = 0.2;                    A = 0.2;                    R = 1.0
    #   t=1: delta = 0.9*0.8 - 0.2 = 0.52;             A = 0.52 + 0.45*0.2 = 0.61; R = 0.81
    #   t=0: delta = 0.9*0.2 - 0.5 = -0.32;            A = -0.32 + 0.45*0.61 = -0.0455
    # Row 1: t=3: delta = -1 - 0.6 = -1.6, A = -1.6, R = -1.0; the environment's tokens 1-2
    #   are skipped, so t=0's next value is t=3's: delta = 0.9*0.6 - 0.3 = 0.24,
    #   A = 0.24 + 0.45*(-1.6) = -0.48, R = -0.18.
    # Row 2 has no token. Row 3's NaN reward counts as 0: t=1: A = -0.2, R = 0;
    #   t=0: delta = 0.9*0.2 - 0.1 = 0.08, A = 0.08 + 0.45*(-0.2) = -0.01, R = 0.09.
    rewards, values, mask = hand_case()
    adv, ret = gae.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), GAMMA, LAM)
    want_adv = [[-0.0455, 0.61, 0.2, 0], [-0.48, 0, 0, -1.6], [0, 0, 0, 0], [-0.01, -0.2, 0, 0]]
    want_ret = [[0.4545, 0.81, 1.0, 0], [-0.18, 0, 0, -1.0], [0, 0, 0, 0], [0.09, 0.0, 0, 0]]
    np.testing.assert_allclose(adv, want_adv, atol=1e-6)
    np.testing.assert_allclose(ret, want_ret, atol=1e-6)


def test_gae_gamma_lam_one_is_monte_carlo():
    # gamma = lam = 1: the deltas telescope, A_t = r - V_t and R_t = r on every model token.
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 5))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 1, 0]], np.float32)
    rewards = np.array([0.7, -0.2, 1.5])
    adv, ret = gae.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), 1.0, 1.0)
    np.testing.assert_allclose(adv, (rewards[:, None] - values) * mask, atol=1e-6)
    np.testing.assert_allclose(ret, rewards[:, None] * mask, atol=1e-6)


def test_gae_ignores_values_off_the_mask():
    rewards, values, mask = hand_case()
    other = np.where(mask > 0, values, 1e30)
    run = lambda v: gae.gae(jnp.asarray(rewards), jnp.asarray(v), jnp.asarray(mask), GAMMA, LAM)
    for a, b in zip(run(values), run(other)):
        np.testing.assert_array_equal(a, b)


def test_whiten_hand_worked():
    x = jnp.array([[1.0, 2.0, 3.0, 100.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, population variance 2/3 over the three masked-in tokens; 0 off the mask.
    want = np.array([[-1.0, 0.0, 1.0, 0.0]]) / np.sqrt(2 / 3 + 1e-8)
    np.testing.assert_allclose(gae.whiten(x, mask), want, rtol=1e-6)


def value_case():
    # Token by token (clip 0.2): 0 V left the band, the unclipped term larger; 1 V left
    # the band, the clipped term larger (no gradient); 2 V inside the band; 3 off the mask.
    v = jnp.array([[1.0, 0.9, 0.45, 3.0]])
    old = jnp.array([[0.5, 0.5, 0.5, 0.0]])
    ret = jnp.array([[0.0, 1.0, 0.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    return v, old, ret, mask


def test_value_loss_hand_worked():
    v, old, ret, mask = value_case()
    loss, metrics = gae.value_loss(v, old, ret, mask, 0.2)
    # Token 0: V_clip = 0.7, max(1.0, 0.49) = 1.0; token 1: V_clip = 0.7, max(0.01, 0.09) = 0.09;
    # token 2: V_clip = V, 0.2025. L = 0.5 * (1.0 + 0.09 + 0.2025) / 3.
    np.testing.assert_allclose(loss, 0.5 * (1.0 + 0.09 + 0.2025) / 3, rtol=1e-6)
    np.testing.assert_allclose(metrics["value_clip_frac"], 1 / 3, rtol=1e-6)


def test_value_loss_gradient_hand_and_finite_difference():
    v, old, ret, mask = value_case()
    grad = jax.grad(lambda x: gae.value_loss(x, old, ret, mask, 0.2)[0])(v)
    # dL/dV = (V - R) / M where V itself is in the max, 0 where the clipped term wins
    # outside the band, 0 off the mask; M = 3.
    np.testing.assert_allclose(grad, [[1.0 / 3, 0.0, 0.45 / 3, 0.0]], rtol=1e-6)
    with jax.enable_x64(True):
        v64, old64, ret64, mask64 = (jnp.asarray(x, jnp.float64) for x in value_case())
        h = 1e-6
        f = jax.jit(lambda x: gae.value_loss(x, old64, ret64, mask64, 0.2)[0])
        for t in range(4):
            e = jnp.zeros_like(v64).at[0, t].set(h)
            fd = (f(v64 + e) - f(v64 - e)) / (2 * h)
            np.testing.assert_allclose(fd, grad[0, t], atol=1e-6)


@pytest.mark.parametrize("shift", [0.0, 3.0])
def test_explained_variance(shift):
    ret = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_allclose(gae.explained_variance(ret, ret, mask), 1.0)
    # A constant critic explains nothing, whatever the constant.
    const = jnp.full_like(ret, shift)
    np.testing.assert_allclose(gae.explained_variance(const, ret, mask), 0.0, atol=1e-6)
    # Returns that do not vary: no value.
    assert np.isnan(gae.explained_variance(const, jnp.ones_like(ret), mask))
