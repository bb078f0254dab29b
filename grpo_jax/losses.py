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
# Policy terms. Each returns the per-token objective (to be maximised) before
# the KL term and the reduction; all take the same keyword arguments:
# log_ratio, logps, adv (N x 1), mask, eps_low, eps_high, and the options
# documented in grpo_loss.


def _dual_clip(surrogate, rho, adv, dual_clip_c):
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
    clipped, _, _ = _clip(rho, eps_low, eps_high)
    surrogate = jnp.minimum(rho * adv, clipped * adv)
    return _dual_clip(surrogate, rho, adv, dual_clip_c)


def policy_cispo(*, log_ratio, logps, adv, eps_low, eps_high, **_):
    """CISPO (MiniMax-M1, MiniMax 2025, eq. 4): sg(clip(rho, 1-eps_low, 1+eps_high)) A log pi.

    The importance weight is clipped and detached instead of the update: every
    token keeps the REINFORCE gradient clip(rho) A grad log pi_theta, including
    the tokens PPO's clip would silence. The value is that of the formula (it
    contains log pi_theta), not a surrogate of the return.
    """
    clipped, _, _ = _clip(jnp.exp(log_ratio), eps_low, eps_high)
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
    centred_lp = logps - _masked_mean(logps, mask)
    centred_a = adv_NxT - _masked_mean(adv_NxT, mask)
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
    clipped, _, _ = _clip(rho, eps_low, eps_high)
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
    clipped = _clip_closed(log_ratio, lo, hi)
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
        "behavior/abs_log_diff_mean": _masked_mean(abs_NxT, mask_NxT),
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
        metrics["behavior/frac_capped"] = _masked_mean(cut_NxT.astype(dtype), mask_NxT)
    else:  # mis
        cut_NxT = jnp.abs(log_w_NxT) > log_cap
        w_NxT = jnp.where(cut_NxT, 0.0, jnp.exp(log_w_NxT))
        metrics["behavior/frac_masked"] = _masked_mean(cut_NxT.astype(dtype), mask_NxT)
    w_NxT = jax.lax.stop_gradient(w_NxT * mask_NxT)
    return w_NxT, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------------
# The loss.


def _at_least_f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _clip_closed(x, lo, hi):
    """clip(x, lo, hi) with derivative 1 on the closed range [lo, hi], 0 outside.

    jnp.clip's derivative is 1/2 at an edge. With an epsilon of 0 the on-policy
    point rho = 1 is an edge, and min(rho A, clip(rho) A), which splits a tie
    evenly, would have the gradient 3/4 A there (5/8 A with both epsilons 0);
    with this clip it is A, the policy gradient, as with torch's clamp.
    """
    return jnp.where((x >= lo) & (x <= hi), x, jnp.clip(x, lo, hi))


def _clip(rho, epsilon_low, epsilon_high):
    lo = -jnp.inf if epsilon_low is None else 1.0 - epsilon_low
    hi = jnp.inf if epsilon_high is None else 1.0 + epsilon_high
    return _clip_closed(rho, lo, hi), lo, hi


