"""The paged engine's pool: page ids, reservations, the sliding-window layers' own pool, and
the static sizes of an engine run (``grpo_jax.sampling.paged``; docs/engine.md).

Host-side bookkeeping only (integers and lists); the pages' arrays live on the device,
in ``Transformer.init_pages``'s layout.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from grpo_jax.sampling.static import SamplingConfig

SCRATCH_PAGE = 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bucket(n: int, most: int) -> int:
    """The smallest power of two >= n, at most ``most``: the static sizes of a decode call."""
    return min(1 << (n - 1).bit_length(), most)


class EngineShape(NamedTuple):
    """The static sizes of one engine run (each distinct one compiles its programs once)."""

    slots: int  # decode slots
    pages: int  # pool pages, the scratch page included
    page_size: int  # Z
    table: int  # M, block-table entries per row: prompt pages then own pages
    chunk: int  # C
    # The sliding-window layers' pool when pages out of the window are freed (0: they
    # share the pages above), the scratch page included; the own pages a slot holds there.
    local_pages: int = 0
    local_slot_pages: int = 0
    window: int = 0  # W of those layers


def model_window(model_cfg) -> int | None:
    """The widest sliding window of ``model_cfg``'s layers when it has any, else None."""
    windows = [model_cfg.window(i) for i in range(model_cfg.num_layers)]
    windows = [w for w in windows if w is not None]
    return max(windows) if windows else None


def engine_shape(
    cfg: SamplingConfig,
    num_prompts: int,
    num_samples: int,
    prompt_len: int,
    due: int = 0,
    window: int | None = None,
):
    """The :class:`EngineShape` for B prompts of padded length P and G samples each.

    The slots are ``cfg.slots``, by default one per row of the ``due`` groups
    (0: all B; partial rollouts' later groups fill the slots the due ones free).
    The pool holds ``cfg.pages`` pages plus the scratch page; by default
    (``cfg.pages`` = 0) the worst case: every prompt's pages at once and every
    slot's own pages for T - 1 fed tokens (the last drawn token is never fed).

    ``window``: the model's sliding window W (``model_window``). When a slot
    can never see all its own pages at once (W + C - 1 tokens span fewer
    pages than T - 1 do), the sliding-window layers get a pool of their own,
    from which a page goes back as soon as every row that reads it has moved
    past it: every prompt's pages plus ceil((W + C - 1) / Z) + 1 pages a slot.
    """
    n, z, t = num_prompts * num_samples, cfg.page_size, cfg.max_new_tokens
    slots = min(cfg.slots or (due or num_prompts) * num_samples, n)
    prompt_pages, own_pages = ceil_div(prompt_len, z), ceil_div(t - 1, z)
    pages = 1 + (cfg.pages or num_prompts * prompt_pages + slots * own_pages)
    shape = EngineShape(slots, pages, z, prompt_pages + max(own_pages, 1), cfg.prefill_chunk)
    if window is None:
        return shape
    held = ceil_div(window + cfg.prefill_chunk - 1, z) + 1
    if held >= own_pages:
        return shape
    local = 1 + num_prompts * prompt_pages + slots * held
    return shape._replace(local_pages=min(local, pages), local_slot_pages=held, window=window)


def pool_bytes(
    cfg: SamplingConfig, model_cfg, num_prompts: int, num_samples: int, due: int = 0
) -> int:
    """Bytes of the pool :func:`engine_shape` sizes for prompts of the largest bucket."""
    shape = engine_shape(
        cfg, num_prompts, num_samples, max(cfg.prompt_buckets), due=due,
        window=model_window(model_cfg),
    )  # fmt: skip
    per_layer = kv_bytes_per_token(model_cfg) // model_cfg.num_layers * shape.page_size
    local_layers = sum(model_cfg.window(i) is not None for i in range(model_cfg.num_layers))
    if not shape.local_pages:
        return shape.pages * per_layer * model_cfg.num_layers
    global_layers = model_cfg.num_layers - local_layers
    return (shape.pages * global_layers + shape.local_pages * local_layers) * per_layer


def kv_bytes_per_token(model_cfg) -> int:
    """Bytes of one token's keys and values over all layers in the compute dtype."""
    width = jnp.dtype(model_cfg.compute_dtype).itemsize
    return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * width


