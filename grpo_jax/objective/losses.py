"""The GRPO objective: per-token log-probs, ratios, clipping, the KL term, reductions.

Shapes: N = B*G completion rows, grouped contiguously (G rows per prompt), T completion tokens
(padded), V vocabulary; ``mask_NxT`` is 1 on real completion tokens, |o_i| its row's sum.
Per token (DeepSeekMath, Shao et al. 2024, eq. 3; derived in docs/objective.md),

    objective_t = min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i) - beta KL_t,

rho_t = exp(logp_theta - logp_old); the default ("grpo") loss is L = -(1/N) sum_i (1/|o_i|)
sum_t objective_it; the other policy terms are in ``policy_terms.py``, KL estimators in ``kl.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.objective.config import BEHAVIOR_CORRECTIONS, BEHAVIOR_LEVELS, GRPOConfig
from grpo_jax.objective.kl import KL_ESTIMATORS
from grpo_jax.objective.policy_terms import (
    POLICY_LOSSES,
    SEQUENCE_POLICY_LOSSES,
    clip_bounds,
    clip_ratio,
    dual_clip,
    masked_mean,
)

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
    ``grpo_jax.objective.logprobs.completion_logps_and_entropy``'s ``chunk_size``: it chunks the LM
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
# Behaviour-policy correction.

# |log w| is clamped here before exp(): a sequence's summed log-ratio can be
# large, and exp(88) already overflows float32. Weights this far out are
# capped (tis) or masked (mis) anyway for any sensible cap.
_LOG_W_BOUND = 20.0


def behavior_weights(
    old_logps_NxT: jax.Array,
    behavior_logps_NxT: jax.Array,
    mask_NxT: jax.Array,
    *,
    correction: str,
    level: str,
    cap: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Importance weights of pi_old against the behaviour distribution q, and their metrics.

    The sampler draws from q (pi_old at the sampling temperature after top-k /
    top-p / min-p truncation, computed at the sampler's precision) while the
    objective is an expectation under pi_old. With w = pi_old / q per token
    ("token") or the product over a row's tokens ("sequence"):

        "none": w = 1 (no correction)
        "tis":  min(w, C)                          truncated IS (Ionides 2008;
                                                   Yao et al. 2025 for LLM RL)
        "mis":  w * 1[1/C <= w <= C]               masked IS: tokens (or rows)
                                                   whose weight leaves the band
                                                   get weight 0

    The weights multiply the per-token policy term (never the KL term) and
    carry no gradient. Returns (weights_NxT, metrics); weights are 0 on
    masked positions. Metrics: behavior/abs_log_diff_mean and _max, the
    per-token |log pi_old - log q| over real tokens; behavior/frac_capped
    ("tis") or behavior/frac_masked ("mis"), the fraction of real tokens whose
    weight was cut (for "sequence", a row's tokens count with their row).
    """
    if correction not in BEHAVIOR_CORRECTIONS:
        raise ValueError(f"correction {correction!r} is not one of {list(BEHAVIOR_CORRECTIONS)}")
    if level not in BEHAVIOR_LEVELS:
        raise ValueError(f"level {level!r} is not one of {list(BEHAVIOR_LEVELS)}")
    if not cap > 1.0:
        raise ValueError(f"cap = {cap!r} must be > 1")
    old_logps_NxT = _at_least_f32(old_logps_NxT)
    dtype = old_logps_NxT.dtype
    mask_NxT = mask_NxT.astype(dtype)
    valid_NxT = mask_NxT > 0
    diff_NxT = jnp.where(valid_NxT, old_logps_NxT - behavior_logps_NxT.astype(dtype), 0.0)
    abs_NxT = jnp.abs(diff_NxT)
    metrics = {
        "behavior/abs_log_diff_mean": masked_mean(abs_NxT, mask_NxT),
        "behavior/abs_log_diff_max": jnp.max(jnp.where(valid_NxT, abs_NxT, 0.0)),
    }
    if correction == "none":
        return mask_NxT, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
    if level == "sequence":
        log_w_NxT = jnp.broadcast_to(diff_NxT.sum(axis=1, keepdims=True), diff_NxT.shape)
    else:
        log_w_NxT = diff_NxT
    log_w_NxT = jnp.clip(log_w_NxT, -_LOG_W_BOUND, _LOG_W_BOUND)
    log_cap = jnp.log(jnp.asarray(cap, dtype))
    if correction == "tis":
        cut_NxT = log_w_NxT > log_cap
        w_NxT = jnp.exp(jnp.minimum(log_w_NxT, log_cap))
        metrics["behavior/frac_capped"] = masked_mean(cut_NxT.astype(dtype), mask_NxT)
    else:  # mis
        cut_NxT = jnp.abs(log_w_NxT) > log_cap
        w_NxT = jnp.where(cut_NxT, 0.0, jnp.exp(log_w_NxT))
        metrics["behavior/frac_masked"] = masked_mean(cut_NxT.astype(dtype), mask_NxT)
    w_NxT = jax.lax.stop_gradient(w_NxT * mask_NxT)
    return w_NxT, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------------
