"""PPO's critic (``grpo.advantage_estimator = "gae"``): a value head on the policy's trunk.

The head is one Dense to a single output, ``V = w . norm(h) + b``, on the features the LM
head reads (the trunk's last layer through the policy's final norm), detached: the value
loss trains the head alone, and the trunk moves by the policy's objective only. Its
parameters are ``TrainState.critic``; the one optimizer updates them with the policy's. Per
step, the update scores the batch's old values once and turns them into GAE targets
(:func:`targets`); each minibatch's loss is the policy term on those per-token advantages plus
the clipped value loss (:func:`combined_loss`). docs/objective.md, section 14.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.core import distributed
from grpo_jax.objective import gae
from grpo_jax.objective.config import GRPOConfig
from grpo_jax.objective.logprobs import completion_features, completion_scores_and_features
from grpo_jax.objective.policy_terms import masked_mean


class Targets(NamedTuple):
    """A step's critic targets, split over rows with the batch (each [N, T] but the last)."""

    advantages_NxT: jax.Array  # GAE, whitened when grpo.whiten_advantages
    returns_NxT: jax.Array  # the value loss's targets
    old_values_NxT: jax.Array  # the values the step started from (the value clip's centre)
    value_mask_NxT: jax.Array  # the loss mask less the rows whose reward is not finite
    policy_on_N: jax.Array  # 0 during the critic's warm-up, else 1 (the same on every row)


def init_head(hidden_size: int, mesh=None) -> dict:
    """A fresh value head, zeros (every value 0 at the start), float32, replicated on ``mesh``.

    D + 1 numbers: replicated, the head and its optimizer moments are sharded alike.
    """
    head = {"w": jnp.zeros((hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    if mesh is None:
        return head
    return distributed.put(head, NamedSharding(mesh, P()))


def head_values(model, head: dict, h_NxTxD: jax.Array) -> jax.Array:
    """V [N, T] from the trunk's features: the final norm (detached), then the head."""
    x_NxTxD = jax.lax.stop_gradient(model.final_norm(h_NxTxD)).astype(jnp.float32)
    return x_NxTxD @ head["w"] + head["b"]


def score(graphdef, params, head, b, temperature, *, chunk_size, group_size, with_entropy):
    """(log-probs, entropies or None, values) [N, T] of batch ``b``'s completions, one pass."""
    logps, ent, model, h = completion_scores_and_features(
        graphdef,
        params,
        b.prompt_tokens_NxP,
        b.prompt_mask_NxP,
        b.tokens_NxT,
        b.mask_NxT,
        temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        group_size=group_size,
    )
    return logps, ent, head_values(model, head, h)


def values(graphdef, params, head, b, *, group_size):
    """V [N, T] of batch ``b``'s completions: the trunk and the head, no LM head."""
    model = nnx.merge(graphdef, params)
    h_NxTxD = completion_features(
        model, b.prompt_tokens_NxP, b.prompt_mask_NxP, b.tokens_NxT, b.mask_NxT, group_size
    )
    return head_values(model, head, h_NxTxD)


def targets(
    objective: GRPOConfig, rewards_N, old_values_NxT, loss_mask_NxT, step
) -> tuple[Targets, dict]:
    """The step's :class:`Targets` and its ``critic/*`` metrics.

    GAE over the loss mask's tokens (padding rows of weight 0 have none), with rows whose
    reward is not finite left out (advantage 0, no value loss), whitened over the whole
    batch when ``grpo.whiten_advantages``. ``step``: the steps taken before this one; the
    policy term is off while it is below ``grpo.critic_warmup_steps``.
    """
    mask_NxT = loss_mask_NxT.astype(jnp.float32) * jnp.isfinite(rewards_N)[:, None]
    old_NxT = jax.lax.stop_gradient(old_values_NxT.astype(jnp.float32))
    adv_NxT, ret_NxT = gae.gae(
        rewards_N, old_NxT, mask_NxT, objective.gae_gamma, objective.gae_lambda
    )
    raw_adv_NxT = adv_NxT
    if objective.whiten_advantages:
        adv_NxT = gae.whiten(adv_NxT, mask_NxT)
    on = (step >= objective.critic_warmup_steps).astype(jnp.float32)
    policy_on_N = jnp.full(rewards_N.shape, on, jnp.float32)
    metrics = {
        "critic/explained_variance": gae.explained_variance(old_NxT, ret_NxT, mask_NxT),
        "critic/value_mean": masked_mean(old_NxT, mask_NxT),
        "critic/return_mean": masked_mean(ret_NxT, mask_NxT),
        "critic/advantage_mean": masked_mean(raw_adv_NxT, mask_NxT),
        "critic/warmup": 1.0 - on,
    }
    return Targets(adv_NxT, ret_NxT, old_NxT, mask_NxT, policy_on_N), metrics


def combined_loss(objective: GRPOConfig, policy_loss, metrics, values_NxT, tg: Targets):
    """(loss, metrics): the policy term (off in the warm-up) plus the weighted value loss,

    L = on * L_policy + value_loss_coef * L_V      (L_V: ``gae.value_loss``)
    """
    value_loss, value_metrics = gae.value_loss(
        values_NxT, tg.old_values_NxT, tg.returns_NxT, tg.value_mask_NxT, objective.value_clip
    )
    on = jnp.max(tg.policy_on_N)
    loss = on * policy_loss + objective.value_loss_coef * value_loss
    stop = jax.lax.stop_gradient
    metrics = dict(
        metrics, **value_metrics, policy_loss=stop(policy_loss), value_loss=stop(value_loss)
    )
    return loss, metrics
