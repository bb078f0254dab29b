"""Completion log-probs under the model: log-probs, entropies and logits of the completion tokens.

Shapes: N completion rows, P padded prompt length (left-padded), T completion
length (right-padded), D model width, V vocabulary.

Rows come as [prompt | completion] split in two, so the update (``grpo_jax.learner.update``)
and the warm start (``grpo_jax.run.warm_start``) score as the sampler does: logps[n, t] =
log softmax(logits(h[n, P-1+t]) / temperature)[tokens[n, t]], the LM head on the completion
positions only. Tokens inside a row's span (:func:`span_mask`) with mask 0, a transcript's
environment tokens, are attended to but not scored. docs/objective.md, section 3. Packed
rows (several sequences a row, no slot on padding): :func:`packed_logps_and_entropy`,
docs/packing.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.attention import Segments
from grpo_jax.models.transformer import positions_from_mask
from grpo_jax.objective import losses
from grpo_jax.objective.distill import full_reverse_kl


def span_mask(mask_NxT):
    """True up to and including each row's last True of ``mask_NxT`` (bool [N, T])."""
    m = mask_NxT.astype(jnp.bool_)
    return jnp.flip(jnp.cumsum(jnp.flip(m, axis=1), axis=1, dtype=jnp.int32) > 0, axis=1)


def completion_features(
    model, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT, group_size: int = 1,
    routes=None, routes_out=False,
):  # fmt: skip
    """The last layer's output [N, T, D] at the positions that predict the completion tokens.

    ``routes`` [N, P + T, R, K] (a mixture of experts; ``RolloutBatch.routes_NxSxRxK``)
    replays the experts recorded at every position of [prompt | completion]; -1 entries
    keep the model's own choice there. ``routes_out``: also return the experts the pass's
    sparse layers used at each completion token's own position, [N, T, R, K] int32 (-1 for
    the last token when the prompt runs once per group: that pass never feeds it).

    The output at position P-1+t of [prompt | completion] predicts completion
    token t, so the slice [P-1, P+T-1) lines up with ``tokens_NxT``. Positions
    are cumsum(mask) - 1, the same positions the sampler used.

    ``group_size`` G > 1 says rows come in aligned groups of G sharing one
    prompt (rows b*G .. b*G+G-1). Then the prompt runs once per group, as the
    sampler's prefill does, filling a KV cache that is repeated to the G rows
    the completions are then run against: the same values as one forward
    over [prompt | completion] per row, with (G-1)/G of the prompt's work
    saved, forward and backward (the repeat's gradient sums over the group).
    """
    n, p = prompt_tokens_NxP.shape
    t = tokens_NxT.shape[1]
    prompt_mask_NxP = prompt_mask_NxP.astype(jnp.bool_)
    mask_NxT = span_mask(mask_NxT)  # real tokens: environment tokens of a transcript too
    if group_size <= 1:
        full_NxL = jnp.concatenate([prompt_tokens_NxP, tokens_NxT], axis=1).astype(jnp.int32)
        full_mask_NxL = jnp.concatenate([prompt_mask_NxP, mask_NxT], axis=1)
        if routes is None and not routes_out:  # any model with ``features``, as before replay
            return model.features(full_NxL, mask_BxT=full_mask_NxL)[:, p - 1 : p + t - 1]
        x_NxLxD, used = model.routed_features(full_NxL, mask_BxT=full_mask_NxL, routes=routes)
        h_NxTxD = x_NxLxD[:, p - 1 : p + t - 1]
        return (h_NxTxD, None if used is None else used[:, p:]) if routes_out else h_NxTxD
    g, b = group_size, n // group_size
    first = lambda x: x.reshape(b, g, *x.shape[1:])[:, 0]
    repeat = lambda x: jnp.repeat(x, g, axis=0)
    prompt_BxP, pmask_BxP = first(prompt_tokens_NxP).astype(jnp.int32), first(prompt_mask_NxP)
    positions_BxP = positions_from_mask(pmask_BxP)
    kv_mask_BxS = jnp.concatenate([pmask_BxP, jnp.zeros((b, t), jnp.bool_)], axis=1)
    replay = {} if routes is None else {"routes": first(routes[:, :p])}
    x_BxPxD, cache = model.features_with_cache(
        prompt_BxP,
        positions_BxT=positions_BxP,
        kv_mask_BxS=kv_mask_BxS,
        cache=model.init_cache(b, p + t),
        cache_index=0,
        **replay,
    )
    h0_Nx1xD = repeat(x_BxPxD[:, -1:])  # the last prompt token predicts completion token 0
    if t == 1:
        return (h0_Nx1xD, None) if routes_out else h0_Nx1xD
    cache = jax.tree.map(repeat, cache)
    # Completion tokens 0..T-2 are fed at slots P..P+T-2 (token T-1 predicts nothing).
    prompt_len_N = prompt_mask_NxP.sum(axis=1, dtype=jnp.int32)
    positions_NxT = prompt_len_N[:, None] + jnp.cumsum(mask_NxT, axis=1, dtype=jnp.int32) - 1
    replay = {} if routes is None else {"routes": routes[:, p : p + t - 1]}
    out = model.features_with_cache(
        tokens_NxT[:, :-1].astype(jnp.int32),
        positions_BxT=positions_NxT[:, :-1],
        kv_mask_BxS=jnp.concatenate([prompt_mask_NxP, mask_NxT], axis=1),
        cache=cache,
        cache_index=p,
        **replay,
        **({"routes_out": True} if routes_out else {}),
    )
    h_NxTxD = jnp.concatenate([h0_Nx1xD, out[0]], axis=1)
    if not routes_out:
        return h_NxTxD
    used = out[2]
    if used is not None:
        used = jnp.pad(used, ((0, 0), (0, 1), (0, 0), (0, 0)), constant_values=-1)
    return h_NxTxD, used


