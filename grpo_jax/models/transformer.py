"""The decoder-only transformer, its KV-cache interface and random initialisation.

Shapes: B batch, T tokens of this call, S cache slots, V vocabulary, D width,
L layers, K key/value heads, Dh head width.

The module holds nnx.Param state only, so ``graphdef, params = nnx.split(model)``
and ``nnx.merge(graphdef, params)`` are the pure boundary that jitted code
works across; the config and the sharding layout are static structure.

Masking, the same rule in both entry points: a query in slot i sees key slot j
iff j <= i (causal), j holds a real token (the mask), and, in a sliding-window
layer, i - j < W. With left padding, real tokens are contiguous, so slot
distance equals position distance. A query that sees no key (a left pad)
gets finite garbage, never NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.config import ModelConfig
from grpo_jax.models.layers import Block, RMSNorm, param, randomize_weights
from grpo_jax.models.partitioning import check_layout, constrain, param_shardings
from grpo_jax.models.rope import inv_frequencies, rope_cos_sin


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
    """Positions of a left-padded batch: cumsum(mask) - 1, clipped at 0 (pads get 0)."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def _allowed(q_slot_BxT, kv_mask_BxS, window: int | None) -> jax.Array:
    """allowed[b, t, s] = s <= q_slot[b, t] and kv_mask[b, s] (and q_slot - s < window)."""
    S = kv_mask_BxS.shape[-1]
    s_S = jnp.arange(S, dtype=jnp.int32)
    dist_BxTxS = q_slot_BxT[:, :, None] - s_S[None, None, :]
    allowed = (dist_BxTxS >= 0) & kv_mask_BxS[:, None, :].astype(bool)
    if window is not None:
        allowed &= dist_BxTxS < window
    return allowed


def _block_fn(layout: str, layer: int):
    def apply(block, x, cos, sin, allowed, cache, cache_index):
        return block(x, cos, sin, allowed, layout, cache, cache_index, layer)

    return apply


