"""Rollout engines behind one interface, chosen by name with ``sampling.engine``.

An :class:`Engine` samples G completions per prompt, plays multi-turn episodes (on the
static kernel unless it has its own), counts its KV cache or pool for the memory plan and
checks its settings when the config is parsed. :func:`register_engine` makes one
selectable; ``"static"`` and ``"paged"`` are registered below. A new engine is one file: an
``Engine`` subclass and one ``register_engine`` call (docs/engine.md, "Engines").
"""

from __future__ import annotations

import numpy as np

from grpo_jax.core.errors import ConfigError
from grpo_jax.sampling import paged, paged_pool, paged_turns, static
from grpo_jax.sampling.static_turns import StaticTurns

STATIC = "static"  # the default engine; evaluation always samples on it (row keys)


class Engine:
    """What the trainer asks of a rollout engine. Only :meth:`generate` is required.

    Shapes: B prompts, G = ``num_samples`` completions each, N = B*G rows (row b*G + g
    is sample g of prompt b), P padded prompt length, T = ``cfg.max_new_tokens``.
    """

    # Partial rollouts (``grpo_jax.rollout.partial``) need an engine that continues rows
    # an earlier run left unfinished (:meth:`generate_rows`); the config refuses others.
    carries_rows: bool = False
    # Routing replay (``grpo.router_replay = "rollout"``) needs an engine whose
    # :meth:`generate` records each token's experts when ``cfg.record_routes``
    # (``SampleOutput.routes``), and whose :meth:`turns` episodes do (their ``routes()``);
    # the config refuses others.
    records_routes: bool = False

    def generate(
        self, graphdef, params, tokens_BxP, mask_BxP, key, cfg, *, num_samples: int, mesh=None
    ):
        """-> (``static.SampleOutput`` of N rows, the run's statistics or None).

        The arguments are ``grpo_jax.sampling.static.generate``'s: the policy
        (``nnx.split``), left-padded prompts and their mask, a PRNG key (the same key gives
        the same output), the static ``SamplingConfig`` and, when given, the mesh whose
        ("data", "fsdp") axes split the rows in whole groups. The output's log-probs are the
        policy's at ``cfg.temperature`` over the whole vocabulary (pi_old), its
        ``behavior_logps`` those of the distribution actually drawn from. The statistics go
        to :meth:`metrics`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define generate")

    def turns(self, graphdef, params, tokens_BxP, mask_BxP, key, sampling, cfg, num_samples):
        """Multi-turn episodes: an object with ``grpo_jax.sampling.static_turns.StaticTurns``'s
        phase interface (``phase``, ``finish``, ``start_turns``, ``transcripts`` and its
        host arrays, and ``routes()``: the fed tokens' experts [N, P + T, R, K] when
        ``sampling.record_routes``, else None), which ``grpo_jax.rollout.episodes`` drives.
        By default the static kernel: an engine without episodes of its own plays them
        there."""
        return StaticTurns(graphdef, params, tokens_BxP, mask_BxP, key, sampling, cfg, num_samples)

    def kv_bytes(self, cfg, model_cfg, *, prompts: int, samples: int, due: int, mesh_shape):
        """Bytes per device of the KV cache (or pool) of one run over ``prompts`` prompts of
        the largest bucket, ``samples`` each, ``due`` of them to finish (partial rollouts
        hold more prompts than are due), for the memory plan (``grpo_jax.run.memory``).

        ``model_cfg`` is a ``ModelConfig`` in the sampler's compute dtype; ``mesh_shape``
        the mesh's axis sizes. None (the default): the static sampler's cache, P + T slots
        a row split over the batch shards, as the plan counts it itself.
        """
        return None

    def check(self, sampling, model, *, completion: int, completion_key: str) -> None:
        """Refuses settings this engine cannot run with a ``ConfigError`` naming the key.

        Called once when the config is parsed, with the ``sampling`` and ``model`` sections
        (``SamplingSection``, ``ModelSection``) and the tokens a row holds after its prompt:
        ``sampling.max_new_tokens``, or ``env.max_tokens`` with an environment, named by
        ``completion_key``.
        """

    def metrics(self, stats: list) -> dict[str, float]:
        """The step's ``engine/*`` metrics from the statistics of its runs (:meth:`generate`'s
        second output, those not None)."""
        return {}

    def generate_rows(
        self, graphdef, params, prompts, rows, key, cfg, *, num_samples: int, due: int, mesh=None
    ):
        """Continues ``rows`` (``paged.Rows``) of ``prompts`` (each prompt's real tokens) until
        the ``due`` first groups are finished -> (the rows then, statistics); only an engine
        that ``carries_rows`` (``paged.generate_rows`` documents the contract, the rows'
        routes under routing replay included)."""
        raise NotImplementedError(f"{type(self).__name__} does not carry rows between its runs")


class StaticEngine(Engine):
    """One batch decoded until its longest row ends, a KV cache of P + T slots a row
    (``grpo_jax.sampling.static``); episodes on ``grpo_jax.sampling.static_turns``."""

    records_routes = True

    def generate(
        self, graphdef, params, tokens_BxP, mask_BxP, key, cfg, *, num_samples: int, mesh=None
    ):
        out = static.generate(
            graphdef, params, tokens_BxP, mask_BxP, key, cfg, num_samples=num_samples, mesh=mesh
        )
        return out, None


class PagedEngine(Engine):
    """A paged KV pool and continuously batched decode slots (``grpo_jax.sampling.paged``,
    its pool ``paged_pool``, its episodes ``paged_turns``; docs/engine.md)."""

    carries_rows = True
    records_routes = True  # and carried rows carry theirs (paged.Rows.routes_NxSxRxK)

    def generate(
        self, graphdef, params, tokens_BxP, mask_BxP, key, cfg, *, num_samples: int, mesh=None
    ):
        return paged.generate_with_stats(
            graphdef, params, tokens_BxP, mask_BxP, key, cfg, num_samples=num_samples, mesh=mesh
        )

    def generate_rows(
        self, graphdef, params, prompts, rows, key, cfg, *, num_samples: int, due: int, mesh=None
    ):
        return paged.generate_rows(
            graphdef, params, prompts, rows, key, cfg, num_samples=num_samples, due=due, mesh=mesh
        )

    def turns(self, graphdef, params, tokens_BxP, mask_BxP, key, sampling, cfg, num_samples):
        prompts = paged.real_prompts(tokens_BxP, mask_BxP)
        width = np.shape(tokens_BxP)[1]
        return paged_turns.TurnEngine(
            graphdef, params, prompts, key, sampling, cfg, num_samples, width=width
        )

    def kv_bytes(self, cfg, model_cfg, *, prompts: int, samples: int, due: int, mesh_shape):
        # The pool is whole on every device (the engine runs in one process, unsharded).
        return paged_pool.pool_bytes(cfg, model_cfg, prompts, samples, due=due)

    def check(self, sampling, model, *, completion: int, completion_key: str) -> None:
        if model.scan_layers:
            raise ConfigError(
                "config key 'sampling.engine' = 'paged' needs model.scan_layers = False: the "
                "paged cache runs the unscanned layers"
            )
        # The page and pool sizes against the sequences they page: a pool too small for
        # any row would otherwise be refused only when the engine first ran.
        longest = max(sampling.prompt_buckets) + completion
        if sampling.page_size > longest:
            raise ConfigError(
                f"config key 'sampling.page_size' = {sampling.page_size} is larger than the "
                f"longest sequence it pages ({longest} tokens: the largest prompt bucket "
                f"{max(sampling.prompt_buckets)} + {completion_key} = {completion}): most of "
                f"every page would be empty, and the KV pool grows with the page; use at most "
                f"{longest} (the default is 16)"
            )
        own = -(-(completion - 1) // sampling.page_size)  # a row's own pages: what it feeds back
        if sampling.pages and sampling.pages < 1 + own:
            raise ConfigError(
                f"config key 'sampling.pages' = {sampling.pages} is too small for any row: a "
                f"row holds its prompt's pages (at least 1) and its own {own} ({completion_key} "
                f"= {completion} tokens in pages of {sampling.page_size}) at once; give at "
                f"least {1 + own}, or 0 for the worst case"
            )

    def metrics(self, stats: list) -> dict[str, float]:
        return {
            "engine/slot_occupancy": float(np.mean([e.slot_occupancy for e in stats])),
            "engine/peak_pages": max(e.peak_pages for e in stats),
        }


_ENGINES: dict[str, Engine] = {}


def register_engine(name: str, engine: Engine) -> Engine:
    """Makes ``engine`` the one ``sampling.engine = name`` selects; returns it.

    A name taken by an engine of another class is an error, so a plug-in cannot replace a
    built-in by accident; one of the same class replaces it (its module loaded again, as a
    config file that defines an engine may be).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an engine's name must be a non-empty string, got {name!r}")
    if not callable(getattr(engine, "generate", None)):
        raise TypeError(f"engine {name!r} has no generate method (grpo_jax.sampling.engines)")
    held = _ENGINES.get(name)
    kind = lambda e: (type(e).__module__, type(e).__qualname__)
    if held is not None and kind(held) != kind(engine):
        raise ValueError(
            f"engine name {name!r} is taken by {type(held).__qualname__}; register "
            f"{type(engine).__qualname__} under another name"
        )
    _ENGINES[name] = engine
    return engine


def engine_names() -> tuple[str, ...]:
    """The registered engines' names, in the order they were registered."""
    return tuple(_ENGINES)


def get_engine(name: str) -> Engine:
    """The engine registered as ``name``; another name is a one-line ``ConfigError``."""
    engine = _ENGINES.get(name) if isinstance(name, str) else None
    if engine is None:
        raise ConfigError(
            f"config key 'sampling.engine' = {name!r} is not a registered engine; registered: "
            f"{', '.join(engine_names())} (an engine of its own registers with "
            "grpo_jax.sampling.engines.register_engine)"
        )
    return engine


register_engine(STATIC, StaticEngine())
register_engine("paged", PagedEngine())