def completion_logits(graphdef, params, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT):
    """Float32 logits [N, T, V] scoring each completion token (the LM head runs on those only)."""
    model = nnx.merge(graphdef, params)
    return model.logits(
        completion_features(model, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT)
    )


def _is_head(path, _) -> bool:
    return path[0] in ("final_norm", "embed", "lm_head")


def completion_logps_and_entropy(
    graphdef,
    params,
    prompt_tokens_NxP,
    prompt_mask_NxP,
    tokens_NxT,
    mask_NxT,
    temperature: float,
    *,
    chunk_size: int = 0,
    with_entropy: bool = False,
    group_size: int = 1,
    routes=None,
):
    """(log-probs [N, T], entropies [N, T] or None) of the completion tokens.

        logps[n, t] = z[n, t, tokens[n, t]] - logsumexp_v z[n, t, v]
        entropy[n, t] = logsumexp_v z[n, t, v] - sum_v softmax(z[n, t])_v z[n, t, v]

    with z = logits / temperature. With ``chunk_size`` (a divisor of T; 0:
    all T at once) the LM head, the log-softmax and the entropy run over
    chunks of the completion with rematerialisation: the float32 logits are
    never formed for more than [N, chunk_size, V] at a time, forward or
    backward (large vocabularies). Entropies carry no gradient.
    ``group_size`` G > 1: rows come in aligned groups of G with one prompt
    each, run once per group (:func:`completion_features`). ``routes``: a mixture of
    experts' recorded routing to replay (:func:`completion_features`).
    """
    model = nnx.merge(graphdef, params)
    h_NxTxD = completion_features(
        model, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT, group_size=group_size,
        routes=routes,
    )  # fmt: skip
    return _head_logps(model, h_NxTxD, tokens_NxT, temperature, chunk_size, with_entropy)


