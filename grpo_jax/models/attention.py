"""Attention implementations, selected by ``ModelConfig.attention``: one math, three kernels.

Shapes: B batch, T queries, S key slots, K key/value heads, G = H / K query
heads per KV head, Dh head width, C keys per block, N = ceil(S / C) blocks.

Each computes softmax((q . k) * scale, soft-capped, over the keys :class:`AttnMask` allows)
times v: ``einsum`` (the reference), ``blockwise`` (online softmax over key blocks of C slots
with a recomputing gradient: Milakov & Gimelshein 2018, Rabe & Staats 2021, Dao et al. 2022),
``dot_product`` (``jax.nn.dot_product_attention``), ``splash`` (TPU Pallas) and the paged
engine's decode kernel. docs/long_context.md, "model.attention", has the formulas and mask.

Attention sinks (GPT-OSS): a learned logit per query head joins every softmax's denominator
and attends to nothing, so a query may give its keys less than all of its weight. ``einsum``,
``blockwise``, ``splash``, the paged gather path and the paged decode kernel take them
(``sinks_KxG``); ``dot_product`` does not (``ModelConfig`` refuses the combination).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.core.sharding import MESH_AXES, logical_to_spec
from grpo_jax.models.partitioning import fit_spec

MASKED = float(jnp.finfo(jnp.float32).min)  # Finite: a row with no visible key stays NaN-free.
NO_WINDOW = 2**30  # A per-layer window value (scanned layers) meaning "global layer".


class Segments(NamedTuple):
    """Packed rows: several sequences one after another in a row, each attending to itself.

    ``id_BxS``: each slot's sequence, 1, 2, ... along the row; 0 for the padding after
    the row's last one (padding sees padding only, so no query is left without a key).
    ``pos_BxS``: each token's position in its sequence (restarting at 0; RoPE reads the
    same positions), by which a sliding window measures distance. ``part_BxS`` (None:
    one level): a sequence of two levels is a shared part 0 (a group's prompt) followed
    by continuations 1, 2, ... (its completions), each of which sees part 0 and itself.

    A query in slot i sees key slot j iff j <= i, id[j] == id[i], part[j] is 0 or
    part[i], and, with a window W, pos[i] - pos[j] < W (docs/packing.md).
    """

    id_BxS: jax.Array
    pos_BxS: jax.Array
    part_BxS: jax.Array | None = None


class AttnMask(NamedTuple):
    """What a query may see, without forming the [B, T, S] mask.

    q_slot_BxT: the cache slot of each query (its column without a cache).
    kv_mask_BxS: True where a key slot holds a real token.
    window: None (all layers global), or a window W (a Python int, or an
      int32 scalar per layer when layers are scanned; ``NO_WINDOW`` for a
      global layer).
    q_offset: the slot of query 0 as a Python int when the queries occupy
      slots q_offset .. q_offset + T - 1 of every row (then
      ``q_slot_BxT[b, t] == q_offset + t``); None when that slot is traced.
      Only the static-mask kernel (``splash``) needs it.
    segments: packed rows (:class:`Segments`, over the key slots), or None. A query
      reads its own sequence, part and position at its slot.
    """

    q_slot_BxT: jax.Array
    kv_mask_BxS: jax.Array
    window: jax.Array | int | None = None
    q_offset: int | None = None
    segments: Segments | None = None


class PagedKV(NamedTuple):
    """One layer's paged KV cache for a call, and where the call writes and reads it.

    ``k`` / ``v`` [pages, Z, K, Dh]: a pool of fixed-size pages of Z token
    slots. Token m of the call's M = B * T is stored at slot
    ``write_off_M[m]`` of page ``write_page_M[m]`` (a token that must not be
    stored writes a scratch page); query row b reads the pages
    ``table_BxN[b]`` (its block table, N pages: S = N * Z slots in table
    order), whose slots hold the tokens at positions ``pos_BxS[b]``
    (``NO_WINDOW`` where none: never visible). A query at position i sees
    slot j iff pos[j] <= i and, with a window W, i - pos[j] < W.
    """

    k: jax.Array
    v: jax.Array
    write_page_M: jax.Array
    write_off_M: jax.Array
    table_BxN: jax.Array
    pos_BxS: jax.Array

    def write(self, k_MxKxDh, v_MxKxDh) -> PagedKV:
        at = (self.write_page_M, self.write_off_M)
        return self._replace(
            k=self.k.at[at].set(k_MxKxDh.astype(self.k.dtype)),
            v=self.v.at[at].set(v_MxKxDh.astype(self.v.dtype)),
        )

    def gather(self) -> tuple[jax.Array, jax.Array]:
        """Each row's keys and values [B, S, K, Dh], whole pages at a time."""
        b, n = self.table_BxN.shape
        rows = lambda x: x[self.table_BxN].reshape(b, n * x.shape[1], *x.shape[2:])
        return rows(self.k), rows(self.v)


def paged_attention(
    q_BxTxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, q_pos_BxT, k_pos_BxS, window, scale, softcap,
    sinks_KxG=None,
):  # fmt: skip
    """The gather-based path over a paged cache: the einsum reference on gathered
    keys/values, the mask by positions (:class:`PagedKV`) rather than by slots."""
    dt = q_BxTxKxGxDh.dtype
    scores_BxKxGxTxS = jnp.einsum(
        "btkgh,bskh->bkgts", q_BxTxKxGxDh, k_BxSxKxDh.astype(dt), preferred_element_type=jnp.float32
    )
    scores_BxKxGxTxS = _cap(scores_BxKxGxTxS * scale, softcap)
    dist_BxTxS = q_pos_BxT[:, :, None] - k_pos_BxS[:, None, :]
    ok_BxTxS = dist_BxTxS >= 0
    if window is not None:
        ok_BxTxS &= dist_BxTxS < window
    scores_BxKxGxTxS = jnp.where(ok_BxTxS[:, None, None], scores_BxKxGxTxS, MASKED)
    probs_BxKxGxTxS = softmax_with_sinks(scores_BxKxGxTxS, sinks_KxG).astype(dt)
    return jnp.einsum("bkgts,bskh->btkgh", probs_BxKxGxTxS, v_BxSxKxDh.astype(dt))


def paged_decode_attention(
    q_BxKxGxDh, kv: PagedKV, q_pos_B, window, scale, softcap, sinks_KxG=None
):
    """One query per row over a paged cache, as a Pallas kernel that reads each row's
    pages through its block table (``model.attention = "splash"``'s decode step on the
    paged engine; docs/engine.md). Equal to :func:`paged_attention` on the gathered
    rows. Compiled by Mosaic when lowered for a TPU, run by Pallas's interpreter when
    lowered for anything else (:func:`_on_platform`).

    Grid (rows, table entries): the block table is prefetched as scalars, so entry j
    of row b fetches the whole page ``table[b, j]``, every KV head at once ([Z, K, Dh]
    blocks: the TPU lowering wants a block's last two dimensions whole or in (8, 128)
    tiles, which one head of [pages, Z, K, Dh] is not), and folds it into each head's
    online softmax (running max, normaliser and weighted sum in scratch), written out
    after the last entry. With ``sinks_KxG`` each head's softmax starts from its sink
    (running max = sink, normaliser = 1).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    B, K, G, Dh = q_BxKxGxDh.shape
    Z = kv.k.shape[1]
    M = kv.table_BxN.shape[1]
    sinks = sinks_KxG is not None
    k_pos = kv.pos_BxS.reshape(B, M, 1, Z).astype(jnp.int32)
    per_page = lambda b, j, table, q_pos: (table[b, j], 0, 0, 0)
    per_row = lambda b, j, table, q_pos: (b, 0, 0, 0)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, M),
        in_specs=[
            pl.BlockSpec((None, K, G, Dh), per_row),
            pl.BlockSpec((None, Z, K, Dh), per_page),
            pl.BlockSpec((None, Z, K, Dh), per_page),
            pl.BlockSpec((None, None, 1, Z), lambda b, j, table, q_pos: (b, j, 0, 0)),
        ]
        + ([pl.BlockSpec((K, G, 1), lambda b, j, table, q_pos: (0, 0, 0))] if sinks else []),
        out_specs=pl.BlockSpec((None, K, G, Dh), per_row),
        scratch_shapes=[
            pltpu.VMEM((K, G, 1), jnp.float32),
            pltpu.VMEM((K, G, 1), jnp.float32),
            pltpu.VMEM((K, G, Dh), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _paged_decode_kernel, scale=scale, window=window, softcap=softcap, entries=M, heads=K,
        sinks=sinks,
    )  # fmt: skip
    call = lambda interpret: pl.pallas_call(
        kernel,
        grid_spec=grid,
        out_shape=jax.ShapeDtypeStruct((B, K, G, Dh), q_BxKxGxDh.dtype),
        interpret=interpret,
    )
    table = kv.table_BxN.astype(jnp.int32)
    args = (table, q_pos_B.astype(jnp.int32), q_BxKxGxDh, kv.k, kv.v, k_pos)
    if sinks:
        args += (sinks_KxG.astype(jnp.float32)[..., None],)
    return _on_platform(call)(*args)


def _paged_decode_kernel(
    table_ref, q_pos_ref, q_ref, k_ref, v_ref, k_pos_ref, *refs,
    scale, window, softcap, entries, heads, sinks,
):  # fmt: skip
    from jax.experimental import pallas as pl

    sinks_ref, (o_ref, m_sc, l_sc, acc_sc) = (refs[0], refs[1:]) if sinks else (None, refs)
    b, j = pl.program_id(0), pl.program_id(1)
    del table_ref  # read by the index maps only

    @pl.when(j == 0)
    def _():
        if sinks:  # the sink is the first "key": max = sink, exp(sink - max) = 1
            m_sc[...] = sinks_ref[...]
            l_sc[...] = jnp.ones(l_sc.shape, jnp.float32)
        else:
            m_sc[...] = jnp.full(m_sc.shape, MASKED, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    contract = lambda a, b_, dims: jax.lax.dot_general(
        a, b_, (dims, ((), ())), preferred_element_type=jnp.float32
    )
    dist_1xZ = q_pos_ref[b] - k_pos_ref[...]
    ok_1xZ = dist_1xZ >= 0
    if window is not None:
        ok_1xZ &= dist_1xZ < window
    k_ZxKxDh = k_ref[...].astype(jnp.float32)
    v_ZxKxDh = v_ref[...].astype(jnp.float32)
    for h in range(heads):  # static: a model has a few KV heads (1-16)
        q_GxDh = q_ref[h].astype(jnp.float32)
        scores_GxZ = _cap(contract(q_GxDh, k_ZxKxDh[:, h, :], ((1,), (1,))) * scale, softcap)
        scores_GxZ = jnp.where(ok_1xZ, scores_GxZ, MASKED)
        m_prev = m_sc[h]
        m_new = jnp.maximum(m_prev, scores_GxZ.max(axis=-1, keepdims=True))
        p_GxZ = jnp.where(ok_1xZ, jnp.exp(scores_GxZ - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[h] = alpha * l_sc[h] + p_GxZ.sum(axis=-1, keepdims=True)
        acc_sc[h] = alpha * acc_sc[h] + contract(p_GxZ, v_ZxKxDh[:, h, :], ((1,), (0,)))
        m_sc[h] = m_new

    @pl.when(j == entries - 1)
    def _():
        norm = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(norm == 0, 1.0, norm)).astype(o_ref.dtype)


def _on_platform(build):
    """``build(interpret)``'s Pallas call, chosen by the platform the program is lowered for:
    Mosaic's kernel for a TPU, Pallas's interpreter for any other. The choice is made when
    the program is lowered (``jax.lax.platform_dependent``), not from the process's default
    backend, so a CPU host lowers the TPU kernel when it compiles ahead of time for a TPU
    topology (``python -m grpo_jax.plan``, docs/pods.md)."""

    def call(*args):
        return jax.lax.platform_dependent(*args, tpu=build(False), default=build(True))

    return call


def allowed(q_slot_BxT, kv_mask_BxS, window, s_offset=0, seg=None) -> jax.Array:
    """allowed[b, t, s]: key slot s_offset + s is visible to query t of row b.

    ``seg``: packed rows, the queries' (sequence, part, position) [B, T] each and the
    keys' [B, S] each (:func:`segment_ids`); then the window measures positions.
    """
    S = kv_mask_BxS.shape[-1]
    s_S = s_offset + jnp.arange(S, dtype=jnp.int32)
    dist_BxTxS = q_slot_BxT[:, :, None] - s_S[None, None, :]
    ok = (dist_BxTxS >= 0) & kv_mask_BxS[:, None, :].astype(bool)
    if seg is not None:
        (q_id, q_part, q_pos), (k_id, k_part, k_pos) = seg
        k_part_Bx1xS = k_part[:, None, :]
        ok &= q_id[:, :, None] == k_id[:, None, :]
        ok &= (k_part_Bx1xS == 0) | (k_part_Bx1xS == q_part[:, :, None])
        if window is not None:
            ok &= q_pos[:, :, None] - k_pos[:, None, :] < window
        return ok
    if window is not None:
        ok &= dist_BxTxS < window
    return ok


def segment_ids(mask: AttnMask):
    """((query id, part, position) [B, T] each, (key id, part, position) [B, S] each) of
    ``mask.segments``, the queries' read at their slots; None without segments."""
    seg = mask.segments
    if seg is None:
        return None
    part = jnp.zeros_like(seg.id_BxS) if seg.part_BxS is None else seg.part_BxS
    keys = tuple(x.astype(jnp.int32) for x in (seg.id_BxS, part, seg.pos_BxS))
    at_q = lambda x: jnp.take_along_axis(x, mask.q_slot_BxT.astype(jnp.int32), axis=1)
    return tuple(at_q(x) for x in keys), keys


def _cap(scores, softcap):
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def softmax_with_sinks(scores_BxKxGxTxS: jax.Array, sinks_KxG: jax.Array | None) -> jax.Array:
    """softmax over the keys (last axis); with sinks, each head's sink logit joins the
    denominator: p_s = exp(x_s) / (sum_s' exp(x_s') + exp(sink)), float32."""
    if sinks_KxG is None:
        return jax.nn.softmax(scores_BxKxGxTxS, axis=-1)
    sink = jnp.broadcast_to(
        sinks_KxG.astype(jnp.float32)[None, :, :, None, None], (*scores_BxKxGxTxS.shape[:-1], 1)
    )
    both = jnp.concatenate([scores_BxKxGxTxS.astype(jnp.float32), sink], axis=-1)
    return jax.nn.softmax(both, axis=-1)[..., :-1]


# ---------------------------------------------------------------------------
# einsum: the reference.


def einsum_attention(
    q_BxTxKxGxDh, k, v, k_spec, v_spec, mask: AttnMask, scale, softcap, sinks_KxG=None
):
    """The reference; ``k_spec`` / ``v_spec`` name the key/value layouts (einsum letters)."""
    dt = q_BxTxKxGxDh.dtype
    scores_BxKxGxTxS = jnp.einsum(
        f"btkgh,{k_spec}->bkgts", q_BxTxKxGxDh, k.astype(dt), preferred_element_type=jnp.float32
    )
    scores_BxKxGxTxS = _cap(scores_BxKxGxTxS * scale, softcap)
    ok_BxTxS = allowed(mask.q_slot_BxT, mask.kv_mask_BxS, mask.window, seg=segment_ids(mask))
    scores_BxKxGxTxS = jnp.where(ok_BxTxS[:, None, None], scores_BxKxGxTxS, MASKED)
    probs_BxKxGxTxS = softmax_with_sinks(scores_BxKxGxTxS, sinks_KxG).astype(dt)
    return jnp.einsum(f"bkgts,{v_spec}->btkgh", probs_BxKxGxTxS, v.astype(dt))


# ---------------------------------------------------------------------------
# blockwise: online softmax over key blocks, with its own gradient.


def _block_scores(
    q_BxKxGxTxDh, k_BxKxCxDh, q_slot_BxT, kv_mask_BxC, window, s0, scale, softcap, seg=None
):
    """(masked scores, pre-cap scaled scores) [B, K, G, T, C] of one key block, float32.

    ``seg``: packed rows, :func:`segment_ids` with the keys' arrays of this block."""
    raw = jnp.einsum(
        "bkgth,bkch->bkgtc", q_BxKxGxTxDh, k_BxKxCxDh, preferred_element_type=jnp.float32
    )
    raw = raw * scale
    ok_BxTxC = allowed(q_slot_BxT, kv_mask_BxC, window, s0, seg)
    return jnp.where(ok_BxTxC[:, None, None], _cap(raw, softcap), MASKED), raw


def _blocks(x, n, c, axis):
    """[..., N*C (at ``axis``), ...] -> [N, ..., C, ...]: scan inputs, one block each."""
    shape = x.shape
    x = x.reshape(*shape[:axis], n, c, *shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x, axis):
    """Inverse of :func:`_blocks`."""
    x = jnp.moveaxis(x, 0, axis)
    shape = x.shape
    return x.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2 :])


