"""The update with its rows packed: no slot on padding, micro-batches filled to a token budget.

    step = jit_packed_update(settings=PackSettings(...), **jit_update's arguments)
    state, metrics = step(state, batch, key, ref_params)     # as the padded update

Each call reads the batch's masks back to the host (a few bytes a row), plans the step
there (:func:`plan_packs`) and runs ``grpo_jax.learner.update.update`` with the plan
(``packs``). The plan, per minibatch (the padded update's minibatches, the same rows):

1. Units. A prompt's real tokens followed by completions of it, each up to its last
   masked token: with ``two_level`` as many of the group's completions as fit a row
   (each sees the prompt and itself), else one. Rows of weight 0 and rows without a
   masked token are left out: they add nothing to the loss.
2. Packed rows of L slots (``row_slots``, default P + T: the padded row's length, which
   holds any single unit), filled by first fit decreasing.
3. Micro-batches of R = S x R_s rows, R_s = ``microbatch_tokens`` // L on each of the S
   batch shards: as few as hold the rows, the rows dealt to the micro-batches' shards
   largest first, each to the one with the fewest tokens so far.

The compiled shapes are few: the micro-batch count is rounded up to a power of two (an
empty micro-batch is skipped at run time, ``lax.cond``), the head slots per shard to one
of eight steps of R_s L / 8, and L follows the prompt bucket. docs/packing.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from grpo_jax.core import distributed, sharding
from grpo_jax.core.packing import balance, first_fit_decreasing, next_power_of_two, round_up
from grpo_jax.learner import update as update_lib
from grpo_jax.objective.logprobs import PackedRows

__all__ = ["PackSettings", "PackedUpdate", "jit_packed_update", "plan_packs"]


@dataclasses.dataclass(frozen=True)
class PackSettings:
    """The planner's settings, fixed for a run.

    Attributes:
      group_size: G: rows b G .. b G + G - 1 share prompt b (1: every row its own).
      shards: the mesh's batch shards S.
      num_minibatches: U, the minibatches of a pass (N / minibatch rows).
      microbatch_tokens: the slots of one micro-batch on one shard (0: those of
        ``default_rows`` rows of P + T).
      default_rows: the padded update's micro-batch rows per shard.
      two_level: several completions of a prompt in one sequence (not for "splash"
        attention, whose segment ids say only "same sequence").
      head_multiple: head slots per shard are a multiple of this (the LM head's
        chunk, ``train.logits_chunk``; 8 without one).
      row_slots: L, the slots of a packed row (0: P + T; more: a prompt with more of
        its group's completions in a row, ``train.pack_row_tokens``).
    """

    group_size: int
    shards: int
    num_minibatches: int
    microbatch_tokens: int = 0
    default_rows: int = 1
    two_level: bool = True
    head_multiple: int = 8
    row_slots: int = 0


def _units(rows_g, live, span, plen, group_size, two_level, capacity):
    """A minibatch's units: lists of local rows sharing one prompt (the first row's)."""
    if not (two_level and group_size > 1):
        return [[li] for li, g in enumerate(rows_g) if live[g]]
    groups: dict[int, list[int]] = {}
    for li, g in enumerate(rows_g):
        if live[g]:
            groups.setdefault(g // group_size, []).append(li)
    units = []
    for rows in groups.values():
        room = capacity - int(plen[rows_g[rows[0]]])
        for part in first_fit_decreasing([int(span[rows_g[li]]) for li in rows], room):
            units.append([rows[i] for i in sorted(part)])
    return units


def plan_packs(prompt_mask_NxP, mask_NxT, weights_N, s: PackSettings):
    """(``PackedRows`` of numpy arrays with leading [U, K] axes, statistics) of one batch.

    ``prompt_mask_NxP``, ``mask_NxT`` and ``weights_N`` are the whole batch's (every
    host's rows), so every host plans the same step. Statistics: ``tokens`` (real tokens
    packed, prompts counted once per sequence), ``slots`` (the used micro-batches'
    slots), ``micro_batches`` (used, over the minibatches) and ``compiled_micro_batches``
    (K per minibatch, as compiled).
    """
    b = _Batch.of(prompt_mask_NxP, mask_NxT, weights_N, s)
    packed_u = [_pack_minibatch(b, u, s) for u in range(b.U)]
    # K micro-batches of R_s rows a shard at most; fewer rows when fewer hold the step.
    most = max(max(len(p[1]) for p in packed_u), 1)
    K = next_power_of_two(math.ceil(most / (b.S * b.R_s)))
    R_s = min(b.R_s, next_power_of_two(math.ceil(most / (b.S * K))))
    R = b.S * R_s
    plans = []  # per minibatch: (micro-batch k, shard s)'s packed rows at bin k S + s
    for rows_g, packed, sizes in packed_u:
        k_u = max(1, math.ceil(len(packed) / R))
        bins = balance(sizes, k_u * b.S, R_s)
        plans.append(([[packed[i] for i in bin_] for bin_ in bins], rows_g, k_u, sizes))
    rows, heads = _fill_rows(b, plans, K, R_s)
    head_src, head_dst, count = _head_arrays(heads, b, K, R_s, s.head_multiple)
    two = s.two_level and s.group_size > 1
    packs = PackedRows(*rows[:3], rows[3] if two else None, head_src, head_dst, count)
    used = sum(p[2] for p in plans)
    stats = {
        "tokens": int(sum(sum(p[3]) for p in plans)),
        "slots": int(used * R * b.L),
        "micro_batches": int(used),
        "compiled_micro_batches": int(K),
    }
    return packs, stats


@dataclasses.dataclass(frozen=True)
class _Batch:
    """One batch's masks as the planner reads them, with the plan's sizes."""

    pmask: np.ndarray  # [N, P] bool
    mask: np.ndarray  # [N, T] bool
    span: np.ndarray  # [N]: a completion's slots up to its last masked token
    plen: np.ndarray  # [N]: a prompt's real tokens
    live: np.ndarray  # [N]: the row adds to the loss
    L: int  # slots of a packed row
    U: int  # minibatches
    S: int  # batch shards
    R_s: int  # packed rows of a micro-batch on one shard, at most

    @property
    def N(self) -> int:
        return self.mask.shape[0]

    @property
    def P(self) -> int:
        return self.pmask.shape[1]

    @property
    def T(self) -> int:
        return self.mask.shape[1]

    @staticmethod
    def of(prompt_mask_NxP, mask_NxT, weights_N, s: PackSettings) -> _Batch:
        pmask = np.asarray(prompt_mask_NxP, bool)
        mask = np.asarray(mask_NxT, bool)
        weights = np.asarray(weights_N, np.float32)
        N, P = pmask.shape
        T = mask.shape[1]
        L, U, S = s.row_slots or P + T, s.num_minibatches, s.shards
        if N % (S * U):
            raise ValueError(f"{N} rows do not split into {U} minibatches over {S} shards")
        if L < P + T:
            raise ValueError(
                f"packed rows of {L} slots do not hold a prompt and completion of {P + T}"
            )
        has = mask.any(axis=1)
        span = np.where(has, T - np.argmax(mask[:, ::-1], axis=1), 0)
        plen = pmask.sum(axis=1)
        live = (weights > 0) & has
        if (live & (plen == 0)).any():
            raise ValueError("a scored row has an empty prompt: nothing predicts its first token")
        R_s = max(1, (s.microbatch_tokens or s.default_rows * (P + T)) // L)
        return _Batch(pmask, mask, span, plen, live, L, U, S, R_s)


def _pack_minibatch(b: _Batch, u: int, s: PackSettings):
    """Minibatch u's (global rows by local index, packed rows as lists of units, the
    packed rows' real tokens)."""
    per = b.N // (b.S * b.U)
    rows_g = [sh * (b.N // b.S) + u * per + j for sh in range(b.S) for j in range(per)]
    units = _units(rows_g, b.live, b.span, b.plen, s.group_size, s.two_level, b.L)
    unit_len = [int(b.plen[rows_g[x[0]]] + sum(b.span[rows_g[li]] for li in x)) for x in units]
    rows_u = first_fit_decreasing(unit_len, b.L)
    packed = [[units[i] for i in row] for row in rows_u]
    return rows_g, packed, [sum(unit_len[i] for i in row) for row in rows_u]


def _fill_rows(b: _Batch, plans, K: int, R_s: int):
    """The packed rows' (src, ids, pos, part) [U, K, R, L] and, per (minibatch,
    micro-batch, shard), the LM head's (source slots, destination tokens)."""
    R, L = b.S * R_s, b.L
    arrays = [np.zeros((b.U, K, R, L), np.int32) for _ in range(4)]
    heads = [[[None] * b.S for _ in range(K)] for _ in range(b.U)]
    for u, (bins, rows_g, _, _) in enumerate(plans):
        for i, rows in enumerate(bins):
            k, sh = divmod(i, b.S)
            h_src, h_dst = [], []
            for r, row in enumerate(rows):
                at = (u, k, sh * R_s + r)
                _fill_row(b, arrays, at, row, rows_g, h_src, h_dst, r * L)
            heads[u][k][sh] = (
                np.concatenate(h_src) if h_src else np.zeros(0, np.int32),
                np.concatenate(h_dst) if h_dst else np.zeros(0, np.int32),
            )
    return arrays, heads


def _fill_row(b: _Batch, arrays, at, row, rows_g, h_src, h_dst, row_start):
    """One packed row's slots: each unit's prompt, then its completions; the LM head's
    source slots (offset by ``row_start``) and destination tokens appended to h_src/h_dst."""
    src, ids, pos, part = (a[at] for a in arrays)
    Nm = len(rows_g)
    P, T = b.P, b.T
    slot = 0
    for j, unit in enumerate(row):
        pp = np.flatnonzero(b.pmask[rows_g[unit[0]]])
        p = len(pp)
        sl = slice(slot, slot + p)
        src[sl] = unit[0] * P + pp
        ids[sl], pos[sl] = j + 1, np.arange(p)
        last_prompt = slot + p - 1
        slot += p
        for c, li in enumerate(unit):
            gi = rows_g[li]
            n = int(b.span[gi])
            sl = slice(slot, slot + n)
            src[sl] = Nm * P + li * T + np.arange(n)
            ids[sl], pos[sl] = j + 1, p + np.arange(n)
            part[sl] = c + 1
            scored = np.flatnonzero(b.mask[gi, :n])
            before = np.where(scored == 0, last_prompt, slot + scored - 1)
            h_src.append(row_start + before)
            h_dst.append(li * T + scored)
            slot += n


def _head_arrays(heads, b: _Batch, K: int, R_s: int, multiple: int):
    """The LM head's (head_src, head_dst [U, K, S, M], count [U, K]): M, the head slots
    per shard, one of eight steps of R_s L / 8 rounded to ``multiple``."""
    Nm, T = b.N // b.U, b.T
    most = max((len(h[0]) for hu in heads for hk in hu for h in hk if h is not None), default=0)
    step = round_up(math.ceil(R_s * b.L / 8), multiple)
    M = min(round_up(max(most, 1), step), round_up(R_s * b.L, multiple))
    head_src = np.zeros((b.U, K, b.S, M), np.int32)
    head_dst = np.full((b.U, K, b.S, M), Nm * T, np.int32)
    count = np.zeros((b.U, K), np.int32)
    for u in range(b.U):
        for k in range(K):
            for sh in range(b.S):
                h = heads[u][k][sh]
                if h is not None:
                    head_src[u, k, sh, : len(h[0])] = h[0]
                    head_dst[u, k, sh, : len(h[1])] = h[1]
                    count[u, k] += len(h[0])
    return head_src, head_dst, count


class PackedUpdate:
    """The packed update as the loop calls the padded one: ``(state, batch, key, ref_params)
    -> (state, metrics)``. Each call plans its batch on the host (:func:`plan_packs`) and
    adds ``perf/pack_fill`` (real tokens over the micro-batches' slots) and
    ``perf/pack_micro_batches`` (micro-batches of the step, over its minibatches) to the
    update's metrics."""

    def __init__(self, jitted, settings: PackSettings, mesh):
        self.jitted, self.settings, self.mesh = jitted, settings, mesh
        self._replicated = sharding.replicated(mesh)
        self._masks = jax.jit(
            lambda b: (b.prompt_mask_NxP, b.mask_NxT, b.weights_N),
            out_shardings=self._replicated,
        )

    def plan(self, batch):
        """(the batch's ``PackedRows`` on the mesh, replicated; the plan's statistics)."""
        with jax.set_mesh(self.mesh):
            masks = distributed.fetch(self._masks(batch))
        packs, stats = plan_packs(*masks, self.settings)
        return distributed.put(packs, self._replicated), stats

    def __call__(self, state, batch, key, ref_params=None):
        packs, stats = self.plan(batch)
        state, metrics = self.jitted(state, batch, key, ref_params, packs)
        metrics = dict(metrics)
        metrics["perf/pack_fill"] = stats["tokens"] / max(stats["slots"], 1)
        metrics["perf/pack_micro_batches"] = float(stats["micro_batches"])
        return state, metrics


def jit_packed_update(
    *,
    settings: PackSettings,
    state_shardings,
    batch_shardings,
    ref_shardings,
    replicated,
    **static,
) -> PackedUpdate:
    """``grpo_jax.learner.update.update`` with ``packs``, jitted with shardings and called
    under the mesh, as :class:`PackedUpdate`. ``static``: ``jit_update``'s settings
    (graphdef, tx, schedule, grpo, minibatch_size, grad_accum, batch_shards,
    track_update, logits_chunk, share_prompts, base_graphdef, lora_dropout)."""
    fn = functools.partial(update_lib.update, **static)
    jitted = jax.jit(
        fn,
        in_shardings=(state_shardings, batch_shardings, replicated, ref_shardings, replicated),
        out_shardings=(state_shardings, replicated),
        donate_argnames=("state",),
    )
    return PackedUpdate(sharding.OnMesh(jitted, replicated.mesh), settings, replicated.mesh)