def completion_logps_and_routes(
    graphdef,
    params,
    prompt_tokens_NxP,
    prompt_mask_NxP,
    tokens_NxT,
    mask_NxT,
    temperature: float,
    *,
    chunk_size: int = 0,
    group_size: int = 1,
    routes=None,
):
    """(log-probs [N, T], the experts each completion token's sparse layers used
    [N, T, R, K] int32, -1 where that pass did not feed the token): a mixture of experts
    scored with its own routing (``routes`` None) or a replayed one
    (:func:`completion_features`)."""
    model = nnx.merge(graphdef, params)
    h_NxTxD, used = completion_features(
        model, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT, group_size=group_size,
        routes=routes, routes_out=True,
    )  # fmt: skip
    return _head_logps(model, h_NxTxD, tokens_NxT, temperature, chunk_size, False)[0], used


def completion_scores_and_features(
    graphdef,
    params,
    prompt_tokens_NxP,
    prompt_mask_NxP,
    tokens_NxT,
    mask_NxT,
    temperature: float,
    *,
    chunk_size: int = 0,
    with_entropy: bool = False,
    group_size: int = 1,
):
    """:func:`completion_logps_and_entropy`'s (log-probs, entropies or None), with the model
    and the features [N, T, D] they were scored from (PPO's value head reads them)."""
    model = nnx.merge(graphdef, params)
    h_NxTxD = completion_features(
        model, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT, group_size=group_size
    )
    scores = _head_logps(model, h_NxTxD, tokens_NxT, temperature, chunk_size, with_entropy)
    return (*scores, model, h_NxTxD)


def _head_logps(model, h_NxTxD, tokens_NxT, temperature, chunk_size, with_entropy):
    """(log-probs, entropies or None) [N, T] of ``tokens_NxT`` from the features that
    predict them: the LM head over chunks of ``chunk_size`` along T, rematerialised
    (:func:`completion_logps_and_entropy`)."""
    n, t = tokens_NxT.shape
    # The LM head's own parameters are the chunks' inputs; the layers' are
    # constants there (unused, and no gradient to accumulate across chunks).
    head_graphdef, head_params, body = nnx.split(model, _is_head, ...)
    body = jax.lax.stop_gradient(body)

    def one(head_params, h_NxCxD, tokens_NxC):
        logits_NxCxV = nnx.merge(head_graphdef, head_params, body).logits(h_NxCxD)
        logps_NxC = losses.per_token_logps(logits_NxCxV, tokens_NxC, temperature=temperature)
        if not with_entropy:
            return logps_NxC, None
        ent_NxC = losses.token_entropy(jax.lax.stop_gradient(logits_NxCxV), temperature=temperature)
        return logps_NxC, ent_NxC

    if not chunk_size or chunk_size >= t:
        return one(head_params, h_NxTxD, tokens_NxT)
    if t % chunk_size:
        raise ValueError(f"chunk_size = {chunk_size} must divide the completion length T = {t}")
    k = t // chunk_size
    h_KxNxCxD = jnp.moveaxis(h_NxTxD.reshape(n, k, chunk_size, -1), 1, 0)
    tokens_KxNxC = jnp.moveaxis(tokens_NxT.reshape(n, k, chunk_size), 1, 0)
    chunk_fn = jax.checkpoint(functools.partial(one, head_params))
    logps_KxNxC, ent_KxNxC = jax.lax.map(lambda a: chunk_fn(*a), (h_KxNxCxD, tokens_KxNxC))
    unchunk = lambda x_KxNxC: jnp.moveaxis(x_KxNxC, 0, 1).reshape(n, t)
    return unchunk(logps_KxNxC), None if ent_KxNxC is None else unchunk(ent_KxNxC)


