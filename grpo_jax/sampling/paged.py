"""The paged, continuously batched rollout engine (``sampling.engine = "paged"``; docs/engine.md).

Shapes: B prompts, G samples per prompt, N = B*G requests (request b*G + g fills row b*G + g
of the output), P padded prompt length, T = ``max_new_tokens``, V vocabulary, Z ``page_size``
tokens per page, M pages in a block table, R rows of a decode call (a power of two, at most
the slots), C prompt tokens per prefill call, L the longest stop sequence. The KV cache is a
pool of pages (page 0 is scratch); a prompt's pages are shared by its G samples, never copied.
A host loop admits requests into free slots, interleaves prefill chunks with decode steps over
the occupied slots, and packs those into static shapes. docs/engine.md has the pages, the
sliding-window pool, the loop, partial rollouts (:func:`generate_rows`) and what is tested.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.core import distributed
from grpo_jax.core import sharding as sharding_lib
from grpo_jax.core.errors import ConfigError
from grpo_jax.models import moe as moe_lib
from grpo_jax.models.attention import NO_WINDOW
from grpo_jax.sampling.draw import sample_with, stop_hits
from grpo_jax.sampling.paged_pool import (
    SCRATCH_PAGE,
    Pool,
    Window,
    bucket,
    ceil_div,
    engine_shape,
    kv_bytes_per_token,
    model_window,
)
from grpo_jax.sampling.static import SampleOutput, SamplingConfig, repeat_rows

# ---------------------------------------------------------------------------
# The jitted calls.


def _prefill_chunk(
    params, pages, tokens_C, start, count, table_M, n, shared, ltable_M, *, graphdef, z: int,
    routes=None,
):  # fmt: skip
    """Writes tokens at positions [start, start + count) (count <= C) into a row's pages.

    A prompt's chunk: ``n`` = ``shared`` = 0 (slot j of the table holds position
    j). A carried row's own tokens (partial rollouts): ``n`` its prompt's real
    tokens, ``shared`` the table entries that are the prompt's pages, as in a
    decode step. ``ltable_M``: the sliding-window layers' block table when
    they have page ids of their own (None: they share ``table_M``). Returns
    (pages, logits [1, V] of the chunk's last real token), and with ``routes`` (the
    dtype routes are recorded in) a third item: the experts the sparse layers chose for
    the chunk's tokens, [C, R, K].
    """
    model = nnx.merge(graphdef, params)
    c, m = tokens_C.shape[0], table_M.shape[0]
    pos_C = start + jnp.arange(c, dtype=jnp.int32)
    real_C = jnp.arange(c) < count
    entry_C = jnp.minimum(shared + (pos_C - n) // z, m - 1)
    page_C = jnp.where(real_C, jnp.take(table_M, entry_C), SCRATCH_PAGE)
    local = None
    if ltable_M is not None:
        local = (jnp.where(real_C, jnp.take(ltable_M, entry_C), SCRATCH_PAGE), ltable_M[None])
    x_1xCxD, pages, *used = model.features_paged(
        tokens_C[None],
        positions_BxT=pos_C[None],
        pages=pages,
        write=(page_C, (pos_C - n) % z),
        table_BxN=table_M[None],
        pos_BxS=_slot_positions(jnp.arange(m * z, dtype=jnp.int32)[None], n, shared * z),
        local=local,
        routes_out=routes is not None,
    )
    last_1x1xD = jax.lax.dynamic_slice_in_dim(x_1xCxD, count - 1, 1, axis=1)
    logits_1xV = model.logits(last_1x1xD)[:, 0]
    if routes is None:
        return pages, logits_1xV
    return pages, logits_1xV, used[0][0].astype(routes)


def _slot_positions(j_RxS, n_Rx1, shared_Rx1, last_Rx1=None):
    """The position each block-table slot holds (``NO_WINDOW``: none, never visible).

    Slots before ``shared_Rx1`` (the prompt's pages) hold prompt positions j,
    real below n; the rest hold the row's own tokens from position n on, real up
    to ``last_Rx1`` (None: all, the causal mask hides those not yet written).
    """
    in_prompt = j_RxS < shared_Rx1
    own_pos = n_Rx1 + j_RxS - shared_Rx1
    pos = jnp.where(in_prompt, j_RxS, own_pos)
    own_real = True if last_Rx1 is None else own_pos <= last_Rx1
    real = jnp.where(in_prompt, j_RxS < n_Rx1, own_real)
    return jnp.where(real, pos, NO_WINDOW)


def _ends(tokens_R, prev_RxL1, count_R, cfg: SamplingConfig):
    """Whether each row ends with its newly drawn token (its ``count_R``-th, 1-based)."""
    done_R = jnp.zeros(tokens_R.shape, jnp.bool_)
    if cfg.eos_ids:
        done_R |= (tokens_R[:, None] == jnp.asarray(cfg.eos_ids, jnp.int32)[None]).any(-1)
    if cfg.stop_sequences:
        recent_RxL = jnp.concatenate([prev_RxL1, tokens_R[:, None]], axis=1)
        done_R |= stop_hits(recent_RxL, count_R, cfg.stop_sequences)
    return done_R


def _first_draw(logits_1xV, key, prompt, *, cfg: SamplingConfig, g: int):
    """Token 0 of a prompt's G samples from its prefill's last logits: (tokens, logps,
    behaviour logps, ended) [G] each."""
    key = jax.random.fold_in(key, prompt)
    tokens_G, logps_G, behavior_G = sample_with(repeat_rows(logits_1xV, g), key, cfg)
    longest = max((len(q) for q in cfg.stop_sequences), default=1)
    prev_GxL1 = jnp.full((g, longest - 1), cfg.pad_id, jnp.int32)
    ends_G = _ends(tokens_G, prev_GxL1, jnp.ones((g,), jnp.int32), cfg)
    return tokens_G, logps_G, behavior_G, ends_G


def _decode_step(
    params, pages, inputs, key, step, *, graphdef, cfg: SamplingConfig, z: int, routes=None
):
    """One token per row: feeds each row's last token, draws the next.

    ``inputs`` (:class:`_StepInputs`, R rows) say where each row's tokens
    live. Returns (pages, tokens, logps, behaviour logps, ended) [R] each, and with
    ``routes`` (their dtype) the experts the fed tokens used, [R, R_sparse, K].
    """
    model = nnx.merge(graphdef, params)
    s = inputs.table_RxM.shape[1] * z
    j_RxS = jnp.arange(s, dtype=jnp.int32)[None]
    pos_RxS = _slot_positions(
        j_RxS, inputs.prompt_len_R[:, None], (inputs.shared_R * z)[:, None], inputs.pos_R[:, None]
    )
    x_RxD, pages, *used = model.features_paged(
        inputs.tokens_R[:, None],
        positions_BxT=inputs.pos_R[:, None],
        pages=pages,
        write=(inputs.write_page_R, inputs.write_off_R),
        table_BxN=inputs.table_RxM,
        pos_BxS=pos_RxS,
        local=None if inputs.ltable_RxM is None else (inputs.lwrite_page_R, inputs.ltable_RxM),
        routes_out=routes is not None,
    )
    draw_key = jax.random.fold_in(key, step)
    tokens_R, logps_R, behavior_R = sample_with(model.logits(x_RxD)[:, 0], draw_key, cfg)
    ends_R = _ends(tokens_R, inputs.prev_RxL1, inputs.count_R + 1, cfg)
    if routes is None:
        return pages, tokens_R, logps_R, behavior_R, ends_R
    return pages, tokens_R, logps_R, behavior_R, ends_R, used[0][:, 0].astype(routes)


class _StepInputs(NamedTuple):
    """Host-built per-row inputs of a decode step (R rows; unused rows point at scratch)."""

    tokens_R: np.ndarray  # int32: the token fed (the row's last drawn one)
    pos_R: np.ndarray  # int32: its position, prompt length + tokens drawn - 1
    prompt_len_R: np.ndarray  # int32: n, the prompt's real tokens
    shared_R: np.ndarray  # int32: table entries that are the prompt's pages
    table_RxM: np.ndarray  # int32: the block table (M: the step's bucket of table entries)
    write_page_R: np.ndarray  # int32: the page of the fed token's keys and values
    write_off_R: np.ndarray  # int32: and its slot within that page
    prev_RxL1: np.ndarray  # int32: the L - 1 tokens before the fed one's successor
    count_R: np.ndarray  # int32: tokens drawn so far
    # The sliding-window layers' own page ids (None: they share the pages above).
    ltable_RxM: np.ndarray | None = None  # int32: their block table (scratch: out of window)
    lwrite_page_R: np.ndarray | None = None  # int32: their page of the fed token

    @classmethod
    def empty(cls, rows: int, m: int, ell: int, pad: int, local: bool = False):
        """R rows pointing at the scratch page, M table entries, L - 1 recent tokens."""
        zeros = lambda *shape: np.zeros(shape, np.int32)
        return cls(
            tokens_R=np.full(rows, pad, np.int32),
            pos_R=zeros(rows),
            prompt_len_R=zeros(rows),
            shared_R=zeros(rows),
            table_RxM=zeros(rows, m),
            write_page_R=zeros(rows),
            write_off_R=zeros(rows),
            prev_RxL1=np.full((rows, ell), pad, np.int32),
            count_R=zeros(rows),
            ltable_RxM=zeros(rows, m) if local else None,
            lwrite_page_R=zeros(rows) if local else None,
        )


_JITTED: list = []


def compile_count() -> int:
    """Engine executables compiled in this process (as ``sampling.compile_count``)."""
    return sum(f._cache_size() for f in _JITTED)


@functools.lru_cache(maxsize=64)
def _compiled(graphdef, cfg: SamplingConfig, num_samples: int, z: int, routes=None):
    """(init pages, prefill chunk, first draw, decode step) jitted for one model and config.
    ``routes``: the dtype the prefill chunks and decode steps return their tokens' experts
    in (:func:`records_routes`); None: they return none (the programs of a run without
    routing replay)."""
    init = jax.jit(
        lambda params, pages, local: nnx.merge(graphdef, params).init_pages(pages, z, local),
        static_argnums=(1, 2),
    )
    prefill = jax.jit(
        functools.partial(_prefill_chunk, graphdef=graphdef, z=z, routes=routes),
        donate_argnums=(1,),
    )
    first = jax.jit(functools.partial(_first_draw, cfg=cfg, g=num_samples))
    decode = jax.jit(
        functools.partial(_decode_step, graphdef=graphdef, cfg=cfg, z=z, routes=routes),
        donate_argnums=(1,),
    )
    _JITTED.extend([init, prefill, first, decode])
    return init, prefill, first, decode


# ---------------------------------------------------------------------------
# The host side: the page pool, the queue, the slots.


def write_chunk(
    prefill, params, pages, tokens, pos, chunk, pad_id, width, page_ids, *, n=0, shared=0,
    local_ids=None,
):  # fmt: skip
    """``tokens`` (at most ``chunk``) at positions pos, pos + 1, ... through the jitted
    prefill call, into a row's pages ``page_ids`` (its block table; ``local_ids``: the
    sliding-window layers' own, if any). A prompt's chunk: ``n`` = ``shared`` = 0; a row's
    own tokens: ``n`` its prompt's length, ``shared`` its prompt's pages in the table ->
    (pages, logits [1, V] of the chunk's last token)."""
    count = len(tokens)
    tokens_C = np.full(chunk, pad_id, np.int32)
    tokens_C[:count] = tokens
    table = lambda ids: np.pad(np.asarray(ids, np.int32), (0, width - len(ids)))
    ltable_M = None if local_ids is None else table(local_ids)
    return prefill(
        params, pages, tokens_C, np.int32(pos), np.int32(count), table(page_ids),
        np.int32(n), np.int32(shared), ltable_M,
    )  # fmt: skip


class EngineStats(NamedTuple):
    """What one engine run did (docs/engine.md's metrics)."""

    decode_steps: int  # decode calls
    prefill_chunks: int  # prefill calls of prompts
    extend_chunks: int  # prefill calls of carried rows' own tokens (partial rollouts)
    slot_occupancy: float  # mean occupied slots / slots over decode calls
    row_occupancy: float  # mean occupied rows / rows of the decode calls (packing's waste)
    peak_pages: int  # most pool pages in use at once (scratch excluded)
    pool_pages: int  # pool pages (scratch excluded)
    page_bytes: int  # bytes of one page over all layers (keys and values)
    prompt_pages: int  # pages holding prompt tokens, summed over prompts
    pool_bytes: int  # bytes of the pool's arrays as allocated (the scratch page included)
    # The sliding-window layers' own pool, when pages out of the window are freed (else 0).
    local_pool_pages: int = 0
    local_peak_pages: int = 0


class Rows(NamedTuple):
    """The per-row state of an engine run, N rows (row b*G + g: sample g of group b).

    A fresh run starts from :func:`fresh_rows` (nothing drawn); partial
    rollouts (``grpo_jax.rollout.partial``) pass the rows an earlier run left
    unfinished, and get them back with the tokens drawn since.
    """

    tokens_NxT: np.ndarray  # int32: drawn tokens (pad after count)
    logps_NxT: np.ndarray  # float32: their log-probs at the temperature
    behavior_NxT: np.ndarray  # float32: and under the distribution drawn from
    count_N: np.ndarray  # int32: tokens drawn
    ended_N: np.ndarray  # bool: ended by EOS or a stop sequence
    # With routing replay (:func:`fresh_routes`), the experts of each position the run that
    # last fed the row fed, [N, W + T, R, K]: its prompt left-padded to W, completion token t
    # at W + t, -1 where nothing was fed; None: no routes recorded.
    routes_NxSxRxK: np.ndarray | None = None

    def finished(self, t: int) -> np.ndarray:
        return self.ended_N | (self.count_N >= t)


def fresh_rows(n: int, t: int, pad_id: int, routes=None) -> Rows:
    """N rows with nothing drawn; ``routes``: their routes array (:func:`fresh_routes`)."""
    return Rows(
        np.full((n, t), pad_id, np.int32),
        np.zeros((n, t), np.float32),
        np.zeros((n, t), np.float32),
        np.zeros(n, np.int32),
        np.zeros(n, np.bool_),
        routes,
    )


def records_routes(model_cfg, cfg: SamplingConfig) -> bool:
    """Whether a run records routes: asked to (``cfg.record_routes``, set by routing replay)
    and the model is a mixture of experts (as the static sampler decides)."""
    return cfg.record_routes and bool(getattr(model_cfg, "num_experts", 0))


def fresh_routes(model_cfg, n: int, width: int, t: int) -> np.ndarray:
    """An empty routes array (all -1) for N rows of prompts up to ``width`` tokens and ``t``
    completion tokens: [N, width + t, R, K] in ``moe.routes_dtype``."""
    dtype = np.dtype(moe_lib.routes_dtype(model_cfg.num_experts))
    shape = (n, width + t, len(model_cfg.sparse_layers), model_cfg.experts_per_token)
    return np.full(shape, -1, dtype)


class _Run:
    """One engine call's host state; :meth:`run` drives the jitted calls.

    ``due``: the run returns once every row of groups 0 .. due - 1 has
    finished; the rows of later groups may then be unfinished (or never
    started), and their state in ``self.rows`` is where they stopped.
    With ``rows.routes_NxSxRxK`` the jitted calls ``fns`` return the fed tokens' experts,
    and the run writes them there (:meth:`read_routes`).
    """

    def __init__(self, fns, params, prompts, key, cfg: SamplingConfig, g: int, shape, rows, due):
        self.init, self.prefill, self.first, self.decode = fns
        self.params, self.prompts, self.cfg, self.g, self.shape = params, prompts, cfg, g, shape
        self.key_first, self.key_decode = jax.random.split(key)
        t, self.due = cfg.max_new_tokens, due
        # Copies: the caller's stay as they were.
        self.rows = Rows(*(None if x is None else np.array(x) for x in rows))
        finished_N = self.rows.finished(t)
        self.before_N = finished_N  # rows finished before the run: their routes stay
        self.due_left = int((~finished_N[: due * g]).sum())  # unfinished rows of due groups
        self.pool = Pool(shape.pages)
        self.win = Window(shape, len(prompts)) if shape.local_pages else None
        self.prompt_pages: list[list[int]] = [[] for _ in prompts]
        self.live_B = np.zeros(len(prompts), np.int32)  # samples of each prompt not yet ended
        # Prompts to prefill: every group with a row still to draw.
        groups_with_work = ~finished_N.reshape(len(prompts), g).all(axis=1)
        self.waiting = collections.deque(np.flatnonzero(groups_with_work).tolist())
        self.filling: tuple[int, int] | None = None  # (prompt, tokens written)
        self.ready: collections.deque = collections.deque()  # requests waiting for a slot
        self.slot_req = [-1] * shape.slots
        self.slot_pages: list[list[int]] = [[] for _ in range(shape.slots)]
        self.slot_written = [0] * shape.slots  # own tokens in the cache (a carried row's)
        self.own_worst = ceil_div(t - 1, shape.page_size)
        self.longest = max((len(q) for q in cfg.stop_sequences), default=1)
        self.steps = self.chunks = self.extend_chunks = 0
        self.occupied = self.rows_run = 0
        self.prompt_page_count = 0
        self.routes = self.rows.routes_NxSxRxK
        # (rows, first column, tokens, device array [C, R, K]) of each prefill chunk, read
        # back once the run ends: a chunk then waits for no transfer.
        self.chunk_routes: list = []

    def _to_write(self, s: int) -> int:
        """Own tokens slot ``s``'s row must still write before it can decode (carried rows)."""
        return int(self.rows.count_N[self.slot_req[s]]) - 1 - self.slot_written[s]

    def run(self) -> None:
        self.pages = self.init(self.params, self.shape.pages, self.shape.local_pages)
        while self.due_left:
            self._admit()
            active = [s for s, r in enumerate(self.slot_req) if r >= 0]
            extending = [s for s in active if self._to_write(s) > 0]
            decoding = [s for s in active if s not in extending]
            free = self.shape.slots - len(active)
            if extending:
                self._extend(extending[0])
            elif (self.filling or self.waiting) and (len(self.ready) < free or not decoding):
                started = self._prefill()
                if not started and not active:
                    raise ConfigError(
                        f"config key 'sampling.pages' = {self.shape.pages - 1} is too small: "
                        "the pool cannot hold the next prompt's pages "
                        f"({self.pool.in_use} in use, {self.pool.reserved} reserved)"
                    )
            if decoding:
                self._decode(decoding)
            elif not (extending or self.ready or self.filling or self.waiting):
                return

    def _can_reserve(self, pages: int, local: int) -> bool:
        ok = self.pool.can_reserve(pages)
        return ok and (self.win is None or self.win.pool.can_reserve(local))

    def _admit(self) -> None:
        local = 0 if self.win is None else self.win.worst
        for s, r in enumerate(self.slot_req):
            if r < 0 and self.ready and self._can_reserve(self.own_worst, local):
                self.slot_req[s] = self.ready.popleft()
                self.slot_pages[s], self.slot_written[s] = [], 0
                self.pool.reserved += self.own_worst
                if self.win is not None:
                    self.win.admit(s)

    def _prefill(self) -> bool:
        """One chunk of the prompt being prefilled; False when its pages cannot be reserved."""
        z, c = self.shape.page_size, self.shape.chunk
        if self.filling is None:
            b = self.waiting[0]
            need = ceil_div(len(self.prompts[b]), z)
            if not self._can_reserve(need, need):
                return False
            self.waiting.popleft()
            self.pool.reserved += need
            if self.win is not None:
                self.win.pool.reserved += need
            self.filling = (b, 0)
        b, start = self.filling
        prompt = self.prompts[b]
        count = min(c, len(prompt) - start)
        pages = self.prompt_pages[b]
        while len(pages) * z < start + count:  # pages as the chunk's tokens need them
            pages.append(self.pool.take())
            if self.win is not None:
                self.win.prompt[b].append(self.win.pool.take())
        local = None if self.win is None else self.win.prompt[b]
        self.pages, logits_1xV, *used = write_chunk(
            self.prefill, self.params, self.pages, prompt[start : start + count], start, c,
            self.cfg.pad_id, self.shape.table, pages, local_ids=local,
        )  # fmt: skip
        if used:  # the group's rows still drawing (a carried group's finished ones keep theirs)
            rows_G = [r for r in range(b * self.g, (b + 1) * self.g) if not self.before_N[r]]
            col = self.routes.shape[1] - self.cfg.max_new_tokens - len(prompt) + start
            self.chunk_routes.append((rows_G, col, count, used[0]))
        self.chunks += 1
        if start + count < len(prompt):
            self.filling = (b, start + count)
            return True
        self.filling = None
        self.prompt_page_count += len(pages)
        rows_G = range(b * self.g, (b + 1) * self.g)
        if self.rows.count_N[rows_G.start] == 0:  # a new group: token 0 of its G samples
            drawn = jax.device_get(self.first(logits_1xV, self.key_first, np.int32(b)))
            for r, (tok, lp, beh, end) in zip(rows_G, zip(*drawn)):
                self._record(r, tok, lp, beh)
                self.rows.ended_N[r] = end
                if end or self.cfg.max_new_tokens == 1:
                    self._finished(r)
        finished_G = self.rows.finished(self.cfg.max_new_tokens)[rows_G.start : rows_G.stop]
        for r, fin in zip(rows_G, finished_G):  # rows still drawing (a carried group's too)
            if not fin:
                self.ready.append(r)
                self.live_B[b] += 1
        if self.live_B[b] == 0:
            self.pool.give(pages)
        if self.win is not None:
            self.win.prompt_done(b, int(self.live_B[b]))
        return True

    def _extend(self, s: int) -> None:
        """One chunk of a carried row's own tokens (all drawn but the last) into its pages."""
        z, c = self.shape.page_size, self.shape.chunk
        r = self.slot_req[s]
        b, start = r // self.g, self.slot_written[s]
        count = min(c, self._to_write(s))
        shared, own = self.prompt_pages[b], self.slot_pages[s]
        n = len(self.prompts[b])
        if self.win is not None:
            self.win.slide(s, b, n, n + start)
        while len(own) * z < start + count:
            own.append(self.pool.take())
            if self.win is not None:
                self.win.take_own(s)
        local = None if self.win is None else self.win.table(s, b, self.shape.table)
        self.pages, _, *used = write_chunk(
            self.prefill, self.params, self.pages, self.rows.tokens_NxT[r, start : start + count],
            n + start, c, self.cfg.pad_id, self.shape.table, shared + own, n=n,
            shared=len(shared), local_ids=local,
        )  # fmt: skip
        if used:  # own token i at column W + i
            col = self.routes.shape[1] - self.cfg.max_new_tokens + start
            self.chunk_routes.append(([r], col, count, used[0]))
        self.slot_written[s] += count
        self.extend_chunks += 1

    def _record(self, r: int, tok, lp, beh) -> None:
        c = self.rows.count_N[r]
        self.rows.tokens_NxT[r, c] = tok
        self.rows.logps_NxT[r, c], self.rows.behavior_NxT[r, c] = lp, beh
        self.rows.count_N[r] = c + 1

    def _finished(self, r: int) -> None:
        if r < self.due * self.g:
            self.due_left -= 1

    def _decode(self, active: list[int]) -> None:
        z, ell = self.shape.page_size, self.longest - 1
        rows = bucket(len(active), self.shape.slots)
        count_N, tokens_NxT = self.rows.count_N, self.rows.tokens_NxT
        win = self.win
        for s in active:  # a page for the fed token's keys and values where it starts one
            r = self.slot_req[s]
            b, o = r // self.g, int(count_N[r]) - 1
            if win is not None:  # first the pages that fall out of the window
                win.slide(s, b, len(self.prompts[b]), len(self.prompts[b]) + o)
            if o % z == 0:
                self.slot_pages[s].append(self.pool.take())
                if win is not None:
                    win.take_own(s)
        need = max(len(self.prompt_pages[self.slot_req[s] // self.g]) + len(self.slot_pages[s])
                   for s in active)  # fmt: skip
        m = bucket(need, self.shape.table)
        pad = self.cfg.pad_id
        x = _StepInputs.empty(rows, m, ell, pad, local=win is not None)
        for i, s in enumerate(active):
            r = self.slot_req[s]
            b, c = r // self.g, int(count_N[r])
            if win is not None:
                x.ltable_RxM[i] = win.table(s, b, m)
                x.lwrite_page_R[i] = win.own[s][(c - 1) // z]
            shared, own = self.prompt_pages[b], self.slot_pages[s]
            o = c - 1  # the fed token's index among the row's own tokens
            x.tokens_R[i] = tokens_NxT[r, c - 1]
            x.pos_R[i] = len(self.prompts[b]) + o
            x.prompt_len_R[i] = len(self.prompts[b])
            x.shared_R[i] = len(shared)
            x.table_RxM[i, : len(shared) + len(own)] = shared + own
            x.write_page_R[i], x.write_off_R[i] = own[o // z], o % z
            if ell:
                recent = tokens_NxT[r, max(0, c - ell) : c]
                x.prev_RxL1[i, ell - len(recent) :] = recent
            x.count_R[i] = c
        self.pages, *out = self.decode(
            self.params, self.pages, x, self.key_decode, np.int32(self.steps)
        )
        tokens_R, logps_R, behavior_R, ends_R, *used = jax.device_get(out)
        self.steps += 1
        self.occupied += len(active)
        self.rows_run += rows
        p = None if self.routes is None else self.routes.shape[1] - self.cfg.max_new_tokens
        for i, s in enumerate(active):
            r = self.slot_req[s]
            if used:  # the fed token, completion token count - 1, sits at column P + count - 1
                self.routes[r, p + count_N[r] - 1] = used[0][i]
            self.slot_written[s] += 1
            self._record(r, tokens_R[i], logps_R[i], behavior_R[i])
            if ends_R[i] or count_N[r] == self.cfg.max_new_tokens:
                self.rows.ended_N[r] = ends_R[i]
                self._release(s, r)
                self._finished(r)

    def read_routes(self) -> None:
        """Writes the prefill chunks' experts into the routes: a prompt of n real tokens at
        columns W - n .. W - 1 of its rows still drawing, a carried row's own tokens after
        W. A row the run fed has then every position it fed from this run's parameters
        (the run that finishes a row feeds its whole prefix again)."""
        if self.routes is None:
            return
        chunks = jax.device_get([used for *_, used in self.chunk_routes])
        for (rows, col, count, _), used in zip(self.chunk_routes, chunks):
            self.routes[rows, col : col + count] = used[:count]
        self.chunk_routes = []

    def _release(self, s: int, r: int) -> None:
        own = self.slot_pages[s]
        self.pool.reserved -= self.own_worst - len(own)
        self.pool.give(own)
        self.slot_req[s], self.slot_pages[s] = -1, []
        b = r // self.g
        if self.win is not None:
            self.win.release(s, b)
        self.live_B[b] -= 1
        if self.live_B[b] == 0:
            self.pool.give(self.prompt_pages[b])

    def stats(self, page_bytes: int) -> EngineStats:
        return EngineStats(
            decode_steps=self.steps,
            prefill_chunks=self.chunks,
            extend_chunks=self.extend_chunks,
            slot_occupancy=self.occupied / max(self.steps * self.shape.slots, 1),
            row_occupancy=self.occupied / max(self.rows_run, 1),
            peak_pages=self.pool.peak,
            pool_pages=self.shape.pages - 1,
            page_bytes=page_bytes,
            prompt_pages=self.prompt_page_count,
            pool_bytes=sum(x.nbytes for x in jax.tree.leaves(self.pages)),
            local_pool_pages=max(self.shape.local_pages - 1, 0),
            local_peak_pages=0 if self.win is None else self.win.pool.peak,
        )


def as_key(key):
    """A typed PRNG key (a raw ``jax.random.PRNGKey`` is wrapped)."""
    if not jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    return key


def real_prompts(tokens_BxP, mask_BxP) -> list[np.ndarray]:
    """Each left-padded prompt's real tokens (int32), the form the engines take."""
    tokens_BxP, mask_BxP = np.asarray(tokens_BxP), np.asarray(mask_BxP, bool)
    prompts = [row[m].astype(np.int32) for row, m in zip(tokens_BxP, mask_BxP)]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one real token (prompt_mask_BxP)")
    return prompts


def generate_rows(
    graphdef: nnx.GraphDef,
    params,
    prompts: list[np.ndarray],
    rows: Rows,
    key: jax.Array,
    cfg: SamplingConfig,
    *,
    num_samples: int,
    due: int,
    width: int | None = None,
    mesh=None,
) -> tuple[Rows, EngineStats]:
    """Continues ``rows`` (row b*G + g: sample g of ``prompts[b]``, its real tokens)
    until every row of groups 0 .. due - 1 has finished -> (the rows then, stats).

    A group with nothing drawn starts as in :func:`generate`; a group carried
    from an earlier call (partial rollouts) has its prompt prefilled again and
    each unfinished row's drawn tokens (but the last) written after it, with
    ``params``: the keys and values are this policy's, so the next token is
    drawn from it given the whole prefix. Later groups use the slots the due
    ones leave free, and may stop anywhere. ``width``: the prompts' padded
    width the engine's sizes follow (default: the smallest prompt bucket that
    holds the longest). With ``rows.routes_NxSxRxK`` (routing replay) each row the run
    feeds gets the routes of every position it fed there (the prompt's and the carried
    tokens' again, with ``params``); rows finished before keep theirs.
    """
    if due < 1 or due > len(prompts):
        raise ValueError(f"due = {due} must be in [1, {len(prompts)}] (the groups)")
    if width is None:  # the prompt bucket: the same shapes (and programs) step after step
        longest = max(len(p) for p in prompts)
        width = min((b for b in cfg.prompt_buckets if b >= longest), default=longest)
    model_cfg = nnx.merge(graphdef, params).config
    window = model_window(model_cfg)
    shape = engine_shape(cfg, len(prompts), num_samples, width, due=due, window=window)
    z, dtype = shape.page_size, None
    if rows.routes_NxSxRxK is not None:
        dtype = moe_lib.routes_dtype(model_cfg.num_experts)
        longest = max(len(p) for p in prompts)
        if rows.routes_NxSxRxK.shape[1] < longest + cfg.max_new_tokens:
            raise ValueError(
                f"rows.routes_NxSxRxK {rows.routes_NxSxRxK.shape} holds no prompt of "
                f"{longest} tokens and {cfg.max_new_tokens} more"
            )
    # Without routes, the very call (and cache entry) of paged_turns and the compiled-ahead
    # programs (grpo_jax.aot): lru_cache keys f(a) and f(a, None) apart.
    g = num_samples
    fns = _compiled(graphdef, cfg, g, z) if dtype is None else _compiled(graphdef, cfg, g, z, dtype)
    run = _Run(fns, params, prompts, as_key(key), cfg, g, shape, rows, due)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        run.run()
    run.read_routes()
    return run.rows, run.stats(kv_bytes_per_token(model_cfg) * shape.page_size)


def generate_with_stats(
    graphdef: nnx.GraphDef,
    params,
    prompt_tokens_BxP,
    prompt_mask_BxP,
    key: jax.Array,
    cfg: SamplingConfig,
    *,
    num_samples: int = 1,
    mesh=None,
) -> tuple[SampleOutput, EngineStats]:
    """:func:`generate` and the run's :class:`EngineStats`."""
    if not isinstance(cfg, SamplingConfig):
        raise TypeError(f"cfg must be a SamplingConfig, got {type(cfg).__name__}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples = {num_samples!r} must be a positive integer")
    tokens_BxP, mask_BxP = np.asarray(prompt_tokens_BxP), np.asarray(prompt_mask_BxP, bool)
    if tokens_BxP.ndim != 2 or tokens_BxP.shape != mask_BxP.shape:
        raise ValueError(
            f"prompt_tokens_BxP {tokens_BxP.shape} and prompt_mask_BxP {mask_BxP.shape} must be "
            "two arrays of the same [B, P] shape"
        )
    if mesh is not None and jax.process_count() > 1:
        raise ConfigError(
            "config key 'sampling.engine' = 'paged' runs in one process; use 'static' on a "
            "mesh that spans hosts"
        )
    prompts = real_prompts(tokens_BxP, mask_BxP)
    b, p = tokens_BxP.shape
    g, t = num_samples, cfg.max_new_tokens
    model_cfg = nnx.merge(graphdef, params).config
    routes = fresh_routes(model_cfg, b * g, p, t) if records_routes(model_cfg, cfg) else None
    rows, stats = generate_rows(
        graphdef,
        params,
        prompts,
        fresh_rows(b * g, t, cfg.pad_id, routes),
        key,
        cfg,
        num_samples=g,
        due=b,
        width=p,
        mesh=mesh,
    )
    out = output_rows(rows, tokens_BxP, mask_BxP, g, mesh=mesh)
    return out, stats


def output_rows(rows: Rows, tokens_BxP, mask_BxP, g: int, *, mesh=None) -> SampleOutput:
    """The :class:`SampleOutput` of B groups' finished ``rows`` (B*G of them) for prompts
    ``tokens_BxP`` (left-padded): on the default device, or split over ``mesh``'s batch.
    Their routes, when recorded, are cut to the prompts' width: [N, P + T, R, K]."""
    t = rows.tokens_NxT.shape[1]
    routes = rows.routes_NxSxRxK
    if routes is not None:
        routes = routes[:, routes.shape[1] - np.shape(tokens_BxP)[1] - t :]
    host = SampleOutput(
        prompt_tokens=np.repeat(np.asarray(tokens_BxP, np.int32), g, axis=0),
        prompt_mask=np.repeat(np.asarray(mask_BxP, bool), g, axis=0),
        tokens=rows.tokens_NxT,
        mask=np.arange(t)[None] < rows.count_N[:, None],
        logps=rows.logps_NxT,
        lengths=rows.count_N,
        truncated=~rows.ended_N,
        behavior_logps=rows.behavior_NxT,
        routes=routes,
    )
    # None stays None: routes without routing replay (SampleOutput.routes).
    if mesh is None:
        return SampleOutput(*(None if x is None else jnp.asarray(x) for x in host))
    return SampleOutput(
        *(
            None if x is None else distributed.put(x, sharding_lib.batch_sharding(mesh, x.ndim))
            for x in host
        )
    )


def generate(
    graphdef, params, prompt_tokens_BxP, prompt_mask_BxP, key, cfg, *, num_samples=1, mesh=None
):
    """Samples ``num_samples`` completions per prompt on the paged engine.

    The arguments and the result are ``grpo_jax.sampling.static.generate``'s (the
    prompts left-padded by ``pad_prompts``; row b*G + g is sample g of prompt
    b). Unlike the static sampler it returns after the whole run (the host
    loop schedules every step), with the rows on the host's devices.
    """
    return generate_with_stats(
        graphdef,
        params,
        prompt_tokens_BxP,
        prompt_mask_BxP,
        key,
        cfg,
        num_samples=num_samples,
        mesh=mesh,
    )[0]
