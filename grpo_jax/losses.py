"""The GRPO objective: per-token log-probs, ratios, clipping, KL estimators, reductions.

Shapes: N = B*G completion rows, grouped contiguously (G rows per prompt),
T completion tokens (padded), V vocabulary. ``mask_NxT`` is 1 on real
completion tokens and 0 on padding; |o_i| = mask_NxT[i].sum().

Per token (DeepSeekMath, Shao et al. 2024, eq. 3; derived in docs/objective.md):

    rho_t       = exp(logp_theta - logp_old)
    surrogate_t = min(rho_t * A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i)
    objective_t = surrogate_t - beta * KL_t

and the default ("grpo") reduction over one group is

    L = -(1/G) sum_i (1/|o_i|) sum_t objective_it,

averaged over the B groups of a batch (which, all groups having G rows, is
the mean over the N rows of each row's token mean).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# ---------------------------------------------------------------------------
# Log-probs and entropy.


def _scaled_f32(logits: jax.Array, temperature: float) -> jax.Array:
    # Under jit XLA fuses this upcast and division into the reductions that
    # read it, so no float32 copy of [N, T, V] is materialised for bf16 logits.
    return logits.astype(jnp.float32) / temperature


def per_token_logps(
    logits_NxTxV: jax.Array, tokens_NxT: jax.Array, *, temperature: float = 1.0
) -> jax.Array:
    """log softmax(logits / temperature) gathered at ``tokens``, in float32.

        logps[n, t] = z[n, t, tokens[n, t]] - logsumexp_v z[n, t, v],  z = logits / temperature

    ``logits[:, t]`` scores ``tokens[:, t]``: the caller aligns the shift
    (logits at position t-1 predict token t). All three policies (current, old,
    reference) must score with the same ``temperature`` as the sampler used.

    Computed as gathered logit minus logsumexp, never forming the full
    log-softmax. Scoring in chunks of the completion (large vocabularies) is
    ``grpo_jax.scoring.completion_scores``'s ``chunk_size``: it chunks the LM
    head too, so the logits themselves are never whole.
    """
    x_NxTxV = _scaled_f32(logits_NxTxV, temperature)
    picked_NxT = jnp.take_along_axis(x_NxTxV, tokens_NxT[..., None], axis=-1)[..., 0]
    return picked_NxT - jax.nn.logsumexp(x_NxTxV, axis=-1)


def token_entropy(logits_NxTxV: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """Entropy of softmax(logits / temperature) per position, in nats (float32)."""
    x_NxTxV = _scaled_f32(logits_NxTxV, temperature)
    lse_NxT = jax.nn.logsumexp(x_NxTxV, axis=-1)
    p_NxTxV = jnp.exp(x_NxTxV - lse_NxT[..., None])
    return lse_NxT - (p_NxTxV * x_NxTxV).sum(-1)


# ---------------------------------------------------------------------------
# KL estimators. Samples come from pi_theta; all take (logp_theta, logp_ref).


def kl_k1(logps: jax.Array, ref_logps: jax.Array) -> jax.Array:
    """k1 = log pi_theta - log pi_ref (Schulman 2020).

    Unbiased for KL(pi_theta || pi_ref) in value, but useless as a loss: on
    on-policy samples E[grad k1] = E[grad log pi_theta] = 0 (the score
    function has mean zero), so it exerts no pull towards the reference,
    only noise. Also negative on many samples.
    """
    return logps - ref_logps


def kl_k2(logps: jax.Array, ref_logps: jax.Array) -> jax.Array:
    """k2 = (log pi_theta - log pi_ref)^2 / 2: biased, low variance, >= 0.

    As a loss on on-policy samples its expected gradient,
    E[(log pi_theta - log pi_ref) grad log pi_theta], is exactly
    grad KL(pi_theta || pi_ref).
    """
    return 0.5 * (logps - ref_logps) ** 2


def kl_k3(logps: jax.Array, ref_logps: jax.Array) -> jax.Array:
    """k3 = exp(log_ref - log_theta) - (log_ref - log_theta) - 1 (DeepSeekMath eq. 4).

    The default. With r = pi_ref / pi_theta and samples from pi_theta,
    E[r] = 1, so k3 = (r - 1) - log r is unbiased for KL(pi_theta || pi_ref),
    is >= 0 on every sample (x - 1 >= log x), and has far lower variance than
    k1. Why it is the default: it is the estimator the GRPO paper uses, its
    value is never negative and unbiased, and, unlike k1, its gradient pulls
    pi_theta towards pi_ref: as a loss on on-policy samples,
    E[grad k3] = E[(1 - r) grad log pi_theta] = grad KL(pi_ref || pi_theta),
    the reverse KL, which vanishes only at pi_theta = pi_ref.
    """
    log_r = ref_logps - logps
    return jnp.exp(log_r) - log_r - 1.0


def kl_k3_seed(logps: jax.Array, ref_logps: jax.Array) -> jax.Array:
    """The source document's form: exp(log_theta - log_ref) - (log_theta - log_ref) - 1.

    The ratio is inverted relative to k3. With r' = pi_theta / pi_ref and
    samples from pi_theta, E[r'] = 1 + chi^2(pi_theta || pi_ref) and
    E[log r'] = KL(pi_theta || pi_ref), so its expectation is

        chi^2(pi_theta || pi_ref) - KL(pi_theta || pi_ref),

    not the KL: it can be larger or smaller (pi_theta = (0.001, 0.999),
    pi_ref = (0.5, 0.5): KL 0.685, expectation 0.311), and its expected
    gradient is that of chi^2 / 2, which grows fast where pi_theta puts much
    more mass than pi_ref. It is k3 written for samples from pi_ref (under
    which it is unbiased for KL(pi_ref || pi_theta)). Still >= 0 per sample;
    offered for reproducing the source document's formula (docs/objective.md).
    """
    log_r = logps - ref_logps
    return jnp.exp(log_r) - log_r - 1.0


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "k3_seed": kl_k3_seed,
}

REDUCTIONS = ("grpo", "token_mean", "dr_grpo", "gspo")


# ---------------------------------------------------------------------------
# The loss.


def _at_least_f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _clip(rho, epsilon_low, epsilon_high):
    lo = -jnp.inf if epsilon_low is None else 1.0 - epsilon_low
    hi = jnp.inf if epsilon_high is None else 1.0 + epsilon_high
    return jnp.clip(rho, lo, hi), lo, hi


def grpo_loss(
    logps_NxT: jax.Array,
    old_logps_NxT: jax.Array,
    advantages_N: jax.Array,
    mask_NxT: jax.Array,
    *,
    ref_logps_NxT: jax.Array | None = None,
    beta: float = 0.0,
    epsilon_low: float | None = 0.2,
    epsilon_high: float | None = 0.2,
    kl_estimator: str = "k3",
    reduction: str = "grpo",
    max_tokens: int | None = None,
    logits_NxTxV: jax.Array | None = None,
    temperature: float = 1.0,
    entropy_NxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped GRPO loss and its monitoring metrics.

    Args:
      logps_NxT: log pi_theta of the completion tokens (differentiated).
      old_logps_NxT: log pi_old, recorded at rollout time (treated as constant).
      advantages_N: one advantage per completion; every token carries it.
      mask_NxT: 1 on real completion tokens.
      ref_logps_NxT: log pi_ref; required when beta > 0, may be None otherwise.
      beta: KL weight. 0 adds no KL term (the KL metric is still reported when
        ``ref_logps_NxT`` is given).
      epsilon_low, epsilon_high: clip range [1 - eps_low, 1 + eps_high]; None
        switches clipping off on that side.
      kl_estimator: a key of ``KL_ESTIMATORS`` ("k3" by default).
      reduction:
        "grpo": per-sequence token mean, then the mean over sequences (the
          paper and the seed; the default).
        "token_mean": sum over all tokens / number of tokens in the batch (DAPO,
          Yu et al. 2025): long completions weigh in proportion to length.
        "dr_grpo": sum over tokens / (N * max_tokens), a constant normaliser
          (Dr. GRPO, Liu et al. 2025) that removes the length bias of the
          per-sequence mean. ``max_tokens`` defaults to T.
        "gspo": sequence-level ratio s_i = exp(mean_t(logp - old_logp)),
          clipped per sequence (GSPO, Zheng et al. 2025); KL is the token
          mean per sequence.
      max_tokens: the constant of "dr_grpo".
      logits_NxTxV: if given, mean token entropy is reported (no gradient).
      temperature: the temperature ``logits_NxTxV`` is scored at.
      entropy_NxT: per-token entropies computed elsewhere (e.g. chunk by chunk
        with the log-probs); reported instead of ``logits_NxTxV``'s.

    Returns:
      (loss, metrics) with metrics: clip_frac_low, clip_frac_high, ratio_mean,
      ratio_min, ratio_max, kl_mean (when ref given), entropy (when logits or
      entropies are given).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r} is not one of {list(REDUCTIONS)}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator {kl_estimator!r} is not one of {sorted(KL_ESTIMATORS)}")
    if beta > 0 and ref_logps_NxT is None:
        raise ValueError("beta > 0 needs ref_logps_NxT (the frozen reference's log-probs)")

    logps_NxT = _at_least_f32(logps_NxT)
    mask_NxT = mask_NxT.astype(logps_NxT.dtype)
    old_logps_NxT = jax.lax.stop_gradient(old_logps_NxT.astype(logps_NxT.dtype))
    adv_Nx1 = jax.lax.stop_gradient(advantages_N.astype(logps_NxT.dtype))[:, None]
    n_tokens_N = mask_NxT.sum(axis=1)
    # Padding positions may hold anything; zero the log-ratio there so that
    # exp() cannot overflow into NaN gradients.
    log_ratio_NxT = jnp.where(mask_NxT > 0, logps_NxT - old_logps_NxT, 0.0)

    if ref_logps_NxT is not None:
        ref_NxT = jax.lax.stop_gradient(ref_logps_NxT.astype(logps_NxT.dtype))
        ref_NxT = jnp.where(mask_NxT > 0, ref_NxT, logps_NxT)
        kl_NxT = KL_ESTIMATORS[kl_estimator](logps_NxT, ref_NxT)
    else:
        kl_NxT = jnp.zeros_like(logps_NxT)

    if reduction == "gspo":
        seq_log_ratio_Nx1 = (log_ratio_NxT * mask_NxT).sum(1, keepdims=True) / jnp.maximum(
            n_tokens_N[:, None], 1.0
        )
        rho_Nx1 = jnp.exp(seq_log_ratio_Nx1)
        clipped_Nx1, lo, hi = _clip(rho_Nx1, epsilon_low, epsilon_high)
        surrogate_N = jnp.minimum(rho_Nx1 * adv_Nx1, clipped_Nx1 * adv_Nx1)[:, 0]
        kl_N = (kl_NxT * mask_NxT).sum(1) / jnp.maximum(n_tokens_N, 1.0)
        has_tokens_N = (n_tokens_N > 0).astype(jnp.float32)
        loss = -((surrogate_N - beta * kl_N) * has_tokens_N).sum() / jnp.maximum(
            has_tokens_N.sum(), 1.0
        )
        rho_stats_NxT, stats_mask_NxT = jnp.broadcast_to(rho_Nx1, mask_NxT.shape), mask_NxT
        low_NxT = (rho_Nx1 < lo) & (adv_Nx1 < 0)
        high_NxT = (rho_Nx1 > hi) & (adv_Nx1 > 0)
    else:
        rho_NxT = jnp.exp(log_ratio_NxT)
        clipped_NxT, lo, hi = _clip(rho_NxT, epsilon_low, epsilon_high)
        surrogate_NxT = jnp.minimum(rho_NxT * adv_Nx1, clipped_NxT * adv_Nx1)
        objective_NxT = (surrogate_NxT - beta * kl_NxT) * mask_NxT
        n_rows = mask_NxT.shape[0]
        if reduction == "grpo":
            per_seq_N = objective_NxT.sum(1) / jnp.maximum(n_tokens_N, 1.0)
            loss = -per_seq_N.sum() / n_rows
        elif reduction == "token_mean":
            loss = -objective_NxT.sum() / jnp.maximum(mask_NxT.sum(), 1.0)
        else:  # dr_grpo
            denom = mask_NxT.shape[1] if max_tokens is None else max_tokens
            loss = -objective_NxT.sum() / (n_rows * denom)
        rho_stats_NxT, stats_mask_NxT = rho_NxT, mask_NxT
        low_NxT = (rho_NxT < lo) & (adv_Nx1 < 0)
        high_NxT = (rho_NxT > hi) & (adv_Nx1 > 0)

    valid_NxT = stats_mask_NxT > 0
    any_valid = valid_NxT.any()
    metrics = {
        "clip_frac_low": _masked_mean(low_NxT.astype(mask_NxT.dtype), stats_mask_NxT),
        "clip_frac_high": _masked_mean(high_NxT.astype(mask_NxT.dtype), stats_mask_NxT),
        "ratio_mean": _masked_mean(rho_stats_NxT, stats_mask_NxT),
        # 1.0 when no token is real, so an empty batch reports no movement.
        "ratio_min": jnp.where(
            any_valid, jnp.min(jnp.where(valid_NxT, rho_stats_NxT, jnp.inf)), 1.0
        ),
        "ratio_max": jnp.where(
            any_valid, jnp.max(jnp.where(valid_NxT, rho_stats_NxT, -jnp.inf)), 1.0
        ),
    }
    metrics = {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
    if ref_logps_NxT is not None:
        metrics["kl_mean"] = jax.lax.stop_gradient(_masked_mean(kl_NxT, mask_NxT))
    if entropy_NxT is None and logits_NxTxV is not None:
        entropy_NxT = token_entropy(jax.lax.stop_gradient(logits_NxTxV), temperature=temperature)
    if entropy_NxT is not None:
        metrics["entropy"] = _masked_mean(jax.lax.stop_gradient(entropy_NxT), mask_NxT)
    return loss, metrics
