"""A mixture-of-experts MLP's routing and its dropless grouped-matmul dispatch, as pure functions.

Shapes: M tokens (B * T), D model width, E experts, K experts per token, F an expert's width.

The router is Qwen3-MoE's (transformers' ``Qwen3MoeTopKRouter``): logits in the compute
dtype, a float32 softmax over the E experts, the top K probabilities, renormalised to sum 1
when ``normalize``; or GPT-OSS's (``softmax_over_topk``): the top K logits, then a float32
softmax over those K. Given ``routes`` (the experts another pass chose) the same probabilities
are read at those experts instead of the top K, so the router's gradient still flows through
the weights of the given experts (routing replay, docs/moe.md).

The experts run dropless: the M * K (token, expert) pairs are sorted by expert, each expert's
contiguous rows are multiplied by its weights in one ``jax.lax.ragged_dot``, and the rows go
back to their tokens; no capacity, no dropped token.

LoRA on the experts (:class:`ExpertLoRA`): each expert's own adapter runs on that expert's
rows of the same sorted order, y += ragged_dot(ragged_dot(x, A), B) * scale.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp


class ExpertLoRA(NamedTuple):
    """Low-rank adapters on the experts' weights (docs/lora.md, "The experts").

    ``pairs`` maps a weight's name (``gate_experts``, ``up_experts``, ``gate_up_experts``,
    ``down_experts``) to its (A [E, in, r], B [E, r, out]); ``drop(name, x)`` applies the
    adapters' dropout to their input rows, or is None.
    """

    pairs: Mapping[str, tuple[jax.Array, jax.Array]]
    scale: float
    drop: Callable | None = None

    def grouped(self, name: str, x_NxI, y_NxO, sizes_E):
        """``y`` plus the adapter's term for rows sorted by expert (group sizes ``sizes_E``)."""
        if name not in self.pairs:
            return y_NxO
        a_ExIxR, b_ExRxO = self.pairs[name]
        dt = x_NxI.dtype
        if self.drop is not None:
            x_NxI = self.drop(name, x_NxI)
        xa_NxR = jax.lax.ragged_dot(x_NxI, a_ExIxR.astype(dt), sizes_E)
        delta_NxO = jax.lax.ragged_dot(xa_NxR, b_ExRxO.astype(dt), sizes_E)
        return y_NxO + delta_NxO * jnp.asarray(self.scale, dt)

    def dense(self, name: str, x, y_ExMxO):
        """``y`` plus the adapter's term for every expert on every row: x [M, in] (shared by
        the experts) or [E, M, in]; no dropout (the slow reference)."""
        if name not in self.pairs:
            return y_ExMxO
        a_ExIxR, b_ExRxO = self.pairs[name]
        dt = x.dtype
        spec = "mi,eir->emr" if x.ndim == 2 else "emi,eir->emr"
        xa_ExMxR = jnp.einsum(spec, x, a_ExIxR.astype(dt))
        delta_ExMxO = jnp.einsum("emr,ero->emo", xa_ExMxR, b_ExRxO.astype(dt))
        return y_ExMxO + delta_ExMxO * jnp.asarray(self.scale, dt)


def _grouped(lora: ExpertLoRA | None, name: str, x_NxI, w_ExIxO, sizes_E):
    """One expert weight on rows sorted by expert, with its adapter when it has one."""
    y_NxO = jax.lax.ragged_dot(x_NxI, w_ExIxO, sizes_E)
    return y_NxO if lora is None else lora.grouped(name, x_NxI, y_NxO, sizes_E)


def _dense(lora: ExpertLoRA | None, name: str, x, w_ExIxO):
    """One expert weight for every expert on every row (x [M, in] or [E, M, in])."""
    y_ExMxO = jnp.einsum("md,edf->emf" if x.ndim == 2 else "emf,efd->emd", x, w_ExIxO)
    return y_ExMxO if lora is None else lora.dense(name, x, y_ExMxO)