class Transformer(nnx.Module):
    """Llama / Qwen2 / Qwen3 / Gemma 3 decoder (see :class:`ModelConfig` for the switches).

    Call ``model(tokens_BxT)`` for float32 logits [B, T, V] of a full,
    uncached forward pass; ``init_cache`` and ``forward_with_cache`` serve the
    sampler.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layout: str = "fsdp"):
        check_layout(layout)
        self.config = cfg
        self.layout = layout
        pd = cfg.params_dtype
        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
        self.layers = nnx.List([Block(cfg) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg)
        if not cfg.tie_embeddings:
            self.lm_head = param((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd)
        randomize_weights(self, rngs.params())

    # -- pieces -------------------------------------------------------------

    def _embed(self, tokens_BxT: jax.Array) -> jax.Array:
        cfg, dt = self.config, self.config.compute_dtype
        x_BxTxD = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(dt)
        if cfg.scale_embeddings:  # Gemma: sqrt(D) rounded to the compute dtype, as trained.
            x_BxTxD = x_BxTxD * jnp.asarray(math.sqrt(cfg.hidden_size), dt)
        return constrain(x_BxTxD, ("batch", None, "embed"), self.layout)

    def _logits(self, x_BxTxD: jax.Array) -> jax.Array:
        cfg = self.config
        h_BxTxD = self.final_norm(x_BxTxD)
        if cfg.tie_embeddings:
            w_VxD = self.embed[...].astype(h_BxTxD.dtype)
            logits = jnp.einsum("btd,vd->btv", h_BxTxD, w_VxD, preferred_element_type=jnp.float32)
        else:
            w_DxV = self.lm_head[...].astype(h_BxTxD.dtype)
            logits = jnp.einsum("btd,dv->btv", h_BxTxD, w_DxV, preferred_element_type=jnp.float32)
        if cfg.final_logit_softcap is not None:
            cap = cfg.final_logit_softcap
            logits = cap * jnp.tanh(logits / cap)
        return constrain(logits, ("batch", None, "vocab"), self.layout)

    def _rope_tables(self, positions_BxT: jax.Array):
        """cos/sin per distinct (base, scaling) of the layers, keyed by layer index."""
        cfg, tables, per_layer = self.config, {}, []
        for i in range(cfg.num_layers):
            key = (cfg.rope_base(i), cfg.layer_rope_scaling(i))
            if key not in tables:
                inv_freq = inv_frequencies(cfg.head_dim, *key)
                tables[key] = rope_cos_sin(positions_BxT, inv_freq, cfg.compute_dtype)
            per_layer.append(tables[key])
        return per_layer

    def _run_layers(self, x_BxTxD, positions_BxT, q_slot_BxT, kv_mask_BxS, cache, cache_index):
        cfg = self.config
        rope = self._rope_tables(positions_BxT)
        windows = {cfg.window(i) for i in range(cfg.num_layers)}
        masks = {w: _allowed(q_slot_BxT, kv_mask_BxS, w) for w in windows}
        for i, block in enumerate(self.layers):
            cos, sin = rope[i]
            apply = _block_fn(self.layout, i)
            if cfg.remat:  # Keep only the layer's inputs; recompute its insides for the gradient.
                apply = nnx.remat(apply)
            x_BxTxD, cache = apply(
                block, x_BxTxD, cos, sin, masks[cfg.window(i)], cache, cache_index
            )
        return x_BxTxD, cache

    # -- public API ---------------------------------------------------------

    def __call__(self, tokens_BxT: jax.Array, *, positions_BxT=None, mask_BxT=None) -> jax.Array:
        """Float32 logits [B, T, V] of a causal forward pass without a cache.

        ``mask_BxT`` (bool/0-1) marks real tokens; pad keys are never attended.
        Positions default to cumsum(mask) - 1 clipped at 0 with a mask, to
        0..T-1 without one.
        """
        return self.logits(
            self.features(tokens_BxT, positions_BxT=positions_BxT, mask_BxT=mask_BxT)
        )

    def features(self, tokens_BxT: jax.Array, *, positions_BxT=None, mask_BxT=None) -> jax.Array:
        """The last layer's output [B, T, D], before the final norm: no LM head.

        ``logits(features(...)[:, a:b])`` scores positions a..b-1 only, so a
        caller that needs a few positions' logits never forms the rest.
        """
        B, T = tokens_BxT.shape
        if mask_BxT is None:
            mask_BxT = jnp.ones((B, T), bool)
        if positions_BxT is None:
            positions_BxT = positions_from_mask(mask_BxT)
        slot_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x_BxTxD = self._embed(tokens_BxT)
        x_BxTxD, _ = self._run_layers(x_BxTxD, positions_BxT, slot_BxT, mask_BxT, None, None)
        return x_BxTxD

    def logits(self, x_BxTxD: jax.Array) -> jax.Array:
        """Float32 logits [B, T, V] of :meth:`features` output: final norm, LM head, soft-cap."""
        return self._logits(x_BxTxD)

    def init_cache(self, batch_size: int, max_len: int) -> dict[str, tuple[jax.Array, ...]]:
        """Zeroed KV cache of S = max_len slots in the compute dtype.

        ``{"k": L x [B, K, S, Dh], "v": L x [B, K, Dh, S]}``: tuples of one
        array per layer; head-major, keys slot-major and values
        slot-minor: the layouts the decode step's attention dots read without
        a copy (see :meth:`Attention.__call__`).
        """
        cfg = self.config
        K, Dh, dt = cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype
        layers = range(cfg.num_layers)
        return {
            "k": tuple(jnp.zeros((batch_size, K, max_len, Dh), dt) for _ in layers),
            "v": tuple(jnp.zeros((batch_size, K, Dh, max_len), dt) for _ in layers),
        }

    def forward_with_cache(
        self, tokens_BxT, *, positions_BxT, kv_mask_BxS, cache, cache_index, last_only=False
    ):
        """(float32 logits [B, T, V], updated cache) for T tokens written at slot cache_index.

        ``last_only=True`` returns the logits of the last position only, [B, 1, V]:
        a prefill needs nothing else, and skipping the LM head elsewhere saves
        a [B, T, V] float32 buffer (gigabytes for long prompts and large vocabularies).

        The tokens' keys/values go to slots [cache_index, cache_index + T) of
        every row (cache_index: int32 scalar, may be traced; the caller keeps
        cache_index + T <= S, since XLA clamps an overflowing write).
        ``kv_mask_BxS`` marks the slots that hold real tokens, including this
        call's. A query in slot cache_index + t attends to slot j iff
        j <= cache_index + t and kv_mask[b, j] (and the window, if sliding).
        """
        x_BxTxD, cache = self.features_with_cache(
            tokens_BxT,
            positions_BxT=positions_BxT,
            kv_mask_BxS=kv_mask_BxS,
            cache=cache,
            cache_index=cache_index,
        )
        if last_only:
            x_BxTxD = x_BxTxD[:, -1:]
        return self._logits(x_BxTxD), cache

    def features_with_cache(self, tokens_BxT, *, positions_BxT, kv_mask_BxS, cache, cache_index):
        """(:meth:`features` [B, T, D], updated cache): forward_with_cache without the head."""
        B, T = tokens_BxT.shape
        index = jnp.asarray(cache_index, jnp.int32)
        slot_BxT = jnp.broadcast_to(index + jnp.arange(T, dtype=jnp.int32), (B, T))
        x_BxTxD = self._embed(tokens_BxT)
        return self._run_layers(x_BxTxD, positions_BxT, slot_BxT, kv_mask_BxS, cache, index)


def create_model(
    cfg: ModelConfig, *, seed: int = 0, mesh=None, layout: str = "fsdp"
) -> Transformer:
    """A randomly initialised model (normal(0, 0.02) weights, unit norms, zero biases).

    With a ``mesh`` the parameters are created directly in their ``layout``
    shardings (no full copy on one device); without one, on the default device.
    """
    check_layout(layout)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed), layout=layout))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = None if mesh is None else param_shardings(abstract_state, mesh, layout)

    @jax.jit
    def init():
        return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed), layout=layout))[1]

    if shardings is not None:
        init = jax.jit(init.__wrapped__, out_shardings=shardings)
    return nnx.merge(graphdef, init())
