"""PPO with a learned critic: GAE advantages, their whitening, the clipped value loss (pure).

Shapes: N completion rows, T completion tokens; ``mask_NxT`` is 1 on the model's tokens
(in a multi-turn transcript the environment's tokens inside a row are 0). ``values_NxT[n, t]``
is the critic's value of the state before token t, read at the position that predicts it.
The reward of a row sits on its last model token; GAE runs over the model's tokens only,
an environment stretch passed through as if absent (docs/objective.md, section 14).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.objective.policy_terms import clip_closed, masked_mean

# verl's constant inside the whitening's square root.
WHITEN_EPS = 1e-8


def last_token_rewards(rewards_N: jax.Array, mask_NxT: jax.Array) -> jax.Array:
    """[N, T]: each row's reward on its last model token, 0 elsewhere (and on empty rows).

    A non-finite reward (an unscored completion) counts as 0 here; the caller leaves
    such rows out of the loss.
    """
    valid_NxT = mask_NxT > 0
    t = mask_NxT.shape[1]
    last_N = t - 1 - jnp.argmax(jnp.flip(valid_NxT, axis=1), axis=1)
    at_last_NxT = (jnp.arange(t)[None, :] == last_N[:, None]) & valid_NxT
    r_N = jnp.where(jnp.isfinite(rewards_N), rewards_N, 0.0)
    return jnp.where(at_last_NxT, r_N[:, None], 0.0)


def gae(
    rewards_N: jax.Array,
    values_NxT: jax.Array,
    mask_NxT: jax.Array,
    gamma: float,
    lam: float,
) -> tuple[jax.Array, jax.Array]:
    """(advantages [N, T], returns [N, T]): GAE(gamma, lambda) over each row's model tokens.

    With t' the next model token after t (none after the last: V = 0 there),

        delta_t = r_t + gamma V_t' - V_t,     A_t = delta_t + gamma lam A_t',
        R_t = A_t + V_t,

    r_t the row's reward on its last model token, 0 elsewhere. Tokens with mask 0 (padding,
    a transcript's environment tokens) take no part: the recursion skips them, so
    discounting counts model tokens only, and their advantage and return are 0. No
    gradient: advantages and returns are the targets.
    """
    valid_NxT = mask_NxT > 0
    dtype = jnp.promote_types(values_NxT.dtype, jnp.float32)
    v_NxT = jnp.where(valid_NxT, jax.lax.stop_gradient(values_NxT).astype(dtype), 0.0)
    r_NxT = last_token_rewards(rewards_N.astype(dtype), mask_NxT)

    def back(carry, xs):
        next_v, next_a = carry
        r, v, m = xs
        a = r + gamma * next_v - v + gamma * lam * next_a
        return (jnp.where(m, v, next_v), jnp.where(m, a, next_a)), jnp.where(m, a, 0.0)

    zeros_N = jnp.zeros(v_NxT.shape[:1], dtype)
    _, adv_TxN = jax.lax.scan(
        back, (zeros_N, zeros_N), (r_NxT.T, v_NxT.T, valid_NxT.T), reverse=True
    )
    adv_NxT = adv_TxN.T
    return adv_NxT, jnp.where(valid_NxT, adv_NxT + v_NxT, 0.0)


def whiten(x_NxT: jax.Array, mask_NxT: jax.Array, eps: float = WHITEN_EPS) -> jax.Array:
    """(x - mean) / sqrt(var + eps) over the mask's tokens (population variance); 0 off it."""
    mask = mask_NxT.astype(x_NxT.dtype)
    mean = masked_mean(x_NxT, mask)
    var = masked_mean((x_NxT - mean) ** 2, mask)
    return jnp.where(mask > 0, (x_NxT - mean) * jax.lax.rsqrt(var + eps), 0.0)


def value_loss(
    values_NxT: jax.Array,
    old_values_NxT: jax.Array,
    returns_NxT: jax.Array,
    mask_NxT: jax.Array,
    clip: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped value loss, a token mean over the mask, and its metrics.

        V_clip = V_old + clip(V - V_old, -clip, clip)
        L_V    = (1/2) mean_t max((V - R)^2, (V_clip - R)^2)

    ``values_NxT`` is differentiated; the old values and the returns are constants. The
    metric ``value_clip_frac`` is the share of tokens where the clipped term is the larger
    (their gradient is 0 once V has left [V_old - clip, V_old + clip]).
    """
    dtype = jnp.promote_types(values_NxT.dtype, jnp.float32)
    v = values_NxT.astype(dtype)
    old = jax.lax.stop_gradient(old_values_NxT.astype(dtype))
    ret = jax.lax.stop_gradient(returns_NxT.astype(dtype))
    mask = mask_NxT.astype(dtype)
    v_clip = old + clip_closed(v - old, -clip, clip)  # derivative 1 at the edges, as torch's
    unclipped, clipped = (v - ret) ** 2, (v_clip - ret) ** 2
    loss = 0.5 * masked_mean(jnp.maximum(unclipped, clipped), mask)
    clip_frac = masked_mean((clipped > unclipped).astype(dtype), mask)
    return loss, {"value_clip_frac": jax.lax.stop_gradient(clip_frac)}


def explained_variance(values_NxT, returns_NxT, mask_NxT) -> jax.Array:
    """1 - var(R - V) / var(R) over the mask's tokens: 1 for a perfect critic, 0 for a
    constant one, negative for one worse than a constant. NaN when the returns do not vary."""
    mask = mask_NxT.astype(jnp.float32)

    def var(x):
        return masked_mean((x - masked_mean(x, mask)) ** 2, mask)

    var_r = var(returns_NxT)
    return jnp.where(var_r > 0, 1.0 - var(returns_NxT - values_NxT) / var_r, jnp.nan)