def route(
    logits_MxE: jax.Array, k: int, normalize: bool, routes_MxK: jax.Array | None = None,
    *, softmax_over_topk: bool = False,
):  # fmt: skip
    """(routing weights [M, K] float32, chosen experts [M, K] int32) of the router's logits.

    Without ``routes_MxK`` the experts are the top ``k`` of softmax(logits), in descending
    order; with it, they are the given ones and the weights are their probabilities. A token
    whose given row holds a negative id (not recorded) takes its own top ``k``. With
    ``softmax_over_topk`` the weights are the softmax of the chosen experts' logits
    (GPT-OSS), whichever chose them, and ``normalize`` has nothing left to do.
    """
    logits_MxE = logits_MxE.astype(jnp.float32)
    scores_MxE = logits_MxE if softmax_over_topk else jax.nn.softmax(logits_MxE, axis=-1)
    weights_MxK, experts_MxK = jax.lax.top_k(scores_MxE, k)
    if routes_MxK is not None:
        # A token whose routes were not recorded (-1: a sampler never fed it) keeps its own.
        given_MxK = routes_MxK.astype(jnp.int32)
        recorded_Mx1 = jnp.all(given_MxK >= 0, axis=-1, keepdims=True)
        experts_MxK = jnp.where(recorded_Mx1, given_MxK, experts_MxK)
        weights_MxK = jnp.take_along_axis(scores_MxE, experts_MxK, axis=-1)
    if softmax_over_topk:
        return jax.nn.softmax(weights_MxK, axis=-1), experts_MxK.astype(jnp.int32)
    if normalize:
        weights_MxK = weights_MxK / jnp.sum(weights_MxK, axis=-1, keepdims=True)
    return weights_MxK, experts_MxK.astype(jnp.int32)


def grouped_experts(
    x_MxD: jax.Array,
    experts_MxK: jax.Array,
    weights_MxK: jax.Array,
    gate_ExDxF: jax.Array,
    up_ExDxF: jax.Array,
    down_ExFxD: jax.Array,
    activation,
    lora: ExpertLoRA | None = None,
) -> jax.Array:
    """sum_k weight[m, k] * expert[experts[m, k]](x[m]) for every token: [M, D].

    An expert is a gated MLP, down(activation(x gate) * (x up)). The (token, expert) pairs
    are sorted by expert (a stable sort), each expert's group of rows goes through one
    ``ragged_dot``, and the inverse permutation brings the rows back. ``lora`` adds each
    expert's adapters on the same sorted rows.
    """
    M, K = experts_MxK.shape
    E = gate_ExDxF.shape[0]
    flat_N = experts_MxK.reshape(-1)  # N = M * K pairs, token-major
    order_N = jnp.argsort(flat_N, stable=True)
    sizes_E = jnp.bincount(flat_N, length=E).astype(jnp.int32)
    rows_NxD = jnp.take(x_MxD, order_N // K, axis=0)
    gate_NxF = _grouped(lora, "gate_experts", rows_NxD, gate_ExDxF, sizes_E)
    up_NxF = _grouped(lora, "up_experts", rows_NxD, up_ExDxF, sizes_E)
    out_NxD = _grouped(lora, "down_experts", activation(gate_NxF) * up_NxF, down_ExFxD, sizes_E)
    back_N = jnp.argsort(order_N)  # the inverse permutation: pair n's row in the sorted order
    out_MxKxD = jnp.take(out_NxD, back_N, axis=0).reshape(M, K, -1)
    return jnp.einsum("mkd,mk->md", out_MxKxD, weights_MxK.astype(out_MxKxD.dtype))


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GPT-OSS's expert activation: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    g = min(gate, limit)."""
    gate = jnp.minimum(gate, jnp.asarray(limit, gate.dtype))
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * jnp.asarray(alpha, gate.dtype)))


