"""The per-step token draw and the stop-sequence check, shared by the samplers.

``grpo_jax.sampling.static`` (the static batch), ``grpo_jax.sampling.static_turns`` (multi-turn)
and ``grpo_jax.sampling.paged`` (the paged engine) draw every token with
:func:`sample_step` and end rows on a stop sequence with :func:`stop_hits`, so
the engines differ in how they schedule rows and hold the KV cache, never in
the distribution a token is drawn from. Shapes: N rows, V vocabulary, K
candidate tokens kept by top-k / top-p, S stop sequences of at most L tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def stop_table(stop_sequences) -> tuple[np.ndarray, np.ndarray]:
    """The stop sequences right-aligned in a [S, L] table: (ids_SxL int32, used_SxL bool).

    L is the longest sequence's length; a shorter one fills the last of its
    row's L columns (``used`` True there) and the columns before it are unused.
    """
    s = len(stop_sequences)
    length = max(len(q) for q in stop_sequences)
    ids_SxL = np.zeros((s, length), np.int32)
    used_SxL = np.zeros((s, length), np.bool_)
    for i, q in enumerate(stop_sequences):
        ids_SxL[i, length - len(q) :] = q
        used_SxL[i, length - len(q) :] = True
    return ids_SxL, used_SxL


def stop_hits(recent_NxL: jax.Array, available_N: jax.Array, stop_sequences) -> jax.Array:
    """Whether each row's most recent tokens end with one of ``stop_sequences``: bool [N].

    ``recent_NxL`` holds each row's last L = (longest stop sequence) tokens,
    the newest in column L-1; only its last ``available_N`` columns count
    (tokens the row generated: earlier columns may hold prompt or padding; a
    scalar applies to every row). A sequence of length l matches when
    l <= available and the last l columns equal it.
    """
    ids_SxL, used_SxL = stop_table(stop_sequences)
    lengths_S = jnp.asarray(used_SxL.sum(axis=1), jnp.int32)
    same_NxSxL = recent_NxL[:, None, :] == jnp.asarray(ids_SxL)[None]
    equal_NxS = jnp.all(same_NxSxL | ~jnp.asarray(used_SxL)[None], axis=-1)
    enough_NxS = jnp.asarray(available_N, jnp.int32)[..., None] >= lengths_S
    return jnp.any(equal_NxS & enough_NxS, axis=-1)


def _min_p_filter(logits_NxK: jax.Array, min_p: float) -> jax.Array:
    # p_i >= min_p * p_max  <=>  z_i >= z_max + log(min_p); the max always stays.
    z_max_Nx1 = jnp.max(logits_NxK, axis=-1, keepdims=True)
    return jnp.where(logits_NxK >= z_max_Nx1 + jnp.log(min_p), logits_NxK, -jnp.inf)


def candidates(
    scaled_NxV: jax.Array, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[jax.Array, jax.Array | None]:
    """The tokens a draw may pick, as (logits_NxK, ids_NxK); -inf marks dropped ones.

    The usual filters, in order: top-k (Fan et al. 2018) keeps the k largest logits, top-p
    (nucleus sampling, Holtzman et al. 2020) the smallest prefix of those, sorted by
    probability, whose renormalised mass reaches top_p, and min-p the candidates at least
    min_p times as likely as the most likely one; the draw then renormalises what is kept.

    ``scaled_NxV`` holds logits / temperature. With no filter on this is
    (scaled_NxV, None): all V tokens, ids implicit; min-p alone also keeps
    ids implicit. top-k alone costs one ``lax.top_k`` (no sort of the
    vocabulary); top-p sorts the vocabulary. top-p keeps candidate i (sorted
    by probability, descending, renormalised over the top-k set) iff the mass
    strictly before it is below top_p: the smallest prefix whose mass reaches
    top_p, never empty. min-p, last, keeps the candidates whose probability is
    at least min_p times the largest (never empty either).
    """
    v = scaled_NxV.shape[-1]
    if top_k <= 0 and top_p >= 1.0:
        if min_p > 0.0:
            return _min_p_filter(scaled_NxV, min_p), None
        return scaled_NxV, None
    k = v if top_k <= 0 else min(top_k, v)
    logits_NxK, ids_NxK = jax.lax.top_k(scaled_NxV, k)
    if top_p < 1.0:
        probs_NxK = jax.nn.softmax(logits_NxK, axis=-1)
        mass_before_NxK = jnp.cumsum(probs_NxK, axis=-1) - probs_NxK
        logits_NxK = jnp.where(mass_before_NxK < top_p, logits_NxK, -jnp.inf)
    if min_p > 0.0:
        logits_NxK = _min_p_filter(logits_NxK, min_p)
    return logits_NxK, ids_NxK


_DRAW_BLOCK = 512


def draw(logits_NxK: jax.Array, key: jax.Array, *, block: int = _DRAW_BLOCK) -> jax.Array:
    """One index per row from softmax(logits_NxK) (-inf entries never drawn): int32 [N].

    Inverse CDF with one uniform number per row, in two levels: the row's
    probability mass is cut into blocks of ``block`` entries, a block is
    chosen by the cumulative sum of block masses, then an entry within it by
    the cumulative sum inside that block. The same distribution as
    ``jax.random.categorical`` (up to float32 rounding of the sums) at a
    fraction of its cost: categorical's Gumbel trick draws random bits for
    every vocabulary entry, which dominated a decode step on a 262k
    vocabulary; here one exp and a blockwise sum pass over the row.

    u is taken in (0, 1], so the entry chosen is the first whose cumulative
    mass reaches u * total: always one of positive probability (rounding
    that would step past a block's last such entry is clamped to it).
    """
    n, k = logits_NxK.shape
    bk = min(block, k)
    nb = -(-k // bk)
    z_NxK = logits_NxK.astype(jnp.float32)
    e_NxK = jnp.exp(z_NxK - jnp.max(z_NxK, axis=-1, keepdims=True))  # the max entry: 1
    e_NxBxK = jnp.pad(e_NxK, ((0, 0), (0, nb * bk - k))).reshape(n, nb, bk)
    mass_NxB = e_NxBxK.sum(axis=-1)
    cum_NxB = jnp.cumsum(mass_NxB, axis=-1)
    if jnp.ndim(key) == 0:
        u_Nx1 = jax.random.uniform(key, (n, 1), jnp.float32)
    else:  # one key per row (generate's row keys): a row's draw is its own key's
        u_Nx1 = jax.vmap(lambda k: jax.random.uniform(k, (1,), jnp.float32))(key)
    u_Nx1 = (1.0 - u_Nx1) * cum_NxB[:, -1:]
    b_N = jnp.minimum(jnp.sum(cum_NxB < u_Nx1, axis=-1), nb - 1)
    before_N = jnp.take_along_axis(cum_NxB - mass_NxB, b_N[:, None], axis=-1)[:, 0]
    blk_NxK = jnp.take_along_axis(e_NxBxK, b_N[:, None, None], axis=1)[:, 0]
    within_N = jnp.sum(jnp.cumsum(blk_NxK, axis=-1) < (u_Nx1[:, 0] - before_N)[:, None], axis=-1)
    last_N = bk - 1 - jnp.argmax(blk_NxK[:, ::-1] > 0, axis=-1)
    return (b_N * bk + jnp.minimum(within_N, last_N)).astype(jnp.int32)


def sample_step(
    logits_NxV: jax.Array,
    key: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens_N int32, logps_N, behavior_logps_N float32).

    logps_N = log softmax(logits / temperature)[token] over the full,
    untruncated vocabulary: pi_old's log-prob, the quantity the GRPO ratio
    needs, independent of how top-k / top-p / min-p shaped the draw.
    behavior_logps_N = log q(token) under the distribution the token was
    actually drawn from: the renormalised candidates (equal to logps_N when
    no filter is on; 0 for greedy, a point mass). The objective's
    behaviour correction weighs tokens by pi_old / q (docs/objective.md).
    """
    scaled_NxV = logits_NxV.astype(jnp.float32) / temperature
    if greedy:
        tokens_N = jnp.argmax(scaled_NxV, axis=-1).astype(jnp.int32)
        behavior_N = None
    else:
        cand_NxK, ids_NxK = candidates(scaled_NxV, top_k=top_k, top_p=top_p, min_p=min_p)
        choice_N = draw(cand_NxK, key)
        if ids_NxK is None:
            tokens_N = choice_N
        else:
            tokens_N = jnp.take_along_axis(ids_NxK, choice_N[:, None], axis=-1)[:, 0]
        tokens_N = tokens_N.astype(jnp.int32)
        behavior_N = None
        if cand_NxK is not scaled_NxV:
            picked_q_N = jnp.take_along_axis(cand_NxK, choice_N[:, None], axis=-1)[:, 0]
            behavior_N = picked_q_N - jax.nn.logsumexp(cand_NxK, axis=-1)
    picked_N = jnp.take_along_axis(scaled_NxV, tokens_N[:, None], axis=-1)[:, 0]
    logps_N = picked_N - jax.nn.logsumexp(scaled_NxV, axis=-1)
    if behavior_N is None:
        behavior_N = jnp.zeros_like(logps_N) if greedy else logps_N
    return tokens_N, logps_N, behavior_N


def sample_with(logits_NxV: jax.Array, key: jax.Array, cfg):
    """:func:`sample_step` with the filters of ``cfg`` (a ``SamplingConfig``): its 3 outputs."""
    return sample_step(
        logits_NxV,
        key,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p,
        greedy=cfg.greedy,
    )