def completion_logps_and_teacher_kl(
    graphdef,
    params,
    prompt_tokens_NxP,
    prompt_mask_NxP,
    tokens_NxT,
    mask_NxT,
    temperature: float,
    teacher,
    teacher_h_NxTxD,
    *,
    chunk_size: int = 0,
    group_size: int = 1,
):
    """(log-probs, entropies, KL(pi_theta || pi_teacher)) [N, T] of the completion tokens.

    :func:`completion_logps_and_entropy` with, at each position, the full-vocabulary
    reverse KL to a teacher (``grpo_jax.objective.distill.full_reverse_kl``; docs/objective.md,
    section 13). ``teacher`` = (graphdef, params) and ``teacher_h_NxTxD`` its
    :func:`completion_features` of the same rows: its LM head runs chunk by chunk beside the
    student's (``chunk_size`` as there), so neither model's logits are ever whole. The KL
    is differentiable in the student; the teacher and the entropies carry no gradient.
    """
    model = nnx.merge(graphdef, params)
    h_NxTxD = completion_features(
        model, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT, group_size=group_size
    )
    n, t = tokens_NxT.shape
    head_graphdef, head_params, body = nnx.split(model, _is_head, ...)
    body = jax.lax.stop_gradient(body)
    t_graphdef, t_params = teacher
    t_params = jax.lax.stop_gradient(t_params)

    def one(head_params, h_NxCxD, th_NxCxD, tokens_NxC):
        logits_NxCxV = nnx.merge(head_graphdef, head_params, body).logits(h_NxCxD)
        t_logits_NxCxW = nnx.merge(t_graphdef, t_params).logits(th_NxCxD)
        logps_NxC = losses.per_token_logps(logits_NxCxV, tokens_NxC, temperature=temperature)
        ent_NxC = losses.token_entropy(jax.lax.stop_gradient(logits_NxCxV), temperature=temperature)
        kl_NxC = full_reverse_kl(logits_NxCxV, t_logits_NxCxW, temperature)
        return logps_NxC, ent_NxC, kl_NxC

    th_NxTxD = jax.lax.stop_gradient(teacher_h_NxTxD)
    if not chunk_size or chunk_size >= t:
        return one(head_params, h_NxTxD, th_NxTxD, tokens_NxT)
    if t % chunk_size:
        raise ValueError(f"chunk_size = {chunk_size} must divide the completion length T = {t}")
    k = t // chunk_size
    chunks = lambda x: jnp.moveaxis(x.reshape(n, k, chunk_size, *x.shape[2:]), 1, 0)
    chunk_fn = jax.checkpoint(functools.partial(one, head_params))
    out = jax.lax.map(
        lambda a: chunk_fn(*a), (chunks(h_NxTxD), chunks(th_NxTxD), chunks(tokens_NxT))
    )
    return tuple(jnp.moveaxis(x_KxNxC, 0, 1).reshape(n, t) for x_KxNxC in out)


def teacher_features(
    graphdef,
    params,
    prompt_tokens_NxP,
    prompt_mask_NxP,
    tokens_NxT,
    mask_NxT,
    *,
    group_size: int = 1,
):
    """A frozen model's :func:`completion_features` [N, T, D] of the rows (no gradient)."""
    model = nnx.merge(graphdef, params)
    h = completion_features(
        model, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT, group_size=group_size
    )
    return jax.lax.stop_gradient(h)


def completion_logps(
    graphdef,
    params,
    prompt_tokens_NxP,
    prompt_mask_NxP,
    tokens_NxT,
    mask_NxT,
    temperature: float,
    *,
    chunk_size: int = 0,
    group_size: int = 1,
    routes=None,
):
    """log pi(completion tokens) [N, T]: :func:`completion_logps_and_entropy`'s log-probs."""
    return completion_logps_and_entropy(
        graphdef,
        params,
        prompt_tokens_NxP,
        prompt_mask_NxP,
        tokens_NxT,
        mask_NxT,
        temperature,
        chunk_size=chunk_size,
        group_size=group_size,
        routes=routes,
    )[0]


# ---------------------------------------------------------------------------
# Packed rows: no slot on padding (docs/packing.md).


