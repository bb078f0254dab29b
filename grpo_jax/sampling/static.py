"""Jitted KV-cache sampler: prefill a left-padded batch, then decode in a ``lax.while_loop``.

Shapes: B prompts, G samples per prompt (``num_samples``), N = B*G rows grouped
contiguously (row b*G + g is sample g of prompt b), P padded prompt length (a bucket),
T = ``max_new_tokens`` completion slots, S = P + T KV-cache slots, V vocabulary, K candidate
tokens kept by top-k / top-p. :func:`generate` records pi_old's log-probs as it samples.
docs/engine.md, "The static sampler", has the two jitted functions, what compiles when, and
the sharding.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.core import distributed
from grpo_jax.core import sharding as sharding_lib
from grpo_jax.models import moe as moe_lib
from grpo_jax.models.partitioning import cache_shardings
from grpo_jax.models.transformer import positions_from_mask
from grpo_jax.sampling.config import SamplingConfig, SamplingSection  # noqa: F401 - also here
from grpo_jax.sampling.draw import (  # noqa: F401 - also here, where the samplers' callers look
    candidates,
    draw,
    sample_step,
    sample_with,
    stop_hits,
    stop_table,
)

# ---------------------------------------------------------------------------
# Prompt padding.


def pad_prompts(
    token_lists: Sequence[Sequence[int]],
    *,
    pad_id: int,
    buckets: Sequence[int],
    max_new_tokens: int = 0,
    max_context: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads prompts to the smallest bucket that holds the longest one.

    Left padding puts every prompt's last token in column P-1, so one
    prefill's last logits start every row's completion, and every row's
    completion starts in the same cache slot P.

    Args:
      token_lists: B prompts, each a non-empty list of token ids.
      pad_id: id written in the padding (masked out everywhere).
      buckets: increasing allowed lengths P.
      max_new_tokens, max_context: when ``max_context`` (the model's maximum
        sequence length) is given, a prompt whose length plus
        ``max_new_tokens`` exceeds it is an error.

    Returns:
      (tokens_BxP int32, mask_BxP bool), mask True on real tokens.
    """
    if len(token_lists) == 0:
        raise ValueError("pad_prompts got no prompts")
    buckets = sorted(int(b) for b in buckets)
    if not buckets:
        raise ValueError("pad_prompts needs at least one bucket")
    lengths = [len(t) for t in token_lists]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if n > buckets[-1]:
            raise ValueError(
                f"prompt {i} has {n} tokens, more than the largest prompt bucket "
                f"{buckets[-1]} (buckets {buckets}); shorten it or add a bucket"
            )
        if max_context is not None and n + max_new_tokens > max_context:
            raise ValueError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{n + max_new_tokens} positions, more than the model's max context "
                f"{max_context}"
            )
    p = next(b for b in buckets if b >= max(lengths))
    tokens_BxP = np.full((len(token_lists), p), pad_id, dtype=np.int32)
    mask_BxP = np.zeros((len(token_lists), p), dtype=np.bool_)
    for i, toks in enumerate(token_lists):
        row = np.asarray(toks, dtype=np.int64)
        if row.ndim != 1 or (row < 0).any() or (row > np.iinfo(np.int32).max).any():
            raise ValueError(f"prompt {i} must be a flat list of non-negative token ids")
        tokens_BxP[i, p - len(row) :] = row
        mask_BxP[i, p - len(row) :] = True
    return tokens_BxP, mask_BxP


# ---------------------------------------------------------------------------
# The decode state machine.


