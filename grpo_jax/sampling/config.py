"""The sampler's settings: ``SamplingConfig`` (what the jitted sampler is compiled for) and
``SamplingSection`` (the run config's ``sampling`` section, checked when parsed).

Both are frozen and hashable, so a ``SamplingConfig`` is a static argument of the
sampler's jitted functions (``grpo_jax.sampling.static``): one compilation per setting.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grpo_jax.core.checks import check_known_keys, check_range, to_dict
from grpo_jax.core.errors import ConfigError
from grpo_jax.models.config import dtype_name


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How completions are drawn.

    Attributes:
      max_new_tokens: T, completion slots per row (static: one compilation).
      temperature: logits are divided by it before sampling and scoring (> 0).
        Greedy decoding ignores it for the choice but still records log-probs
        at this temperature.
      top_k: keep the k most likely tokens; 0 switches it off.
      top_p: keep the smallest set of most likely tokens whose probability
        (after top-k, renormalised) reaches top_p; 1 switches it off.
      min_p: then keep only tokens whose probability is at least min_p times
        the most likely token's; 0 switches it off.
      greedy: take the argmax instead of sampling.
      eos_ids: a row stops after emitting any of these ids (the EOS token is
        part of the completion). Empty: every row runs to max_new_tokens.
      stop_sequences: token-id sequences (each non-empty); a row also stops
        once its most recent generated tokens equal one of them (a suffix
        match over the completion only, never reaching into the prompt). The
        sequence's tokens are part of the completion, as an EOS is. Tokens
        are the unit: the run config's ``sampling.stop`` strings arrive here
        as their tokenizer encodings (``grpo_jax.run.builders.tokenizer_sampling``),
        and the same text written as other tokens does not match. Empty: no
        stop logic is traced at all.
      pad_id: written after a row's end and to the left of short prompts.
      prompt_buckets: allowed padded prompt lengths, increasing; a batch is
        padded to the smallest bucket that holds its longest prompt.
      engine: the name of a registered engine (``grpo_jax.sampling.engines``):
        "static" (``grpo_jax.sampling.static``: one batch, a cache of P + T slots
        per row), "paged" (``grpo_jax.sampling.paged``: a paged KV cache and
        continuously batched decode slots; docs/engine.md) or one of its own.
      page_size: tokens per KV page (paged engine).
      slots: decode slots of the paged engine; 0: one per row (B * G).
      pages: KV pages in the paged engine's pool; 0: enough for the worst case.
      prefill_chunk: prompt tokens per prefill call of the paged engine.
        These four leave greedy completions unchanged; sampled ones are drawn
        from the same distribution but change with them (the schedule decides
        which random numbers a row gets; docs/engine.md, "Settings").
      record_routes: record the experts a mixture of experts' routers chose at every
        position (``SampleOutput.routes``), for routing replay; set by the run from
        ``grpo.router_replay``, not a key of the ``sampling`` section.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = False
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    engine: str = "static"
    page_size: int = 16
    slots: int = 0
    pages: int = 0
    prefill_chunk: int = 64
    record_routes: bool = False

    def __post_init__(self):
        # Lists from a config file become tuples so the config stays hashable
        # (it is a static argument of the jitted sampler).
        for name in ("eos_ids", "prompt_buckets"):
            value = getattr(self, name)
            if isinstance(value, (list, np.ndarray)):
                object.__setattr__(self, name, tuple(int(v) for v in value))
            elif isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, (value,))
            elif not isinstance(value, tuple):
                raise ConfigError(
                    f"config key 'sampling.{name}' = {value!r} must be a tuple of integers"
                )
        check_range("sampling.max_new_tokens", self.max_new_tokens, lo=1, integer=True)
        check_range("sampling.temperature", self.temperature, lo=0.0, lo_open=True)
        check_range("sampling.top_k", self.top_k, lo=0, integer=True)
        check_range("sampling.top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        check_range("sampling.min_p", self.min_p, lo=0.0, hi=1.0)
        if not isinstance(self.greedy, (bool, np.bool_)):
            raise ConfigError(f"config key 'sampling.greedy' = {self.greedy!r} must be a bool")
        for i, eos in enumerate(self.eos_ids):
            check_range(f"sampling.eos_ids[{i}]", eos, lo=0, integer=True)
        object.__setattr__(self, "stop_sequences", _check_stop_sequences(self.stop_sequences))
        check_range("sampling.pad_id", self.pad_id, lo=0, integer=True)
        if not self.prompt_buckets:
            raise ConfigError("config key 'sampling.prompt_buckets' = () must not be empty")
        for i, b in enumerate(self.prompt_buckets):
            check_range(f"sampling.prompt_buckets[{i}]", b, lo=1, integer=True)
        if any(a >= b for a, b in zip(self.prompt_buckets, self.prompt_buckets[1:])):
            raise ConfigError(
                f"config key 'sampling.prompt_buckets' = {self.prompt_buckets!r} "
                "must be strictly increasing"
            )
        _check_engine(self)


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    """The ``sampling`` section: how GRPO samples completions (:class:`SamplingConfig` at run time).

    The temperature is ``grpo.temperature``: the sampler and the loss must
    score tokens from the same logits / temperature.

    Attributes:
      max_new_tokens: T, completion slots per row.
      top_k: keep the k most likely tokens; 0 switches it off.
      top_p: nucleus sampling mass; 1 switches it off.
      min_p: drop tokens whose probability is below min_p times the most
        likely token's; 0 switches it off.
      prompt_buckets: allowed padded prompt lengths, increasing (one
        compilation per bucket).
      stop: stop strings (default none). A completion also ends once its last
        generated tokens are a stop string's encoding by the run's tokenizer
        (no special tokens, no BOS); those tokens stay in the completion,
        scored like an EOS, and padding follows. Tokens are the unit: the
        same text written as other tokens (a different split of the
        characters) does not stop the row, and a match never reaches into the
        prompt. A base model prompted few-shot stops before writing the next
        example, e.g. ``("\\n\\nQuestion:",)``. A single string is one stop
        string. With an environment (``env.name``), a stop string ends the
        model's turn.
      engine: "static", "paged" or another registered engine's name, checked when
        the run's config is parsed (``grpo_jax.sampling.engines``; docs/engine.md).
      page_size, slots, pages, prefill_chunk: the paged engine's page size
        in tokens, decode slots (0: one per row), pool pages (0: the worst
        case) and prompt tokens per prefill call. Greedy completions are the
        same under any of them; sampled rollouts change with them (the same
        distribution, other draws; docs/engine.md, "Settings"). A page longer
        than the longest sequence, or a pool too small for any row, is refused
        at start-up (``PagedEngine.check`` in ``grpo_jax.sampling.engines``).
      param_dtype: "" (default): the sampler reads the trained parameters as
        they are. "bfloat16" (or "float16", "float32"): it samples with a
        copy of them in that dtype, computing in it too, made after each
        update (``grpo_jax.sampling.weights``; docs/engine.md). Evaluation
        always uses the trained parameters.
      partial_rollouts: with ``engine = "paged"`` (an engine that carries rows)
        and ``train.max_staleness`` = k >= 1: the engine starts the next k
        steps' prompts in the slots the step's rows leave free, and rows still
        unfinished when the step's groups are done carry over to the next step,
        each token tagged with the parameter version that drew it (``grpo_jax.rollout.partial``;
        docs/engine.md).
    """

    max_new_tokens: int
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    prompt_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    stop: tuple[str, ...] = ()
    engine: str = "static"
    page_size: int = 16
    slots: int = 0
    pages: int = 0
    prefill_chunk: int = 64
    param_dtype: str = ""
    partial_rollouts: bool = False

    def __post_init__(self):
        _check_engine(self)
        if not isinstance(self.partial_rollouts, bool):
            raise ConfigError(
                f"config key 'sampling.partial_rollouts' = {self.partial_rollouts!r} must be "
                "True or False"
            )
        if self.param_dtype != "":
            name = dtype_name("param_dtype", self.param_dtype, section="sampling")
            object.__setattr__(self, "param_dtype", name)
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if isinstance(stop, list):
            stop = tuple(stop)
        if not isinstance(stop, tuple) or not all(isinstance(x, str) for x in stop):
            raise ConfigError(
                f"config key 'sampling.stop' = {self.stop!r} must be a tuple of strings"
            )
        for i, x in enumerate(stop):
            if not x:
                raise ConfigError(
                    f"config key 'sampling.stop[{i}]' = '' is empty; every stop string needs "
                    "at least one character"
                )
        object.__setattr__(self, "stop", stop)

    @classmethod
    def from_mapping(cls, mapping) -> SamplingSection:
        cfg = to_dict(mapping)
        if "temperature" in cfg:
            raise ConfigError(
                "config key 'sampling.temperature' is not allowed: the sampling temperature is "
                "'grpo.temperature' (sampler and loss must score with the same one)"
            )
        check_known_keys("sampling", cfg, {f.name for f in dataclasses.fields(cls)})
        if "max_new_tokens" not in cfg:
            raise ConfigError("config key 'sampling.max_new_tokens' is required")
        buckets = cfg.get("prompt_buckets")
        if isinstance(buckets, (list, tuple)):
            cfg["prompt_buckets"] = tuple(buckets)
        section = cls(**cfg)
        section.sampler()  # The sampler's own checks name the bad value now.
        return section

    def sampler(
        self,
        *,
        temperature: float = 1.0,
        eos_ids=(),
        pad_id: int = 0,
        greedy=False,
        stop_sequences=(),
        record_routes=False,
    ):
        """The jitted sampler's static ``SamplingConfig`` for this section.

        ``stop_sequences`` are the token ids of ``stop`` (the section holds
        strings; ``grpo_jax.run.builders.tokenizer_sampling`` encodes them).
        """
        return SamplingConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            greedy=greedy,
            eos_ids=tuple(eos_ids),
            pad_id=pad_id,
            prompt_buckets=self.prompt_buckets,
            stop_sequences=tuple(tuple(q) for q in stop_sequences),
            engine=self.engine,
            page_size=self.page_size,
            slots=self.slots,
            pages=self.pages,
            prefill_chunk=self.prefill_chunk,
            record_routes=record_routes,
        )


def _check_stop_sequences(value) -> tuple[tuple[int, ...], ...]:
    """``value`` as a tuple of non-empty tuples of non-negative ints (hashable, static)."""
    key = "sampling.stop_sequences"
    if not isinstance(value, (tuple, list)):
        raise ConfigError(f"config key '{key}' = {value!r} must be a tuple of token-id tuples")
    out = []
    for i, seq in enumerate(value):
        if isinstance(seq, np.ndarray):
            seq = seq.tolist()
        if not isinstance(seq, (tuple, list)) or not seq:
            raise ConfigError(
                f"config key '{key}[{i}]' = {seq!r} must be a non-empty tuple of token ids"
            )
        seq = [int(t) if isinstance(t, np.integer) else t for t in seq]
        for j, tok in enumerate(seq):
            check_range(f"{key}[{i}][{j}]", tok, lo=0, integer=True)
        out.append(tuple(int(t) for t in seq))
    return tuple(out)


def _check_engine(cfg) -> None:
    """The engine keys of a ``SamplingConfig`` or ``SamplingSection``. The name is checked
    against the registered engines when the run's config is parsed
    (``grpo_jax.sampling.engines``, which sits above this module)."""
    if not isinstance(cfg.engine, str) or not cfg.engine:
        raise ConfigError(
            f"config key 'sampling.engine' = {cfg.engine!r} must be the name of a registered "
            "engine (a non-empty string)"
        )
    check_range("sampling.page_size", cfg.page_size, lo=1, integer=True)
    check_range("sampling.slots", cfg.slots, lo=0, integer=True)
    check_range("sampling.pages", cfg.pages, lo=0, integer=True)
    check_range("sampling.prefill_chunk", cfg.prefill_chunk, lo=1, integer=True)
