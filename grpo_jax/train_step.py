"""The jitted GRPO update: mu passes over a rollout batch in minibatches, guarded.

Shapes: N completion rows (B prompts x G, grouped contiguously), P padded
prompt length, T completion length, V vocabulary, U optimizer updates per
step (mu * N / M for minibatches of M rows), A gradient-accumulation
micro-batches per update.

    train_step(state, batch, key, ref_params) -> (state, metrics)

is a pure function of its arguments, compiled once with explicit shardings and
``donate_argnames=("state",)``. The batch carries pi_old's log-probs as the
sampler recorded them, so no old-policy forward pass is needed: all mu passes
start from the parameters that sampled the batch. The reference parameters
are a separate, frozen pytree (no optimizer state) and are None when beta = 0,
in which case no reference forward pass is traced at all.

Non-finite guard: an update whose loss or gradient norm is not finite is
dropped inside the jitted step (a ``lax.cond`` skips the optimizer, so
parameters and optimizer state keep their values bit for bit), counted in
``state.skipped`` and ``state.skipped_in_row``; the host stops the run after
too many in a row.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax import distributed, losses
from grpo_jax.config import GRPOConfig, OptimConfig
from grpo_jax.models.transformer import positions_from_mask

BATCH_KEYS = ("prompt_tokens", "prompt_mask", "tokens", "mask", "old_logps", "advantages")


@flax.struct.dataclass
class TrainState:
    """Everything the update changes; donated to the step and returned anew."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32 []: GRPO steps taken
    updates: jax.Array  # int32 []: optimizer updates applied (the schedule's clock)
    skipped: jax.Array  # int32 []: updates dropped as non-finite, in total
    skipped_in_row: jax.Array  # int32 []: ... since the last applied update


def init_state(params, tx: optax.GradientTransformation, mesh=None) -> TrainState:
    """A fresh state; with a mesh every leaf is committed to a NamedSharding on it.

    The optimizer moments inherit the parameters' shardings and scalars are
    replicated, so the state that goes in has the shardings of the state that
    comes out of the jitted step (a mismatch would compile the step twice).
    """
    opt_state = jax.jit(tx.init)(params)
    # Four distinct buffers: the state is donated, and one buffer may not be donated twice.
    zeros = [jnp.zeros((), jnp.int32) for _ in range(4)]
    state = TrainState(params, opt_state, *zeros)
    if mesh is not None:
        rep = NamedSharding(mesh, P())
        state = jax.tree.map(
            lambda x: x if isinstance(x.sharding, NamedSharding) else distributed.put(x, rep),
            state,
        )
    return state


def lr_schedule(cfg: OptimConfig, total_updates: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then constant, cosine or linear decay."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.end_lr_factor
    # The last update (index total_updates - 1) runs at the end value.
    decay_steps = max(total_updates - cfg.warmup_steps - 1, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.end_lr_factor)
    else:
        after = optax.linear_schedule(peak, end, decay_steps)
    if cfg.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig, total_updates: int):
    """(optax transformation, schedule): clip global norm, then AdamW."""
    schedule = lr_schedule(cfg, total_updates)
    parts = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    parts.append(
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    )
    return optax.chain(*parts), schedule