# The loss: prepared terms, the KL term, the ratio and its clip, aggregation, metrics.


def _at_least_f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


class Whole(NamedTuple):
    """The counts of a whole minibatch whose loss is summed from calls on parts of it.

    A packed micro-batch's call sees the minibatch's rows with a mask on its own tokens
    (``grpo_jax.learner.update``); its loss divides by these, so that the calls' losses
    add up to the minibatch's: ``tokens`` its real tokens ("token_mean"), ``rows`` its
    rows with at least one ("gspo"). The other reductions divide by the row count N
    (the mask's rows) or N T_max, the same for every call.
    """

    tokens: jax.Array
    rows: jax.Array


class _Terms(NamedTuple):
    """grpo_loss's inputs as the pieces use them (:func:`_prepare`); float32 or wider."""

    logps_NxT: jax.Array  # log pi_theta, the only differentiated input
    mask_NxT: jax.Array
    adv_Nx1: jax.Array
    n_tokens_N: jax.Array  # |o_i|
    log_ratio_NxT: jax.Array  # log rho_t, 0 on padding
    kl_NxT: jax.Array  # KL_t, 0 on padding and without a reference
    behavior_w_NxT: jax.Array | None
    penalty_NxT: jax.Array | None = None  # a weighted per-token penalty (a teacher's KL)


def _row_mean(x_NxT, t: _Terms):
    """(1/|o_i|) sum_t x_it per row (0 for a row without tokens)."""
    return (x_NxT * t.mask_NxT).sum(1) / jnp.maximum(t.n_tokens_N, 1.0)


def kl_term(logps_NxT, ref_logps_NxT, mask_NxT, estimator: str) -> jax.Array:
    """The objective's KL_t: ``KL_ESTIMATORS[estimator](logp_theta, logp_ref)`` per token.

    logp_ref carries no gradient and is replaced by logp_theta on padding, so
    KL_t = 0 there whatever the reference scored (every estimator is 0 at
    logp_theta = logp_ref). Without a reference (None) KL_t = 0.
    """
    if ref_logps_NxT is None:
        return jnp.zeros_like(logps_NxT)
    ref_NxT = jax.lax.stop_gradient(ref_logps_NxT.astype(logps_NxT.dtype))
    ref_NxT = jnp.where(mask_NxT > 0, ref_NxT, logps_NxT)
    return KL_ESTIMATORS[estimator](logps_NxT, ref_NxT)


def _prepare(
    logps_NxT,
    old_logps_NxT,
    advantages_N,
    mask_NxT,
    ref_logps_NxT,
    behavior_weights_NxT,
    kl,
    distill_adv_NxT=None,
) -> _Terms:
    """Casts (float32 at least), constants and the per-token log-ratio and KL term.

        log rho_t = logp_theta - logp_old   on real tokens, 0 on padding

    pi_old's log-probs, the advantages, the reference and the behaviour
    weights carry no gradient. Zeroing the log-ratio on padding (which may
    hold anything) keeps exp() from overflowing into NaN gradients. With a
    per-token distillation term D_it the advantage is A_i + D_it ([N, T]).
    """
    logps_NxT = _at_least_f32(logps_NxT)
    mask_NxT = mask_NxT.astype(logps_NxT.dtype)
    old_logps_NxT = jax.lax.stop_gradient(old_logps_NxT.astype(logps_NxT.dtype))
    adv_Nx1 = jax.lax.stop_gradient(advantages_N.astype(logps_NxT.dtype))
    if adv_Nx1.ndim == 1:  # one per row; [N, T] (GAE) is one per token
        adv_Nx1 = adv_Nx1[:, None]
    if distill_adv_NxT is not None:
        adv_Nx1 = adv_Nx1 + jax.lax.stop_gradient(distill_adv_NxT.astype(logps_NxT.dtype))
    n_tokens_N = mask_NxT.sum(axis=1)
    log_ratio_NxT = jnp.where(mask_NxT > 0, logps_NxT - old_logps_NxT, 0.0)
    kl_NxT = kl_term(logps_NxT, ref_logps_NxT, mask_NxT, kl)
    behavior_w_NxT = None
    if behavior_weights_NxT is not None:
        behavior_w_NxT = jax.lax.stop_gradient(behavior_weights_NxT.astype(logps_NxT.dtype))
    return _Terms(logps_NxT, mask_NxT, adv_Nx1, n_tokens_N, log_ratio_NxT, kl_NxT, behavior_w_NxT)


