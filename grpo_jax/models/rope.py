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
    if scaling.kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
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


def _yarn(inv_freq: np.ndarray, head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN's blend of inv_freq (extrapolation) and inv_freq / factor (interpolation), in the
    order and precision transformers computes it (:class:`RopeScaling`)."""
    old_len = scaling.original_max_position_embeddings

    def dim_of(turns: float) -> float:  # the dimension whose wavelength makes `turns` in old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # the extrapolated share of each frequency
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = (np.float32(theta) ** exponents).astype(np.float32)
    interpolated = (1.0 / (np.float32(scaling.factor) * pos_freqs)).astype(np.float32)
    return (interpolated * (1 - keep) + inv_freq * keep).astype(np.float32)


def rope_cos_sin(
    positions_BxT: jax.Array, inv_freq: np.ndarray, dtype, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, Dh] of the angles p * inv_freq, computed in float32, times ``scale``
    (YaRN's attention factor), cast to ``dtype``."""
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BxTxDh = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)
    cos, sin = jnp.cos(angles_BxTxDh), jnp.sin(angles_BxTxDh)
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    return cos.astype(dtype), sin.astype(dtype)


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