def _reduce(objective_NxT, mask_NxT, n_tokens_N, reduction, max_tokens):
    n_rows = mask_NxT.shape[0]
    if reduction == "grpo":
        per_seq_N = objective_NxT.sum(1) / jnp.maximum(n_tokens_N, 1.0)
        return -per_seq_N.sum() / n_rows
    if reduction == "token_mean":
        return -objective_NxT.sum() / jnp.maximum(mask_NxT.sum(), 1.0)
    # dr_grpo
    denom = mask_NxT.shape[1] if max_tokens is None else max_tokens
    return -objective_NxT.sum() / (n_rows * denom)


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
    policy_loss: str = "clip",
    dual_clip_c: float | None = None,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    cov_frac: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    kl_cov_coef: float = 1.0,
    behavior_weights_NxT: jax.Array | None = None,
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
      policy_loss: a key of ``POLICY_LOSSES``, the per-token policy term
        ("clip" by default, the surrogate above). "cispo", "sapo", "clip_cov"
        and "kl_cov" replace surrogate_t; "gmpo" is one term per sequence and
        needs reduction "grpo" (mean over rows). Only "clip" combines with
        reduction "gspo". See each ``policy_*`` function and docs/objective.md.
      dual_clip_c: c > 1 of dual-clip PPO for A < 0 ("clip", "clip_cov",
        and the "gspo" reduction); None (default) switches it off.
      sapo_tau_pos, sapo_tau_neg: "sapo" temperatures for A > 0 and A < 0.
      cov_frac, cov_lb, cov_ub, kl_cov_coef: "clip_cov"/"kl_cov" parameters:
        fraction of valid tokens picked, Clip-Cov's covariance band, KL-Cov's k.
      behavior_weights_NxT: importance weights of pi_old against the
        behaviour distribution (:func:`behavior_weights`, no gradient); they
        multiply the policy term of each token (each row's term for "gspo"
        and "gmpo", which need weights constant along a row: level
        "sequence"). None: no correction.

    Returns:
      (loss, metrics) with metrics: clip_frac_low, clip_frac_high, ratio_mean,
      ratio_min, ratio_max, kl_mean (when ref given), entropy (when logits or
      entropies are given).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r} is not one of {list(REDUCTIONS)}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator {kl_estimator!r} is not one of {sorted(KL_ESTIMATORS)}")
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss {policy_loss!r} is not one of {sorted(POLICY_LOSSES)}")
    if reduction == "gspo" and policy_loss != "clip":
        raise ValueError(f"reduction 'gspo' needs policy_loss 'clip', not {policy_loss!r}")
    if policy_loss in SEQUENCE_POLICY_LOSSES and reduction != "grpo":
        raise ValueError(f"policy_loss {policy_loss!r} needs reduction 'grpo', not {reduction!r}")
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

    if behavior_weights_NxT is not None:
        behavior_w_NxT = jax.lax.stop_gradient(behavior_weights_NxT.astype(logps_NxT.dtype))

        def row_weight_N():
            # Rows' weights are constant along the row at level "sequence".
            return (behavior_w_NxT * mask_NxT).sum(1) / jnp.maximum(n_tokens_N, 1.0)

    if reduction == "gspo":
        seq_log_ratio_Nx1 = (log_ratio_NxT * mask_NxT).sum(1, keepdims=True) / jnp.maximum(
            n_tokens_N[:, None], 1.0
        )
        rho_Nx1 = jnp.exp(seq_log_ratio_Nx1)
        clipped_Nx1, lo, hi = _clip(rho_Nx1, epsilon_low, epsilon_high)
        surrogate_N = _dual_clip(
            jnp.minimum(rho_Nx1 * adv_Nx1, clipped_Nx1 * adv_Nx1), rho_Nx1, adv_Nx1, dual_clip_c
        )[:, 0]
        if behavior_weights_NxT is not None:
            surrogate_N = surrogate_N * row_weight_N()
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
        _, lo, hi = _clip(rho_NxT, epsilon_low, epsilon_high)
        surrogate = POLICY_LOSSES[policy_loss](
            log_ratio=log_ratio_NxT,
            logps=logps_NxT,
            adv=adv_Nx1,
            mask=mask_NxT,
            eps_low=epsilon_low,
            eps_high=epsilon_high,
            dual_clip_c=dual_clip_c,
            sapo_tau_pos=sapo_tau_pos,
            sapo_tau_neg=sapo_tau_neg,
            cov_frac=cov_frac,
            cov_lb=cov_lb,
            cov_ub=cov_ub,
            kl_cov_coef=kl_cov_coef,
        )
        n_rows = mask_NxT.shape[0]
        if policy_loss in SEQUENCE_POLICY_LOSSES:
            # One term per row: the KL enters as its token mean over the row.
            kl_N = (kl_NxT * mask_NxT).sum(1) / jnp.maximum(n_tokens_N, 1.0)
            seq_N = surrogate[:, 0]
            if behavior_weights_NxT is not None:
                seq_N = seq_N * row_weight_N()
            loss = -(seq_N - beta * kl_N).sum() / n_rows
        else:
            if behavior_weights_NxT is not None:
                surrogate = surrogate * behavior_w_NxT
            loss = _reduce(
                (surrogate - beta * kl_NxT) * mask_NxT, mask_NxT, n_tokens_N, reduction, max_tokens
            )
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