class DecodeState(NamedTuple):
    """Carry of the decode loop; every array but ``step`` (and one key's ``key_data``) leads
    with N."""

    step: jax.Array  # int32 []: completion tokens written so far (all rows)
    last_tokens_N: jax.Array  # int32: token written at step-1, to be fed next
    prompt_lengths_N: jax.Array  # int32: real prompt tokens (position of token 0)
    tokens_NxT: jax.Array  # int32: completion so far, pad_id after a row's end
    logps_NxT: jax.Array  # float32: log-prob of each written token, 0 after the end
    behavior_logps_NxT: jax.Array  # float32: its log-prob under the sampled distribution
    lengths_N: jax.Array  # int32: real completion tokens, EOS / stop sequence included
    done_N: jax.Array  # bool: row has emitted an EOS or completed a stop sequence
    kv_mask_NxS: jax.Array  # bool: cache slots holding real tokens
    cache: Any  # the model's KV cache pytree
    # Raw uint32 data of the PRNG key for the remaining draws: a typed key
    # crossing the prefill -> decode boundary costs jit a second dispatch
    # cache entry for the same executable, which would hide real recompiles.
    # [N, ...] with row keys (one key per row), else one key's.
    key_data: jax.Array
    # With cfg.record_routes on a mixture of experts: the experts each cache slot's token
    # used, [N, S, R, K] (int8 / int16, -1 where no token was fed); None otherwise.
    routes_NxSxRxK: Any = None


class SampleOutput(NamedTuple):
    """Rollouts, row b*G + g being sample g of prompt b.

    ``mask_NxT`` is True on real completion tokens up to and including the
    EOS or the last token of the stop sequence that ended the row;
    ``logps_NxT`` is 0 and ``tokens_NxT`` is pad_id elsewhere.
    ``truncated_N`` marks rows that hit max_new_tokens without either.
    ``logps`` are full-softmax log-probs (pi_old at the temperature);
    ``behavior_logps`` those under the distribution actually sampled (after
    top-k / top-p / min-p; :func:`sample_step`).
    """

    prompt_tokens: jax.Array  # int32 [N, P]
    prompt_mask: jax.Array  # bool [N, P]
    tokens: jax.Array  # int32 [N, T]
    mask: jax.Array  # bool [N, T]
    logps: jax.Array  # float32 [N, T]
    lengths: jax.Array  # int32 [N]
    truncated: jax.Array  # bool [N]
    behavior_logps: jax.Array | None = None  # float32 [N, T]
    # With cfg.record_routes on a mixture of experts: the experts the sparse layers chose at
    # every position of [prompt | completion], [N, P + T, R, K] int8 (int16 past 127
    # experts); completion token t's at P + t, -1 where no token was fed (a row's last
    # token, which predicts nothing the update scores). None otherwise.
    routes: jax.Array | None = None


def split_key(key):
    """(carry, sub) of a key, or of each of the [N] row keys."""
    if jnp.ndim(key) == 0:
        return jax.random.split(key)
    keys_Nx2 = jax.vmap(jax.random.split)(key)
    return keys_Nx2[:, 0], keys_Nx2[:, 1]


def sample_keys(keys_B, g: int):
    """[B * G] row keys from one key per prompt: row b*G + g is ``fold_in(keys_B[b], g)``."""
    samples = jnp.arange(g, dtype=jnp.uint32)
    keys_BxG = jax.vmap(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(samples))(keys_B)
    return keys_BxG.reshape(-1)


def problem_keys(key, start: int, count: int, size: int):
    """[size] prompt keys of a call holding problems start .. start + count - 1 (and
    ``size - count`` padding copies of the first): problem i's key is ``fold_in(key, i)``,
    whatever call it falls in (evaluation's row keys)."""
    index = list(range(start, start + count)) + [start] * (size - count)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(index))


