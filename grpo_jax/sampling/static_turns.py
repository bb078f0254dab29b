"""The multi-turn decode kernel: the model continues an episode from its KV cache.

Shapes: B prompts, G episodes per prompt, N = B*G rows (grouped contiguously), P padded
prompt length, T transcript slots per episode (``MultiTurnConfig.max_tokens``), S = P + T
cache slots, O the most observation tokens appended at once (``max_obs_tokens``), V
vocabulary. :func:`phase` advances every active row one token per step until every turn has
ended; :func:`align` rolls each row's cache so that its real tokens end at one shared slot.
docs/multiturn.md, "How the sampler continues from the KV cache", explains both and the keys.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.core.checks import check_range
from grpo_jax.models import moe as moe_lib
from grpo_jax.models.transformer import positions_from_mask
from grpo_jax.sampling.static import (
    SamplingConfig,
    _records_routes,
    repeat_rows,
    sample_keys,
    sample_with,
    split_key,
    stop_hits,
)

__all__ = [
    "BUDGET",
    "StaticTurns",
    "RUNNING",
    "TURN_END",
    "MTState",
    "MultiTurnConfig",
    "align",
    "compiled",
    "phase",
    "prefill",
    "write_token",
]

# Why a row went idle in a phase.
RUNNING, TURN_END, BUDGET = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """Budgets of a multi-turn episode.

    Attributes:
      max_tokens: T, transcript slots per episode: model and environment tokens.
      max_turns: model turns per episode.
      max_turn_tokens: model tokens per turn; a turn ends at an EOS, a stop
        sequence (``SamplingConfig.stop_sequences``) or here.
        0: no limit but ``max_tokens``.
      max_obs_tokens: O, the most tokens one observation may add.
      env_timeout_s: time budget of each ``reset`` / ``step`` call.
    """

    max_tokens: int
    max_turns: int = 4
    max_turn_tokens: int = 0
    max_obs_tokens: int = 32
    env_timeout_s: float = 10.0

    def __post_init__(self):
        check_range("env.max_tokens", self.max_tokens, lo=2, integer=True)
        check_range("env.max_turns", self.max_turns, lo=1, integer=True)
        check_range("env.max_turn_tokens", self.max_turn_tokens, lo=0, integer=True)
        check_range("env.max_obs_tokens", self.max_obs_tokens, lo=1, integer=True)
        check_range("env.env_timeout_s", self.env_timeout_s, lo=0.0, lo_open=True)


# ---------------------------------------------------------------------------
# The device state and its two jitted functions.


class MTState(NamedTuple):
    """Carry of the multi-turn loop; arrays lead with N unless noted."""

    cache: Any  # the model's KV cache, S slots
    kv_mask_NxS: jax.Array  # bool: slots holding real tokens
    end_slot_N: jax.Array  # int32: the slot after the row's last real token
    pos_N: jax.Array  # int32: real tokens in the cache = position of the next one fed
    pending_N: jax.Array  # int32: the last token written, not yet fed
    tokens_NxT: jax.Array  # int32: transcript
    mask_NxT: jax.Array  # bool: written by the model
    logps_NxT: jax.Array  # float32: log pi_old of model tokens
    behavior_NxT: jax.Array  # float32: log q of model tokens (after top-k / top-p / min-p)
    len_N: jax.Array  # int32: transcript tokens written
    turn_len_N: jax.Array  # int32: model tokens in the current turn
    active_N: jax.Array  # bool: takes part in this phase
    reason_N: jax.Array  # int32: RUNNING, TURN_END or BUDGET
    last_eos_N: jax.Array  # bool: the last model token was an EOS
    forced_NxO: jax.Array  # int32: observation tokens queued
    forced_len_N: jax.Array  # int32
    forced_pos_N: jax.Array  # int32
    key_data: jax.Array  # raw PRNG key data: one key [...], or one per row [N, ...]
    # With sampling.record_routes on a mixture of experts: the experts each position of
    # [prompt | transcript] used when it was fed, [N, P + T, R, K] (int8 / int16, -1 where
    # nothing was fed); indexed by position, not cache slot, so the rolls leave it be.
    # None otherwise: the programs of a run without routing replay.
    routes_NxSxRxK: Any = None


def cache_axes(model, b: int, s: int):
    """(batch axis, slot axis) of each cache leaf, from the cache's shapes."""
    shape = lambda b_, s_: jax.eval_shape(lambda: model.init_cache(b_, s_))
    base, more_b, more_s = shape(b, s), shape(b + 1, s), shape(b, s + 1)
    diff = lambda x, y: next(i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q)
    batch = jax.tree.map(lambda x, y: diff(x, y), base, more_b)
    slot = jax.tree.map(lambda x, y: diff(x, y), base, more_s)
    return batch, slot


