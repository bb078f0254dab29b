"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer"): :func:`apply_rope`.

The half-split pairing of Hugging Face checkpoints, not the paper's interleaved one. The
frequencies are numpy constants derived from the static config at trace time: the model
holds no RoPE state.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """inv_freq [Dh/2] in float32, optionally rescaled (see :class:`RopeScaling`)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    factor = np.float32(scaling.factor)
    lo, hi = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
    old_len = np.float32(scaling.original_max_position_embeddings)
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_cos_sin(
    positions_BxT: jax.Array, inv_freq: np.ndarray, dtype
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, Dh] of the angles p * inv_freq, computed in float32, cast to ``dtype``."""
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BxTxDh = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)
    return jnp.cos(angles_BxTxDh).astype(dtype), jnp.sin(angles_BxTxDh).astype(dtype)


def apply_rope(x_BxTxNxDh: jax.Array, cos_BxTxDh: jax.Array, sin_BxTxDh: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin, broadcast over the heads axis N.

    RoPE (Su et al. 2021, "RoFormer"): for a head vector x of even width Dh split into halves
    (x1, x2) and a position p, with inverse frequencies inv_freq_i = theta^(-2i/Dh),
    i = 0..Dh/2-1, and angle a_i = p * inv_freq_i:

        rope(x, p) = x * cos(a ++ a) + rotate_half(x) * sin(a ++ a),
        rotate_half(x1 ++ x2) = (-x2) ++ x1,

    the half-split pairing of Hugging Face checkpoints, not the paper's interleaved one.
    """
    x1, x2 = jnp.split(x_BxTxNxDh, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_BxTxDh[:, :, None, :], sin_BxTxDh[:, :, None, :]
    return x_BxTxNxDh * cos + rotated * sin
