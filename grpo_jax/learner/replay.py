"""Routing replay's metrics (``grpo.router_replay = "rollout"``; docs/moe.md): how the
policy's own routing differs from the rollout's that its passes replay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models import moe as moe_lib
from grpo_jax.objective.logprobs import completion_logps_and_routes


def own_route_metrics(graphdef, params, batch, mask_NxT, temperature, *, chunk_size, group_size):
    """``moe/*``: one forward pass without replay at ``params``, against the batch's recorded
    routes.

    Over the loss mask's completion tokens whose routes both passes have (a row's last
    token was never fed to the sampler): ``route_flip_frac``, the share of tokens whose
    experts differ in some sparse layer; ``route_flip_layer_frac``, the share of (token,
    sparse layer) pairs; ``abs_log_ratio_unreplayed``, the mean |log pi_own - log pi_old|,
    what the first ratio's log would be without replay; ``expert_load_imbalance``, the
    largest expert's share of the rollout's (token, expert) picks over the mean share
    (1: even), the largest over the sparse layers. NaN when no token counts.
    """
    own_NxT, own_NxTxRxK = completion_logps_and_routes(
        graphdef,
        params,
        batch.prompt_tokens_NxP,
        batch.prompt_mask_NxP,
        batch.tokens_NxT,
        batch.mask_NxT,
        temperature,
        chunk_size=chunk_size,
        group_size=group_size,
    )
    if own_NxTxRxK is None:  # one completion token, never fed by a pass that runs prompts once
        return {}
    return replay_metrics(
        batch.routes_NxSxRxK,
        own_NxTxRxK,
        jax.lax.stop_gradient(own_NxT),
        batch.old_logps_NxT,
        mask_NxT,
        num_experts=nnx.merge(graphdef, params).config.num_experts,
    )


def replay_metrics(routes_NxSxRxK, own_NxTxRxK, own_NxT, old_NxT, mask_NxT, *, num_experts):
    """:func:`own_route_metrics`'s figures from the recorded routes [N, P + T, R, K], the
    policy's own [N, T, R, K] and its log-probs under them, pi_old's and the loss mask."""
    t = own_NxTxRxK.shape[1]
    recorded_NxTxRxK = routes_NxSxRxK[:, -t:].astype(jnp.int32)
    valid_NxT = (mask_NxT > 0) & (recorded_NxTxRxK[..., 0, 0] >= 0) & (own_NxTxRxK[..., 0, 0] >= 0)
    flips_NxTxR = moe_lib.route_flips(own_NxTxRxK, recorded_NxTxRxK) & valid_NxT[..., None]
    tokens = valid_NxT.sum()
    nan_if_none = lambda x: jnp.where(tokens > 0, x, jnp.nan)
    per = lambda x: nan_if_none(x / jnp.maximum(tokens, 1))
    r = own_NxTxRxK.shape[2]
    # Each layer's picks per expert, scattered (a one-hot would be [N, T, R, K, E]); the
    # tokens that do not count go to a last, dropped column.
    ids_NxTxRxK = jnp.where(valid_NxT[..., None, None], recorded_NxTxRxK, num_experts)
    layer_NxTxRxK = jnp.broadcast_to(jnp.arange(r)[:, None], ids_NxTxRxK.shape)
    picks_RxE = jnp.zeros((r, num_experts + 1), jnp.float32)
    picks_RxE = picks_RxE.at[layer_NxTxRxK, ids_NxTxRxK].add(1.0)[:, :num_experts]
    mean_R = picks_RxE.sum(-1) / num_experts
    imbalance = jnp.max(picks_RxE.max(-1) / jnp.maximum(mean_R, 1e-9))
    return {
        "moe/route_flip_frac": per(flips_NxTxR.any(-1).sum()),
        "moe/route_flip_layer_frac": per(flips_NxTxR.sum() / r),
        "moe/abs_log_ratio_unreplayed": per(
            jnp.where(valid_NxT, jnp.abs(own_NxT - old_NxT), 0).sum()
        ),
        "moe/expert_load_imbalance": nan_if_none(imbalance),
    }