def roll_rows(x, shift_N, batch_axis: int, slot_axis: int):
    """out[n, ..., s] = x[n, ..., (s - shift[n]) mod S] along the given axes."""
    y = jnp.moveaxis(x, (batch_axis, slot_axis), (0, -1))
    s = y.shape[-1]
    idx_NxS = (jnp.arange(s, dtype=jnp.int32)[None, :] - shift_N[:, None]) % s
    idx = idx_NxS.reshape(idx_NxS.shape[0], *([1] * (y.ndim - 2)), s)
    y = jnp.take_along_axis(y, jnp.broadcast_to(idx, y.shape), axis=-1)
    return jnp.moveaxis(y, (0, -1), (batch_axis, slot_axis))


def write_token(st: MTState, feed_N, token_N, model_N, logp_N, behavior_N, cfg, sampling):
    """Writes each feeding row's next transcript token and updates its turn bookkeeping.

    A model token ends the turn when it is one of ``sampling.eos_ids``, when it
    completes one of ``sampling.stop_sequences`` within the current turn's model
    tokens (they are contiguous at the end of the transcript; an observation or
    an earlier turn never takes part in a match), or at ``max_turn_tokens``.
    """
    t = st.tokens_NxT.shape[1]
    at_NxT = (jnp.arange(t, dtype=jnp.int32)[None, :] == st.len_N[:, None]) & feed_N[:, None]
    model_N = model_N & feed_N
    tokens_NxT = jnp.where(at_NxT, token_N[:, None], st.tokens_NxT)
    mask_NxT = jnp.where(at_NxT, model_N[:, None], st.mask_NxT)
    logps_NxT = jnp.where(at_NxT & model_N[:, None], logp_N[:, None], st.logps_NxT)
    behavior_NxT = jnp.where(at_NxT & model_N[:, None], behavior_N[:, None], st.behavior_NxT)
    len_N = st.len_N + feed_N.astype(jnp.int32)
    turn_len_N = st.turn_len_N + model_N.astype(jnp.int32)
    is_eos_N = jnp.zeros_like(feed_N)
    if sampling.eos_ids:
        eos_E = jnp.asarray(sampling.eos_ids, jnp.int32)
        is_eos_N = (token_N[:, None] == eos_E[None, :]).any(-1)
    eos_N = model_N & is_eos_N
    turn_over_N = eos_N
    if sampling.stop_sequences:
        longest = max(len(q) for q in sampling.stop_sequences)
        idx_NxL = len_N[:, None] - longest + jnp.arange(longest, dtype=jnp.int32)[None, :]
        recent_NxL = jnp.take_along_axis(tokens_NxT, jnp.clip(idx_NxL, 0, t - 1), axis=1)
        stop_N = model_N & stop_hits(recent_NxL, turn_len_N, sampling.stop_sequences)
        turn_over_N = turn_over_N | stop_N
    if cfg.max_turn_tokens:
        turn_over_N = turn_over_N | (model_N & (turn_len_N >= cfg.max_turn_tokens))
    budget_N = feed_N & (len_N >= t)
    # A turn that ends on the last slot is still a turn: the environment sees it.
    reason_N = jnp.where(turn_over_N, TURN_END, jnp.where(budget_N, BUDGET, st.reason_N))
    idle_N = feed_N & (budget_N | turn_over_N)
    return st._replace(
        tokens_NxT=tokens_NxT,
        mask_NxT=mask_NxT,
        logps_NxT=logps_NxT,
        behavior_NxT=behavior_NxT,
        len_N=len_N,
        turn_len_N=turn_len_N,
        pending_N=jnp.where(feed_N, token_N, st.pending_N),
        last_eos_N=jnp.where(model_N, eos_N, st.last_eos_N),
        active_N=st.active_N & ~idle_N,
        reason_N=reason_N,
    )