def _seg_blocks(seg, n, block):
    """Packed rows' key arrays as scan inputs, one block each (None without segments)."""
    return None if seg is None else tuple(_blocks(x, n, block, 1) for x in seg[1])


def _seg_of(seg, kv_seg_blk):
    return None if seg is None else (seg[0], kv_seg_blk)


def _flash_forward(q, k, v, q_slot, kv_mask, window, seg, sinks, scale, softcap, block):
    """(out [B,K,G,T,Dh] float32, row max m, row normaliser l [B,K,G,T]).

    ``sinks`` [K, G] (or None): each head's sink starts the online softmax as a key with
    logit sink and value 0 (m = sink, l = 1), so it joins the normaliser alone."""
    B, K, G, T, Dh = q.shape
    n = k.shape[2] // block
    k_N, v_N, kv_mask_N = (
        _blocks(k, n, block, 2),
        _blocks(v, n, block, 2),
        _blocks(kv_mask, n, block, 1),
    )
    seg_N = _seg_blocks(seg, n, block)

    def step(carry, xs):
        m, l, acc = carry
        j, k_blk, v_blk, kvm_blk, seg_blk = xs
        s, _ = _block_scores(
            q, k_blk, q_slot, kvm_blk, window, j * block, scale, softcap, _seg_of(seg, seg_blk)
        )
        m_new = jnp.maximum(m, s.max(-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * corr + p.sum(-1)
        pv = jnp.einsum(
            "bkgtc,bkch->bkgth", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32
        )
        return (m_new, l, acc * corr[..., None] + pv), None

    init = (
        jnp.full((B, K, G, T), MASKED, jnp.float32),
        jnp.zeros((B, K, G, T), jnp.float32),
        jnp.zeros((B, K, G, T, Dh), jnp.float32),
    )
    if sinks is not None:
        sink_BxKxGxT = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None], (B, K, G, T))
        init = (sink_BxKxGxT, jnp.ones((B, K, G, T), jnp.float32), init[2])
    js = jnp.arange(n, dtype=jnp.int32)
    (m, l, acc), _ = jax.lax.scan(step, init, (js, k_N, v_N, kv_mask_N, seg_N))
    return acc / l[..., None], m, l


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _flash(q, k, v, q_slot, kv_mask, window, seg, sinks, scale, softcap, block):
    out = _flash_forward(q, k, v, q_slot, kv_mask, window, seg, sinks, scale, softcap, block)[0]
    return out.astype(q.dtype)


