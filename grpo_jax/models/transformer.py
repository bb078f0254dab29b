"""The decoder-only transformer, its KV-cache interface and random initialisation.

Shapes: B batch, T tokens of this call, S cache slots, V vocabulary, D width,
L layers, K key/value heads, Dh head width.

The module holds nnx.Param state only: ``nnx.split(model)`` is the pure boundary for jitted
code (docs/models.md). The full pass and the KV-cache calls mask alike (docs/long_context.md,
"model.attention"). With ``cfg.scan_layers`` the layers are one stacked ``Block`` run by a
``jax.lax.scan``, and the KV cache is ``{"k": [B, L, K, S, Dh], "v": [B, L, K, Dh, S]}``
(``grpo_jax.models.stacking`` converts parameters; docs/long_context.md, "model.scan_layers").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.attention import NO_WINDOW, AttnMask, PagedKV
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.layers import Block, RMSNorm, param, randomize_weights
from grpo_jax.models.partitioning import check_layout, constrain, param_shardings
from grpo_jax.models.rope import inv_frequencies, rope_cos_sin
from grpo_jax.models.stacking import stack_layers, unstack_layers

__all__ = [
    "Transformer",
    "create_model",
    "positions_from_mask",
    "stack_layers",  # grpo_jax.models.stacking's, re-exported
    "unstack_layers",
]


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
    """Positions of a left-padded batch: cumsum(mask) - 1, clipped at 0 (pads get 0)."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def _block_fn(layout: str):
    def apply(block, x, cos, sin, mask, cache, cache_index, routes):
        return block(x, cos, sin, mask, layout, cache, cache_index, routes)

    return apply


def _write_back(cache, layer_cache, layer, index, T: int):
    """A scanned model's stacked cache with layer ``layer``'s slots [index, index + T) taken
    from its updated slabs (only this call's T slots are written, in place)."""
    zero = jnp.int32(0)
    k_new = jax.lax.dynamic_slice_in_dim(layer_cache["k"], index, T, axis=2)
    v_new = jax.lax.dynamic_slice_in_dim(layer_cache["v"], index, T, axis=3)
    return {
        "k": jax.lax.dynamic_update_slice(
            cache["k"], k_new[:, None], (zero, layer, zero, index, zero)
        ),
        "v": jax.lax.dynamic_update_slice(
            cache["v"], v_new[:, None], (zero, layer, zero, zero, index)
        ),
    }


def _stack_routes(routes: list) -> jax.Array | None:
    """The sparse layers' routes [B, T, K] each as one [B, T, R, K] array (None: a dense model)."""
    return jnp.stack(routes, axis=2) if routes else None