def _completion_features(
    model, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT, group_size: int = 1
):
    """The last layer's output at the positions that predict the completion tokens.

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
    mask_NxT = mask_NxT.astype(jnp.bool_)
    if group_size <= 1:
        full_NxL = jnp.concatenate([prompt_tokens_NxP, tokens_NxT], axis=1).astype(jnp.int32)
        full_mask_NxL = jnp.concatenate([prompt_mask_NxP, mask_NxT], axis=1)
        return model.features(full_NxL, mask_BxT=full_mask_NxL)[:, p - 1 : p + t - 1]
    g, b = group_size, n // group_size
    first = lambda x: x.reshape(b, g, *x.shape[1:])[:, 0]
    repeat = lambda x: jnp.repeat(x, g, axis=0)
    prompt_BxP, pmask_BxP = first(prompt_tokens_NxP).astype(jnp.int32), first(prompt_mask_NxP)
    positions_BxP = positions_from_mask(pmask_BxP)
    kv_mask_BxS = jnp.concatenate([pmask_BxP, jnp.zeros((b, t), jnp.bool_)], axis=1)
    x_BxPxD, cache = model.features_with_cache(
        prompt_BxP,
        positions_BxT=positions_BxP,
        kv_mask_BxS=kv_mask_BxS,
        cache=model.init_cache(b, p + t),
        cache_index=0,
    )
    h0_Nx1xD = repeat(x_BxPxD[:, -1:])  # the last prompt token predicts completion token 0
    if t == 1:
        return h0_Nx1xD
    cache = jax.tree.map(repeat, cache)
    # Completion tokens 0..T-2 are fed at slots P..P+T-2 (token T-1 predicts nothing).
    prompt_len_N = prompt_mask_NxP.sum(axis=1, dtype=jnp.int32)
    positions_NxT = prompt_len_N[:, None] + jnp.cumsum(mask_NxT, axis=1, dtype=jnp.int32) - 1
    x_NxTmxD, _ = model.features_with_cache(
        tokens_NxT[:, :-1].astype(jnp.int32),
        positions_BxT=positions_NxT[:, :-1],
        kv_mask_BxS=jnp.concatenate([prompt_mask_NxP, mask_NxT], axis=1),
        cache=cache,
        cache_index=p,
    )
    return jnp.concatenate([h0_Nx1xD, x_NxTmxD], axis=1)


def completion_logits(graphdef, params, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT):
    """Float32 logits [N, T, V] scoring each completion token (the LM head runs on those only)."""
    model = nnx.merge(graphdef, params)
    return model.logits(
        _completion_features(model, prompt_tokens_NxP, prompt_mask_NxP, tokens_NxT, mask_NxT)
    )


def _is_head(path, _) -> bool:
    return path[0] in ("final_norm", "embed", "lm_head")


def completion_scores(
    graphdef,
    params,
    batch,
    temperature: float,
    *,
    chunk_size: int = 0,
    with_entropy: bool = False,
    group_size: int = 1,
):
    """(log-probs [N, T], entropies [N, T] or None) of the completion tokens.

    With ``chunk_size`` (a divisor of T; 0: all T at once) the LM head, the
    log-softmax and the entropy run over chunks of the completion with
    rematerialisation: the float32 logits are never formed for more than
    [N, chunk_size, V] at a time, forward or backward (large vocabularies).
    Entropies carry no gradient. ``group_size`` G > 1: rows come in aligned
    groups of G with one prompt each, run once per group (``_completion_features``).
    """
    model = nnx.merge(graphdef, params)
    h_NxTxD = _completion_features(
        model,
        batch["prompt_tokens"],
        batch["prompt_mask"],
        batch["tokens"],
        batch["mask"],
        group_size=group_size,
    )
    tokens_NxT = batch["tokens"]
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


def completion_logps(
    graphdef, params, batch, temperature, *, chunk_size: int = 0, group_size: int = 1
):
    """log pi(completion tokens) [N, T] (no entropy): the reference and update-tracking passes."""
    return completion_scores(
        graphdef, params, batch, temperature, chunk_size=chunk_size, group_size=group_size
    )[0]


def _split_rows(x, num_parts: int, shards: int):
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


def _metric_reduce(name: str):
    if name.endswith("ratio_min"):
        return jnp.min
    if name.endswith("ratio_max"):
        return jnp.max
    return jnp.mean


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    key: jax.Array,
    ref_params=None,
    *,
    graphdef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    grpo: GRPOConfig,
    minibatch_size: int,
    grad_accum: int,
    batch_shards: int,
    track_update: bool,
    logits_chunk: int = 0,
    share_prompts: bool = False,
):
    """mu passes over the batch, one optimizer update per minibatch (see module doc).

    ``batch`` holds the keys of ``BATCH_KEYS``: prompt_tokens / prompt_mask
    [N, P], tokens / mask / old_logps [N, T], advantages [N]. ``key`` is
    unused by the deterministic update and kept for a uniform signature
    (stochastic regularisers would fold it). ``logits_chunk`` > 0 scores the
    completions in chunks of that many tokens (``completion_scores``).
    ``share_prompts``: the batch's rows come in groups of G = ``grpo.G`` that
    share one prompt (as the sampler writes them); each prompt is then run
    once per group wherever a (micro-)batch holds whole groups.
    """
    del key
    n = batch["tokens"].shape[0]
    m = n if minibatch_size == 0 else minibatch_size
    num_mb = n // m
    temperature = grpo.temperature
    use_ref = grpo.beta > 0
    G = grpo.G if share_prompts else 1
    # Groups stay whole and aligned in a part of the batch when each shard's
    # block of it holds a multiple of G rows (``_split_rows`` takes blocks).
    g_full = G if (n // batch_shards) % G == 0 else 1
    g_micro = G if (m // (batch_shards * grad_accum)) % G == 0 else 1
    if use_ref:
        ref_logps_NxT = jax.lax.stop_gradient(
            completion_logps(
                graphdef, ref_params, batch, temperature, chunk_size=logits_chunk, group_size=g_full
            )
        )
        batch = dict(batch, ref_logps=ref_logps_NxT)

    def loss_fn(params, mb):
        logps_NxT, entropy_NxT = completion_scores(
            graphdef,
            params,
            mb,
            temperature,
            chunk_size=logits_chunk,
            with_entropy=True,
            group_size=g_micro,
        )
        return losses.grpo_loss(
            logps_NxT,
            mb["old_logps"],
            mb["advantages"],
            mb["mask"],
            ref_logps_NxT=mb.get("ref_logps"),
            beta=grpo.beta,
            epsilon_low=grpo.epsilon_low,
            epsilon_high=grpo.epsilon_high,
            kl_estimator=grpo.kl_estimator,
            reduction=grpo.reduction,
            entropy_NxT=entropy_NxT,
        )

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one_update(st: TrainState, mb):
        if grad_accum == 1:
            (loss, aux), grads = grad_fn(st.params, mb)
        else:
            micro = jax.tree.map(lambda x: _split_rows(x, grad_accum, batch_shards), mb)
            # Each micro-batch's share of the minibatch: its rows (1 / A) for the
            # per-sequence reductions, its tokens for "token_mean", whose loss is a
            # mean over all the minibatch's tokens. Token means in the metrics
            # (KL, entropy, clip fractions) are weighted by tokens either way.
            tokens_A = micro["mask"].astype(jnp.float32).sum(axis=(1, 2))
            tok_w_A = tokens_A / jnp.maximum(tokens_A.sum(), 1.0)
            if grpo.reduction == "token_mean":
                w_A = tok_w_A
            else:
                w_A = jnp.full((grad_accum,), 1.0 / grad_accum)

            def acc(carry, xs):
                mbi, w = xs
                (l_i, aux_i), g_i = grad_fn(st.params, mbi)
                return jax.tree.map(lambda c, g: c + w * g, carry, g_i), (l_i, aux_i)

            zeros = jax.tree.map(jnp.zeros_like, st.params)
            grads, (loss_A, aux_A) = jax.lax.scan(acc, zeros, (micro, w_A))
            loss = (loss_A * w_A).sum()
            aux = {
                k: (v * tok_w_A).sum() if _metric_reduce(k) is jnp.mean else _metric_reduce(k)(v)
                for k, v in aux_A.items()
            }
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def apply(params_opt):
            params, opt_state = params_opt
            upd, new_opt = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, upd), new_opt

        # A branch, not a select over the results: the skip costs nothing on
        # the common path, where selecting new-or-old over params and both
        # Adam moments took three extra passes over the state (20M
        # parameters, 1 CPU thread: 120 -> 77 ms per update).
        new_params, new_opt = jax.lax.cond(
            finite, apply, lambda params_opt: params_opt, (st.params, st.opt_state)
        )
        lr = schedule(st.updates)
        st = st.replace(
            params=new_params,
            opt_state=new_opt,
            updates=st.updates + finite.astype(jnp.int32),
            skipped=st.skipped + (~finite).astype(jnp.int32),
            skipped_in_row=jnp.where(finite, 0, st.skipped_in_row + 1),
        )
        metrics = dict(aux, loss=loss, grad_norm=grad_norm, lr=lr)
        return st, metrics

    parts = jax.tree.map(lambda x: _split_rows(x, num_mb, batch_shards), batch)
    skipped_before = state.skipped
    all_metrics = []
    for _ in range(grpo.mu):  # mu is small and static: unrolled passes.
        state, m_U = jax.lax.scan(one_update, state, parts)
        all_metrics.append(m_U)
    m_U = jax.tree.map(lambda *xs: jnp.concatenate([jnp.atleast_1d(x) for x in xs]), *all_metrics)
    metrics = {}
    for k, v in m_U.items():
        if k in ("ratio_min", "ratio_max"):
            metrics[f"train/{k}"] = _metric_reduce(k)(v)
        elif k == "kl_mean":
            metrics["train/kl"] = v.mean()
        elif k == "lr":
            metrics["train/lr"] = v[-1]
        else:
            metrics[f"train/{k}"] = v.mean()
    metrics["train/skipped_updates"] = state.skipped - skipped_before
    metrics["train/skipped_total"] = state.skipped
    metrics["train/skipped_in_row"] = state.skipped_in_row
    metrics["train/updates"] = state.updates

    if track_update:
        # How far one step moved the policy on its own samples: KL(pi_old ||
        # pi_new) by the k3 estimator with samples from pi_old, and the ratio range.
        new_NxT = jax.lax.stop_gradient(
            completion_logps(
                graphdef,
                state.params,
                batch,
                temperature,
                chunk_size=logits_chunk,
                group_size=g_full,
            )
        )
        mask_NxT = batch["mask"].astype(jnp.float32)
        log_r_NxT = jnp.where(mask_NxT > 0, new_NxT - batch["old_logps"], 0.0)
        denom = jnp.maximum(mask_NxT.sum(), 1.0)
        k3_NxT = jnp.exp(log_r_NxT) - log_r_NxT - 1.0
        metrics["policy/kl_old_new"] = (k3_NxT * mask_NxT).sum() / denom
        metrics["policy/ratio_max"] = jnp.max(jnp.where(mask_NxT > 0, jnp.exp(log_r_NxT), 0.0))
        metrics["policy/ratio_min"] = jnp.min(jnp.where(mask_NxT > 0, jnp.exp(log_r_NxT), jnp.inf))
        metrics["policy/abs_log_ratio_mean"] = (jnp.abs(log_r_NxT) * mask_NxT).sum() / denom
    state = state.replace(step=state.step + 1)
    return state, metrics


def jit_train_step(
    *,
    graphdef,
    tx,
    schedule,
    grpo: GRPOConfig,
    minibatch_size: int,
    grad_accum: int,
    batch_shards: int,
    track_update: bool,
    state_shardings,
    logits_chunk: int = 0,
    share_prompts: bool = False,
    batch_sharding_fn,
    ref_shardings,
    replicated,
):
    """``train_step`` bound to its static configuration and jitted with shardings."""
    fn = functools.partial(
        train_step,
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=grpo,
        minibatch_size=minibatch_size,
        grad_accum=grad_accum,
        batch_shards=batch_shards,
        track_update=track_update,
        logits_chunk=logits_chunk,
        share_prompts=share_prompts,
    )
    batch_shardings = {k: batch_sharding_fn(2 if k != "advantages" else 1) for k in BATCH_KEYS}
    return jax.jit(
        fn,
        in_shardings=(state_shardings, batch_shardings, replicated, ref_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnames=("state",),
    )