def _write(state: DecodeState, drawn, cfg: SamplingConfig) -> DecodeState:
    """Records step ``state.step``'s draw (tokens, logps, behavior logps); done rows pad."""
    tokens_N, logps_N, behavior_N = drawn
    live_N = ~state.done_N
    tokens_N = jnp.where(live_N, tokens_N, cfg.pad_id).astype(jnp.int32)
    logps_N = jnp.where(live_N, logps_N, 0.0).astype(jnp.float32)
    behavior_N = jnp.where(live_N, behavior_N, 0.0).astype(jnp.float32)
    col = (jnp.zeros((), jnp.int32), state.step)
    done_N = state.done_N
    if cfg.eos_ids:
        eos_E = jnp.asarray(cfg.eos_ids, jnp.int32)
        done_N = done_N | (live_N & (tokens_N[:, None] == eos_E[None, :]).any(-1))
    tokens_NxT = jax.lax.dynamic_update_slice(state.tokens_NxT, tokens_N[:, None], col)
    if cfg.stop_sequences:
        # The last L completion columns up to this step's; those before column 0
        # (clipped there) do not count: a stop never matches into the prompt.
        # A live row has written every column so far, so all rows share them.
        longest = max(len(q) for q in cfg.stop_sequences)
        t = tokens_NxT.shape[1]
        cols_L = state.step + 1 - longest + jnp.arange(longest, dtype=jnp.int32)
        recent_NxL = jnp.take(tokens_NxT, jnp.clip(cols_L, 0, t - 1), axis=1)
        done_N = done_N | (live_N & stop_hits(recent_NxL, state.step + 1, cfg.stop_sequences))
    return state._replace(
        step=state.step + 1,
        last_tokens_N=tokens_N,
        tokens_NxT=tokens_NxT,
        logps_NxT=jax.lax.dynamic_update_slice(state.logps_NxT, logps_N[:, None], col),
        behavior_logps_NxT=jax.lax.dynamic_update_slice(
            state.behavior_logps_NxT, behavior_N[:, None], col
        ),
        lengths_N=state.lengths_N + live_N.astype(jnp.int32),
        done_N=done_N,
    )


def repeat_rows(x, g: int, axis: int = 0):
    # [..., B, ...] -> [..., B*G, ...], each row repeated G times contiguously;
    # a reshape of a broadcast, so rows stay on the shard of their prompt.
    if g == 1:
        return x
    shape = x.shape
    x = jnp.expand_dims(x, axis + 1)
    x = jnp.broadcast_to(x, (*shape[: axis + 1], g, *shape[axis + 1 :]))
    return x.reshape(*shape[:axis], shape[axis] * g, *shape[axis + 1 :])


def _cache_batch_axes(model, s: int):
    """The batch axis of each cache leaf: where init_cache(1, S) and (2, S) differ."""
    one, two = (jax.eval_shape(lambda b=b: model.init_cache(b, s)) for b in (1, 2))
    return jax.tree.map(
        lambda a, b: next(i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y),
        one,
        two,
    )