def _clip_sides(rho, adv, lo, hi):
    """The tokens the clip binds, below (rho < lo, A < 0) and above (rho > hi, A > 0)."""
    return (rho < lo) & (adv < 0), (rho > hi) & (adv > 0)


def _gspo_loss(t: _Terms, obj: GRPOConfig, whole: Whole | None = None):
    """GSPO (Zheng et al. 2025): the ratio and its clip per sequence, then the row mean.

        s_i = exp((1/|o_i|) sum_t log rho_it)
        J_i = w_i max(min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), c A_i)
              - beta (1/|o_i|) sum_t KL_it
        L   = -(1/N') sum_{i: |o_i| > 0} J_i,   N' = #rows with tokens

    (the max with c A_i only with dual clip and A_i < 0; w_i the row's
    behaviour weight, constant along the row, 1 without correction).
    Returns (loss, (rho, low, high)): s_i broadcast over the row's tokens and
    the rows the clip binds, for the metrics.
    """
    adv_Nx1 = t.adv_Nx1
    seq_log_ratio_Nx1 = (t.log_ratio_NxT * t.mask_NxT).sum(1, keepdims=True) / jnp.maximum(
        t.n_tokens_N[:, None], 1.0
    )
    rho_Nx1 = jnp.exp(seq_log_ratio_Nx1)
    clipped_Nx1, lo, hi = clip_ratio(rho_Nx1, obj.epsilon_low, obj.epsilon_high)
    surrogate_N = dual_clip(
        jnp.minimum(rho_Nx1 * adv_Nx1, clipped_Nx1 * adv_Nx1), rho_Nx1, adv_Nx1, obj.dual_clip_c
    )[:, 0]
    if t.behavior_w_NxT is not None:
        surrogate_N = surrogate_N * _row_mean(t.behavior_w_NxT, t)
    kl_N = _row_mean(t.kl_NxT, t)
    has_tokens_N = (t.n_tokens_N > 0).astype(jnp.float32)
    rows = has_tokens_N.sum() if whole is None else whole.rows
    loss = -((surrogate_N - obj.beta * kl_N) * has_tokens_N).sum() / jnp.maximum(rows, 1.0)
    rho_NxT = jnp.broadcast_to(rho_Nx1, t.mask_NxT.shape)
    return loss, (rho_NxT, *_clip_sides(rho_Nx1, adv_Nx1, lo, hi))


def _reduce(objective_NxT, mask_NxT, n_tokens_N, reduction, max_tokens, whole=None):
    """L from the masked per-token objective, by ``reduction`` (``grpo.reduction``):

    "grpo":       L = -(1/N) sum_i (1/|o_i|) sum_t objective_it
    "token_mean": L = -sum_it objective_it / sum_i |o_i|   (``whole.tokens`` when given)
    "dr_grpo":    L = -sum_it objective_it / (N max_tokens)
    """
    n_rows = mask_NxT.shape[0]
    if reduction == "grpo":
        per_seq_N = objective_NxT.sum(1) / jnp.maximum(n_tokens_N, 1.0)
        return -per_seq_N.sum() / n_rows
    if reduction == "token_mean":
        tokens = mask_NxT.sum() if whole is None else whole.tokens
        return -objective_NxT.sum() / jnp.maximum(tokens, 1.0)
    # dr_grpo
    denom = mask_NxT.shape[1] if max_tokens is None else max_tokens
    return -objective_NxT.sum() / (n_rows * denom)