class PackedRows(NamedTuple):
    """Completions packed into R rows of L slots, with the prompts they continue.

    Built on the host (``grpo_jax.learner.packing``) for a batch of N rows, P prompt and
    T completion slots; the R rows are split over the S batch shards, shard s holding
    rows s R/S .. (s + 1) R/S - 1, and M head slots per shard. A row holds sequences one
    after another (``grpo_jax.models.attention.Segments``): a prompt's real tokens, then
    one of its completions (one level), or several (two levels: part k the k-th, each
    seeing the prompt and itself), each completion up to its last masked token.

    src_RxL: each slot's token, an index into the rows' tokens laid end to end,
      [prompt tokens (N P) | completion tokens (N T)]; any index on padding.
    id_RxL, pos_RxL, part_RxL: the slots' ``Segments`` (``part_RxL`` None: one level).
    head_src_SxM: the slot, among its shard's R/S rows laid end to end, whose output
      predicts each scored token: the one before it, the prompt's last for a
      completion's first.
    head_dst_SxM: that token's index in the completions [N T]; N T on unused slots.
    count: the scored tokens (0: an empty micro-batch, skipped).
    """

    src_RxL: jax.Array
    id_RxL: jax.Array
    pos_RxL: jax.Array
    part_RxL: jax.Array | None
    head_src_SxM: jax.Array
    head_dst_SxM: jax.Array
    count: jax.Array


def packed_logps_and_entropy(
    graphdef,
    params,
    prompt_tokens_NxP,
    tokens_NxT,
    pack: PackedRows,
    temperature: float,
    *,
    chunk_size: int = 0,
    with_entropy: bool = False,
):
    """(log-probs [N, T], entropies [N, T] or None) of the completion tokens ``pack``
    scores, 0 at every other token: the rows of :func:`completion_logps_and_entropy`,
    packed.

    The model runs over the packed rows (every sequence attending to itself alone, its
    positions restarting), the LM head over the M scored tokens of each shard only
    (gathered within the shard, ``chunk_size`` at a time; M a multiple of it), and the
    log-probs are scattered back to their rows and columns.
    """
    n, p = prompt_tokens_NxP.shape
    t = tokens_NxT.shape[1]
    table = jnp.concatenate([prompt_tokens_NxP.reshape(-1), tokens_NxT.reshape(-1)])
    tokens_RxL = table.astype(jnp.int32)[pack.src_RxL]
    model = nnx.merge(graphdef, params)
    seg = Segments(pack.id_RxL, pack.pos_RxL, pack.part_RxL)
    h_RxLxD = model.features(tokens_RxL, segments=seg)
    s, m = pack.head_src_SxM.shape
    r, l = tokens_RxL.shape
    h_SxRLxD = h_RxLxD.reshape(s, (r // s) * l, -1)
    h_SxMxD = jnp.take_along_axis(h_SxRLxD, pack.head_src_SxM[..., None], axis=1)
    flat_tokens = tokens_NxT.reshape(-1).astype(jnp.int32)
    targets_SxM = flat_tokens[jnp.minimum(pack.head_dst_SxM, n * t - 1)]
    logps_SxM, ent_SxM = _head_logps(
        model, h_SxMxD, targets_SxM, temperature, chunk_size, with_entropy
    )

    def scatter(x_SxM):
        out = jnp.zeros((n * t,), x_SxM.dtype)
        return out.at[pack.head_dst_SxM.reshape(-1)].set(x_SxM.reshape(-1), mode="drop")

    unflat = lambda x: scatter(x).reshape(n, t)
    return unflat(logps_SxM), None if ent_SxM is None else unflat(ent_SxM)


def packed_member(pack: PackedRows, n: int, t: int) -> jax.Array:
    """[N, T] float32: 1 at the tokens ``pack`` scores, 0 elsewhere."""
    out = jnp.zeros((n * t,), jnp.float32)
    return out.at[pack.head_dst_SxM.reshape(-1)].set(1.0, mode="drop").reshape(n, t)