def prefill(params, prompt_BxP, pmask_BxP, key, *, graphdef, sampling, cfg, g):
    """Runs each prompt once, repeats its cache to its G rows and draws transcript token 0."""
    model = nnx.merge(graphdef, params)
    b, p = prompt_BxP.shape
    t, o = cfg.max_tokens, cfg.max_obs_tokens
    n, s = b * g, p + t
    pmask_BxP = pmask_BxP.astype(jnp.bool_)
    kv_mask_BxS = jnp.concatenate([pmask_BxP, jnp.zeros((b, t), jnp.bool_)], axis=1)
    inputs = dict(
        positions_BxT=positions_from_mask(pmask_BxP),
        kv_mask_BxS=kv_mask_BxS,
        cache=model.init_cache(b, s),
        cache_index=0,  # static: the splash kernel serves the prefill
    )
    record = _records_routes(model, sampling)
    if record:
        x_BxPxD, cache, routes_BxPxRxK = model.features_with_cache(
            prompt_BxP.astype(jnp.int32), routes_out=True, **inputs
        )
        logits_Bx1xV = model.logits(x_BxPxD[:, -1:])
    else:
        logits_Bx1xV, cache = model.forward_with_cache(
            prompt_BxP.astype(jnp.int32), last_only=True, **inputs
        )
    batch_axes, _ = cache_axes(model, b, s)
    cache = jax.tree.map(lambda c, ax: repeat_rows(c, g, axis=ax), cache, batch_axes)
    if jnp.ndim(key) == 1:  # row keys: one per prompt -> one per episode
        key = sample_keys(key, g)
    key, sub = split_key(key)
    token_N, logp_N, behavior_N = sample_with(repeat_rows(logits_Bx1xV[:, 0], g), sub, sampling)
    zeros_N = jnp.zeros((n,), jnp.int32)
    st = MTState(
        cache=cache,
        kv_mask_NxS=repeat_rows(kv_mask_BxS, g),
        end_slot_N=jnp.full((n,), p, jnp.int32),
        pos_N=repeat_rows(pmask_BxP.sum(axis=1, dtype=jnp.int32), g),
        pending_N=zeros_N,
        tokens_NxT=jnp.full((n, t), sampling.pad_id, jnp.int32),
        mask_NxT=jnp.zeros((n, t), jnp.bool_),
        logps_NxT=jnp.zeros((n, t), jnp.float32),
        behavior_NxT=jnp.zeros((n, t), jnp.float32),
        len_N=zeros_N,
        turn_len_N=zeros_N,
        active_N=jnp.ones((n,), jnp.bool_),
        reason_N=zeros_N,
        last_eos_N=jnp.zeros((n,), jnp.bool_),
        forced_NxO=jnp.zeros((n, o), jnp.int32),
        forced_len_N=zeros_N,
        forced_pos_N=zeros_N,
        key_data=jax.random.key_data(key),
    )
    if record:  # the prompt's experts, once per prompt, repeated to its G rows
        dtype = moe_lib.routes_dtype(model.config.num_experts)
        r_, k_ = routes_BxPxRxK.shape[2:]
        prompt = repeat_rows(routes_BxPxRxK.astype(dtype), g)
        routes = jnp.full((n, s, r_, k_), -1, dtype).at[:, :p].set(prompt)
        st = st._replace(routes_NxSxRxK=routes)
    feed_N = jnp.ones((n,), jnp.bool_)
    return write_token(st, feed_N, token_N, feed_N, logp_N, behavior_N, cfg, sampling)