def _prefill(
    params,
    prompt_tokens_BxP,
    prompt_mask_BxP,
    key,
    *,
    graphdef,
    cfg: SamplingConfig,
    num_samples: int,
    mesh: Mesh | None,
):
    """Runs each prompt through the model once, fills the cache, draws token 0.

    The forward pass sees the B distinct prompts only; its cache and last
    logits are then repeated G times, so prefill costs B rows, not B*G.
    """
    model = nnx.merge(graphdef, params)
    g = num_samples
    tokens_BxP = prompt_tokens_BxP.astype(jnp.int32)
    mask_BxP = prompt_mask_BxP.astype(jnp.bool_)
    b, p = tokens_BxP.shape
    n, t = b * g, cfg.max_new_tokens
    s = p + t
    # Positions count real tokens only, so a left-padded prompt sees the same
    # rotary phases as an unpadded one; pads get 0 (they are masked anyway).
    positions_BxP = positions_from_mask(mask_BxP)
    kv_mask_BxS = jnp.concatenate([mask_BxP, jnp.zeros((b, t), jnp.bool_)], axis=1)
    constrain_cache = lambda c: c
    if mesh is not None:
        # Rows of the cache live with their rows of the batch (KV heads split
        # too under tensor parallelism); the loop then never moves them.
        constrain_cache = lambda c: jax.lax.with_sharding_constraint(
            c, cache_shardings(c, mesh, model.layout)
        )
    record = _records_routes(model, cfg)
    inputs = dict(
        positions_BxT=positions_BxP,
        kv_mask_BxS=kv_mask_BxS,
        cache=constrain_cache(model.init_cache(b, s)),
        cache_index=0,  # static: the splash kernel serves the prefill
    )
    if record:
        x_BxPxD, cache, routes_BxPxRxK = model.features_with_cache(
            tokens_BxP, routes_out=True, **inputs
        )
        logits_Bx1xV = model.logits(x_BxPxD[:, -1:])  # a prefill needs the last logits only
    else:
        logits_Bx1xV, cache = model.forward_with_cache(tokens_BxP, last_only=True, **inputs)
    # Left padding puts every row's last prompt token in column P-1.
    last_NxV = repeat_rows(logits_Bx1xV[:, 0], g)
    if g > 1:
        axes = _cache_batch_axes(model, s)
        cache = jax.tree.map(lambda c, ax: repeat_rows(c, g, axis=ax), cache, axes)
    cache = constrain_cache(cache)
    rows = lambda x: x
    if mesh is not None:
        rows = lambda x: jax.lax.with_sharding_constraint(
            x, sharding_lib.batch_sharding(mesh, x.ndim)
        )
    tokens_NxP, mask_NxP = rows(repeat_rows(tokens_BxP, g)), rows(repeat_rows(mask_BxP, g))
    if jnp.ndim(key) == 1:  # row keys: row b*G + g draws from fold_in(key_b, g)
        key = rows(sample_keys(key, g))
    key, sub = split_key(key)
    state = DecodeState(
        step=jnp.zeros((), jnp.int32),
        last_tokens_N=jnp.full((n,), cfg.pad_id, jnp.int32),
        prompt_lengths_N=mask_NxP.sum(axis=1, dtype=jnp.int32),
        tokens_NxT=jnp.full((n, t), cfg.pad_id, jnp.int32),
        logps_NxT=jnp.zeros((n, t), jnp.float32),
        behavior_logps_NxT=jnp.zeros((n, t), jnp.float32),
        lengths_N=jnp.zeros((n,), jnp.int32),
        done_N=jnp.zeros((n,), jnp.bool_),
        kv_mask_NxS=rows(repeat_rows(kv_mask_BxS, g)),
        cache=cache,
        key_data=jax.random.key_data(key),
    )
    if record:
        dtype = moe_lib.routes_dtype(model.config.num_experts)
        r_, k_ = routes_BxPxRxK.shape[2:]
        routes = jnp.full((n, s, r_, k_), -1, dtype)
        prompt = repeat_rows(routes_BxPxRxK.astype(dtype), g)
        state = state._replace(routes_NxSxRxK=rows(routes.at[:, :p].set(prompt)))
    return tokens_NxP, mask_NxP, _write(state, sample_with(rows(last_NxV), sub, cfg), cfg)


def _records_routes(model, cfg: SamplingConfig) -> bool:
    """Whether the sampler records routes: asked to, and the model is a mixture of experts."""
    return cfg.record_routes and bool(getattr(getattr(model, "config", None), "num_experts", 0))


