"""The policy terms of the objective: the clipped surrogate and the methods that replace it.

Each ``policy_*`` function returns the per-token objective (to be maximised)
before the KL term, the behaviour weights and the reduction, which
``grpo_jax.objective.losses.grpo_loss`` adds (docs/objective.md, sections 5 and 10).
Shapes as in ``grpo_jax.objective.losses``: N rows, T completion tokens, A the row's
advantage broadcast over its tokens (N x 1).

Also the clip and mean helpers the loss shares with them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# ---------------------------------------------------------------------------
# Clip and mean helpers (shared with grpo_jax.objective.losses).


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """sum(x * mask) / max(sum(mask), 1): the mean over the mask's tokens, 0 with none."""
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def clip_closed(x, lo, hi):
    """clip(x, lo, hi) with derivative 1 on the closed range [lo, hi], 0 outside.

    jnp.clip's derivative is 1/2 at an edge. With an epsilon of 0 the on-policy
    point rho = 1 is an edge, and min(rho A, clip(rho) A), which splits a tie
    evenly, would have the gradient 3/4 A there (5/8 A with both epsilons 0);
    with this clip it is A, the policy gradient, as with torch's clamp.
    """
    return jnp.where((x >= lo) & (x <= hi), x, jnp.clip(x, lo, hi))


def clip_bounds(epsilon_low, epsilon_high):
    """[lo, hi] = [1 - eps_low, 1 + eps_high]; a side whose epsilon is None is unbounded."""
    lo = -jnp.inf if epsilon_low is None else 1.0 - epsilon_low
    hi = jnp.inf if epsilon_high is None else 1.0 + epsilon_high
    return lo, hi


def clip_ratio(rho, epsilon_low, epsilon_high):
    """(clip(rho, lo, hi), lo, hi) with the bounds of :func:`clip_bounds` (:func:`clip_closed`)."""
    lo, hi = clip_bounds(epsilon_low, epsilon_high)
    return clip_closed(rho, lo, hi), lo, hi


# ---------------------------------------------------------------------------
# Policy terms. Each returns the per-token objective (to be maximised) before
# the KL term and the reduction; all take the same keyword arguments:
# log_ratio, logps, adv (N x 1), mask, eps_low, eps_high, and the options
# of grpo_jax.objective.losses._policy_options (GRPOConfig's fields of those names).


def dual_clip(surrogate, rho, adv, dual_clip_c):
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games").

    For A < 0 the clipped surrogate min(rho A, clip(rho) A) is unbounded below
    as rho grows; dual clip bounds it: max(min(rho A, clip(rho) A), c A), c > 1.
    """
    if dual_clip_c is None:
        return surrogate
    return jnp.where(adv < 0, jnp.maximum(surrogate, dual_clip_c * adv), surrogate)


def policy_clip(*, log_ratio, adv, eps_low, eps_high, dual_clip_c=None, **_):
    """PPO/GRPO clipped surrogate: min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A).

    With ``dual_clip_c`` = c, tokens with A < 0 take max(that, c A) (dual clip).
    """
    rho = jnp.exp(log_ratio)
    clipped, _, _ = clip_ratio(rho, eps_low, eps_high)
    surrogate = jnp.minimum(rho * adv, clipped * adv)
    return dual_clip(surrogate, rho, adv, dual_clip_c)


def policy_cispo(*, log_ratio, logps, adv, eps_low, eps_high, **_):
    """CISPO (MiniMax-M1, MiniMax 2025, eq. 4): sg(clip(rho, 1-eps_low, 1+eps_high)) A log pi.

    The importance weight is clipped and detached instead of the update: every
    token keeps the REINFORCE gradient clip(rho) A grad log pi_theta, including
    the tokens PPO's clip would silence. The value is that of the formula (it
    contains log pi_theta), not a surrogate of the return.
    """
    clipped, _, _ = clip_ratio(jnp.exp(log_ratio), eps_low, eps_high)
    return jax.lax.stop_gradient(clipped) * adv * logps


def policy_sapo(*, log_ratio, adv, sapo_tau_pos=1.0, sapo_tau_neg=1.05, **_):
    """SAPO (Soft Adaptive Policy Optimization, Qwen 2025): f_tau(rho) A.

        f_tau(rho) = sigmoid(tau (rho - 1)) * 4 / tau,  tau = tau_pos if A > 0 else tau_neg

    A smooth gate in place of the hard clip: f'(rho) = 4 s (1 - s) with
    s = sigmoid(tau (rho - 1)), which is 1 at rho = 1 (on-policy gradient
    equals the clip's) and decays smoothly as rho leaves 1.
    """
    tau = jnp.where(adv > 0, sapo_tau_pos, sapo_tau_neg).astype(log_ratio.dtype)
    rho = jnp.exp(log_ratio)
    return jax.nn.sigmoid(tau * (rho - 1.0)) * (4.0 / tau) * adv


def _cov_NxT(logps, adv, mask):
    """Per-token centred cross product (Cui et al. 2025, eq. 9), no gradient.

        cov_t = (log pi_t - mean log pi) (A_t - mean A)

    with both means over the batch's valid tokens (A_t is the row's advantage).
    """
    logps, adv = jax.lax.stop_gradient(logps), jax.lax.stop_gradient(adv)
    adv_NxT = jnp.broadcast_to(adv, logps.shape)
    centred_lp = logps - masked_mean(logps, mask)
    centred_a = adv_NxT - masked_mean(adv_NxT, mask)
    return jnp.where(mask > 0, centred_lp * centred_a, 0.0)


def _top_by_rank(score, eligible, mask, frac):
    """The max(1, floor(frac * n_valid)) eligible tokens of highest score; ties by flat index.

    At least one token whenever frac > 0, as in the paper's code: the default
    fraction 2e-4 would otherwise pick nothing below 5000 tokens and switch
    the method off unnoticed. frac = 0 picks none. By rank, not by draw: the
    paper's code takes this top-k for KL-Cov and draws at random for Clip-Cov.
    """
    n_valid = mask.sum()
    k = jnp.where(frac > 0, jnp.maximum(jnp.floor(frac * n_valid), 1.0), 0.0)
    flat = jnp.where(eligible, score, -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return eligible & (rank.reshape(score.shape) < k)


def policy_clip_cov(
    *,
    log_ratio,
    logps,
    adv,
    mask,
    eps_low,
    eps_high,
    dual_clip_c=None,
    cov_frac=2e-4,
    cov_lb=1.0,
    cov_ub=5.0,
    **_,
):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", sec. 4.2).

    The clipped surrogate, except that the gradient of max(1, floor(cov_frac *
    n_valid)) tokens with cov_lb <= cov_t <= cov_ub is detached (their value
    stays in the loss). Tokens the ratio clip already binds (no gradient
    anyway) are not candidates, as in the paper's code. The paper picks at
    random among the candidates; here those of highest cov are taken, so the
    choice is reproducible.
    """
    surrogate = policy_clip(
        log_ratio=log_ratio, adv=adv, eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c
    )
    rho = jnp.exp(log_ratio)
    clipped, _, _ = clip_ratio(rho, eps_low, eps_high)
    clip_binds = clipped * adv < rho * adv
    cov = _cov_NxT(logps, adv, mask)
    band = (mask > 0) & ~clip_binds & (cov >= cov_lb) & (cov <= cov_ub)
    picked = _top_by_rank(cov, band, mask, cov_frac)
    return jnp.where(picked, jax.lax.stop_gradient(surrogate), surrogate)