def _flash_fwd(q, k, v, q_slot, kv_mask, window, seg, sinks, scale, softcap, block):
    out, m, l = _flash_forward(q, k, v, q_slot, kv_mask, window, seg, sinks, scale, softcap, block)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_slot, kv_mask, window, seg, sinks, out, m, l)


def _flash_bwd(scale, softcap, block, res, d_out):
    """Recomputes each block's probabilities p = exp(s - m) / l and accumulates
    dq; dk, dv per block (FlashAttention's backward pass):

        dv_j = p^T do,  dp = do v_j^T,  ds = p * (dp - rowsum(do * out)),
        ds_raw = ds * (1 - tanh^2(raw / c)) when soft-capped,
        dq += scale * ds_raw k_j,  dk_j = scale * ds_raw^T q,
        dsink = -sum over rows and queries of p_sink * rowsum(do * out)
    (a sink is a key of value 0: its ds is p_sink * (0 - rowsum(do * out))).
    """
    q, k, v, q_slot, kv_mask, window, seg, sinks, out, m, l = res
    n = k.shape[2] // block
    do = d_out.astype(jnp.float32)
    delta = jnp.sum(do * out.astype(jnp.float32), axis=-1)  # [B,K,G,T]
    k_N, v_N, kv_mask_N = (
        _blocks(k, n, block, 2),
        _blocks(v, n, block, 2),
        _blocks(kv_mask, n, block, 1),
    )
    seg_N = _seg_blocks(seg, n, block)
    inv_l = 1.0 / l

    def step(dq, xs):
        j, k_blk, v_blk, kvm_blk, seg_blk = xs
        s, raw = _block_scores(
            q, k_blk, q_slot, kvm_blk, window, j * block, scale, softcap, _seg_of(seg, seg_blk)
        )
        p = jnp.exp(s - m[..., None]) * inv_l[..., None]
        dv = jnp.einsum("bkgtc,bkgth->bkch", p, do)
        dp = jnp.einsum("bkgth,bkch->bkgtc", do, v_blk.astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        if softcap is not None:
            ds = ds * (1.0 - jnp.square(jnp.tanh(raw / softcap)))
        ds = ds * scale
        dq = dq + jnp.einsum("bkgtc,bkch->bkgth", ds, k_blk.astype(jnp.float32))
        dk = jnp.einsum("bkgtc,bkgth->bkch", ds, q.astype(jnp.float32))
        return dq, (dk, dv)

    js = jnp.arange(n, dtype=jnp.int32)
    dq, (dk_N, dv_N) = jax.lax.scan(
        step, jnp.zeros(q.shape, jnp.float32), (js, k_N, v_N, kv_mask_N, seg_N)
    )
    zero_int = lambda x: jnp.zeros(x.shape, jax.dtypes.float0)
    d_sinks = None
    if sinks is not None:
        p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, :, None] - m) * inv_l
        d_sinks = (-jnp.sum(p_sink * delta, axis=(0, 3))).astype(sinks.dtype)
    return (
        dq.astype(q.dtype),
        _unblocks(dk_N, 2).astype(k.dtype),
        _unblocks(dv_N, 2).astype(v.dtype),
        zero_int(q_slot),
        zero_int(kv_mask),
        zero_int(window),
        jax.tree.map(zero_int, seg),
        d_sinks,
    )


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(
    q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, mask: AttnMask, scale, softcap, block_size,
    sinks_KxG=None,
):  # fmt: skip
    """Online-softmax attention over key blocks of ``block_size`` slots (module docstring).

    Keys/values are padded with masked slots up to a multiple of the block.
    """
    S = k_BxKxSxDh.shape[2]
    block = min(block_size, S)
    pad = -S % block
    kv_mask_BxS = mask.kv_mask_BxS.astype(bool)
    seg = segment_ids(mask)
    if pad:
        widen = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
        k_BxKxSxDh, v_BxKxSxDh = widen(k_BxKxSxDh), widen(v_BxKxSxDh)
        kv_mask_BxS = jnp.pad(kv_mask_BxS, ((0, 0), (0, pad)))
        if seg is not None:  # the added slots are masked by kv_mask already
            seg = (seg[0], tuple(jnp.pad(x, ((0, 0), (0, pad))) for x in seg[1]))
    q_BxKxGxTxDh = jnp.transpose(q_BxTxKxGxDh, (0, 2, 3, 1, 4))
    window = NO_WINDOW if mask.window is None else mask.window
    dt = q_BxTxKxGxDh.dtype
    out_BxKxGxTxDh = _flash(
        q_BxKxGxTxDh,
        k_BxKxSxDh.astype(dt),
        v_BxKxSxDh.astype(dt),
        mask.q_slot_BxT.astype(jnp.int32),
        kv_mask_BxS,
        jnp.asarray(window, jnp.int32),
        seg,
        sinks_KxG,
        scale,
        softcap,
        block,
    )
    return jnp.transpose(out_BxKxGxTxDh, (0, 3, 1, 2, 4))


