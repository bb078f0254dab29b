"""A training run's bundles, built once from its validated config.

    s, state = setup(run, workdir)

returns a frozen :class:`Setup` (where arrays live, the policy, what sampling and
scoring a batch needs, the optimizer and the jitted update, what the run writes, its
problems) and the initial :class:`grpo_jax.learner.optimizer.TrainState` (the model as
built, with a fresh optimizer state). The parts it builds them from, which the other
commands share, are ``grpo_jax.run.builders``'s. docs/architecture.md, "setup".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import sys
from typing import Any

import jax
from flax import nnx

from grpo_jax.core import batch as batch_lib
from grpo_jax.core import distributed, sharding
from grpo_jax.learner import critic as critic_lib
from grpo_jax.learner import optimizer as optim_lib
from grpo_jax.learner import packing
from grpo_jax.learner import update as update_lib
from grpo_jax.models import lora
from grpo_jax.reward_models import learned_bytes
from grpo_jax.rollout.rounds import Policy, Rollouts
from grpo_jax.run import memory, runlocal, wandb_writer, writers
from grpo_jax.run import workdir as workdir_lib
from grpo_jax.run.builders import (
    build_datasets,
    build_encoder,
    build_mesh,
    build_policy,
    build_sampler_mesh,
    build_sampler_weights,
    build_scorer,
    build_teacher,
    build_tokenizer,
    eval_examples,
    route_spec,
    run_devices,
    sampler_dtype_warning,
    tokenizer_sampling,
)
from grpo_jax.run.checkpoints import Checkpointer, check_alarm_stop, check_resume_config
from grpo_jax.run.config import ConfigError, RunConfig, check_batch_layout
from grpo_jax.run.evaluation import eval_base_key
from grpo_jax.run.report import PulsedProgress

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The optimisation: the optimizer, its learning-rate schedule and the jitted update
    ``(state, RolloutBatch, key, ref_params) -> (state, metrics)``; ``teacher_params``: a
    ``teacher.path`` checkpoint's frozen parameters (None without one, or for "reference")."""

    tx: Any
    schedule: Any
    update: Any
    teacher_params: Any = None


@dataclasses.dataclass(frozen=True)
class Records:
    """What a run writes: its workdir, checkpoints, metrics and console line.

    ``lock``: process 0's hold on the workdir (None on the other processes).
    """

    workdir: pathlib.Path
    checkpointer: Checkpointer
    writer: writers.MetricsWriter
    progress: PulsedProgress
    lock: workdir_lib.WorkdirLock | None

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    def close(self) -> None:
        try:
            self.checkpointer.close()  # may raise: a save that failed in the background
        finally:
            self.progress.close()  # its pulses end with the run
            self.writer.close()
            if self.lock is not None:
                self.lock.release()