def _aggregate(policy, t: _Terms, obj: GRPOConfig, max_tokens: int | None, whole=None):
    """The loss from the policy term: weighted, minus beta KL, reduced.

    Per token: objective_t = w_t policy_t - beta KL_t, reduced by :func:`_reduce`.
    A sequence term ("gmpo", N x 1): J_i = w_i policy_i - beta (1/|o_i|) sum_t KL_it
    and L = -(1/N) sum_i J_i. w is the behaviour weight (1 without correction;
    a row's, constant along it, for a sequence term).
    """
    if obj.policy_loss in SEQUENCE_POLICY_LOSSES:
        kl_N = _row_mean(t.kl_NxT, t)
        seq_N = policy[:, 0]
        if t.behavior_w_NxT is not None:
            seq_N = seq_N * _row_mean(t.behavior_w_NxT, t)
        return -(seq_N - obj.beta * kl_N).sum() / t.mask_NxT.shape[0]
    if t.behavior_w_NxT is not None:
        policy = policy * t.behavior_w_NxT
    objective_NxT = policy - obj.beta * t.kl_NxT
    if t.penalty_NxT is not None:
        objective_NxT = objective_NxT - t.penalty_NxT
    objective_NxT = objective_NxT * t.mask_NxT
    return _reduce(objective_NxT, t.mask_NxT, t.n_tokens_N, obj.reduction, max_tokens, whole)


def _policy_options(objective: GRPOConfig) -> dict:
    """The keyword options of the ``policy_*`` terms beyond the clip range."""
    return dict(
        dual_clip_c=objective.dual_clip_c,
        sapo_tau_pos=objective.sapo_tau_pos,
        sapo_tau_neg=objective.sapo_tau_neg,
        cov_frac=objective.cov_frac,
        cov_lb=objective.cov_lb,
        cov_ub=objective.cov_ub,
        kl_cov_coef=objective.kl_cov_coef,
    )


def _token_loss(t: _Terms, obj: GRPOConfig, max_tokens: int | None, whole=None):
    """The per-token ratio rho_t = exp(log rho_t), the policy term, and its aggregation.

    The policy term is ``POLICY_LOSSES[obj.policy_loss]`` (the clipped
    surrogate by default; see the ``policy_*`` functions). Returns (loss,
    (rho, low, high)): rho_t and the tokens the clip [1 - eps_low,
    1 + eps_high] binds, for the metrics (whether or not the term clips).
    """
    rho_NxT = jnp.exp(t.log_ratio_NxT)
    lo, hi = clip_bounds(obj.epsilon_low, obj.epsilon_high)
    policy = POLICY_LOSSES[obj.policy_loss](
        log_ratio=t.log_ratio_NxT,
        logps=t.logps_NxT,
        adv=t.adv_Nx1,
        mask=t.mask_NxT,
        eps_low=obj.epsilon_low,
        eps_high=obj.epsilon_high,
        **_policy_options(obj),
    )
    loss = _aggregate(policy, t, obj, max_tokens, whole)
    return loss, (rho_NxT, *_clip_sides(rho_NxT, t.adv_Nx1, lo, hi))


def _ratio_metrics(rho_NxT, low, high, mask_NxT) -> dict[str, jax.Array]:
    """clip_frac_low/high, ratio_mean (token means of the clip sides and rho), ratio_min/max.

    ratio_min and ratio_max are over the real tokens, 1.0 when there is none
    (an empty batch reports no movement). No gradient.
    """
    valid_NxT = mask_NxT > 0
    any_valid = valid_NxT.any()
    metrics = {
        "clip_frac_low": masked_mean(low.astype(mask_NxT.dtype), mask_NxT),
        "clip_frac_high": masked_mean(high.astype(mask_NxT.dtype), mask_NxT),
        "ratio_mean": masked_mean(rho_NxT, mask_NxT),
        "ratio_min": jnp.where(any_valid, jnp.min(jnp.where(valid_NxT, rho_NxT, jnp.inf)), 1.0),
        "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(valid_NxT, rho_NxT, -jnp.inf)), 1.0),
    }
    return {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}


_DEFAULTS = GRPOConfig()  # the paper's objective: clip 0.2, no KL, the "grpo" reduction