class Pool:
    """The host's page allocator: a free list, reference counts and reservations.

    A request admitted to a slot (a prompt started in prefill) reserves the
    pages it may still need, so a pool smaller than the worst case delays
    admission instead of running dry mid-decode.
    """

    def __init__(self, pages: int):
        self.size = pages
        self.free = list(range(pages - 1, SCRATCH_PAGE, -1))  # page 1 is taken first
        self.refs = np.zeros(pages, np.int32)
        self.reserved = 0
        self.peak = 0

    @property
    def in_use(self) -> int:
        return self.size - 1 - len(self.free)

    def can_reserve(self, n: int) -> bool:
        return len(self.free) - self.reserved >= n

    def take(self) -> int:
        page = self.free.pop()  # reserved beforehand, so never empty
        self.refs[page] = 1
        self.reserved -= 1
        self.peak = max(self.peak, self.in_use)
        return page

    def give(self, pages) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)


class Window:
    """The sliding-window layers' pages when they have a pool of their own (docs/engine.md).

    Every page of the main pool that a row reads (a prompt's page j, a slot's
    own page k) has a twin here while some row can still see it: a query at
    position q sees positions q - W + 1 .. q only, so a page whose last
    position is before q - W + 1 goes back for good once every row reading it
    has passed it. A prompt's twins are counted by the samples still reading
    them; a slot's own twins go as soon as its row passes them. A slot reserves
    the most it can hold at once (``EngineShape.local_slot_pages``), so the pool
    never runs dry.
    """

    def __init__(self, shape: EngineShape, num_prompts: int):
        self.pool = Pool(shape.local_pages)
        self.w, self.z, self.worst = shape.window, shape.page_size, shape.local_slot_pages
        self.prompt: list[list[int]] = [[] for _ in range(num_prompts)]
        self.own: list[list[int]] = [[] for _ in range(shape.slots)]  # SCRATCH once gone
        self.passed_prompt = [0] * shape.slots
        self.passed_own = [0] * shape.slots
        self.held = [0] * shape.slots

    def admit(self, s: int) -> None:
        self.pool.reserved += self.worst
        self.own[s], self.passed_prompt[s], self.passed_own[s], self.held[s] = [], 0, 0, 0

    def prompt_done(self, b: int, readers: int) -> None:
        """Prompt ``b``'s pages are written and ``readers`` samples will read them."""
        if readers == 0:
            self.pool.give(self.prompt[b])
        for page in self.prompt[b] if readers else ():
            self.pool.refs[page] = readers

    def take_own(self, s: int) -> None:
        self.own[s].append(self.pool.take())
        self.held[s] += 1

    def slide(self, s: int, b: int, n: int, q: int) -> None:
        """Slot ``s``'s row (prompt ``b`` of ``n`` tokens) queries from position ``q`` on:
        the pages wholly before q - W + 1 go back."""
        first = q - self.w + 1
        prompt, own, z = self.prompt[b], self.own[s], self.z
        while self.passed_prompt[s] < len(prompt) and (self.passed_prompt[s] + 1) * z <= first:
            self.pool.give([prompt[self.passed_prompt[s]]])
            self.passed_prompt[s] += 1
        while self.passed_own[s] < len(own) and n + (self.passed_own[s] + 1) * z <= first:
            k = self.passed_own[s]
            self.pool.give([own[k]])
            own[k] = SCRATCH_PAGE
            self.pool.reserved += 1  # the slot's reservation stays whole
            self.held[s] -= 1
            self.passed_own[s] += 1

    def release(self, s: int, b: int) -> None:
        """Slot ``s``'s row ended: its own pages and its reads of the prompt's go back."""
        self.pool.reserved -= self.worst - self.held[s]
        self.pool.give([p for p in self.own[s] if p != SCRATCH_PAGE])
        self.pool.give(self.prompt[b][self.passed_prompt[s] :])
        self.own[s], self.held[s] = [], 0

    def table(self, s: int, b: int, width: int) -> np.ndarray:
        """Slot ``s``'s block table in this pool (pages out of its window: scratch)."""
        prompt = list(self.prompt[b])
        prompt[: self.passed_prompt[s]] = [SCRATCH_PAGE] * self.passed_prompt[s]
        out = np.zeros(width, np.int32)
        entries = prompt + self.own[s]
        out[: len(entries)] = entries
        return out