def policy_kl_cov(*, log_ratio, logps, adv, mask, cov_frac=2e-4, kl_cov_coef=1.0, **_):
    """KL-Cov (Cui et al. 2025, sec. 4.2): rho A - k |log rho| on the top tokens by cov.

        objective_t = rho_t A - k |log rho_t|   for the max(1, floor(cov_frac *
                                               n_valid)) valid tokens of highest cov_t,
        objective_t = rho_t A                   elsewhere.

    As in the paper, there is no ratio clip: the penalty on the high-covariance
    tokens takes its place (epsilon_low/high are ignored). |log rho| is written
    log rho * sg(sign(log rho)), whose derivative is sign(log rho): 0 at
    log rho = 0, where the penalty is minimal (jnp.abs's derivative there is 1,
    a spurious push down on every picked token of an on-policy minibatch).
    """
    rho = jnp.exp(log_ratio)
    cov = _cov_NxT(logps, adv, mask)
    picked = _top_by_rank(cov, mask > 0, mask, cov_frac)
    abs_log_ratio = log_ratio * jax.lax.stop_gradient(jnp.sign(log_ratio))
    return rho * adv - jnp.where(picked, kl_cov_coef * abs_log_ratio, 0.0)


def policy_gmpo(*, log_ratio, adv, mask, eps_low, eps_high, **_):
    """GMPO (Geometric-Mean Policy Optimization, Zhao et al. 2025, eq. 5), one value per row.

        J_i = sgn(A_i) (prod_t |min(rho_t A_i, clip(rho_t, e^-eps_low, e^eps_high) A_i)|)^(1/|o_i|)
            = A_i exp((1/|o_i|) sum_t l_t),
        l_t = min(log rho_t, clip(log rho_t, -eps_low, eps_high))   if A_i > 0
        l_t = max(log rho_t, clip(log rho_t, -eps_low, eps_high))   if A_i < 0

    The clip is on the token log-ratio (the paper uses eps = 0.4 on each
    side); the geometric mean of the token ratios replaces their arithmetic
    mean, so an outlier token ratio moves the sequence term less. Returns the
    per-sequence objective, shape N x 1 (0 for rows without tokens).
    """
    lo = -jnp.inf if eps_low is None else -eps_low
    hi = jnp.inf if eps_high is None else eps_high
    clipped = clip_closed(log_ratio, lo, hi)
    l_t = jnp.where(adv > 0, jnp.minimum(log_ratio, clipped), jnp.maximum(log_ratio, clipped))
    n_tokens = mask.sum(1, keepdims=True)
    mean_l = (l_t * mask).sum(1, keepdims=True) / jnp.maximum(n_tokens, 1.0)
    return jnp.where(n_tokens > 0, adv * jnp.exp(mean_l), 0.0)


# Terms evaluated per sequence (N x 1) rather than per token.
SEQUENCE_POLICY_LOSSES = ("gmpo",)

POLICY_LOSSES: dict[str, Callable[..., jax.Array]] = {
    "clip": policy_clip,
    "cispo": policy_cispo,
    "sapo": policy_sapo,
    "gmpo": policy_gmpo,
    "clip_cov": policy_clip_cov,
    "kl_cov": policy_kl_cov,
}
