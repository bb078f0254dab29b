"""Each program a run compiles, built from abstract parameters on a mesh of any devices.

Every argument is a ``jax.ShapeDtypeStruct`` carrying its sharding: the model is built
with ``nnx.eval_shape`` (no weight is made or read), the optimizer state with
``jax.eval_shape`` and ``optimizer.opt_state_shardings``. The jitted functions are the
project's own, made as the run makes them (``setup.build_trainer``'s update, the samplers'
``prefill`` and ``decode``, the paged engine's prefill chunk and decode step), so what
compiles here is what the run would run. Lowering them needs no device of the mesh's
kind: on a CPU host with libtpu the mesh is a TPU topology's compile-only devices.

Nothing may execute under ``jax.set_mesh`` of compile-only devices (it would run on
them), so the PRNG key's type is made before any mesh is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.core import batch as batch_lib
from grpo_jax.core import sharding as sharding_lib
from grpo_jax.learner import optimizer as optim_lib
from grpo_jax.learner import update as update_lib
from grpo_jax.learner.optimizer import TrainState
from grpo_jax.models import lora
from grpo_jax.models.partitioning import cache_shardings, param_shardings
from grpo_jax.models.transformer import Transformer
from grpo_jax.objective.logprobs import completion_logps
from grpo_jax.reward_models import judge as judge_lib
from grpo_jax.reward_models import model as reward_model_lib
from grpo_jax.reward_models import scorer as scorer_lib
from grpo_jax.run.builders import route_spec
from grpo_jax.sampling import paged, paged_pool
from grpo_jax.sampling import static as static_sampler

ORDER = (
    "decode",
    "prefill",
    "paged_decode",
    "paged_prefill",
    "reward_model",
    "judge",
    "scoring",
    "update",
)


@dataclasses.dataclass(frozen=True)
class Program:
    """A jitted function and the abstract arguments of one call; ``mesh``: lowered under
    ``jax.set_mesh(mesh)`` (as the run calls it), else None."""

    name: str
    fn: Any
    args: tuple
    mesh: Any = None

    def lower(self):
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            return self.fn.lower(*self.args)


def _sds(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract_params(cfg, mesh, layout: str, lora_cfg=None):
    """(graphdef, parameters as ShapeDtypeStructs with their shardings): no weights. With
    ``lora_cfg`` (an enabled ``LoRAConfig``) the model carries its adapters, as
    ``run.builders.build_policy`` attaches them (``grpo_jax.models.lora``)."""

    def make():
        model = Transformer(cfg, rngs=nnx.Rngs(0), layout=layout)
        if lora_cfg is not None:
            lora.attach(model, lora_cfg, jax.random.key(0))
        return model

    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    shardings = param_shardings(state, mesh, layout)
    params = jax.tree.map(lambda s, h: _sds(s.shape, s.dtype, h), state, shardings)
    return graphdef, params


def per_device_bytes(tree) -> int:
    """What one device holds of a tree of ShapeDtypeStructs with shardings."""
    import math

    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


@dataclasses.dataclass
class Builder:
    """The programs of one run on one mesh (:func:`programs`)."""

    run: Any
    cfg: Any
    mesh: Any

    def __post_init__(self):
        run = self.run
        self.key_dtype = jax.random.key(0).dtype  # made here, outside any mesh
        self.key_impl = jax.random.key_impl(jax.random.key(0))
        layout = run.mesh.layout
        # LoRA: the adapted model is the one the samplers and the update run; the update
        # also takes the base's graphdef (the reference is the base inside the parameters).
        self.lora = run.model.lora if run.model.lora.enabled else None
        self.graphdef, self.params = abstract_params(self.cfg, self.mesh, layout, self.lora)
        self.base_graphdef = None
        if self.lora is not None:
            self.base_graphdef = nnx.split(
                nnx.eval_shape(lambda: Transformer(self.cfg, rngs=nnx.Rngs(0), layout=layout))
            )[0]
        self.rep = sharding_lib.replicated(self.mesh)
        self.B, self.G = run.train.batch_size, run.grpo.G
        self.N = self.B * self.G
        self.P, self.T = max(run.sampling.prompt_buckets), run.completion_slots[0]
        self.routes = route_spec(run, self.cfg)  # routing replay's recorded routes, or None
        self.bsh = batch_lib.rollout_batch_shardings(self.mesh, routes=self.routes is not None)

    def key(self):
        return _sds((), self.key_dtype, self.rep)

    def batch(self):
        return batch_lib.batch_spec(self.bsh, self.N, self.P, self.T, routes=self.routes)

    def critic(self):
        """PPO's value head (``grpo_jax.learner.critic.init_head``), abstract; None without."""
        if self.run.grpo.advantage_estimator != "gae":
            return None
        d = self.cfg.hidden_size
        return {"w": _sds((d,), jnp.float32, self.rep), "b": _sds((), jnp.float32, self.rep)}

    def opt_state(self, tx, critic=None):
        """The optimizer's state over what trains: the adapters alone with LoRA."""
        trained = self.params if self.lora is None else lora.trainable(self.params)
        target = trained if critic is None else {"policy": trained, "value": critic}
        abstract = jax.eval_shape(tx.init, target)
        shardings = optim_lib.opt_state_shardings(tx, target, self.mesh)
        return jax.tree.map(lambda s, h: _sds(s.shape, s.dtype, h), abstract, shardings)

    def update(self) -> Program:
        """The update as ``setup.build_trainer`` jits it, for the run's batch."""
        run = self.run
        m_rows = run.train.minibatch_size or self.N
        total = run.train.steps * run.grpo.mu * (self.N // m_rows)
        tx, schedule = optim_lib.make_optimizer(run.optim, total)
        i32 = lambda: _sds((), jnp.int32, self.rep)
        head = self.critic()
        state = TrainState(self.params, self.opt_state(tx, head), *(i32() for _ in range(4)), head)
        param_sh = jax.tree.map(lambda x: x.sharding, self.params)
        # The reference: a copy of the parameters when beta > 0, but with LoRA the base half
        # of the policy's own (``run.setup``'s frozen shardings).
        ref = self.params if run.grpo.beta > 0 and self.lora is None else None
        step = update_lib.jit_update(
            graphdef=self.graphdef,
            tx=tx,
            schedule=schedule,
            grpo=run.grpo,
            minibatch_size=m_rows,
            grad_accum=run.optim.grad_accum,
            batch_shards=sharding_lib.batch_shards(self.mesh),
            track_update=run.train.track_update,
            logits_chunk=run.train.logits_chunk,
            share_prompts=True,
            state_shardings=jax.tree.map(lambda x: x.sharding, state),
            batch_shardings=self.bsh,
            ref_shardings=param_sh if ref is not None else None,
            replicated=self.rep,
            base_graphdef=self.base_graphdef,
            lora_dropout=run.model.lora.dropout,
        )
        return Program("update", step, (state, self.batch(), self.key(), ref))

    def scoring(self) -> Program:
        """One scoring pass over the whole batch (the reference's, and "recompute"'s):
        the update's first phase, as a program of its own."""
        rows2 = sharding_lib.batch_sharding(self.mesh, 2)
        fn = jax.jit(
            functools.partial(
                completion_logps,
                self.graphdef,
                temperature=self.run.grpo.temperature,
                chunk_size=self.run.train.logits_chunk,
                group_size=self.G,
            ),
            in_shardings=(jax.tree.map(lambda x: x.sharding, self.params),) + (rows2,) * 4,
            out_shardings=rows2,
        )
        b = self.batch()
        args = (self.params, b.prompt_tokens_NxP, b.prompt_mask_NxP, b.tokens_NxT, b.mask_NxT)
        return Program("scoring", fn, args, self.mesh)

    def _sampling_config(self):
        return self.run.sampling.sampler(
            eos_ids=(1,), pad_id=0, temperature=self.run.grpo.temperature
        )

    def static(self) -> list[Program]:
        """The static engine's prefill and its decode loop (``sampling.static.generate``)."""
        cfg = self._sampling_config()
        prefill, decode = static_sampler._compiled(
            self.graphdef, cfg, self.G, self.mesh, self.key_impl, False
        )
        rows2 = sharding_lib.batch_sharding(self.mesh, 2)
        tokens = _sds((self.B, self.P), jnp.int32, rows2)
        mask = _sds((self.B, self.P), jnp.bool_, rows2)
        args = (self.params, tokens, mask, self.key())
        with jax.set_mesh(self.mesh):
            out = jax.eval_shape(prefill, *args)[2]
        # The decode state as prefill lays it out (its cache's sharding is set inside).
        state_sh = _decode_state_shardings(self.cfg, out, self.mesh, self.run.mesh.layout)
        state = jax.tree.map(lambda s, h: _sds(s.shape, s.dtype, h), out, state_sh)
        return [
            Program("prefill", prefill, args, self.mesh),
            Program("decode", decode, (self.params, state), self.mesh),
        ]

    def paged(self) -> list[Program]:
        """The paged engine's prefill chunk and decode step over all its slots."""
        cfg = self._sampling_config()
        shape = paged_pool.engine_shape(
            cfg, self.B, self.G, self.P, window=paged_pool.model_window(self.cfg)
        )
        init, prefill, _, decode = paged._compiled(self.graphdef, cfg, self.G, shape.page_size)
        with jax.set_mesh(self.mesh):
            pages = jax.eval_shape(init, self.params, shape.pages, shape.local_pages)
        # As the run's pool is made from parameters on the mesh: whole on every device.
        pages = jax.tree.map(lambda s: _sds(s.shape, s.dtype, self.rep), pages)
        i32 = lambda *s: _sds(s, jnp.int32, self.rep)
        C, M, R = shape.chunk, shape.table, shape.slots
        local = bool(shape.local_pages)
        chunk_args = (self.params, pages, i32(C), i32(), i32(), i32(M), i32(), i32())
        chunk_args += (i32(M) if local else None,)
        inputs = paged._StepInputs(
            tokens_R=i32(R), pos_R=i32(R), prompt_len_R=i32(R), shared_R=i32(R),
            table_RxM=i32(R, M), write_page_R=i32(R), write_off_R=i32(R),
            prev_RxL1=i32(R, max((len(q) for q in cfg.stop_sequences), default=1) - 1),
            count_R=i32(R), ltable_RxM=i32(R, M) if local else None,
            lwrite_page_R=i32(R) if local else None,
        )  # fmt: skip
        return [
            Program("paged_prefill", prefill, chunk_args, self.mesh),
            Program(
                "paged_decode", decode, (self.params, pages, inputs, self.key(), i32()), self.mesh
            ),
        ]

    def learned(self) -> list[Program]:
        """The learned reward model's and the LLM judge's scoring pass (``reward_model.path``,
        ``judge.path``), as ``grpo_jax.reward_models`` jits them: one batch of their
        ``batch_size`` rows at their largest bucket, split over the batch axes, their
        weights in the run's layout. Their config.json and safetensors headers are read, no
        weight; the judge "reference" scores with the policy's own parameters."""
        run, made = self.run, []
        rm, judge = run.reward_model, run.judge
        if rm.path:
            graphdef, params = self._checkpoint(rm.path, classifier=True)
            fn = jax.jit(scorer_lib._scores_fn, static_argnums=0)
            args = (graphdef, params, *self._rows(rm))
            made.append(Program("reward_model", fn, args, self.mesh))
        if judge.path:
            if judge.path == judge_lib.REFERENCE:
                graphdef, params = self.graphdef, self.params
            else:
                graphdef, params = self._checkpoint(judge.path, classifier=False)
            k = len(judge.score_tokens)
            score = (_sds((k,), jnp.int32, self.rep), _sds((k,), jnp.float32, self.rep))
            fn = jax.jit(judge_lib._judge_fn, static_argnums=0)
            args = (graphdef, params, *self._rows(judge), *score)
            made.append(Program("judge", fn, args, self.mesh))
        return made

    def _checkpoint(self, path: str, *, classifier: bool):
        layout = self.run.mesh.layout
        model = reward_model_lib.abstract_checkpoint_model(path, layout, classifier=classifier)
        graphdef, state = nnx.split(model)
        shardings = param_shardings(state, self.mesh, layout)
        return graphdef, jax.tree.map(lambda s, h: _sds(s.shape, s.dtype, h), state, shardings)

    def _rows(self, section):
        """A scoring batch's tokens and mask: ``batch_size`` rows of the largest bucket."""
        rows2 = sharding_lib.batch_sharding(self.mesh, 2)
        shape = (section.batch_size, max(section.buckets))
        return _sds(shape, jnp.int32, rows2), _sds(shape, jnp.bool_, rows2)


def _decode_state_shardings(cfg, state, mesh, layout):
    """The shardings ``sampling.static``'s prefill gives its decode state: rows over the
    batch axes, the KV cache by the model's layout, the step and key replicated."""
    rows = lambda x: sharding_lib.batch_sharding(mesh, x.ndim)
    sh = jax.tree.map(rows, state)
    return sh._replace(
        step=sharding_lib.replicated(mesh),
        key_data=sharding_lib.replicated(mesh),
        cache=cache_shardings(state.cache, mesh, layout),
    )


def programs(run, cfg, mesh, names=None) -> list[Program]:
    """The run's programs, cheapest to compile first (``ORDER``); ``names`` picks some."""
    b = Builder(run, cfg, mesh)
    paged_engine = getattr(run.sampling, "engine", "static") == "paged"
    scores = run.grpo.beta > 0 or run.grpo.old_logps == "recompute" or run.train.track_update
    scores = scores or run.grpo.advantage_estimator == "gae"  # the critic's old values
    want = set(names or ORDER)
    made: list[Program] = []
    if want & {"prefill", "decode"} and not paged_engine:
        made += [p for p in b.static() if p.name in want]
    if want & {"paged_prefill", "paged_decode"} and paged_engine:
        made += [p for p in b.paged() if p.name in want]
    if want & {"reward_model", "judge"}:
        made += [p for p in b.learned() if p.name in want]
    if "scoring" in want and scores:
        made.append(b.scoring())
    if "update" in want:
        made.append(b.update())
    return sorted(made, key=lambda p: ORDER.index(p.name))