def grpo_loss(
    logps_NxT: jax.Array,
    old_logps_NxT: jax.Array,
    advantages_N: jax.Array,
    mask_NxT: jax.Array,
    objective: GRPOConfig = _DEFAULTS,
    *,
    max_tokens: int | None = None,
    ref_logps_NxT: jax.Array | None = None,
    logits_NxTxV: jax.Array | None = None,
    entropy_NxT: jax.Array | None = None,
    behavior_weights_NxT: jax.Array | None = None,
    whole: Whole | None = None,
    distill_adv_NxT: jax.Array | None = None,
    penalty_NxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss (module doc) with the settings ``objective``, and its monitoring metrics.

    Args:
      logps_NxT: log pi_theta of the completion tokens (differentiated).
      old_logps_NxT: log pi_old, recorded at rollout time (treated as constant).
      advantages_N: one advantage per completion, which every token carries; or [N, T],
        one per token (GAE, ``grpo.advantage_estimator = "gae"``: per-token terms only).
      mask_NxT: 1 on real completion tokens.
      objective: the settings, a ``GRPOConfig`` (frozen and hashable: a static
        argument under jit); the loss reads its objective's fields, not ``G``,
        ``mu``, the advantage estimator or ``old_logps``.
      max_tokens: the constant of the "dr_grpo" reduction (None: T, the padded
        completion length, as a run uses it).
      ref_logps_NxT: log pi_ref; required when ``objective.beta`` > 0, may be
        None otherwise.
      logits_NxTxV: if given, mean token entropy is reported (no gradient),
        scored at ``objective.temperature``.
      entropy_NxT: per-token entropies computed elsewhere (e.g. chunk by chunk
        with the log-probs); reported instead of ``logits_NxTxV``'s.
      behavior_weights_NxT: importance weights of pi_old against the
        behaviour distribution (:func:`behavior_weights`, no gradient); they
        multiply the policy term of each token (each row's term for "gspo"
        and "gmpo", which need weights constant along a row: level
        "sequence"). None: no correction.
      whole: when ``mask_NxT`` holds one part of a minibatch (:class:`Whole`), the
        minibatch's counts; the parts' losses then add up to the minibatch's. The
        Clip-Cov and KL-Cov picks and the metrics are over this call's tokens.
      distill_adv_NxT: a per-token advantage term added to each token's A_i (on-policy
        distillation, ``grpo_jax.objective.distill``; no gradient); per-token objectives
        only. None: every token carries its row's advantage.
      penalty_NxT: a weighted per-token penalty subtracted from each token's objective
        beside beta KL_t, differentiated (a teacher's full-vocabulary KL,
        ``grpo_jax.objective.distill.full_reverse_kl``); per-token objectives only.

    Returns:
      (loss, metrics) with metrics: clip_frac_low, clip_frac_high, ratio_mean,
      ratio_min, ratio_max (:func:`_ratio_metrics`), kl_mean (when ref given),
      entropy (when logits or entropies are given).
    """
    if objective.beta > 0 and ref_logps_NxT is None:
        raise ValueError("beta > 0 needs ref_logps_NxT (the frozen reference's log-probs)")
    sequence = objective.reduction == "gspo" or objective.policy_loss in SEQUENCE_POLICY_LOSSES
    if (distill_adv_NxT is not None or penalty_NxT is not None) and sequence:
        raise ValueError("a per-token advantage term needs a per-token objective, not gspo or gmpo")
    t = _prepare(
        logps_NxT,
        old_logps_NxT,
        advantages_N,
        mask_NxT,
        ref_logps_NxT,
        behavior_weights_NxT,
        objective.kl_estimator,
        distill_adv_NxT,
    )
    if penalty_NxT is not None:
        t = t._replace(penalty_NxT=_at_least_f32(penalty_NxT))
    if objective.reduction == "gspo":
        loss, (rho_NxT, low, high) = _gspo_loss(t, objective, whole)
    else:
        loss, (rho_NxT, low, high) = _token_loss(t, objective, max_tokens, whole)
    metrics = _ratio_metrics(rho_NxT, low, high, t.mask_NxT)
    if ref_logps_NxT is not None:
        metrics["kl_mean"] = jax.lax.stop_gradient(masked_mean(t.kl_NxT, t.mask_NxT))
    if entropy_NxT is None and logits_NxTxV is not None:
        logits_NxTxV = jax.lax.stop_gradient(logits_NxTxV)
        entropy_NxT = token_entropy(logits_NxTxV, temperature=objective.temperature)
    if entropy_NxT is not None:
        metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy_NxT), t.mask_NxT)
    return loss, metrics
