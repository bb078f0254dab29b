"""Building blocks of the decoder: RMSNorm, grouped-query attention, gated MLP, the block.

Shapes: B batch, T query tokens, S key slots (T without a cache, the cache
length with one), D model width, H query heads, K key/value heads, G = H / K
query heads per KV head, Dh head width, F MLP width.

Parameters are stored in ``param_dtype`` and cast to the compute ``dtype`` at
use; attention scores and softmax are float32. Each parameter carries its
logical axes (see ``grpo_jax.models.partitioning``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import grpo_jax.models.attention as attn_lib
import grpo_jax.models.lora as lora
import grpo_jax.models.moe as moe_lib
from grpo_jax.core.sharding import MESH_AXES, logical_to_spec
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.partitioning import constrain, fit_spec
from grpo_jax.models.rope import apply_rope


def param(shape, axes, dtype, init: str = "zeros", stack: int = 0):
    """An ``nnx.Param`` with logical-axis metadata, filled with zeros or ones.

    Weight matrices start as zeros here; the Transformer then draws all of
    them at once (``randomize_weights``), which compiles far faster than one
    random-number kernel per matrix. ``stack`` = L > 0 gives the parameter a
    leading [L] axis named "layers" (the stacked layers of a scanned model).
    """
    fill = jnp.ones if init == "ones" else jnp.zeros
    if stack:
        shape, axes = (stack, *shape), ("layers", *axes)
    return nnx.Param(fill(shape, dtype), logical_axes=tuple(axes))


WEIGHT_NAMES = (
    "embed",
    "lm_head",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "router",
    "gate_up_experts",
    "gate_experts",
    "up_experts",
    "down_experts",
)


def randomize_weights(module: nnx.Module, key: jax.Array, std: float = 0.02) -> None:
    """Sets every weight matrix (by name, ``WEIGHT_NAMES``) of ``module`` to normal(0, std).

    One flat normal draw, sliced among the matrices: a single RNG kernel
    however deep the model (XLA:CPU compiles one threefry per draw, slowly
    for high-rank shapes).
    """
    weights = [
        node
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Param) and path and path[-1] in WEIGHT_NAMES
    ]
    sizes = [math.prod(p.shape) for p in weights]
    flat = std * jax.random.normal(key, (sum(sizes),))
    offset = 0
    for p, size in zip(weights, sizes):
        p[...] = flat[offset : offset + size].reshape(p.shape).astype(p.dtype)
        offset += size


def _paged_decode(
    q_BxKxGxDh, kv: attn_lib.PagedKV, q_pos_B, window, scale, softcap, layout, sinks_KxG=None
):
    """The Pallas paged decode kernel; on a mesh with the ("data", "fsdp", "tensor") axes
    it runs under ``shard_map`` (XLA does not partition a Pallas call): each device
    attends its rows over its copy of the pool, which the engine keeps whole on every
    device."""
    call = lambda q, k, v, table, pos, q_pos, *sinks: attn_lib.paged_decode_attention(
        q, attn_lib.PagedKV(k, v, None, None, table, pos), q_pos, window, scale, softcap,
        *sinks,
    )  # fmt: skip
    sinks = () if sinks_KxG is None else (sinks_KxG,)
    args = (q_BxKxGxDh, kv.k, kv.v, kv.table_BxN, kv.pos_BxS, q_pos_B, *sinks)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or not set(MESH_AXES) <= set(mesh.axis_names):
        return call(*args)
    P = jax.sharding.PartitionSpec
    rows_ax = fit_spec(logical_to_spec(("batch",), layout), q_BxKxGxDh.shape[:1], mesh.shape)
    rows, whole = P(*rows_ax), P()
    return jax.shard_map(
        call,
        mesh=mesh,
        in_specs=(rows, whole, whole, rows, rows, rows) + (whole,) * len(sinks),
        out_specs=rows,
        check_vma=False,
    )(*args)


def _project(x_MxD: jax.Array, w_DxHxDh: jax.Array) -> jax.Array:
    """x @ W for a [D, heads, head_dim] weight, as one 2-D matmul: [M, heads * head_dim]."""
    return x_MxD @ w_DxHxDh.reshape(w_DxHxDh.shape[0], -1)


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019) over the last axis: x / sqrt(mean(x^2) + eps) * w.

    ``plus_one`` (Gemma): the stored weight is an offset, the scale is (1 + w),
    and the product is taken in float32 before casting back; GPT-OSS also takes
    w * x in float32 before the cast; otherwise (Llama, Qwen) the normalised x is
    cast back first, then multiplied by w.
    """

    def __init__(self, dim: int, cfg: ModelConfig, stack: int = 0):
        self.eps = cfg.rms_norm_eps
        self.plus_one = cfg.norm_plus_one
        init = "zeros" if cfg.norm_plus_one else "ones"
        self.scale = param((dim,), ("norm",), cfg.params_dtype, init=init, stack=stack)
        self.scale_in_float32 = cfg.family == "gpt_oss"  # GPT-OSS multiplies before the cast

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        if self.scale_in_float32:
            return (self.scale[...].astype(jnp.float32) * normed).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention (Ainslie et al. 2023) with RoPE and optional q/k RMSNorm.

        scores = (q k^T) * scale  [c * tanh(scores / c) when soft-capped]
        out    = softmax(scores masked to the allowed keys) v W_o

    Query head h uses KV head h // G (Hugging Face's ``repeat_kv`` order).
    The scores, softmax and weighted sum run in ``cfg.attention``'s
    implementation (``grpo_jax.models.attention``).
    """

    def __init__(self, cfg: ModelConfig, stack: int = 0):
        D, H, K, Dh, pd = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.params_dtype,
        )
        self.cfg = cfg
        p = lambda shape, axes: param(shape, axes, pd, stack=stack)
        self.q_proj = p((D, H, Dh), ("embed", "heads", "head_dim"))
        self.k_proj = p((D, K, Dh), ("embed", "kv_heads", "head_dim"))
        self.v_proj = p((D, K, Dh), ("embed", "kv_heads", "head_dim"))
        self.o_proj = p((H, Dh, D), ("heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = p((H, Dh), ("heads", "head_dim"))
            self.k_bias = p((K, Dh), ("kv_heads", "head_dim"))
            self.v_bias = p((K, Dh), ("kv_heads", "head_dim"))
        if cfg.out_bias:
            self.o_bias = p((D,), ("norm",))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg, stack)
            self.k_norm = RMSNorm(Dh, cfg, stack)
        if cfg.attention_sinks:  # one logit per query head (GPT-OSS)
            self.sinks = p((H,), ("heads",))

    def _sinks(self):
        """The sinks as [K, G] float32 (query head h = k * G + g), or None."""
        if not self.cfg.attention_sinks:
            return None
        return self.sinks[...].astype(jnp.float32).reshape(self.cfg.num_kv_heads, -1)

    def __call__(
        self,
        x_BxTxD: jax.Array,
        cos_BxTxDh: jax.Array,
        sin_BxTxDh: jax.Array,
        mask: attn_lib.AttnMask,
        layout: str,
        kv_cache: dict[str, jax.Array] | None = None,
        cache_index: jax.Array | None = None,
    ):
        """Returns (out_BxTxD, updated kv_cache or None).

        Without ``kv_cache`` the keys are this call's T tokens (S = T). With
        this layer's ``kv_cache = {"k": [B, K, S, Dh], "v": [B, K, Dh, S]}``,
        this call's keys/values are written into slots
        [cache_index, cache_index + T) and the queries attend over all S
        slots; the updated slabs are returned.

        The cache is laid out for the decode step's two dots, which batch over
        (B, K) and have one query per row: XLA:CPU computes them as
        keys [S, Dh] x query^T and values [Dh, S] x probs^T, reading each slab
        as it lies. One array per layer, not one stacked [L, ...] array: a
        layer's slab of a stacked cache is copied out before a dot can read
        it. The stacked [L, B, S, K, Dh] cache this replaces was transposed
        and copied, per layer, at every decode step (a tenth of the 20M
        benchmark model's decode time at 80 slots).
        """
        cfg, dt = self.cfg, x_BxTxD.dtype
        B, T, _ = x_BxTxD.shape
        K, G, Dh = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        w = lambda p: p[...].astype(dt)

        # Projections run on 2-D [B*T, D] rows: on CPU, XLA's 3-D dot and its
        # gradient add transposes that cost about as much as the matmuls.
        x_MxD = x_BxTxD.reshape(B * T, -1)
        # lora.add: + s (x A) B where the projection has adapters (models/lora.py).
        proj = lambda name: lora.add(self, name, x_MxD, _project(x_MxD, w(getattr(self, name))))
        q_BxTxHxDh = proj("q_proj").reshape(B, T, -1, Dh)
        k_BxTxKxDh = proj("k_proj").reshape(B, T, K, Dh)
        v_BxTxKxDh = proj("v_proj").reshape(B, T, K, Dh)
        if cfg.qkv_bias:
            q_BxTxHxDh = q_BxTxHxDh + w(self.q_bias)
            k_BxTxKxDh = k_BxTxKxDh + w(self.k_bias)
            v_BxTxKxDh = v_BxTxKxDh + w(self.v_bias)
        if cfg.qk_norm:
            q_BxTxHxDh = self.q_norm(q_BxTxHxDh)
            k_BxTxKxDh = self.k_norm(k_BxTxKxDh)
        q_BxTxHxDh = apply_rope(q_BxTxHxDh, cos_BxTxDh, sin_BxTxDh)
        k_BxTxKxDh = apply_rope(k_BxTxKxDh, cos_BxTxDh, sin_BxTxDh)
        q_BxTxHxDh = constrain(q_BxTxHxDh, ("batch", None, "heads", "head_dim"), layout)
        k_BxTxKxDh = constrain(k_BxTxKxDh, ("batch", None, "kv_heads", "head_dim"), layout)
        v_BxTxKxDh = constrain(v_BxTxKxDh, ("batch", None, "kv_heads", "head_dim"), layout)

        if kv_cache is None:  # Keys and values [B, S, K, Dh], S = T.
            k_spec = "bskh"
            k_kv, v_kv = k_BxTxKxDh, v_BxTxKxDh
        elif isinstance(kv_cache, attn_lib.PagedKV):  # Write into the pages, then attend.
            kv_cache = kv_cache.write(
                k_BxTxKxDh.reshape(B * T, K, Dh), v_BxTxKxDh.reshape(B * T, K, Dh)
            )
            out_BxTxKxGxDh = self._paged(q_BxTxHxDh.reshape(B, T, K, G, Dh), kv_cache, mask, layout)
            return self._out(out_BxTxKxGxDh, w), kv_cache
        else:  # Update this layer's slabs in place.
            k_spec = "bksh"
            zero, index = jnp.int32(0), jnp.asarray(cache_index, jnp.int32)
            k_BxKxSxDh, v_BxKxDhxS = kv_cache["k"], kv_cache["v"]
            k_BxKxSxDh = jax.lax.dynamic_update_slice(
                k_BxKxSxDh,
                jnp.transpose(k_BxTxKxDh, (0, 2, 1, 3)).astype(k_BxKxSxDh.dtype),
                (zero, zero, index, zero),
            )
            v_BxKxDhxS = jax.lax.dynamic_update_slice(
                v_BxKxDhxS,
                jnp.transpose(v_BxTxKxDh, (0, 2, 3, 1)).astype(v_BxKxDhxS.dtype),
                (zero, zero, zero, index),
            )
            kv_cache = {"k": k_BxKxSxDh, "v": v_BxKxDhxS}
            k_kv, v_kv = k_BxKxSxDh, v_BxKxDhxS

        q_BxTxKxGxDh = q_BxTxHxDh.reshape(B, T, K, G, Dh)
        out_BxTxKxGxDh = self._attend(q_BxTxKxGxDh, k_kv, v_kv, k_spec, mask, layout)
        return self._out(out_BxTxKxGxDh, w), kv_cache

    def _paged(self, q_BxTxKxGxDh, kv: attn_lib.PagedKV, mask, layout: str):
        """Attention over a paged cache: the Pallas decode kernel for one query per row with
        ``attention = "splash"`` (:func:`_paged_decode`), else the gather path."""
        cfg = self.cfg
        B, T, K, G, Dh = q_BxTxKxGxDh.shape
        scale, softcap = cfg.attn_scale, cfg.attn_logit_softcap
        if T == 1 and cfg.attention == "splash":
            out_BxKxGxDh = _paged_decode(
                q_BxTxKxGxDh[:, 0], kv, mask.q_slot_BxT[:, 0], mask.window, scale, softcap,
                layout, self._sinks(),
            )  # fmt: skip
            return out_BxKxGxDh[:, None]
        k_BxSxKxDh, v_BxSxKxDh = kv.gather()
        return attn_lib.paged_attention(
            q_BxTxKxGxDh, k_BxSxKxDh, v_BxSxKxDh,
            mask.q_slot_BxT,  # the queries' positions
            kv.pos_BxS, mask.window, scale, softcap, self._sinks(),
        )  # fmt: skip

    def _out(self, out_BxTxKxGxDh, w):
        """The output projection (and bias) of the heads' attention outputs: [B, T, D]."""
        B, T, K, G, Dh = out_BxTxKxGxDh.shape
        o_proj_HDhxD = w(self.o_proj).reshape(K * G * Dh, -1)
        out_MxHDh = out_BxTxKxGxDh.reshape(B * T, K * G * Dh)
        out_BxTxD = lora.add(self, "o_proj", out_MxHDh, out_MxHDh @ o_proj_HDhxD).reshape(B, T, -1)
        if self.cfg.out_bias:
            out_BxTxD = out_BxTxD + w(self.o_bias)
        return out_BxTxD

    def _attend(self, q_BxTxKxGxDh, k, v, k_spec: str, mask: attn_lib.AttnMask, layout: str):
        """softmax(q k^T) v in the configured implementation; keys/values in their layout:
        "bskh" [B, S, K, Dh] each (no cache), or "bksh" keys [B, K, S, Dh] with
        values [B, K, Dh, S] (the cache).

        ``splash`` needs the queries' static slot offset; a one-token decode step
        runs ``einsum`` and a traced multi-token write ``blockwise`` (attention.py).
        """
        cfg = self.cfg
        scale, cap = cfg.attn_scale, cfg.attn_logit_softcap
        cached = k_spec == "bksh"
        impl = cfg.attention
        if impl == "splash" and (q_BxTxKxGxDh.shape[1] == 1 or mask.q_offset is None):
            impl = "einsum" if q_BxTxKxGxDh.shape[1] == 1 else "blockwise"
        if impl == "einsum":
            v_spec = "bkhs" if cached else "bskh"
            return attn_lib.einsum_attention(
                q_BxTxKxGxDh, k, v, k_spec, v_spec, mask, scale, cap, self._sinks()
            )
        if impl in ("blockwise", "splash"):
            k_BxKxSxDh = k if cached else jnp.transpose(k, (0, 2, 1, 3))
            v_BxKxSxDh = jnp.swapaxes(v, 2, 3) if cached else jnp.transpose(v, (0, 2, 1, 3))
            if impl == "splash":
                return attn_lib.splash_attention(
                    q_BxTxKxGxDh,
                    k_BxKxSxDh,
                    v_BxKxSxDh,
                    mask,
                    scale,
                    cap,
                    cfg.attention_block_size,
                    cfg.sliding_window,
                    layout,
                    self._sinks(),
                )
            return attn_lib.blockwise_attention(
                q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, mask, scale, cap, cfg.attention_block_size,
                self._sinks(),
            )  # fmt: skip
        k_BxSxKxDh = jnp.transpose(k, (0, 2, 1, 3)) if cached else k
        v_BxSxKxDh = jnp.transpose(v, (0, 3, 1, 2)) if cached else v
        return attn_lib.dot_product_attention(q_BxTxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, mask, scale)


def _activation(cfg: ModelConfig):
    if cfg.activation == "silu":
        return jax.nn.silu
    return lambda x: jax.nn.gelu(x, approximate=cfg.activation == "gelu_tanh")


class MoE(nnx.Module):
    """A mixture of gated-MLP experts with a top-k router (Qwen3-MoE's or GPT-OSS's block).

    The weights are stacked over the E experts; the router is [D, E]. The names differ
    from the dense MLP's (``gate_experts``, not ``gate_proj``): LoRA adapts the experts only
    when they are named (``EXPERT_PROJECTIONS``), one adapter per expert. With
    ``cfg.swiglu_limit`` (GPT-OSS) the gate and up projections are one weight
    ``gate_up_experts`` [E, D, 2F], gate and up interleaved along its output as the
    checkpoint stores them, and ``cfg.moe_bias`` adds the router's and the experts' biases.
    ``grpo_jax.models.moe`` has the routing and the dispatch.
    """

    def __init__(self, cfg: ModelConfig, stack: int = 0):
        D, E, F, pd = cfg.hidden_size, cfg.num_experts, cfg.expert_mlp_dim, cfg.params_dtype
        self.cfg = cfg
        p = lambda shape, axes: param(shape, axes, pd, stack=stack)
        self.router = p((D, E), ("embed", None))
        if cfg.swiglu_limit is not None:
            self.gate_up_experts = p((E, D, 2 * F), ("experts", "embed", "mlp"))
        else:
            self.gate_experts = p((E, D, F), ("experts", "embed", "mlp"))
            self.up_experts = p((E, D, F), ("experts", "embed", "mlp"))
        self.down_experts = p((E, F, D), ("experts", "mlp", "embed"))
        if cfg.moe_bias:
            self.router_bias = p((E,), (None,))
            self.gate_up_bias = p((E, 2 * F), ("experts", "mlp"))
            self.down_bias = p((E, D), ("experts", "norm"))

    def __call__(self, x_BxTxD: jax.Array, layout: str, routes_BxTxK=None):
        """(out [B, T, D], the experts used [B, T, K] int32); ``routes_BxTxK`` replays them."""
        cfg, dt = self.cfg, x_BxTxD.dtype
        B, T, D = x_BxTxD.shape
        w = lambda p: p[...].astype(dt)
        x_MxD = x_BxTxD.reshape(B * T, D)
        given = None if routes_BxTxK is None else routes_BxTxK.reshape(B * T, -1)
        logits_MxE = x_MxD @ w(self.router)
        if cfg.moe_bias:
            logits_MxE = logits_MxE + w(self.router_bias)
        weights_MxK, experts_MxK = moe_lib.route(
            logits_MxE, cfg.experts_per_token, cfg.norm_topk_prob, given,
            softmax_over_topk=cfg.router_softmax_over_topk,
        )  # fmt: skip
        adapters = lora.expert_adapters(self)  # None without LoRA on the experts
        if cfg.swiglu_limit is not None:
            gate_up_bias = w(self.gate_up_bias) if cfg.moe_bias else None
            down_bias = w(self.down_bias) if cfg.moe_bias else None
            out_MxD = moe_lib.clamped_grouped_experts(
                x_MxD, experts_MxK, weights_MxK.astype(dt), w(self.gate_up_experts),
                gate_up_bias, w(self.down_experts), down_bias, cfg.swiglu_alpha,
                cfg.swiglu_limit, adapters,
            )  # fmt: skip
            return out_MxD.reshape(B, T, D), experts_MxK.reshape(B, T, -1)
        out_MxD = moe_lib.grouped_experts(
            x_MxD, experts_MxK, weights_MxK.astype(dt),
            w(self.gate_experts), w(self.up_experts), w(self.down_experts), _activation(cfg),
            adapters,
        )  # fmt: skip
        return out_MxD.reshape(B, T, D), experts_MxK.reshape(B, T, -1)


class MLP(nnx.Module):
    """Gated MLP: down(act(x W_gate) * (x W_up)); SwiGLU (Shazeer 2020) or GeGLU."""

    def __init__(self, cfg: ModelConfig, stack: int = 0):
        D, F, pd = cfg.hidden_size, cfg.mlp_dim, cfg.params_dtype
        self.cfg = cfg
        p = lambda shape, axes: param(shape, axes, pd, stack=stack)
        self.gate_proj = p((D, F), ("embed", "mlp"))
        self.up_proj = p((D, F), ("embed", "mlp"))
        self.down_proj = p((F, D), ("mlp", "embed"))
        if cfg.mlp_bias:
            self.gate_bias = p((F,), ("mlp",))
            self.up_bias = p((F,), ("mlp",))
            self.down_bias = p((D,), ("norm",))

    def __call__(self, x_BxTxD: jax.Array, layout: str) -> jax.Array:
        cfg, dt = self.cfg, x_BxTxD.dtype
        B, T, D = x_BxTxD.shape
        w = lambda p: p[...].astype(dt)
        x_MxD = x_BxTxD.reshape(B * T, D)  # 2-D matmuls: see Attention.
        proj = lambda name: lora.add(self, name, x_MxD, x_MxD @ w(getattr(self, name)))
        gate_BxTxF = proj("gate_proj").reshape(B, T, -1)
        up_BxTxF = proj("up_proj").reshape(B, T, -1)
        if cfg.mlp_bias:
            gate_BxTxF, up_BxTxF = gate_BxTxF + w(self.gate_bias), up_BxTxF + w(self.up_bias)
        gate_BxTxF = _activation(cfg)(gate_BxTxF)
        h_BxTxF = constrain(gate_BxTxF * up_BxTxF, ("batch", None, "mlp"), layout)
        h_MxF = h_BxTxF.reshape(B * T, -1)
        out_BxTxD = lora.add(self, "down_proj", h_MxF, h_MxF @ w(self.down_proj)).reshape(B, T, D)
        if cfg.mlp_bias:
            out_BxTxD = out_BxTxD + w(self.down_bias)
        return out_BxTxD


class Block(nnx.Module):
    """One pre-norm decoder layer; Gemma adds norms after attention and after the MLP.

    h = x + [post_attn_norm](attn(attn_norm(x)))
    y = h + [post_mlp_norm](mlp(mlp_norm(h)))

    ``stack`` = L > 0: every parameter has a leading [L] axis, the L layers
    of a scanned model (``Transformer`` runs one slice per scan step).
    ``layer``: the layer's index, which says whether its MLP is a mixture of
    experts (``ModelConfig.is_sparse``); a stack's layers are all alike.
    """

    def __init__(self, cfg: ModelConfig, stack: int = 0, layer: int = 0):
        D = cfg.hidden_size
        self.attn_norm = RMSNorm(D, cfg, stack)
        self.attn = Attention(cfg, stack)
        self.mlp_norm = RMSNorm(D, cfg, stack)
        self.sparse = cfg.is_sparse(layer)
        self.mlp = MoE(cfg, stack) if self.sparse else MLP(cfg, stack)
        if cfg.sandwich_norm:
            self.post_attn_norm = RMSNorm(D, cfg, stack)
            self.post_mlp_norm = RMSNorm(D, cfg, stack)
        self.sandwich = cfg.sandwich_norm

    def __call__(
        self,
        x_BxTxD,
        cos_BxTxDh,
        sin_BxTxDh,
        mask,
        layout,
        kv_cache=None,
        cache_index=None,
        routes_BxTxK=None,
    ):
        """Returns (y_BxTxD, updated kv_cache or None, the experts used [B, T, K] or None
        for a dense layer); see :meth:`Attention.__call__`. ``routes_BxTxK`` replays a
        sparse layer's routing."""
        a_BxTxD, kv_cache = self.attn(
            self.attn_norm(x_BxTxD),
            cos_BxTxDh,
            sin_BxTxDh,
            mask,
            layout,
            kv_cache,
            cache_index,
        )
        if self.sandwich:
            a_BxTxD = self.post_attn_norm(a_BxTxD)
        h_BxTxD = constrain(x_BxTxD + a_BxTxD, ("batch", None, "embed"), layout)
        routes = None
        if self.sparse:
            m_BxTxD, routes = self.mlp(self.mlp_norm(h_BxTxD), layout, routes_BxTxK)
        else:
            m_BxTxD = self.mlp(self.mlp_norm(h_BxTxD), layout)
        if self.sandwich:
            m_BxTxD = self.post_mlp_norm(m_BxTxD)
        y_BxTxD = constrain(h_BxTxD + m_BxTxD, ("batch", None, "embed"), layout)
        return y_BxTxD, kv_cache, routes
