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

:func:`grpo_loss` takes these arrays and one :class:`ObjectiveConfig`, the
settings (epsilons, beta, estimators, reduction, ...). It is assembled from
named pieces: :func:`_prepare` (casts, log rho_t), :func:`kl_term` (KL_t), the
ratio, its clip and the policy term (:func:`_token_loss`, or
:func:`_gspo_loss` per sequence), :func:`_aggregate` / :func:`_reduce` (the
reduction) and :func:`_ratio_metrics`. The policy terms that may replace
surrogate_t (CISPO, SAPO, GMPO, Clip-Cov, KL-Cov, dual clip) are in
``grpo_jax.objective.policy_terms``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

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
    ``grpo_jax.objective.logprobs.completion_scores``'s ``chunk_size``: it chunks the LM
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
# Behaviour-policy correction.

BEHAVIOR_CORRECTIONS = ("none", "tis", "mis")
BEHAVIOR_LEVELS = ("token", "sequence")
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
    level: str = "token",
    cap: float = 2.0,
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
# The objective's settings.


def _check_choice(name: str, value, choices: list) -> None:
    if value not in choices:
        raise ValueError(f"{name} {value!r} is not one of {choices}")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """The objective's hyper-parameters: every setting of :func:`grpo_loss`, none of its arrays.

    Frozen and hashable, so it can be a static argument under ``jax.jit``. A
    run builds it from its ``GRPOConfig`` (the ``grpo`` config section) with
    :meth:`from_grpo`; the defaults are the paper's objective (clip 0.2, no
    KL, the "grpo" reduction) and GRPOConfig's.

    Attributes:
      beta: KL weight. 0 adds no KL term (the KL metric is still reported when
        reference log-probs are given).
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
      max_tokens: the constant of "dr_grpo" (None: T, the padded length).
      temperature: the temperature logits given to :func:`grpo_loss` are
        scored at (for the entropy metric).
      policy_loss: a key of ``POLICY_LOSSES``, the per-token policy term
        ("clip" by default, the surrogate of the module doc). "cispo", "sapo",
        "clip_cov" and "kl_cov" replace surrogate_t; "gmpo" is one term per
        sequence and needs reduction "grpo" (mean over rows). Only "clip"
        combines with reduction "gspo". See each ``policy_*`` function and
        docs/objective.md.
      dual_clip_c: c > 1 of dual-clip PPO for A < 0 ("clip", "clip_cov",
        and the "gspo" reduction); None (default) switches it off.
      sapo_tau_pos, sapo_tau_neg: "sapo" temperatures for A > 0 and A < 0.
      cov_frac, cov_lb, cov_ub, kl_cov_coef: "clip_cov"/"kl_cov" parameters:
        fraction of valid tokens picked, Clip-Cov's covariance band, KL-Cov's k.
      behavior_correction, behavior_level, behavior_cap: the correction of
        :func:`behavior_weights` (its ``correction``, ``level`` and ``cap``),
        whose weights :func:`grpo_loss` takes as an array.

    Raises ValueError for an unknown name or a combination the loss does not
    define.
    """

    beta: float = 0.0
    epsilon_low: float | None = 0.2
    epsilon_high: float | None = 0.2
    kl_estimator: str = "k3"
    reduction: str = "grpo"
    max_tokens: int | None = None
    temperature: float = 1.0
    policy_loss: str = "clip"
    dual_clip_c: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cov_frac: float = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    kl_cov_coef: float = 1.0
    behavior_correction: str = "none"
    behavior_level: str = "token"
    behavior_cap: float = 2.0

    def __post_init__(self):
        _check_choice("reduction", self.reduction, list(REDUCTIONS))
        _check_choice("kl_estimator", self.kl_estimator, sorted(KL_ESTIMATORS))
        _check_choice("policy_loss", self.policy_loss, sorted(POLICY_LOSSES))
        if self.reduction == "gspo" and self.policy_loss != "clip":
            raise ValueError(f"reduction 'gspo' needs policy_loss 'clip', not {self.policy_loss!r}")
        if self.policy_loss in SEQUENCE_POLICY_LOSSES and self.reduction != "grpo":
            raise ValueError(
                f"policy_loss {self.policy_loss!r} needs reduction 'grpo', not {self.reduction!r}"
            )
        _check_choice("behavior_correction", self.behavior_correction, list(BEHAVIOR_CORRECTIONS))
        _check_choice("behavior_level", self.behavior_level, list(BEHAVIOR_LEVELS))
        if not self.behavior_cap > 1.0:
            raise ValueError(f"behavior_cap = {self.behavior_cap!r} must be > 1")

    @classmethod
    def from_grpo(cls, grpo) -> ObjectiveConfig:
        """The objective of a run's ``GRPOConfig`` ``grpo`` (the ``grpo`` config section).

        Every field but ``max_tokens`` (left at None: "dr_grpo" divides by the
        padded completion length) is the GRPOConfig field of the same name.
        Read by name, so this module need not import the config's module,
        which sits above it.
        """
        names = [f.name for f in dataclasses.fields(cls) if f.name != "max_tokens"]
        return cls(**{name: getattr(grpo, name) for name in names})

    def policy_options(self) -> dict:
        """The keyword options of the ``policy_*`` terms beyond the clip range."""
        return dict(
            dual_clip_c=self.dual_clip_c,
            sapo_tau_pos=self.sapo_tau_pos,
            sapo_tau_neg=self.sapo_tau_neg,
            cov_frac=self.cov_frac,
            cov_lb=self.cov_lb,
            cov_ub=self.cov_ub,
            kl_cov_coef=self.kl_cov_coef,
        )