def _decode(params, state: DecodeState, *, graphdef, cfg: SamplingConfig, key_impl):
    """Feeds one token per step until every row is done or T tokens are written."""
    model = nnx.merge(graphdef, params)
    t = cfg.max_new_tokens
    prompt_len = state.kv_mask_NxS.shape[1] - t

    def cond(st: DecodeState):
        return (st.step < t) & ~jnp.all(st.done_N)

    def body(st: DecodeState):
        slot = prompt_len + st.step - 1  # cache slot of the token being fed
        n = st.last_tokens_N.shape[0]
        kv_mask_NxS = jax.lax.dynamic_update_slice(
            st.kv_mask_NxS, jnp.ones((n, 1), jnp.bool_), (jnp.zeros((), jnp.int32), slot)
        )
        inputs = dict(
            positions_BxT=(st.prompt_lengths_N + st.step - 1)[:, None],
            kv_mask_BxS=kv_mask_NxS,
            cache=st.cache,
            cache_index=slot,
        )
        if st.routes_NxSxRxK is None:
            logits_Nx1xV, cache = model.forward_with_cache(st.last_tokens_N[:, None], **inputs)
        else:
            x_Nx1xD, cache, used_Nx1xRxK = model.features_with_cache(
                st.last_tokens_N[:, None], routes_out=True, **inputs
            )
            logits_Nx1xV = model.logits(x_Nx1xD)
        key, sub = split_key(jax.random.wrap_key_data(st.key_data, impl=key_impl))
        drawn = sample_with(logits_Nx1xV[:, 0], sub, cfg)
        st = st._replace(kv_mask_NxS=kv_mask_NxS, cache=cache, key_data=jax.random.key_data(key))
        if st.routes_NxSxRxK is not None:  # the fed token's experts, at its slot
            used = used_Nx1xRxK.astype(st.routes_NxSxRxK.dtype)
            zero = jnp.zeros((), jnp.int32)
            routes = jax.lax.dynamic_update_slice(st.routes_NxSxRxK, used, (zero, slot, zero, zero))
            st = st._replace(routes_NxSxRxK=routes)
        return _write(st, drawn, cfg)

    state = jax.lax.while_loop(cond, body, state)
    mask_NxT = jnp.arange(t, dtype=jnp.int32)[None, :] < state.lengths_N[:, None]
    # The whole final state goes back out so every donated buffer (the cache
    # above all) aliases an output and the loop updates it in place.
    return state, mask_NxT, ~state.done_N


# ---------------------------------------------------------------------------
# Compilation and the public entry point.

_JITTED: list = []  # Every jitted prefill/decode made, for compile_count().


def compile_count() -> int:
    """How many sampler executables have been compiled in this process.

    Unchanged across two ``generate`` calls means the second reused compiled
    code: what bucketed prompt lengths buy in steady-state training.
    """
    return sum(f._cache_size() for f in _JITTED)


@functools.lru_cache(maxsize=64)
def _compiled(
    graphdef, cfg: SamplingConfig, num_samples: int, mesh: Mesh | None, key_impl, row_keys=False,
    routes=False,
):  # fmt: skip
    """(prefill, decode) jitted for one model structure, config, group size and mesh.
    ``routes``: whether the decode state records routes (:func:`_records_routes`)."""
    if mesh is None:
        prefill_io: dict = {}
        decode_io: dict = {}
    else:
        rows2 = sharding_lib.batch_sharding(mesh, 2)
        rows1 = sharding_lib.batch_sharding(mesh, 1)
        rep = sharding_lib.replicated(mesh)
        # The cache's sharding is set inside prefill from the model's layout
        # (None: as it comes out of the computation).
        state_shardings = DecodeState(
            step=rep,
            last_tokens_N=rows1,
            prompt_lengths_N=rows1,
            tokens_NxT=rows2,
            logps_NxT=rows2,
            behavior_logps_NxT=rows2,
            lengths_N=rows1,
            done_N=rows1,
            kv_mask_NxS=rows2,
            cache=None,
            key_data=rows2 if row_keys else rep,
            routes_NxSxRxK=sharding_lib.batch_sharding(mesh, 4) if routes else None,
        )
        # None for params: they keep whatever layout the trainer gave them.
        prefill_io = dict(
            in_shardings=(None, rows2, rows2, rows1 if row_keys else rep),
            out_shardings=(rows2, rows2, state_shardings),
        )
        decode_io = dict(
            in_shardings=(None, state_shardings),
            out_shardings=(state_shardings, rows2, rows1),
        )
    prefill = jax.jit(
        functools.partial(_prefill, graphdef=graphdef, cfg=cfg, num_samples=num_samples, mesh=mesh),
        **prefill_io,
    )
    decode = jax.jit(
        functools.partial(_decode, graphdef=graphdef, cfg=cfg, key_impl=key_impl),
        donate_argnums=(1,),
        **decode_io,
    )
    _JITTED.extend([prefill, decode])
    return prefill, decode


