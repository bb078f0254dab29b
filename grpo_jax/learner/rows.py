"""A step's rows split into the update's parts, and the metrics of the parts combined.

Shapes: N rows (B prompts x G, grouped contiguously, split over the batch shards), T
completion length, K parts (micro-batches or updates). Each part draws its rows from every
shard (:func:`split_rows`), so every device works on every part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.core.batch import RolloutBatch


def split_rows(x, num_parts: int, shards: int):
    """[N, ...] -> [num_parts, N / num_parts, ...], each part drawing rows from every shard.

    The batch's leading dimension is split over ``shards`` devices; taking a
    part's rows from every shard (rather than one contiguous slice) keeps
    every device busy on every part.
    """
    n = x.shape[0]
    per = n // (shards * num_parts)
    y = x.reshape(shards, num_parts, per, *x.shape[1:])
    y = jnp.swapaxes(y, 0, 1)
    return y.reshape(num_parts, shards * per, *x.shape[1:])


def join_rows(y, shards: int):
    """[num_parts, M, ...] -> [num_parts M, ...]: the inverse of :func:`split_rows`."""
    num_parts, m = y.shape[:2]
    z = y.reshape(num_parts, shards, m // shards, *y.shape[2:])
    return jnp.swapaxes(z, 0, 1).reshape(num_parts * m, *y.shape[2:])


# grpo_loss's metrics that are means over the loss mask's tokens.
TOKEN_MEANS = (
    "clip_frac_low",
    "clip_frac_high",
    "ratio_mean",
    "kl_mean",
    "entropy",
    "teacher_kl",
    "value_clip_frac",
)


def combine(metrics_K: dict, tokens_K: jax.Array) -> dict:
    """One value per metric from its values over K parts (micro-batches or updates).

    ``tokens_K``: each part's tokens under the loss mask. A token mean is

        sum_k tokens_k v_k / sum_k tokens_k,

    so a part without tokens (rows of weight 0 alone) counts for nothing, and
    with no token at all the mean is NaN: no value this step (the writers, the
    progress line and the health rules skip it), not 0. ``ratio_min`` /
    ``ratio_max``: over the parts with tokens, 1.0 with none (no movement).
    Anything else (loss, grad_norm): the mean over the parts.
    """
    has_K = tokens_K > 0
    total = tokens_K.sum()
    out = {}
    for k, v_K in metrics_K.items():
        if k in TOKEN_MEANS:
            mean = (jnp.where(has_K, v_K, 0.0) * tokens_K).sum() / jnp.where(total > 0, total, 1.0)
            out[k] = jnp.where(total > 0, mean, jnp.nan)
        elif k in ("ratio_min", "ratio_max"):
            reduce, empty = (jnp.min, jnp.inf) if k == "ratio_min" else (jnp.max, -jnp.inf)
            out[k] = jnp.where(has_K.any(), reduce(jnp.where(has_K, v_K, empty)), 1.0)
        else:
            out[k] = v_K.mean()
    return out


def loss_mask(b: RolloutBatch):
    """mask_NxT * weights_N[:, None] (float32): the tokens the loss and the metrics see."""
    return b.mask_NxT * b.weights_N[..., None]


def group_sizes(G: int, n: int, m: int, shards: int, grad_accum: int) -> tuple[int, int]:
    """(g_full, g_micro): G for the whole batch of ``n`` rows / a micro-batch of minibatch
    ``m``, where each shard's block of it holds a multiple of G rows, else 1.

    Groups stay whole and aligned in a part of the batch exactly then
    (``split_rows`` takes blocks); G = 1 scores every row with its own prompt.
    """
    g_full = G if (n // shards) % G == 0 else 1
    g_micro = G if (m // (shards * grad_accum)) % G == 0 else 1
    return g_full, g_micro