class Transformer(nnx.Module):
    """Llama / Qwen2 / Qwen3 / Qwen3-MoE / GPT-OSS / Gemma 3 decoder (:class:`ModelConfig`).

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
        if cfg.scan_layers:
            self.layers = Block(cfg, stack=cfg.num_layers)
        else:
            self.layers = nnx.List([Block(cfg, layer=i) for i in range(cfg.num_layers)])
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
        """(cos/sin tables, one per distinct (base, scaling) of the layers; each layer's index)."""
        cfg, keys, tables, kind = self.config, {}, [], []
        for i in range(cfg.num_layers):
            key = (cfg.rope_base(i), cfg.layer_rope_scaling(i))
            if key not in keys:
                keys[key] = len(tables)
                inv_freq = inv_frequencies(cfg.head_dim, *key)
                scale = 1.0 if key[1] is None else key[1].cos_sin_scale
                tables.append(rope_cos_sin(positions_BxT, inv_freq, cfg.compute_dtype, scale))
            kind.append(keys[key])
        return tables, kind

    def _run_layers(
        self,
        x_BxTxD,
        positions_BxT,
        q_slot_BxT,
        kv_mask_BxS,
        cache,
        cache_index,
        q_offset,
        segments=None,
        routes=None,
    ):
        """(output, cache, the experts the sparse layers used [B, T, R, K] or None).

        ``q_offset``: query 0's slot as a Python int, or None; ``segments``: packed rows
        (``grpo_jax.models.attention.Segments``), or None; ``routes`` [B, T, R, K]: the
        sparse layers' experts to use instead of their routers' choice, or None."""
        if self.config.scan_layers:
            return self._scan_layers(
                x_BxTxD,
                positions_BxT,
                q_slot_BxT,
                kv_mask_BxS,
                cache,
                cache_index,
                q_offset,
                segments,
                routes,
            )
        cfg = self.config
        tables, kind = self._rope_tables(positions_BxT)
        sparse, used = cfg.sparse_layers, []
        for i, block in enumerate(self.layers):
            cos, sin = tables[kind[i]]
            mask = AttnMask(q_slot_BxT, kv_mask_BxS, cfg.window(i), q_offset, segments)
            apply = _block_fn(self.layout)
            if cfg.remat:  # Keep only the layer's inputs; recompute its insides for the gradient.
                apply = nnx.remat(apply)
            layer_cache = None if cache is None else {k: v[i] for k, v in cache.items()}
            given = None if routes is None or i not in sparse else routes[:, :, sparse.index(i)]
            x_BxTxD, layer_cache, chosen = apply(
                block, x_BxTxD, cos, sin, mask, layer_cache, cache_index, given
            )
            if chosen is not None:
                used.append(chosen)
            if cache is not None:
                swap = lambda xs, x, i=i: (*xs[:i], x, *xs[i + 1 :])
                cache = {k: swap(cache[k], layer_cache[k]) for k in cache}
        return x_BxTxD, cache, _stack_routes(used)

    def _scan_layers(
        self,
        x_BxTxD,
        positions_BxT,
        q_slot_BxT,
        kv_mask_BxS,
        cache,
        cache_index,
        q_offset,
        segments=None,
        routes=None,
    ):
        """The stacked layers by ``jax.lax.scan``; per-layer window and RoPE table as inputs.
        Every layer is sparse or none is (``ModelConfig`` checks): routes scan with the layers."""
        cfg, layout, L = self.config, self.layout, self.config.num_layers
        tables, kind = self._rope_tables(positions_BxT)
        windows = [cfg.window(i) for i in range(L)]
        xs = {"params": nnx.split(self.layers)[1], "layer": jnp.arange(L, dtype=jnp.int32)}
        if len(tables) > 1:
            xs["kind"] = jnp.asarray(kind, jnp.int32)
            cos_RxBxTxDh = jnp.stack([c for c, _ in tables])
            sin_RxBxTxDh = jnp.stack([s for _, s in tables])
        if routes is not None:
            xs["routes"] = jnp.moveaxis(routes, 2, 0)  # [L, B, T, K]
        if len(set(windows)) > 1:
            xs["window"] = jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)
        block_def = nnx.graphdef(self.layers)
        index = None if cache is None else jnp.asarray(cache_index, jnp.int32)

        def step(carry, xs):
            x_BxTxD, cache = carry
            block = nnx.merge(block_def, xs["params"])
            if "kind" in xs:
                cos, sin = cos_RxBxTxDh[xs["kind"]], sin_RxBxTxDh[xs["kind"]]
            else:
                cos, sin = tables[0]
            window = xs.get("window", windows[0])
            mask = AttnMask(q_slot_BxT, kv_mask_BxS, window, q_offset, segments)
            layer_cache = None
            if cache is not None:  # This layer's slabs [B, K, S, Dh] / [B, K, Dh, S].
                layer_cache = {
                    k: jax.lax.dynamic_index_in_dim(c, xs["layer"], axis=1, keepdims=False)
                    for k, c in cache.items()
                }
            x_BxTxD, layer_cache, chosen = block(
                x_BxTxD, cos, sin, mask, layout, layer_cache, index, xs.get("routes")
            )
            if cache is not None:
                cache = _write_back(cache, layer_cache, xs["layer"], index, x_BxTxD.shape[1])
            return (x_BxTxD, cache), chosen

        if cfg.remat:  # Keep only each layer's input; recompute its insides for the gradient.
            step = jax.checkpoint(step, prevent_cse=False)
        (x_BxTxD, cache), chosen_LxBxTxK = jax.lax.scan(step, (x_BxTxD, cache), xs)
        used = None if chosen_LxBxTxK is None else jnp.moveaxis(chosen_LxBxTxK, 0, 2)
        return x_BxTxD, cache, used

    # -- public API ---------------------------------------------------------

    def __call__(
        self, tokens_BxT: jax.Array, *, positions_BxT=None, mask_BxT=None, routes=None
    ) -> jax.Array:
        """Float32 logits [B, T, V] of a causal forward pass without a cache.

        ``mask_BxT`` (bool/0-1) marks real tokens; pad keys are never attended.
        Positions default to cumsum(mask) - 1 clipped at 0 with a mask, to
        0..T-1 without one. ``routes``: see :meth:`routed_features`.
        """
        return self.logits(
            self.features(tokens_BxT, positions_BxT=positions_BxT, mask_BxT=mask_BxT, routes=routes)
        )

    def features(
        self, tokens_BxT: jax.Array, *, positions_BxT=None, mask_BxT=None, segments=None,
        routes=None,
    ) -> jax.Array:  # fmt: skip
        """The last layer's output [B, T, D], before the final norm: no LM head.

        ``logits(features(...)[:, a:b])`` scores positions a..b-1 only, so a
        caller that needs a few positions' logits never forms the rest.

        ``segments`` (``grpo_jax.models.attention.Segments``): packed rows, several
        sequences one after another in each row, each attending to itself alone; their
        positions (``segments.pos_BxS``) are the RoPE positions and their ids mark the
        real tokens (``mask_BxT`` and ``positions_BxT`` are then not given).
        """
        return self.routed_features(
            tokens_BxT, positions_BxT=positions_BxT, mask_BxT=mask_BxT, segments=segments,
            routes=routes,
        )[0]  # fmt: skip

    def routed_features(
        self, tokens_BxT: jax.Array, *, positions_BxT=None, mask_BxT=None, segments=None,
        routes=None,
    ) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
        """(:meth:`features`, the experts each token's sparse layers used [B, T, R, K] int32).

        R is the number of sparse layers (``ModelConfig.sparse_layers``), K the experts per
        token; None for a dense model. ``routes`` (the same shape) replays a routing: the
        sparse layers use those experts, weighted by their router's probabilities for them
        (routing replay, docs/moe.md).
        """
        B, T = tokens_BxT.shape
        if segments is not None:
            mask_BxT, positions_BxT = segments.id_BxS > 0, segments.pos_BxS
        if mask_BxT is None:
            mask_BxT = jnp.ones((B, T), bool)
        if positions_BxT is None:
            positions_BxT = positions_from_mask(mask_BxT)
        slot_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x_BxTxD = self._embed(tokens_BxT)
        x_BxTxD, _, used = self._run_layers(
            x_BxTxD, positions_BxT, slot_BxT, mask_BxT, None, None, 0, segments, routes
        )
        return x_BxTxD, used

    def logits(self, x_BxTxD: jax.Array) -> jax.Array:
        """Float32 logits [B, T, V] of :meth:`features` output: final norm, LM head, soft-cap."""
        return self._logits(x_BxTxD)

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """Zeroed KV cache of S = max_len slots in the compute dtype.

        ``{"k": L x [B, K, S, Dh], "v": L x [B, K, Dh, S]}``: tuples of one
        array per layer; head-major, keys slot-major and values
        slot-minor: the layouts the decode step's attention dots read without
        a copy (see :meth:`Attention.__call__`). With ``scan_layers`` one
        array per kind with a layer axis after the batch axis:
        ``{"k": [B, L, K, S, Dh], "v": [B, L, K, Dh, S]}``.
        """
        cfg = self.config
        K, Dh, dt = cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype
        layers = range(cfg.num_layers)
        if cfg.scan_layers:
            L = cfg.num_layers
            return {
                "k": jnp.zeros((batch_size, L, K, max_len, Dh), dt),
                "v": jnp.zeros((batch_size, L, K, Dh, max_len), dt),
            }
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

    def features_with_cache(
        self, tokens_BxT, *, positions_BxT, kv_mask_BxS, cache, cache_index, routes_out=False,
        routes=None,
    ):  # fmt: skip
        """(:meth:`features` [B, T, D], updated cache): forward_with_cache without the head.
        ``routes_out``: a third item, the experts the sparse layers used [B, T, R, K] (None
        for a dense model), as :meth:`routed_features` returns them. ``routes`` [B, T, R, K]
        replays a routing, as in :meth:`routed_features`."""
        B, T = tokens_BxT.shape
        # A Python int slot is static: the static-mask kernel (splash) can serve the call.
        q_offset = cache_index if isinstance(cache_index, int) else None
        index = jnp.asarray(cache_index, jnp.int32)
        slot_BxT = jnp.broadcast_to(index + jnp.arange(T, dtype=jnp.int32), (B, T))
        x_BxTxD = self._embed(tokens_BxT)
        x_BxTxD, cache, used = self._run_layers(
            x_BxTxD, positions_BxT, slot_BxT, kv_mask_BxS, cache, index, q_offset, None, routes
        )
        return (x_BxTxD, cache, used) if routes_out else (x_BxTxD, cache)

    def init_pages(self, num_pages: int, page_size: int, local_pages: int = 0) -> dict:
        """A zeroed paged KV cache: ``{"k": L x [pages, Z, K, Dh], "v": the same}`` in
        the compute dtype (:class:`grpo_jax.models.attention.PagedKV`). With
        ``local_pages``, the sliding-window layers' pools have that many pages (their
        own page ids: :meth:`features_paged`'s ``local``)."""
        cfg = self.config

        def pool(i):
            n = local_pages if local_pages and cfg.window(i) is not None else num_pages
            return jnp.zeros((n, page_size, cfg.num_kv_heads, cfg.head_dim), cfg.compute_dtype)

        zeros = lambda: tuple(pool(i) for i in range(cfg.num_layers))
        return {"k": zeros(), "v": zeros()}

    def features_paged(
        self, tokens_BxT, *, positions_BxT, pages, write, table_BxN, pos_BxS, local=None,
        routes_out=False,
    ):  # fmt: skip
        """(:meth:`features` [B, T, D], updated pages) of T tokens per row over a paged cache.

        Token t of row b is stored at (page, slot) ``write[0][b * T + t]``,
        ``write[1][b * T + t]`` of every layer and attends over the pages
        ``table_BxN[b]``, whose slots hold the tokens at positions
        ``pos_BxS[b]``: those up to its own position (and within the window
        of a sliding-window layer) are visible; ``pages`` as
        :meth:`init_pages`. ``local``: (write pages, block tables) of the
        sliding-window layers when their pools have page ids of their own
        (the same slots and positions; a page out of every row's window may be
        gone from them). Attention is the gather-based einsum path
        (``grpo_jax.models.attention.paged_attention``), or with ``cfg.attention``
        "splash" and one token per row the Pallas paged decode kernel
        (``paged_decode_attention``; on a mesh under ``shard_map``). ``routes_out``: a
        third item, the experts the sparse layers used [B, T, R, K] (None for a dense
        model), as :meth:`features_with_cache` returns them.
        """
        cfg = self.config
        if cfg.scan_layers:
            raise ValueError(
                "the paged KV cache needs unscanned layers (model.scan_layers = False)"
            )
        tables, kind = self._rope_tables(positions_BxT)
        x_BxTxD = self._embed(tokens_BxT)
        ks, vs, used = [], [], []
        for i, block in enumerate(self.layers):
            cos, sin = tables[kind[i]]
            # The queries' positions and the window; the keys' visibility is by pos_BxS.
            mask = AttnMask(positions_BxT, None, cfg.window(i), None)
            page_M, table = write[0], table_BxN
            if local is not None and cfg.window(i) is not None:
                page_M, table = local
            pool = PagedKV(pages["k"][i], pages["v"][i], page_M, write[1], table, pos_BxS)
            x_BxTxD, pool, chosen = block(x_BxTxD, cos, sin, mask, self.layout, pool, None)
            if chosen is not None:
                used.append(chosen)
            ks.append(pool.k)
            vs.append(pool.v)
        pages = {"k": tuple(ks), "v": tuple(vs)}
        return (x_BxTxD, pages, _stack_routes(used)) if routes_out else (x_BxTxD, pages)


def create_model(
    cfg: ModelConfig, *, seed: int = 0, mesh=None, layout: str = "fsdp"
) -> Transformer:
    """A randomly initialised model (normal(0, 0.02) weights, unit norms, zero biases).

    With a ``mesh`` the parameters are created directly in their ``layout``
    shardings (no full copy on one device); without one, on the default device.
    A scanned model (``cfg.scan_layers``) gets the same weights as the
    unrolled one of the same seed, stacked.
    """
    check_layout(layout)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed), layout=layout))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = None if mesh is None else param_shardings(abstract_state, mesh, layout)
    unrolled = cfg.replace(scan_layers=False)

    @jax.jit
    def init():
        state = nnx.split(Transformer(unrolled, rngs=nnx.Rngs(seed), layout=layout))[1]
        return stack_layers(state, cfg.num_layers) if cfg.scan_layers else state

    if shardings is not None:
        init = jax.jit(init.__wrapped__, out_shardings=shardings)
    return nnx.merge(graphdef, init())