# ---------------------------------------------------------------------------
# dot_product: jax.nn.dot_product_attention.


def dot_product_attention(q_BxTxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, mask: AttnMask, scale):
    """``jax.nn.dot_product_attention`` with the allowed-key mask (cuDNN: GPU, half precision)."""
    B, T, K, G, Dh = q_BxTxKxGxDh.shape
    dt = q_BxTxKxGxDh.dtype
    ok_Bx1xTxS = allowed(mask.q_slot_BxT, mask.kv_mask_BxS, mask.window, seg=segment_ids(mask))
    ok_Bx1xTxS = ok_Bx1xTxS[:, None]
    gpu_half = jax.default_backend() == "gpu" and dt in (jnp.bfloat16, jnp.float16)
    out_BxTxHxDh = jax.nn.dot_product_attention(
        q_BxTxKxGxDh.reshape(B, T, K * G, Dh),
        k_BxSxKxDh.astype(dt),
        v_BxSxKxDh.astype(dt),
        mask=ok_Bx1xTxS,
        scale=scale,
        implementation="cudnn" if gpu_half else "xla",
    )
    return out_BxTxHxDh.reshape(B, T, K, G, Dh)


# ---------------------------------------------------------------------------
# splash: TPU splash attention (Pallas), interpreted off the TPU.


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.lru_cache(maxsize=64)
def _splash_kernel(shape, q_offset, window, heads, softcap, bq, bkv, interpret):
    """The Pallas kernel of one static mask: causal from ``q_offset``, within ``window``.

    Built in a thread of its own: its mask tables are concrete arrays (made while a
    program is traced), and the mesh a caller set with ``jax.set_mesh`` is thread-local.
    Under the caller's mesh they would be placed on the mesh's devices, which fails for
    the compile-only devices of a TPU topology (``python -m grpo_jax.plan``); here they
    are host constants of the program, whatever the mesh.
    """
    import concurrent.futures

    args = (shape, q_offset, window, heads, softcap, bq, bkv, interpret)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="splash-tables") as pool:
        return pool.submit(_build_splash_kernel, *args).result()