# ---------------------------------------------------------------------------
# The loss: prepared terms, the KL term, the ratio and its clip, aggregation, metrics.


def _at_least_f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


class _Terms(NamedTuple):
    """grpo_loss's inputs as the pieces use them (:func:`_prepare`); float32 or wider."""

    logps_NxT: jax.Array  # log pi_theta, the only differentiated input
    mask_NxT: jax.Array
    adv_Nx1: jax.Array
    n_tokens_N: jax.Array  # |o_i|
    log_ratio_NxT: jax.Array  # log rho_t, 0 on padding
    kl_NxT: jax.Array  # KL_t, 0 on padding and without a reference
    behavior_w_NxT: jax.Array | None


def _row_mean(x_NxT, t: _Terms):
    """(1/|o_i|) sum_t x_it per row (0 for a row without tokens)."""
    return (x_NxT * t.mask_NxT).sum(1) / jnp.maximum(t.n_tokens_N, 1.0)


def kl_term(logps_NxT, ref_logps_NxT, mask_NxT, estimator: str = "k3") -> jax.Array:
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
    logps_NxT, old_logps_NxT, advantages_N, mask_NxT, ref_logps_NxT, behavior_weights_NxT, kl
) -> _Terms:
    """Casts (float32 at least), constants and the per-token log-ratio and KL term.

        log rho_t = logp_theta - logp_old   on real tokens, 0 on padding

    pi_old's log-probs, the advantages, the reference and the behaviour
    weights carry no gradient. Zeroing the log-ratio on padding (which may
    hold anything) keeps exp() from overflowing into NaN gradients.
    """
    logps_NxT = _at_least_f32(logps_NxT)
    mask_NxT = mask_NxT.astype(logps_NxT.dtype)
    old_logps_NxT = jax.lax.stop_gradient(old_logps_NxT.astype(logps_NxT.dtype))
    adv_Nx1 = jax.lax.stop_gradient(advantages_N.astype(logps_NxT.dtype))[:, None]
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


