"""Rollout sources: where the training loop's batches come from.

    source.submit(step, params, version)    # start the batch of ``step``, sampled by ``params``
    source.take(step) -> InFlight           # that batch, sampled and scored

One interface (:class:`RolloutSource`) serves every kind of run (:class:`SingleTurn`,
:class:`Dynamic`, :class:`MultiTurn`, :class:`Partial`), so the loop has no branch on the kind
of source; bounded staleness wraps any of them (``grpo_jax.rollout.staleness``).
docs/architecture.md, "Rollout sources", has the interface, the four sources and the keys.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

import jax

from grpo_jax.core import batch as batch_lib
from grpo_jax.core import distributed
from grpo_jax.core import sharding as sharding_lib
from grpo_jax.core.batch import rollout_batch_shardings
from grpo_jax.rollout import episodes, partial, rounds
from grpo_jax.sampling import paged
from grpo_jax.sampling.static import pad_prompts

__all__ = [
    "Dynamic",
    "InFlight",
    "MultiTurn",
    "Partial",
    "RolloutSource",
    "SingleTurn",
    "make_source",
    "sample_key",
]


def sample_key(base_key: jax.Array, step: int) -> jax.Array:
    """The PRNG key that samples step ``step``'s batch (the update's is the other half)."""
    return jax.random.split(jax.random.fold_in(base_key, step))[0]


@dataclasses.dataclass
class InFlight:
    """A batch sampled and scored for its step.

    Attributes:
      step: the step that trains on it.
      version: the parameter version that sampled it (updates applied).
      batch: the RolloutBatch, on the learner mesh.
      host: its HostRollout.
      t_dispatch, t_sampled, t_done: ``perf_counter()`` when its sampling was
        dispatched, when the samples were ready, when its host work ended
        (0.0 for a batch restored from a checkpoint).
    """

    step: int
    version: int
    batch: batch_lib.RolloutBatch
    host: batch_lib.HostRollout
    t_dispatch: float = 0.0
    t_sampled: float = 0.0
    t_done: float = 0.0


class RolloutSource(Protocol):
    """What the loop and the staleness wrapper need of a source of batches (module doc).

    ``state_dict`` / ``load_state_dict`` (and, for arrays, ``state_arrays`` /
    ``arrays_like``) carry what the source holds between steps through a checkpoint
    (``grpo_jax.run.state.Stateful``): nothing, but for partial rollouts' carried rows.
    """

    split: bool  # whether it samples on a mesh of its own (mesh.sampler_devices)
    # Whether it spends train.max_staleness itself (partial rollouts: on rows carried
    # between its engine's runs); the wrapper then samples each batch at its own step.
    spends_staleness: bool

    def params(self, params):
        """The sampler's copy of ``params`` (the same arrays on one mesh)."""

    def submit(self, step: int, params, version: int) -> None: ...

    def take(self, step: int) -> InFlight: ...

    def state_dict(self): ...

    def state_arrays(self): ...

    def arrays_like(self, state): ...

    def load_state_dict(self, state, arrays=None) -> None: ...


class _CarriesNothing:
    """A source that holds nothing between steps: a checkpoint saves nothing of it, and
    batches sampled ahead are the staleness wrapper's."""

    spends_staleness = False

    def state_dict(self):
        return None

    def state_arrays(self):
        return None

    def arrays_like(self, state):
        return None

    def load_state_dict(self, state, arrays=None) -> None:
        # Only a queue saved at k >= 1 and resumed at k = 0 (checkpoint.allow_changed_config)
        # reaches here: those batches are not taken up, and the run samples afresh.
        del state, arrays


def _on_mesh(shardings, mesh):
    """The same partition specs on another mesh with the same axis names."""
    return jax.tree.map(lambda sh: jax.sharding.NamedSharding(mesh, sh.spec), shardings)


