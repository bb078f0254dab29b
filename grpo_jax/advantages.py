"""Group-relative advantages (pure functions of the rewards).

Shapes: B prompts, G completions per prompt; ``rewards_BxG[b, g]`` is the
reward of completion g of prompt b. A non-finite reward (NaN: a reward
function that could not score that completion) is left out of its group's
statistics and gets advantage 0, so it pushes the policy neither way. A group
whose finite rewards are all equal gets advantage exactly 0 under every
estimator, whatever the values and eps.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

DEFAULT_EPS = 1e-4


def _valid_stats(rewards_BxG: jax.Array):
    """Masked group mean, centred rewards and population std over the finite rewards.

        centered_i = r_i - mean(r),   std = sqrt(mean(centered**2))

    except that a group whose finite rewards are all equal (max == min) has
    centered_i = 0 exactly, and so std = 0: its rounded float mean can differ
    from the common value (mean of eight 0.1 is not 0.1 in float32), and that
    rounding error must not become a learning signal.
    """
    valid_BxG = jnp.isfinite(rewards_BxG)
    r_BxG = jnp.where(valid_BxG, rewards_BxG, 0.0)
    n_Bx1 = valid_BxG.sum(axis=1, keepdims=True)
    denom_Bx1 = jnp.maximum(n_Bx1, 1)
    mean_Bx1 = r_BxG.sum(axis=1, keepdims=True) / denom_Bx1
    max_Bx1 = jnp.where(valid_BxG, rewards_BxG, -jnp.inf).max(axis=1, keepdims=True)
    min_Bx1 = jnp.where(valid_BxG, rewards_BxG, jnp.inf).min(axis=1, keepdims=True)
    varies_Bx1 = max_Bx1 != min_Bx1
    centered_BxG = jnp.where(valid_BxG & varies_Bx1, r_BxG - mean_Bx1, 0.0)
    var_Bx1 = (centered_BxG**2).sum(axis=1, keepdims=True) / denom_Bx1
    return valid_BxG, r_BxG, n_Bx1, mean_Bx1, centered_BxG, jnp.sqrt(var_Bx1)


def _safe_div(centered, std, eps):
    # A zero std means every centred reward is 0: the advantage is 0 even at eps = 0.
    return jnp.where(std > 0, centered / jnp.where(std > 0, std + eps, 1.0), 0.0)


def group_advantages(
    rewards_BxG: jax.Array, *, eps: float = DEFAULT_EPS, scale: str = "group"
) -> jax.Array:
    """GRPO advantages, normalised within each group (DeepSeekMath, eq. in 4.1.2).

        A_i = (r_i - mean(r)) / (std(r) + eps)

    with mean and *population* std (divide by G, not G-1) over the group's
    finite rewards.

    Args:
      rewards_BxG: rewards, one row per prompt; NaN where unscored.
      eps: added to the std; it bounds |A| for near-constant groups.
        Default 1e-4. A group whose finite rewards all agree gets A = 0
        exactly (never NaN), at any eps including 0.
      scale: "group" (the paper: divide by the group's std), "batch" (divide
        by the std of all finite rewards in the batch, as in Hu et al.'s
        REINFORCE++ and TRL's ``scale_rewards="batch"``: less noisy for small
        G), or "none" (no division: Dr. GRPO, Liu et al. 2025, which argues the
        std term over-weights near-solved and near-impossible prompts).

    Returns:
      advantages_BxG, 0 where the reward was not finite.
    """
    valid_BxG, r_BxG, _, _, centered_BxG, std_Bx1 = _valid_stats(rewards_BxG)
    if scale == "group":
        adv_BxG = _safe_div(centered_BxG, std_Bx1, eps)
    elif scale == "batch":
        n = jnp.maximum(valid_BxG.sum(), 1)
        batch_mean = r_BxG.sum() / n
        batch_var = (jnp.where(valid_BxG, r_BxG - batch_mean, 0.0) ** 2).sum() / n
        adv_BxG = _safe_div(centered_BxG, jnp.sqrt(batch_var), eps)
    elif scale == "none":
        adv_BxG = centered_BxG
    else:
        raise ValueError(f"scale={scale!r} is not one of ['batch', 'group', 'none']")
    return jnp.where(valid_BxG, adv_BxG, 0.0)


def rloo_advantages(rewards_BxG: jax.Array, *, eps: float = DEFAULT_EPS) -> jax.Array:
    """Leave-one-out baseline (RLOO, Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j.

    Equal to G/(G-1) * (r_i - mean(r)) over the n finite rewards of the group;
    a group with fewer than two finite rewards gets 0. ``eps`` is unused (no
    std scaling) and accepted for a uniform signature.
    """
    del eps
    valid_BxG, _, n_Bx1, _, centered_BxG, _ = _valid_stats(rewards_BxG)
    factor_Bx1 = jnp.where(n_Bx1 > 1, n_Bx1 / jnp.maximum(n_Bx1 - 1, 1), 0.0)
    return jnp.where(valid_BxG, centered_BxG * factor_Bx1, 0.0)


ESTIMATORS: dict[str, Callable[..., jax.Array]] = {
    "grpo": lambda r, eps: group_advantages(r, eps=eps, scale="group"),
    "batch_std": lambda r, eps: group_advantages(r, eps=eps, scale="batch"),
    "dr_grpo": lambda r, eps: group_advantages(r, eps=eps, scale="none"),
    "rloo": lambda r, eps: rloo_advantages(r, eps=eps),
}


def compute_advantages(
    rewards_BxG: jax.Array, *, estimator: str = "grpo", eps: float = DEFAULT_EPS
) -> jax.Array:
    """Advantages by registry name: one of ``ESTIMATORS``."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[estimator](rewards_BxG, eps)


def group_reward_stats(rewards_BxG: jax.Array) -> dict[str, jax.Array]:
    """Monitoring: within-group reward variance and the share of groups with none.

    A group whose finite rewards all agree carries no learning signal under
    GRPO (every advantage is 0); when that share reaches 1 the run has stopped
    learning.
    """
    valid_BxG, _, n_Bx1, _, _, std_Bx1 = _valid_stats(rewards_BxG)
    var_B = std_Bx1[:, 0] ** 2
    return {
        "group_reward_var": var_B.mean(),
        "frac_zero_var_groups": (var_B <= 1e-12).astype(jnp.float32).mean(),
        "frac_unscored": 1.0 - valid_BxG.astype(jnp.float32).mean(),
        "groups_with_signal": (var_B > 1e-12).sum(),
    }