def _build_splash_kernel(shape, q_offset, window, heads, softcap, bq, bkv, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if window is None:
        one = sm.CausalMask(shape, offset=q_offset)
    else:  # j in [i - (W - 1), i]: causal and i - j < W.
        one = sm.LocalMask(shape, window_size=(window - 1, 0), offset=q_offset)
    blocks = sk.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    with jax.ensure_compile_time_eval():  # concrete mask tables, safe to cache across traces
        return sk.make_splash_mqa(
            sm.MultiHeadMask([one] * heads),
            block_sizes=blocks,
            attn_logits_soft_cap=softcap,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )


def splash_attention(
    q_BxTxKxGxDh,
    k_BxKxSxDh,
    v_BxKxSxDh,
    mask: AttnMask,
    scale,
    softcap,
    block_size: int,
    local_window: int | None,
    layout: str,
    sinks_KxG: jax.Array | None = None,
):
    """TPU splash attention for queries in consecutive slots from ``mask.q_offset``.

    Per row and KV head the G query heads share one key/value head (the MQA
    kernel, vmapped over rows and KV heads). T and S are padded to blocks of
    ``block_size`` rounded up to 128 (at most T or S rounded up to 128, since the
    kernel works in whole 128-lane tiles): padded queries and keys are
    pads (segment 0), outside every real query's view. ``mask.window`` may be a
    traced per-layer scalar (scanned Gemma 3): then a ``lax.cond`` picks the
    global kernel or the one of ``local_window``. On a mesh with the
    ("data", "fsdp", "tensor") axes the kernel runs under ``shard_map``, rows
    over the batch axes and KV heads over "tensor" as the layout shards them,
    since a Pallas call is not partitioned by XLA. ``sinks_KxG``: the kernel's own attention
    sinks, each KV head's G of them given to its call.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    if mask.q_offset is None:
        raise ValueError("splash_attention needs the queries' static slot offset (q_offset)")
    B, T, K, G, Dh = q_BxTxKxGxDh.shape
    S, off = k_BxKxSxDh.shape[2], mask.q_offset
    block = _round_up(block_size, 128)  # the kernel's blocks are whole 128-lane tiles
    bq, bkv = min(block, _round_up(T, 128)), min(block, _round_up(S, 128))
    Tp, Sp = _round_up(T, bq), _round_up(S, bkv)
    window = mask.window

    dt = q_BxTxKxGxDh.dtype
    kv_seg_BxS = mask.kv_mask_BxS.astype(jnp.int32)
    if mask.segments is not None:  # packed rows: each sequence its own segment, padding 0
        if mask.segments.part_BxS is not None:
            raise ValueError(
                "splash attention's segment ids say only whether two tokens share a "
                "sequence: packed rows of two levels (a prompt shared by its completions) "
                "need another attention; pack one completion per prompt for splash"
            )
        kv_seg_BxS = mask.segments.id_BxS.astype(jnp.int32)
    q_seg_BxT = jax.lax.slice_in_dim(kv_seg_BxS, off, off + T, axis=1)
    q_BxKxGxTxDh = jnp.transpose(q_BxTxKxGxDh * jnp.asarray(scale, dt), (0, 2, 3, 1, 4))
    pad_t = lambda x, axis, n: jnp.pad(x, [(0, n if a == axis else 0) for a in range(x.ndim)])
    args = (
        pad_t(q_BxKxGxTxDh, 3, Tp - T),
        pad_t(k_BxKxSxDh.astype(dt), 2, Sp - S),
        pad_t(v_BxKxSxDh.astype(dt), 2, Sp - S),
        pad_t(q_seg_BxT, 1, Tp - T),
        pad_t(kv_seg_BxS, 1, Sp - S),
    )

    has_sinks = sinks_KxG is not None
    if has_sinks:
        args += (sinks_KxG.astype(jnp.float32),)

    def run(kern, q, k, v, q_seg, kv_seg, *sinks):
        def row(q_KxGxTxDh, k_KxSxDh, v_KxSxDh, q_seg_T, kv_seg_S):
            seg = sk.SegmentIds(q=q_seg_T, kv=kv_seg_S)
            if has_sinks:
                head = lambda q, k, v, s_G: kern(q, k, v, segment_ids=seg, sinks=s_G)
                return jax.vmap(head)(q_KxGxTxDh, k_KxSxDh, v_KxSxDh, sinks[0])
            return jax.vmap(lambda q, k, v: kern(q, k, v, segment_ids=seg))(
                q_KxGxTxDh, k_KxSxDh, v_KxSxDh
            )

        return jax.vmap(row)(q, k, v, q_seg, kv_seg)

    # A static window (or none) picks one kernel; a traced one (scanned layers) arrives as an
    # extra int32 input and a lax.cond picks between the global and the local kernel.
    static = window is None or isinstance(window, int)
    extra = () if static else (jnp.asarray(window, jnp.int32),)

    def attend_with(interpret):  # Mosaic's kernel lowered for a TPU, else interpreted
        kernel = lambda w: _splash_kernel((Tp, Sp), off, w, G, softcap, bq, bkv, interpret)

        def attend(q, k, v, q_seg, kv_seg, *rest):
            sinks, w = rest[: int(has_sinks)], rest[int(has_sinks) :]
            if static:
                return run(kernel(window), q, k, v, q_seg, kv_seg, *sinks)
            return jax.lax.cond(
                w[0] >= NO_WINDOW,
                lambda *a: run(kernel(None), *a),
                lambda *a: run(kernel(local_window), *a),
                q,
                k,
                v,
                q_seg,
                kv_seg,
                *sinks,
            )

        return attend

    attend = _on_platform(attend_with)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        out = attend(*args, *extra)
    else:
        P = jax.sharding.PartitionSpec
        b_ax, k_ax = fit_spec(logical_to_spec(("batch", "kv_heads"), layout), (B, K), mesh.shape)
        heads, rows = P(b_ax, k_ax), P(b_ax)
        in_specs = (heads,) * 3 + (rows,) * 2 + (P(k_ax),) * has_sinks + (P(),) * len(extra)
        out = jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(
            *args, *extra
        )
    out_BxKxGxTxDh = out[:, :, :, :T]
    return jnp.transpose(out_BxKxGxTxDh, (0, 3, 1, 2, 4))