class SingleTurn(_CarriesNothing):
    """One round of B prompts x G completions a step, on the learner's or its own mesh.

    ``wait_params``: wait for the parameters before dispatching, so the
    sampler's time is its own (the on-policy loop, where nothing overlaps).
    ``on_prompts``: called once, with the first batch's padded prompt width
    P, before its generation is dispatched (the loop starts compiling the
    update for that shape then).
    """

    def __init__(
        self,
        r: rounds.Rollouts,
        iterator,
        base_key: jax.Array,
        *,
        wait_params: bool,
        on_prompts: Callable[[int], None] | None = None,
    ):
        self.r, self.iterator, self.base_key = r, iterator, base_key
        self.wait_params = wait_params
        self.on_prompts = on_prompts
        placement = r.placement
        self.split = placement.sampler_mesh is not None
        self.mesh = placement.sampler_mesh if self.split else placement.mesh
        if self.split:
            self.param_shardings = _on_mesh(placement.param_shardings, self.mesh)
            self.learner_mesh = placement.mesh
        self._pending = {}

    def params(self, params):
        """The sampler's copy of ``params`` (a device-to-device copy on a split mesh, in
        ``sampling.param_dtype`` when it is set; on one mesh the rollout casts them).

        With several processes JAX moves arrays only between the same device
        sets, so the learner mesh first gathers each array onto every one of
        its devices; each process then copies its local copy onto its own
        sampler devices (no host round trip).
        """
        if not self.split:
            return params
        # The copy in sampling.param_dtype, if any, is made before the move: fewer bytes.
        _, params = self.r.sampler_policy(params)
        if jax.process_count() == 1:
            return jax.device_put(params, self.param_shardings)
        full = self._gather(params)

        def one(x, sh):
            if not sh.is_fully_replicated:
                raise ValueError(f"the sampler's parameters must be replicated, got {sh.spec}")
            local = x.addressable_data(0)
            parts = [jax.device_put(local, d) for d in sh.addressable_devices]
            return jax.make_array_from_single_device_arrays(x.shape, sh, parts)

        return jax.tree.map(one, full, self.param_shardings)

    def _gather(self, tree):
        if not hasattr(self, "_gather_fn"):
            replicated = sharding_lib.replicated(self.r.mesh)
            self._gather_fn = jax.jit(lambda t: t, out_shardings=replicated)
        return self._gather_fn(tree)

    def submit(self, step: int, params, version: int) -> None:
        r = self.r
        examples = self.iterator.next()  # this host's rows of the global batch
        if self.on_prompts is not None:
            on_prompts, self.on_prompts = self.on_prompts, None
            T = r.sampling.max_new_tokens
            on_prompts(rounds.prompt_width(r.encoder, examples, max_new_tokens=T))
        d = rounds.dispatch_round(
            r,
            params,
            examples,
            sample_key(self.base_key, step),
            mesh=self.mesh,
            wait_params=self.wait_params,
        )
        self._pending[step] = (version, d)

    def take(self, step: int) -> InFlight:
        version, d = self._pending.pop(step)
        rd = rounds.finish_round(self.r, d)
        batch, host = rounds.batch_from_round(self.r, rd)
        if self.split and jax.process_count() == 1:  # sampler devices -> learner devices
            routes = batch.routes_NxSxRxK is not None
            batch = jax.device_put(batch, rollout_batch_shardings(self.learner_mesh, routes))
        elif self.split:  # several processes: each moves its own rows (the same block)
            N = batch.num_rows
            rows = distributed.local_rows(batch, self.r.rows_N)
            batch = distributed.global_batch(rows, self.r.mesh, N)
        return InFlight(
            step,
            version,
            batch,
            host,
            t_dispatch=d.t_params_ready,
            t_sampled=d.t_params_ready + rd.t_sample,
            t_done=time.perf_counter(),
        )


class _Eager(_CarriesNothing):
    """A source that samples and scores the whole batch in ``submit`` (module doc)."""

    split = False

    def __init__(self, r: rounds.Rollouts, iterator, base_key: jax.Array):
        self.r, self.iterator, self.base_key = r, iterator, base_key
        self._done: dict[int, InFlight] = {}

    def params(self, params):
        return params

    def submit(self, step: int, params, version: int) -> None:
        t0 = time.perf_counter()
        batch, host = self._collect(params, sample_key(self.base_key, step))
        t1 = time.perf_counter()
        self._done[step] = InFlight(step, version, batch, host, t0, t1, t1)

    def take(self, step: int) -> InFlight:
        return self._done.pop(step)