def generate(
    graphdef: nnx.GraphDef,
    params,
    prompt_tokens_BxP,
    prompt_mask_BxP,
    key: jax.Array,
    cfg: SamplingConfig,
    *,
    num_samples: int = 1,
    mesh: Mesh | None = None,
) -> SampleOutput:
    """Samples ``num_samples`` completions per prompt with the model ``(graphdef, params)``.

    Each token's recorded log-prob is pi_old's over the untruncated vocabulary,

        logp_t = log softmax(logits_t / temperature)[o_t],

    the formula of ``grpo_jax.objective.losses.per_token_logps`` on a full forward pass over
    [prompt | completion]; the two differ only in the order of their floating-point
    operations (docs/objective.md, sections 3 and 9).

    Args:
      graphdef, params: ``nnx.split(model)``; params are read, never copied
        or donated, and keep their shardings.
      prompt_tokens_BxP, prompt_mask_BxP: left-padded prompts and their
        real-token mask, as made by :func:`pad_prompts`.
      key: PRNG key; the same key gives the same output, and every row (also
        within a group) draws independently. Or B keys, one per prompt ("row
        keys"): sample g of prompt b then draws from fold_in(key[b], g) alone, so
        its completion does not depend on the other prompts of the call, their
        number or their order (what evaluation needs to be independent of its
        batch size).
      cfg: the sampling settings (static: each distinct config compiles once).
      num_samples: G, completions per prompt; row b*G + g is sample g of b.
      mesh: when given, rows are split over ("data", "fsdp") in whole groups
        (B must be a multiple of the number of batch shards).

    Returns:
      :class:`SampleOutput` with N = B*G rows and T = cfg.max_new_tokens.
    """
    if not isinstance(cfg, SamplingConfig):
        raise TypeError(f"cfg must be a SamplingConfig, got {type(cfg).__name__}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples = {num_samples!r} must be a positive integer")
    shape, mask_shape = np.shape(prompt_tokens_BxP), np.shape(prompt_mask_BxP)
    if len(shape) != 2 or shape != mask_shape:
        raise ValueError(
            f"prompt_tokens_BxP {shape} and prompt_mask_BxP {mask_shape} must be two "
            "arrays of the same [B, P] shape"
        )
    if not jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # A raw jax.random.PRNGKey.
    row_keys = jnp.ndim(key) == 1
    if row_keys and jnp.shape(key) != (shape[0],):
        raise ValueError(f"row keys must be one per prompt, [{shape[0]}], got {jnp.shape(key)}")
    if jnp.ndim(key) > 1:
        raise ValueError(f"key must be one key or one per prompt, got shape {jnp.shape(key)}")
    if mesh is not None:
        sharding_lib.check_group_layout(shape[0] * num_samples, num_samples, mesh)
        rows2 = sharding_lib.batch_sharding(mesh, 2)
        # distributed.put: also when the mesh spans hosts (every host passes the same prompts).
        prompt_tokens_BxP, prompt_mask_BxP = distributed.put(
            (prompt_tokens_BxP, prompt_mask_BxP), rows2
        )
        key = distributed.put(
            key, sharding_lib.batch_sharding(mesh, 1) if row_keys else sharding_lib.replicated(mesh)
        )
    routes = cfg.record_routes and _records_routes(nnx.merge(graphdef, params), cfg)
    prefill, decode = _compiled(
        graphdef, cfg, num_samples, mesh, jax.random.key_impl(key), bool(row_keys), routes
    )
    # Under the mesh the model's activation sharding constraints take effect.
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        prompt_tokens_NxP, prompt_mask_NxP, state = prefill(
            params, prompt_tokens_BxP, prompt_mask_BxP, key
        )
        state, mask_NxT, truncated_N = decode(params, state)
    return SampleOutput(
        prompt_tokens=prompt_tokens_NxP,
        prompt_mask=prompt_mask_NxP,
        tokens=state.tokens_NxT,
        mask=mask_NxT,
        logps=state.logps_NxT,
        lengths=state.lengths_N,
        truncated=truncated_N,
        behavior_logps=state.behavior_logps_NxT,
        routes=state.routes_NxSxRxK,
    )
