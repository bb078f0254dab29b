"""Multi-turn episodes on the paged engine: each row continues from its own pages.

``TurnEngine`` plays N = B * G episodes (row b*G + g plays prompt b) one phase at a time,
with the interface of the static kernel's loop in ``grpo_jax.rollout.episodes``
(:meth:`TurnEngine.phase`, :meth:`TurnEngine.queue`, :meth:`TurnEngine.finish`). Prompt pages
are shared by a prompt's G rows and each row's transcript lives in pages of its own for the
whole episode; observations are written by prefill calls and nothing is re-aligned.
docs/multiturn.md, "How the sampler continues from the KV cache" (on the paged engine).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.core.errors import ConfigError
from grpo_jax.models import moe as moe_lib
from grpo_jax.sampling import paged, paged_pool
from grpo_jax.sampling.static import SamplingConfig
from grpo_jax.sampling.static_turns import BUDGET, RUNNING, TURN_END, MultiTurnConfig

__all__ = ["TurnEngine"]


class TurnEngine:
    """N episodes' transcripts and pages (module doc). Host arrays, one entry a row:
    ``tokens_NxT``, ``mask_NxT`` (written by the model), ``logps_NxT``,
    ``behavior_NxT``, ``len_N`` (transcript tokens), ``reason_N`` (``RUNNING``,
    ``TURN_END``, ``BUDGET``: why the row's last phase ended), ``last_eos_N``.

    ``width``: the prompts' padded width P (default: the longest prompt), the layout of
    :meth:`routes` [N, P + T, R, K], which routing replay records (``sampling.record_routes``
    on a mixture of experts): the prompt's experts from its prefill chunks, shared by its G
    rows, each observation token's from the chunk or decode step that fed it, each model
    token's from the decode step that fed it."""

    def __init__(
        self, graphdef, params, prompts, key, sampling: SamplingConfig, cfg: MultiTurnConfig, g,
        width: int | None = None,
    ):  # fmt: skip
        key = paged.as_key(key)
        if jnp.ndim(key) != 0:  # row keys (evaluation's) are the static kernel's
            raise ValueError("the paged engine plays episodes with one key, not row keys")
        self.params, self.prompts, self.sampling, self.cfg, self.g = (
            params, prompts, sampling, cfg, g,
        )  # fmt: skip
        z, t = sampling.page_size, cfg.max_tokens
        n = self.n = len(prompts) * g
        self.z, self.t = z, t
        self.slots = min(sampling.slots or n, n)
        self.own_worst = paged_pool.ceil_div(t - 1, z)
        prompt_pages = paged_pool.ceil_div(max(len(p) for p in prompts), z)
        self.table = prompt_pages + self.own_worst  # block-table entries of a row, at most
        worst = len(prompts) * prompt_pages + n * self.own_worst
        self.pool = paged_pool.Pool(1 + (sampling.pages or worst))
        model_cfg = nnx.merge(graphdef, params).config
        self.width = max(len(p) for p in prompts) if width is None else width
        self._routes, self.chunk_routes = None, []  # chunks' (rows, column, count, experts)
        if paged.records_routes(model_cfg, sampling):
            self._routes = paged.fresh_routes(model_cfg, n, self.width, t)
            dtype = moe_lib.routes_dtype(model_cfg.num_experts)  # as paged.generate_rows's
            fns = paged._compiled(graphdef, sampling, g, z, dtype)
        else:  # the very programs (and cache entry) of a run without routing replay
            fns = paged._compiled(graphdef, sampling, g, z)
        self.init, self.prefill, self.first, self.decode = fns
        self.key_first, self.key_decode = jax.random.split(key)
        pad = sampling.pad_id
        self.tokens_NxT = np.full((n, t), pad, np.int32)
        self.mask_NxT = np.zeros((n, t), np.bool_)
        self.logps_NxT = np.zeros((n, t), np.float32)
        self.behavior_NxT = np.zeros((n, t), np.float32)
        self.len_N = np.zeros(n, np.int32)
        self.turn_len_N = np.zeros(n, np.int32)  # model tokens in the current turn
        self.written_N = np.zeros(n, np.int32)  # transcript tokens in the row's pages
        self.reason_N = np.zeros(n, np.int32)
        self.last_eos_N = np.zeros(n, np.bool_)
        self.reserved_N = np.zeros(n, np.bool_)
        self.row_pages: list[list[int]] = [[] for _ in range(n)]
        self.prompt_pages: list[list[int]] = [[] for _ in prompts]
        self.live_B = np.zeros(len(prompts), np.int32)  # episodes of each prompt not ended
        self.waiting = collections.deque(range(len(prompts)))  # prompts not yet prefilled
        self.filling: tuple[int, int] | None = None
        self.ready: collections.deque = collections.deque()  # rows whose turn may start
        self.slot_row = [-1] * self.slots
        self.playing = n  # rows whose turn has not ended in this phase
        self.steps = 0
        self.longest = max((len(q) for q in sampling.stop_sequences), default=1)
        self.eos = np.asarray(sampling.eos_ids, np.int32)
        self.pages = self.init(params, self.pool.size, 0)

    @property
    def active_N(self) -> np.ndarray:
        """Rows still in their turn after a phase: none (a phase ends every row's turn)."""
        return np.zeros(self.n, np.bool_)

    def start_turns(self, queued: dict) -> None:
        """Row -> observation ids: each starts its next turn (:meth:`queue`)."""
        for r, ids in queued.items():
            self.queue(r, ids)

    def transcripts(self):
        """-> (tokens, model mask, log-probs, behaviour log-probs, lengths)."""
        return self.tokens_NxT, self.mask_NxT, self.logps_NxT, self.behavior_NxT, self.len_N

    def routes(self):
        """The experts of every position the rows fed, [N, P + T, R, K] (-1 where nothing was
        fed: the prompt's left padding, a row's last token and after it); None without
        routing replay. The prefill chunks' are read here, once: no chunk waits for them."""
        if self._routes is None:
            return None
        chunks = jax.device_get([used for *_, used in self.chunk_routes])
        for (rows, col, count, _), used in zip(self.chunk_routes, chunks):
            self._routes[rows, col : col + count] = used[:count]
        self.chunk_routes = []
        return self._routes

    # -- the host loop ---------------------------------------------------------

    def phase(self) -> None:
        """Plays every row in play until its turn ends or its transcript is full."""
        while self.playing:
            self._admit()
            active = [s for s, r in enumerate(self.slot_row) if r >= 0]
            extending = [s for s in active if self._to_write(self.slot_row[s]) > 0]
            decoding = [s for s in active if s not in extending]
            free = self.slots - len(active)
            if extending:
                self._extend(self.slot_row[extending[0]])
            elif (self.filling or self.waiting) and (len(self.ready) < free or not decoding):
                if not self._prefill() and not active:
                    raise ConfigError(
                        f"config key 'sampling.pages' = {self.pool.size - 1} is too small for "
                        "the episodes' prompts and transcripts"
                    )
            if decoding:
                self._decode(decoding)
            elif not (extending or self.ready or self.filling or self.waiting):
                raise RuntimeError(f"{self.playing} rows in play, none can run")

    def queue(self, r: int, ids) -> None:
        """Appends observation ``ids`` to row ``r``'s transcript and starts its next turn."""
        m, at = len(ids), int(self.len_N[r])
        if not 0 < m < self.t - at:
            raise ValueError(f"row {r}: an observation of {m} tokens after {at} of {self.t}")
        self.tokens_NxT[r, at : at + m] = ids
        self.len_N[r] = at + m
        self.turn_len_N[r], self.reason_N[r] = 0, RUNNING
        self.ready.append(r)
        self.playing += 1

    def finish(self, r: int) -> None:
        """Row ``r``'s episode is over: its pages go back (its prompt's with its last row)."""
        own = self.row_pages[r]
        if self.reserved_N[r]:
            self.pool.reserved -= self.own_worst - len(own)
            self.reserved_N[r] = False
        self.pool.give(own)
        self.row_pages[r] = []
        b = r // self.g
        self.live_B[b] -= 1
        if self.live_B[b] == 0:
            self.pool.give(self.prompt_pages[b])

    # -- one call each ---------------------------------------------------------

    def _to_write(self, r: int) -> int:
        return int(self.len_N[r]) - 1 - int(self.written_N[r])  # all but the pending token

    def _admit(self) -> None:
        for s, r in enumerate(self.slot_row):
            if r >= 0 or not self.ready:
                continue
            nxt = self.ready[0]
            if not self.reserved_N[nxt]:
                if not self.pool.can_reserve(self.own_worst):
                    return
                self.pool.reserved += self.own_worst
                self.reserved_N[nxt] = True
            self.slot_row[s] = self.ready.popleft()

    def _pages_for(self, r: int, upto: int) -> list[int]:
        own = self.row_pages[r]
        while len(own) * self.z < upto:
            own.append(self.pool.take())
        return own

    def _table(self, r: int, width: int) -> np.ndarray:
        shared, own = self.prompt_pages[r // self.g], self.row_pages[r]
        table = np.zeros(width, np.int32)
        table[: len(shared) + len(own)] = shared + own
        return table

    def _prefill(self) -> bool:
        z, c = self.z, self.sampling.prefill_chunk
        if self.filling is None:
            b = self.waiting[0]
            need = paged_pool.ceil_div(len(self.prompts[b]), z)
            if not self.pool.can_reserve(need):
                return False
            self.waiting.popleft()
            self.pool.reserved += need
            self.filling = (b, 0)
        b, start = self.filling
        prompt = self.prompts[b]
        count = min(c, len(prompt) - start)
        pages = self.prompt_pages[b]
        while len(pages) * z < start + count:
            pages.append(self.pool.take())
        self.pages, logits_1xV, *used = paged.write_chunk(
            self.prefill, self.params, self.pages, prompt[start : start + count], start, c,
            self.sampling.pad_id, self.table, pages,
        )  # fmt: skip
        if used:  # prompt token i of n at column P - n + i of its G rows
            rows_G = list(range(b * self.g, (b + 1) * self.g))
            self.chunk_routes.append((rows_G, self.width - len(prompt) + start, count, used[0]))
        if start + count < len(prompt):
            self.filling = (b, start + count)
            return True
        self.filling = None
        drawn = jax.device_get(self.first(logits_1xV, self.key_first, np.int32(b)))
        self.live_B[b] = self.g
        for g, (tok, lp, beh, end) in enumerate(zip(*drawn)):
            r = b * self.g + g
            if not self._record(r, tok, lp, beh, bool(end)):
                self.ready.append(r)
        return True

    def _extend(self, r: int) -> None:
        """One chunk of row ``r``'s transcript tokens not yet in its pages (an observation)."""
        c = self.sampling.prefill_chunk
        start, count = int(self.written_N[r]), min(c, self._to_write(r))
        self._pages_for(r, start + count)
        b = r // self.g
        n, shared = len(self.prompts[b]), self.prompt_pages[b]
        self.pages, _, *used = paged.write_chunk(
            self.prefill, self.params, self.pages, self.tokens_NxT[r, start : start + count],
            n + start, c, self.sampling.pad_id, self.table, shared + self.row_pages[r], n=n,
            shared=len(shared),
        )  # fmt: skip
        if used:  # transcript token i (the turn's last model token, an observation's) at P + i
            self.chunk_routes.append(([r], self.width + start, count, used[0]))
        self.written_N[r] += count

    def _decode(self, active: list[int]) -> None:
        z, ell, pad = self.z, self.longest - 1, self.sampling.pad_id
        rows = paged_pool.bucket(len(active), self.slots)
        for s in active:  # a page for the fed token where it starts one
            r = self.slot_row[s]
            self._pages_for(r, int(self.written_N[r]) + 1)
        shared_of = lambda r: len(self.prompt_pages[r // self.g])
        need = max(shared_of(self.slot_row[s]) + len(self.row_pages[self.slot_row[s]])
                   for s in active)  # fmt: skip
        m = paged_pool.bucket(need, self.table)
        x = paged._StepInputs.empty(rows, m, ell, pad)
        for i, s in enumerate(active):
            r = self.slot_row[s]
            o, n = int(self.written_N[r]), len(self.prompts[r // self.g])
            x.tokens_R[i] = self.tokens_NxT[r, o]
            x.pos_R[i], x.prompt_len_R[i], x.shared_R[i] = n + o, n, shared_of(r)
            x.table_RxM[i] = self._table(r, m)
            x.write_page_R[i], x.write_off_R[i] = self.row_pages[r][o // z], o % z
            if ell:
                recent = self.tokens_NxT[r, max(0, o + 1 - ell) : o + 1]
                x.prev_RxL1[i, ell - len(recent) :] = recent
            x.count_R[i] = self.turn_len_N[r]  # a stop sequence matches within the turn
        self.pages, *out = self.decode(
            self.params, self.pages, x, self.key_decode, np.int32(self.steps)
        )
        tokens_R, logps_R, behavior_R, ends_R, *used = jax.device_get(out)
        self.steps += 1
        for i, s in enumerate(active):
            r = self.slot_row[s]
            if used:  # the fed token, transcript token written_N, at column P + written_N
                self._routes[r, self.width + self.written_N[r]] = used[0][i]
            self.written_N[r] += 1
            if self._record(r, tokens_R[i], logps_R[i], behavior_R[i], bool(ends_R[i])):
                self.slot_row[s] = -1

    def _record(self, r: int, tok, lp, beh, end: bool) -> bool:
        """Writes row ``r``'s drawn token; True when its turn is over (the row goes idle)."""
        at = int(self.len_N[r])
        self.tokens_NxT[r, at], self.mask_NxT[r, at] = tok, True
        self.logps_NxT[r, at], self.behavior_NxT[r, at] = lp, beh
        self.len_N[r] = at + 1
        self.turn_len_N[r] += 1
        self.last_eos_N[r] = bool((self.eos == tok).any())
        limit = self.cfg.max_turn_tokens
        turn_over = end or bool(limit and self.turn_len_N[r] >= limit)
        if turn_over:
            self.reason_N[r] = TURN_END
        elif self.len_N[r] >= self.t:
            self.reason_N[r] = BUDGET
        else:
            return False
        self.playing -= 1
        return True