@dataclasses.dataclass(frozen=True)
class Data:
    """The run's problems.

    Attributes:
      train_examples: every training example, solutions included (the warm start's).
      eval_examples: the held-out problems.
      stats: ``"skipped/<split>"``: malformed rows skipped (``data.on_error = "skip"``).
      prompts: the GRPO problems: the training examples without their solutions (the
        run's data iterator, ``grpo_jax.run.state.RunState``, reads them).
    """

    train_examples: list
    eval_examples: list
    stats: dict
    prompts: list


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a training run needs, in bundles; built once by :func:`setup`.

    ``placement`` places arrays, ``policy`` is the model as code and text,
    ``rollouts`` what sampling and scoring a batch needs, ``trainer`` the
    optimizer and the jitted update, ``records`` what the run writes, ``data``
    its problems. Each part of the run takes the bundles it uses; only the run
    layer (this module, ``train``, ``start``, ``base_policy``) sees them all.
    What moves as the run trains is not here but in its
    :class:`grpo_jax.run.state.RunState` (the scorer's running moments excepted: the
    ``RunState`` names the scorer ``rollouts`` holds).
    """

    run: RunConfig
    placement: sharding.Placement
    policy: Policy
    rollouts: Rollouts
    trainer: Trainer
    records: Records
    data: Data
    base_key: jax.Array
    eval_key: jax.Array

    def close(self) -> None:
        self.records.close()


def _host_rows(mesh, B: int, G: int) -> tuple[slice, slice]:
    rows_B, rows_N = distributed.host_rows(mesh, B), distributed.host_rows(mesh, B * G)
    if (rows_N.start, rows_N.stop) != (rows_B.start * G, rows_B.stop * G):
        raise distributed.DistributedError(
            f"this host holds prompt rows {rows_B} but completion rows {rows_N}: "
            "the mesh splits groups across hosts"
        )
    if jax.process_count() > 1:
        log.info(
            "process %d of %d reads, samples for and scores rows %d:%d of every batch of %d",
            jax.process_index(),
            jax.process_count(),
            rows_B.start,
            rows_B.stop,
            B,
        )
    return rows_B, rows_N


def setup(run: RunConfig, workdir, *, stream=None):
    """-> (:class:`Setup`, the initial ``TrainState``) for ``run`` in ``workdir``.

    Raises ``ConfigError`` for what the config alone could not show (a missing
    tokenizer, a batch that does not fit the mesh, a memory plan that cannot
    fit the devices) before any training.
    """
    workdir = pathlib.Path(workdir).absolute()
    is_main = jax.process_index() == 0
    # One run per workdir: a second one stops here, before it touches anything.
    run_devices(run)  # too few devices: one line, before anything is opened
    lock = workdir_lib.WorkdirLock(workdir) if is_main else None
    checkpointer = None
    try:
        checkpointer = Checkpointer(
            workdir / "checkpoints",
            keep=run.checkpoint.keep,
            async_save=run.checkpoint.async_save,
            say=lambda text: is_main and print(text, file=stream or sys.stdout, flush=True),
        )
        # A resumed run must be the run its checkpoints continue: refuse before writing.
        changed = check_resume_config(run, checkpointer)
        if changed and is_main:
            print(
                f"resuming with a changed config: {'; '.join(changed)}", file=stream or sys.stdout
            )
        # ... and not resume past a stop on a health alarm unasked.
        stopped = check_alarm_stop(run, checkpointer)
        if stopped and is_main:
            print(
                f"resuming past the stop by {stopped} (health.resume_after_stop)",
                file=stream or sys.stdout,
            )
        if is_main:
            text = json.dumps(run.raw, indent=2, sort_keys=True) + "\n"
            (workdir / "config.json").write_text(text)
        return _setup(run, workdir, lock, checkpointer, stream)
    except BaseException:
        if checkpointer is not None:
            checkpointer.close()
        if lock is not None:
            lock.release()
        raise


def use_compilation_cache(directory: str) -> None:
    """JAX's persistent compilation cache in ``directory`` ("": leave JAX's setting alone).

    Every compiled program is written there, the small ones too (in one
    comparison, loading them took 0.4-0.8 s off the 20M benchmark model's warm
    first step),
    and loaded by later processes that compile the same program (same shapes,
    config and JAX version). JAX decides once per process whether it uses a cache, so
    the decision is reset when the directory changes after something compiled.
    """
    if not directory:
        return
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = str(pathlib.Path(directory).expanduser().absolute())
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        cc.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def build_data(run: RunConfig) -> Data:
    """The run's problems: datasets, held-out split and the GRPO prompts."""
    stats = {}
    datasets = build_datasets(run, stats)
    train_all = datasets["train"]
    ws = run.warm_start
    if ws.enabled and len(train_all) <= ws.val_problems + ws.batch_size:
        raise ConfigError(
            f"warm_start.val_problems = {ws.val_problems} leaves too few of the "
            f"{len(train_all)} training problems to train on"
        )
    # The GRPO phase sees prompts and reference answers only, never worked solutions.
    prompts = [{k: v for k, v in ex.items() if k != "solution"} for ex in train_all]
    return Data(
        train_examples=train_all,
        eval_examples=eval_examples(run, datasets),
        stats=stats,
        prompts=prompts,
    )