def clamped_grouped_experts(
    x_MxD, experts_MxK, weights_MxK, gate_up_ExDx2F, gate_up_bias_Ex2F, down_ExFxD,
    down_bias_ExD, alpha: float, limit: float, lora: ExpertLoRA | None = None,
):  # fmt: skip
    """GPT-OSS's experts through the dispatch of :func:`grouped_experts`: one ``ragged_dot``
    by the fused gate/up weight (gate at even columns, up at odd), the biases of each row's
    expert, :func:`clamped_swiglu`, the down projection and its bias, then the weighted sum
    (the down bias inside the weight, as transformers adds it). Biases may be None. The
    fused weight's adapter (``gate_up_experts``) adds to its interleaved columns, before
    the bias and the split."""
    M, K = experts_MxK.shape
    E = gate_up_ExDx2F.shape[0]
    flat_N = experts_MxK.reshape(-1)
    order_N = jnp.argsort(flat_N, stable=True)
    sizes_E = jnp.bincount(flat_N, length=E).astype(jnp.int32)
    expert_N = jnp.take(flat_N, order_N)  # each sorted row's expert
    rows_NxD = jnp.take(x_MxD, order_N // K, axis=0)
    gate_up_Nx2F = _grouped(lora, "gate_up_experts", rows_NxD, gate_up_ExDx2F, sizes_E)
    if gate_up_bias_Ex2F is not None:
        gate_up_Nx2F = gate_up_Nx2F + jnp.take(gate_up_bias_Ex2F, expert_N, axis=0)
    h_NxF = clamped_swiglu(gate_up_Nx2F[:, ::2], gate_up_Nx2F[:, 1::2], alpha, limit)
    out_NxD = _grouped(lora, "down_experts", h_NxF, down_ExFxD, sizes_E)
    if down_bias_ExD is not None:
        out_NxD = out_NxD + jnp.take(down_bias_ExD, expert_N, axis=0)
    back_N = jnp.argsort(order_N)
    out_MxKxD = jnp.take(out_NxD, back_N, axis=0).reshape(M, K, -1)
    return jnp.einsum("mkd,mk->md", out_MxKxD, weights_MxK.astype(out_MxKxD.dtype))


def clamped_dense_experts(
    x_MxD, experts_MxK, weights_MxK, gate_up_ExDx2F, gate_up_bias_Ex2F, down_ExFxD,
    down_bias_ExD, alpha: float, limit: float, lora: ExpertLoRA | None = None,
):  # fmt: skip
    """:func:`clamped_grouped_experts` computed the slow way (every expert on every token,
    masked by the routing weights): the reference the dispatch is tested against."""
    E = gate_up_ExDx2F.shape[0]
    mask_MxKxE = jax.nn.one_hot(experts_MxK, E, dtype=weights_MxK.dtype)
    w_MxE = jnp.einsum("mk,mke->me", weights_MxK, mask_MxKxE)
    gu_ExMx2F = _dense(lora, "gate_up_experts", x_MxD, gate_up_ExDx2F)
    if gate_up_bias_Ex2F is not None:
        gu_ExMx2F = gu_ExMx2F + gate_up_bias_Ex2F[:, None, :]
    h_ExMxF = clamped_swiglu(gu_ExMx2F[..., ::2], gu_ExMx2F[..., 1::2], alpha, limit)
    out_ExMxD = _dense(lora, "down_experts", h_ExMxF, down_ExFxD)
    if down_bias_ExD is not None:
        out_ExMxD = out_ExMxD + down_bias_ExD[:, None, :]
    return jnp.einsum("emd,me->md", out_ExMxD, w_MxE.astype(out_ExMxD.dtype))


def dense_experts(
    x_MxD, experts_MxK, weights_MxK, gate_ExDxF, up_ExDxF, down_ExFxD, activation,
    lora: ExpertLoRA | None = None,
):  # fmt: skip
    """:func:`grouped_experts` computed the slow way: every expert on every token, masked by
    the routing weights. The reference the dispatch is tested against."""
    E = gate_ExDxF.shape[0]
    mask_MxKxE = jax.nn.one_hot(experts_MxK, E, dtype=weights_MxK.dtype)
    w_MxE = jnp.einsum("mk,mke->me", weights_MxK, mask_MxKxE)
    h_ExMxF = activation(_dense(lora, "gate_experts", x_MxD, gate_ExDxF))
    h_ExMxF = h_ExMxF * _dense(lora, "up_experts", x_MxD, up_ExDxF)
    out_ExMxD = _dense(lora, "down_experts", h_ExMxF, down_ExFxD)
    return jnp.einsum("emd,me->md", out_ExMxD, w_MxE.astype(out_ExMxD.dtype))


def routes_dtype(num_experts: int):
    """The integer type a sampler records expert ids in: int8 up to 127 experts, else int16
    (-1 marks a position without a recorded route)."""
    return jnp.int8 if num_experts <= 127 else jnp.int16


def route_flips(routes_a: jax.Array, routes_b: jax.Array) -> jax.Array:
    """Per token and sparse layer, whether the two chosen sets of experts differ ([..., K] in,
    [...] bool out; the order within a set does not count)."""
    a, b = jnp.sort(routes_a, axis=-1), jnp.sort(routes_b, axis=-1)
    return jnp.any(a != b, axis=-1)