class Dynamic(_Eager):
    """DAPO's dynamic sampling: up to ``max_rounds`` rounds of prompts until B groups
    have signal."""

    def __init__(self, r, iterator, base_key, *, max_rounds: int):
        super().__init__(r, iterator, base_key)
        self.max_rounds = max_rounds

    def _collect(self, params, key):
        draw = self.iterator.next
        return rounds.collect_dynamic(self.r, params, draw, key, max_rounds=self.max_rounds)


class MultiTurn(_Eager):
    """Episodes against the run's environment (``env``: the run's ``env`` section)."""

    def __init__(self, r, iterator, base_key, *, env):
        super().__init__(r, iterator, base_key)
        self.env = env

    def _collect(self, params, key):
        return episodes.collect(self.r, self.env, params, self.iterator.next(), key)


class Partial:
    """Partial rollouts (``grpo_jax.rollout.partial``): each step's engine run also advances the
    next k steps' groups, and carries their unfinished rows over.

    The run is synchronous (the paged engine returns when the step's groups are
    done), so ``submit`` samples and ``take`` decodes and scores. It spends the staleness
    bound on the rows it carries, and its state (``state_dict`` and its arrays) is those
    groups in flight.
    """

    split = False
    spends_staleness = True

    def __init__(self, r: rounds.Rollouts, iterator, base_key, *, k: int, on_prompts=None):
        self.r, self.iterator, self.base_key = r, iterator, base_key
        self.carry = partial.Carry(r, k)
        self.on_prompts = on_prompts
        self._pending = {}

    def params(self, params):
        return params

    def submit(self, step: int, params, version: int) -> None:
        r, T = self.r, self.r.sampling.max_new_tokens
        head = self.carry.top_up(self.iterator.next)
        examples, texts = [x.example for x in head], r.encoder.texts([x.example for x in head])
        # The prompt tokens the engine samples with (a restored group's as saved), padded.
        tokens_BxP, mask_BxP = pad_prompts(
            [x.prompt.tolist() for x in head], pad_id=r.encoder.pad_id,
            buckets=r.encoder.buckets, max_new_tokens=T,
        )  # fmt: skip
        if self.on_prompts is not None:
            on_prompts, self.on_prompts = self.on_prompts, None
            on_prompts(tokens_BxP.shape[1])
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        done, stats = self.carry.sample(params, sample_key(self.base_key, step), version)
        metrics = self.carry.metrics(done, version)
        rows = partial.stack_rows(done)
        out = paged.output_rows(rows, tokens_BxP, mask_BxP, r.grpo.G, mesh=r.mesh)
        d = rounds.Dispatched(out, examples, texts, int(mask_BxP.sum()), t0, stats)
        self._pending[step] = (version, d, metrics)

    def take(self, step: int) -> InFlight:
        version, d, metrics = self._pending.pop(step)
        rd = rounds.finish_round(self.r, d)
        batch, host = rounds.batch_from_round(self.r, rd)
        host = dataclasses.replace(host, metrics={**host.metrics, **metrics})
        t_sampled = d.t_params_ready + rd.t_sample
        return InFlight(
            step, version, batch, host, d.t_params_ready, t_sampled, time.perf_counter()
        )

    def state_dict(self):
        return self.carry.state_dict()

    def state_arrays(self):
        return self.carry.state_arrays()

    def arrays_like(self, state):
        return self.carry.arrays_like(state)

    def load_state_dict(self, state, arrays=None) -> None:
        self.carry.load_state_dict(state, arrays)


def make_source(run, r: rounds.Rollouts, iterator, base_key, *, on_prompts=None):
    """The source ``run`` asks for: multi-turn with ``env.name``, dynamic with
    ``train.dynamic_sampling``, partial rollouts with ``sampling.partial_rollouts``,
    else single-turn."""
    if run.sampling.partial_rollouts:
        k = run.train.max_staleness
        return Partial(r, iterator, base_key, k=k, on_prompts=on_prompts)
    if run.env.name:
        return MultiTurn(r, iterator, base_key, env=run.env)
    if run.train.dynamic_sampling:
        return Dynamic(r, iterator, base_key, max_rounds=run.train.max_sampling_rounds)
    wait = not run.train.max_staleness  # on-policy: nothing overlaps the sampler
    return SingleTurn(r, iterator, base_key, wait_params=wait, on_prompts=on_prompts)
