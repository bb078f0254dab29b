"""The KL estimators of the objective's KL_t (docs/objective.md, section 6).

Samples come from pi_theta; each takes (logp_theta, logp_ref) per token. ``KL_ESTIMATORS``
is the registry ``grpo.kl_estimator`` names (``grpo_jax.objective.config``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


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