def align(st: MTState, model) -> tuple[MTState, jax.Array]:
    """Rolls each active row's cache so its real tokens end at one shared slot F; -> (st, F)."""
    s = st.kv_mask_NxS.shape[1]
    frontier = jnp.max(jnp.where(st.active_N, st.pos_N, 0))
    shift_N = jnp.where(st.active_N, frontier - st.end_slot_N, 0)
    batch_axes, slot_axes = cache_axes(model, st.kv_mask_NxS.shape[0], s)
    cache = jax.tree.map(
        lambda c, b, sl: roll_rows(c, shift_N, b, sl), st.cache, batch_axes, slot_axes
    )
    kv_mask = roll_rows(st.kv_mask_NxS, shift_N, 0, 1)
    st = st._replace(cache=cache, kv_mask_NxS=kv_mask, end_slot_N=st.end_slot_N + shift_N)
    return st, frontier


def phase(params, st: MTState, *, graphdef, sampling: SamplingConfig, cfg, key_impl):
    """Advances the active rows until each is idle (turn over, budget) or the cache is full."""
    model = nnx.merge(graphdef, params)
    st, frontier = align(st, model)
    s = st.kv_mask_NxS.shape[1]
    n = st.pos_N.shape[0]

    def cond(carry):
        step, st = carry
        return (frontier + step < s) & jnp.any(st.active_N)

    def body(carry):
        step, st = carry
        slot = frontier + step
        feed_N = st.active_N
        col = jax.lax.dynamic_slice(st.kv_mask_NxS, (0, slot), (n, 1))
        kv_mask = jax.lax.dynamic_update_slice(
            st.kv_mask_NxS, col | feed_N[:, None], (jnp.zeros((), jnp.int32), slot)
        )
        inputs = dict(
            positions_BxT=st.pos_N[:, None], kv_mask_BxS=kv_mask, cache=st.cache, cache_index=slot
        )
        if st.routes_NxSxRxK is None:
            logits_Nx1xV, cache = model.forward_with_cache(st.pending_N[:, None], **inputs)
        else:
            x_Nx1xD, cache, used_Nx1xRxK = model.features_with_cache(
                st.pending_N[:, None], routes_out=True, **inputs
            )
            logits_Nx1xV = model.logits(x_Nx1xD)
            # The fed token, model's or observation's, is transcript token len - 1: its
            # experts go to position P + len - 1 of the feeding rows (the others' drop).
            p = s - st.tokens_NxT.shape[1]
            at_N = jnp.where(feed_N, p + st.len_N - 1, s)
            routes = st.routes_NxSxRxK.at[jnp.arange(n), at_N].set(
                used_Nx1xRxK[:, 0].astype(st.routes_NxSxRxK.dtype), mode="drop"
            )
            st = st._replace(routes_NxSxRxK=routes)
        key, sub = split_key(jax.random.wrap_key_data(st.key_data, impl=key_impl))
        drawn_N, logp_N, behavior_N = sample_with(logits_Nx1xV[:, 0], sub, sampling)
        forcing_N = st.forced_pos_N < st.forced_len_N
        key_data = jax.random.key_data(key)
        if st.key_data.ndim > 1:  # row keys: a row's key advances when it draws a token
            drew_N = feed_N & ~forcing_N
            key_data = jnp.where(drew_N[:, None], key_data, st.key_data)
        forced_N = jnp.take_along_axis(
            st.forced_NxO, jnp.minimum(st.forced_pos_N, st.forced_NxO.shape[1] - 1)[:, None], 1
        )[:, 0]
        token_N = jnp.where(forcing_N, forced_N, drawn_N).astype(jnp.int32)
        st = st._replace(
            cache=cache,
            kv_mask_NxS=kv_mask,
            end_slot_N=jnp.where(feed_N, slot + 1, st.end_slot_N),
            pos_N=st.pos_N + feed_N.astype(jnp.int32),
            forced_pos_N=st.forced_pos_N + (feed_N & forcing_N).astype(jnp.int32),
            key_data=key_data,
        )
        st = write_token(st, feed_N, token_N, ~forcing_N, logp_N, behavior_N, cfg, sampling)
        return step + 1, st

    _, st = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), st))
    return st