def _gspo_loss(t: _Terms, obj: ObjectiveConfig):
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
    loss = -((surrogate_N - obj.beta * kl_N) * has_tokens_N).sum() / jnp.maximum(
        has_tokens_N.sum(), 1.0
    )
    rho_NxT = jnp.broadcast_to(rho_Nx1, t.mask_NxT.shape)
    return loss, (rho_NxT, *_clip_sides(rho_Nx1, adv_Nx1, lo, hi))


def _reduce(objective_NxT, mask_NxT, n_tokens_N, reduction, max_tokens):
    """L from the masked per-token objective, by ``reduction`` (ObjectiveConfig):

    "grpo":       L = -(1/N) sum_i (1/|o_i|) sum_t objective_it
    "token_mean": L = -sum_it objective_it / sum_i |o_i|
    "dr_grpo":    L = -sum_it objective_it / (N max_tokens)
    """
    n_rows = mask_NxT.shape[0]
    if reduction == "grpo":
        per_seq_N = objective_NxT.sum(1) / jnp.maximum(n_tokens_N, 1.0)
        return -per_seq_N.sum() / n_rows
    if reduction == "token_mean":
        return -objective_NxT.sum() / jnp.maximum(mask_NxT.sum(), 1.0)
    # dr_grpo
    denom = mask_NxT.shape[1] if max_tokens is None else max_tokens
    return -objective_NxT.sum() / (n_rows * denom)


def _aggregate(policy, t: _Terms, obj: ObjectiveConfig):
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
    objective_NxT = (policy - obj.beta * t.kl_NxT) * t.mask_NxT
    return _reduce(objective_NxT, t.mask_NxT, t.n_tokens_N, obj.reduction, obj.max_tokens)


def _token_loss(t: _Terms, obj: ObjectiveConfig):
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
        **obj.policy_options(),
    )
    loss = _aggregate(policy, t, obj)
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


def grpo_loss(
    logps_NxT: jax.Array,
    old_logps_NxT: jax.Array,
    advantages_N: jax.Array,
    mask_NxT: jax.Array,
    objective: ObjectiveConfig = ObjectiveConfig(),
    *,
    ref_logps_NxT: jax.Array | None = None,
    logits_NxTxV: jax.Array | None = None,
    entropy_NxT: jax.Array | None = None,
    behavior_weights_NxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss (module doc) with the settings ``objective``, and its monitoring metrics.

    Args:
      logps_NxT: log pi_theta of the completion tokens (differentiated).
      old_logps_NxT: log pi_old, recorded at rollout time (treated as constant).
      advantages_N: one advantage per completion; every token carries it.
      mask_NxT: 1 on real completion tokens.
      objective: the hyper-parameters (:class:`ObjectiveConfig`; a static
        argument under jit).
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

    Returns:
      (loss, metrics) with metrics: clip_frac_low, clip_frac_high, ratio_mean,
      ratio_min, ratio_max (:func:`_ratio_metrics`), kl_mean (when ref given),
      entropy (when logits or entropies are given).
    """
    if objective.beta > 0 and ref_logps_NxT is None:
        raise ValueError("beta > 0 needs ref_logps_NxT (the frozen reference's log-probs)")
    t = _prepare(
        logps_NxT,
        old_logps_NxT,
        advantages_N,
        mask_NxT,
        ref_logps_NxT,
        behavior_weights_NxT,
        objective.kl_estimator,
    )
    piece = _gspo_loss if objective.reduction == "gspo" else _token_loss
    loss, (rho_NxT, low, high) = piece(t, objective)
    metrics = _ratio_metrics(rho_NxT, low, high, t.mask_NxT)
    if ref_logps_NxT is not None:
        metrics["kl_mean"] = jax.lax.stop_gradient(masked_mean(t.kl_NxT, t.mask_NxT))
    if entropy_NxT is None and logits_NxTxV is not None:
        logits_NxTxV = jax.lax.stop_gradient(logits_NxTxV)
        entropy_NxT = token_entropy(logits_NxTxV, temperature=objective.temperature)
    if entropy_NxT is not None:
        metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy_NxT), t.mask_NxT)
    return loss, metrics