def _device_bytes(params) -> int:
    """Bytes one device holds of ``params`` (its first shard of each array)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))


def _print_memory_plan(run: RunConfig, model_cfg, mesh, samp_mesh, stream, teacher=None) -> None:
    """The per-device memory plan of this layout (and the sampler mesh's); one that cannot
    fit what the devices report (GPUs, TPUs) stops the run here, before any training.
    ``teacher``: a ``teacher.path`` checkpoint's (graphdef, params), counted as placed."""
    learned = learned_bytes(run.reward_model.path, run.judge.path, mesh.shape, run.mesh.layout)
    teacher_bytes = 0 if teacher is None else _device_bytes(teacher[1])
    mem = memory.plan_run(
        run, model_cfg, mesh.shape, learned_bytes=learned, teacher_bytes=teacher_bytes
    )
    samp_mem = None
    if samp_mesh is not None:  # its own copy of the parameters and the KV cache
        samp_mem = memory.plan_sampler(run, model_cfg, samp_mesh.shape)
    if jax.process_index() != 0:
        return
    out = stream or sys.stdout
    print(mem.table(), file=out, flush=True)
    if samp_mem is not None:
        print("sampler mesh: " + samp_mem.table(), file=out, flush=True)
    t, t_key = run.completion_slots
    longest = max(run.sampling.prompt_buckets) + t
    if longest > model_cfg.max_position_embeddings:
        print(
            f"WARNING: the longest prompt bucket ({max(run.sampling.prompt_buckets)}) plus "
            f"{t_key} ({t}) is {longest} "
            f"positions, past the model's context of {model_cfg.max_position_embeddings} "
            "(max_position_embeddings): positions beyond it were never trained",
            file=out,
            flush=True,
        )


def _frozen_shardings(run: RunConfig, lora_run, param_sh, teacher):
    """The shardings of the update's frozen parameters: the reference's (None when beta = 0
    or with LoRA), with a teacher a ``FrozenModels`` of the reference's and the teacher's
    (the reference's layout for "reference" when the run holds no reference of its own)."""
    ref_sh = param_sh if run.grpo.beta > 0 and lora_run is None else None
    if not run.teacher.enabled:
        return ref_sh
    if teacher is not None:
        return update_lib.FrozenModels(ref_sh, jax.tree.map(lambda x: x.sharding, teacher[1]))
    own = param_sh if ref_sh is None and lora_run is None else None
    return update_lib.FrozenModels(ref_sh, own)


def build_trainer(run: RunConfig, policy: Policy, params, mesh, teacher=None):
    """-> (Trainer, the initial TrainState): the optimizer over the trained parameters (the
    adapters alone with LoRA) and the update, jitted with the state's shardings (with
    ``train.packing``, the packed update: ``grpo_jax.learner.packing``). ``teacher``: a
    ``teacher.path`` checkpoint's (graphdef, params), None otherwise."""
    N = run.train.batch_size * run.grpo.G
    m_rows = run.train.minibatch_size or N
    total_updates = run.train.steps * run.grpo.mu * (N // m_rows)
    tx, schedule = optim_lib.make_optimizer(run.optim, total_updates)
    lora_run = policy.lora
    trained = None if lora_run is None else lora.trainable(params)
    head = None
    if run.grpo.advantage_estimator == "gae":  # PPO: a value head on the policy's trunk
        head = critic_lib.init_head(nnx.merge(policy.graphdef, params).config.hidden_size, mesh)
    state = optim_lib.init_state(params, tx, mesh, trained=trained, critic=head)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    settings = dict(
        graphdef=policy.graphdef,
        tx=tx,
        schedule=schedule,
        grpo=run.grpo,
        minibatch_size=m_rows,
        grad_accum=run.optim.grad_accum,
        batch_shards=sharding.batch_shards(mesh),
        track_update=run.train.track_update,
        logits_chunk=run.train.logits_chunk,
        share_prompts=True,  # the sampler writes each prompt's G rows together
        state_shardings=state_sh,
        batch_shardings=batch_lib.rollout_batch_shardings(
            mesh, routes=route_spec(run, nnx.merge(policy.graphdef, params).config) is not None
        ),
        ref_shardings=_frozen_shardings(run, lora_run, param_sh, teacher),
        replicated=sharding.replicated(mesh),
        base_graphdef=None if lora_run is None else lora_run.base_graphdef,
        lora_dropout=run.model.lora.dropout,
        teacher=run.teacher if run.teacher.enabled else None,
        teacher_graphdef=None if teacher is None else teacher[0],
    )
    if run.train.packing == "on":
        shards = sharding.batch_shards(mesh)
        attention = nnx.merge(policy.graphdef, params).config.attention
        pack = packing.PackSettings(
            group_size=run.grpo.G,
            shards=shards,
            num_minibatches=N // m_rows,
            microbatch_tokens=run.train.microbatch_tokens,
            default_rows=m_rows // shards // run.optim.grad_accum,
            # splash's segment ids cannot say "the prompt, or this completion"
            two_level=attention != "splash",
            head_multiple=run.train.logits_chunk or 8,
            row_slots=run.train.pack_row_tokens,
        )
        step_fn = packing.jit_packed_update(settings=pack, **settings)
    else:
        step_fn = update_lib.jit_update(**settings)
    teacher_params = None if teacher is None else teacher[1]
    return Trainer(tx=tx, schedule=schedule, update=step_fn, teacher_params=teacher_params), state


def _setup(run: RunConfig, workdir: pathlib.Path, lock, checkpointer, stream):
    run = runlocal.resolve(run)
    use_compilation_cache(run.train.compilation_cache_dir)
    is_main = jax.process_index() == 0
    mesh, samp_mesh = build_mesh(run), build_sampler_mesh(run)
    check_batch_layout(run, sharding.batch_shards(mesh))
    B = run.train.batch_size
    rows_B, rows_N = _host_rows(mesh, B, run.grpo.G)
    tokenizer = build_tokenizer(run, workdir)
    data_ = build_data(run)
    graphdef, params, lora_run = build_policy(run, tokenizer, mesh)
    model_cfg = nnx.merge(graphdef, params).config
    teacher = build_teacher(run, tokenizer, mesh, model_cfg.vocab_size)
    _print_memory_plan(run, model_cfg, mesh, samp_mesh, stream, teacher)
    policy = Policy(graphdef=graphdef, tokenizer=tokenizer, lora=lora_run)
    copy = build_sampler_weights(run, graphdef, params, model_cfg)
    trainer, state = build_trainer(run, policy, params, mesh, teacher)
    placement = sharding.Placement(
        mesh=mesh,
        param_shardings=jax.tree.map(lambda x: x.sharding, params),
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        rows_B=rows_B,
        rows_N=rows_N,
        sampler_mesh=samp_mesh,
    )
    kept = []
    if is_main and checkpointer.latest_step() is None:
        # A fresh start: an earlier attempt's records (no checkpoint continues it) go aside.
        kept = [workdir_lib.set_aside(workdir / n) for n in ("metrics.jsonl", "tensorboard")]
    progress = PulsedProgress(  # a line at least every PULSE_S seconds: a silent run looks hung
        run.train.steps, stream=stream, enabled=is_main, every=run.train.log_every
    )
    base_key = jax.random.key(run.seed)
    s = Setup(
        run=run,
        placement=placement,
        policy=policy,
        rollouts=Rollouts(
            policy=policy,
            encoder=build_encoder(run, tokenizer),
            scorer=build_scorer(run, mesh),
            sampling=tokenizer_sampling(
                run, tokenizer, record_routes=route_spec(run, model_cfg) is not None
            ),
            grpo=run.grpo,
            batch_size=B,
            placement=placement,
            message=progress.message,
            sampler_weights=copy,
        ),
        trainer=trainer,
        records=Records(
            workdir=workdir,
            checkpointer=checkpointer,
            writer=writers.MetricsWriter(
                workdir,
                enabled=is_main,
                extra=wandb_writer.writers_for(run, workdir, data_.eval_examples, is_main),
            ),
            progress=progress,
            lock=lock,
        ),
        data=data_,
        base_key=base_key,
        eval_key=eval_base_key(run.seed),
    )
    skipped = {k: v for k, v in data_.stats.items() if v}
    if skipped:
        progress.message(f"malformed data rows skipped (data.on_error='skip'): {skipped}")
    warning = sampler_dtype_warning(run, copy)
    if warning:
        progress.message(warning)
    for path in filter(None, kept):
        progress.message(f"starting afresh: the earlier attempt's records are kept as {path}")
    return s, state