@functools.lru_cache(maxsize=32)
def compiled(graphdef, sampling: SamplingConfig, cfg: MultiTurnConfig, g: int, key_impl):
    jitted_prefill = jax.jit(
        functools.partial(prefill, graphdef=graphdef, sampling=sampling, cfg=cfg, g=g)
    )
    jitted_phase = jax.jit(
        functools.partial(phase, graphdef=graphdef, sampling=sampling, cfg=cfg, key_impl=key_impl),
        donate_argnums=(1,),
    )
    return jitted_prefill, jitted_phase


class StaticTurns:
    """The static kernel behind the phase interface ``grpo_jax.rollout.episodes`` plays episodes
    with (``grpo_jax.sampling.paged_turns.TurnEngine`` has the same): :meth:`phase`, then the host
    arrays of the rows (``active_N``: still in their turn, the cache being full;
    ``reason_N``, ``len_N``, ``last_eos_N``, ``tokens_NxT``, ``mask_NxT``), then
    :meth:`start_turns` with the observations of the rows that go on; at the end
    :meth:`transcripts` and :meth:`routes` (routing replay's)."""

    def __init__(self, graphdef, params, prompt_tokens_BxP, prompt_mask_BxP, key, sampling, cfg, g):
        self.params, self.o = params, cfg.max_obs_tokens
        prefill_fn, self._phase = compiled(graphdef, sampling, cfg, g, jax.random.key_impl(key))
        self.st = prefill_fn(
            params, jnp.asarray(prompt_tokens_BxP), jnp.asarray(prompt_mask_BxP), key
        )

    def phase(self) -> None:
        self.st = self._phase(self.params, self.st)
        st = self.st
        (
            self.active_N,
            self.reason_N,
            self.len_N,
            self.last_eos_N,
            self.tokens_NxT,
            self.mask_NxT,
        ) = (
            np.asarray(x)
            for x in jax.device_get(
                (st.active_N, st.reason_N, st.len_N, st.last_eos_N, st.tokens_NxT, st.mask_NxT)
            )
        )

    def finish(self, r: int) -> None:
        """Row ``r``'s episode is over (its cache rows simply stay idle)."""

    def start_turns(self, queued: dict) -> None:
        """The next phase: the rows still in their turn go on, and each row of ``queued``
        (row -> observation ids) starts its next turn with the observation.

        A row still in its turn (the cache filled) keeps its queue: the rest of an
        observation it was writing comes first in the next phase.
        """
        n = len(self.active_N)
        new_N = np.zeros(n, bool)
        forced = np.zeros((n, self.o), np.int32)
        forced_len = np.zeros(n, np.int32)
        for i, ids in queued.items():
            new_N[i], forced_len[i] = True, len(ids)
            forced[i, : len(ids)] = ids
        st, new = self.st, jnp.asarray(new_N)
        self.st = st._replace(
            active_N=jnp.asarray(self.active_N | new_N),
            reason_N=jnp.zeros((n,), jnp.int32),
            forced_NxO=jnp.where(new[:, None], jnp.asarray(forced), st.forced_NxO),
            forced_len_N=jnp.where(new, jnp.asarray(forced_len), st.forced_len_N),
            forced_pos_N=jnp.where(new, 0, st.forced_pos_N),
            turn_len_N=jnp.where(new, 0, st.turn_len_N),
        )

    def transcripts(self):
        """-> (tokens, model mask, log-probs, behaviour log-probs, lengths) on the host."""
        st = self.st
        out = jax.device_get((st.tokens_NxT, st.mask_NxT, st.logps_NxT, st.behavior_NxT, st.len_N))
        return tuple(np.asarray(x) for x in out)

    def routes(self):
        """The experts of every position the rows fed, [N, P + T, R, K] on the host (-1 where
        nothing was fed: a row's last token and after it), with ``sampling.record_routes`` on
        a mixture of experts; else None."""
        r = self.st.routes_NxSxRxK
        return None if r is None else np.asarray(jax.device_get(r))
