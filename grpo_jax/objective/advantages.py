"""Group-relative advantages (pure functions of the rewards).

Shapes: B prompts, G completions per prompt; ``rewards_BxG[b, g]`` is the
reward of completion g of prompt b. A non-finite reward (NaN: a reward
function that could not score that completion) is left out of its group's
statistics and gets advantage 0, so it pushes the policy neither way. A group
whose finite rewards are all equal gets advantage exactly 0 under every
estimator, whatever the values and eps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

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


def _batch_std(x_BxG, valid_BxG):
    """Population std of the finite entries of the whole batch, about their mean."""
    n = jnp.maximum(valid_BxG.sum(), 1)
    mean = jnp.where(valid_BxG, x_BxG, 0.0).sum() / n
    return jnp.sqrt((jnp.where(valid_BxG, x_BxG - mean, 0.0) ** 2).sum() / n)


def reinforce_pp_advantages(rewards_BxG: jax.Array, *, eps: float = DEFAULT_EPS) -> jax.Array:
    """REINFORCE++ (Hu et al. 2025): a global baseline and global normalisation.

        A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps)

    over all finite rewards of the batch, no group baseline. One departure:
    a group whose finite rewards all agree gets A = 0 (the library-wide
    rule), where the paper would give it r - mean_batch(r).
    """
    valid_BxG, r_BxG, _, _, centered_BxG, _ = _valid_stats(rewards_BxG)
    n = jnp.maximum(valid_BxG.sum(), 1)
    batch_centered_BxG = jnp.where(valid_BxG, r_BxG - r_BxG.sum() / n, 0.0)
    adv_BxG = _safe_div(batch_centered_BxG, _batch_std(r_BxG, valid_BxG), eps)
    # _valid_stats zeroes the group-centred rewards of constant groups; a group
    # that varies has at least one member off its own mean.
    varies_Bx1 = (centered_BxG != 0).any(axis=1, keepdims=True)
    return jnp.where(valid_BxG & varies_Bx1, adv_BxG, 0.0)


def reinforce_pp_baseline_advantages(
    rewards_BxG: jax.Array, *, eps: float = DEFAULT_EPS
) -> jax.Array:
    """REINFORCE++-baseline (Hu et al. 2025): group baseline, batch normalisation.

        c_i = r_i - mean_group(r),   A_i = c_i / (std_batch(c) + eps)

    std_batch(c) is the population std of the group-centred rewards over the
    whole batch (OpenRLHF's global whitening of the centred rewards; their
    batch mean is 0 up to rounding and is not subtracted, so constant groups
    stay exactly 0). Unlike "batch_std", the std is of the centred rewards,
    so spread between prompts' difficulty does not shrink the advantages.
    """
    valid_BxG, _, _, _, centered_BxG, _ = _valid_stats(rewards_BxG)
    n = jnp.maximum(valid_BxG.sum(), 1)
    std = jnp.sqrt((centered_BxG**2).sum() / n)
    return jnp.where(valid_BxG, _safe_div(centered_BxG, std, eps), 0.0)


def _binomial_ratio(top_Bx1, bottom_Bx1, k):
    """C(top, k) / C(bottom, k) = prod_{j<k} (top - j) / (bottom - j), 0 once top < k."""
    out = jnp.ones_like(top_Bx1)
    for j in range(k):
        out = out * jnp.maximum(top_Bx1 - j, 0.0) / jnp.maximum(bottom_Bx1 - j, 1.0)
    return out


def _check_binary(rewards_BxG) -> None:
    """Raises unless concrete rewards are 0, 1 or NaN (traced ones cannot be checked)."""
    if not isinstance(rewards_BxG, jax.core.Tracer):
        r = np.asarray(rewards_BxG)
        bad = np.isfinite(r) & (r != 0) & (r != 1)
        if bad.any():
            raise ValueError(
                "advantage estimator 'passk' needs binary rewards (0 or 1, NaN for unscored); "
                f"got {r[bad][:5].tolist()}"
            )


def passk_advantages(rewards_BxG: jax.Array, *, k: int = 1, eps: float = DEFAULT_EPS) -> jax.Array:
    """Pass@k advantages in closed form (Chen et al. 2025, "Pass@k Training", sec. 4).

    For a group of n finite binary rewards with c correct (r = 1), the group
    reward is pass@k over its k-subsets and each sample's advantage is its
    expected share:

        R = 1 - C(n - c, k) / C(n, k),         sigma = sqrt(R (1 - R))
        A_correct   = (1 - R) / (sigma + eps)
        A_incorrect = (1 - R - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / (sigma + eps)

    k = 1 gives GRPO's advantages. sigma = 0 (no correct sample, or every
    k-subset holds one) gives 0. A group with fewer than k finite rewards
    gets 0. Rewards must be 0 or 1 (or NaN): concrete rewards with other values
    raise ValueError (``compute_advantages`` checks before its jitted program);
    under jit, where values cannot be checked, a reward counts as correct
    exactly when it equals 1.
    """
    _check_binary(rewards_BxG)
    valid_BxG = jnp.isfinite(rewards_BxG)
    correct_BxG = valid_BxG & (rewards_BxG == 1)
    dtype = jnp.promote_types(rewards_BxG.dtype, jnp.float32)
    n_Bx1 = valid_BxG.sum(axis=1, keepdims=True).astype(dtype)
    c_Bx1 = correct_BxG.sum(axis=1, keepdims=True).astype(dtype)
    mean_Bx1 = 1.0 - _binomial_ratio(n_Bx1 - c_Bx1, n_Bx1, k)
    std_Bx1 = jnp.sqrt(jnp.maximum(mean_Bx1 * (1.0 - mean_Bx1), 0.0))
    miss_Bx1 = _binomial_ratio(n_Bx1 - c_Bx1 - 1.0, n_Bx1 - 1.0, k - 1)
    centered_BxG = jnp.where(correct_BxG, 1.0 - mean_Bx1, 1.0 - mean_Bx1 - miss_Bx1)
    usable_Bx1 = n_Bx1 >= k
    adv_BxG = _safe_div(centered_BxG, jnp.where(usable_Bx1, std_Bx1, 0.0), eps)
    return jnp.where(valid_BxG, adv_BxG, 0.0)


ESTIMATORS: dict[str, Callable[..., jax.Array]] = {
    "grpo": lambda r, eps, **_: group_advantages(r, eps=eps, scale="group"),
    "batch_std": lambda r, eps, **_: group_advantages(r, eps=eps, scale="batch"),
    "dr_grpo": lambda r, eps, **_: group_advantages(r, eps=eps, scale="none"),
    "rloo": lambda r, eps, **_: rloo_advantages(r, eps=eps),
    "reinforce_pp": lambda r, eps, **_: reinforce_pp_advantages(r, eps=eps),
    "reinforce_pp_baseline": lambda r, eps, **_: reinforce_pp_baseline_advantages(r, eps=eps),
    "passk": lambda r, eps, passk_k=1, **_: passk_advantages(r, k=passk_k, eps=eps),
    # PPO with a learned critic: the update computes GAE advantages per token from the
    # critic's values (grpo_jax.objective.gae); a row carries none of its own.
    "gae": lambda r, eps, **_: jnp.zeros_like(r),
}


def compute_advantages(
    rewards_BxG: jax.Array,
    *,
    estimator: str = "grpo",
    eps: float = DEFAULT_EPS,
    passk_k: int = 1,
) -> jax.Array:
    """Advantages by registry name: one of ``ESTIMATORS``; ``passk_k`` is "passk"'s k.

    One jitted program per (estimator, eps, k, shape): run op by op, the
    estimator compiled each of its dozen small operations on first use.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not one of {sorted(ESTIMATORS)}")
    if estimator == "passk":
        _check_binary(rewards_BxG)  # here: inside the jitted program the values are traced
    return _jitted_advantages(jnp.asarray(rewards_BxG), estimator, float(eps), int(passk_k))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _jitted_advantages(rewards_BxG, estimator, eps, passk_k):
    return ESTIMATORS[estimator](rewards_BxG, eps, passk_k=passk_k)


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
