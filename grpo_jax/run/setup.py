"""What a training run needs, built once from its validated config.

    s, state = setup(run, workdir)

returns a frozen :class:`Setup` (the mesh, the model's graphdef and
shardings, the tokenizer, prompt encoder, reward scorer and sampler config,
the data, the optimizer and the jitted update, the checkpointer and the
writers) and the initial :class:`grpo_jax.learner.optimizer.TrainState` (the model as
built, with a fresh optimizer state). Everything below reads settings from
the typed ``RunConfig`` (``grpo_jax.run.config``), never from the ConfigDict.
The ``build_*`` helpers are shared with evaluation and export.
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

from grpo_jax import data, models
from grpo_jax.core import batch as batch_lib
from grpo_jax.core import distributed, sharding
from grpo_jax.learner import optimizer as optim_lib
from grpo_jax.learner import update as update_lib
from grpo_jax.models import builtin_tokenizer, lora
from grpo_jax.models.hf_config import generation_eos_ids
from grpo_jax.reward_models import JUDGE, LEARNED, Judge, LearnedReward, learned_bytes
from grpo_jax.rollout import staleness as pipeline
from grpo_jax.rollout.rounds import Policy, PromptEncoder, Rollouts
from grpo_jax.rollout.scorer import Scorer
from grpo_jax.run import memory, runlocal, writers
from grpo_jax.run import warm_start as sft
from grpo_jax.run import workdir as workdir_lib
from grpo_jax.run.checkpoints import Checkpointer, check_alarm_stop, check_resume_config
from grpo_jax.run.config import (
    BUILTIN_TOKENIZER,
    ConfigError,
    RunConfig,
    check_batch_layout,
    check_known_keys,
)
from grpo_jax.run.evaluation import eval_base_key
from grpo_jax.run.report import PulsedProgress
from grpo_jax.sampling.static import SamplingConfig
from grpo_jax.sampling.weights import SamplerWeights, copy_dtype, sampler_weights

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Builders.


def _devices(run: RunConfig) -> list:
    """The devices the run uses (``mesh.num_devices``, 0: all); a ConfigError if too few."""
    devices = jax.devices()
    n = run.mesh.num_devices
    if n > len(devices):
        hint = (
            f" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} gives {n})"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ConfigError(
            f"config key 'mesh.num_devices' = {n}, but only {len(devices)} devices are "
            f"available{hint}"
        )
    return devices[: n or None]


def build_mesh(run: RunConfig):
    devices = _devices(run)
    if run.mesh.sampler_devices:  # the learner's mesh: the devices the sampler leaves
        devices, _ = pipeline.learner_and_sampler_devices(devices, run.mesh.sampler_devices)
    axes = {"data": run.mesh.data, "fsdp": run.mesh.fsdp, "tensor": run.mesh.tensor}
    try:
        return sharding.make_mesh(axes, devices)
    except ValueError as e:
        raise ConfigError(f"config section 'mesh' = {axes}: {e}") from None


def build_sampler_mesh(run: RunConfig):
    """The sampler's own mesh with ``mesh.sampler_devices`` (``rollout.staleness``), else None."""
    if not run.mesh.sampler_devices:
        return None

    devices = jax.devices()[: run.mesh.num_devices or None]
    _, sampler = pipeline.learner_and_sampler_devices(devices, run.mesh.sampler_devices)
    mesh = pipeline.sampler_mesh(sampler)
    shards = sharding.batch_shards(mesh)
    if run.train.batch_size % shards:
        raise ConfigError(
            f"config key 'train.batch_size' = {run.train.batch_size} must be a multiple of the "
            f"{shards} sampler devices (mesh.sampler_devices: each holds whole groups)"
        )
    return mesh


def build_tokenizer(run: RunConfig, workdir: str | pathlib.Path | None):
    """The tokenizer, always loaded through ``transformers.AutoTokenizer``.

    "builtin" saves the project's character tokenizer under
    ``<workdir>/tokenizer`` first (once), so a run directory is self-contained.
    """
    from transformers import AutoTokenizer

    name = run.tokenizer
    if name == BUILTIN_TOKENIZER:
        path = builtin_tokenizer.ensure_tokenizer(pathlib.Path(workdir) / "tokenizer")
    elif not name and run.model.path.endswith(".gguf"):  # The GGUF file's own vocabulary.
        return models.load_gguf_tokenizer(run.model.path)
    else:
        path = pathlib.Path(name or run.model.path)
        if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
            raise ConfigError(
                f"config key 'tokenizer' = {name!r}: no Hugging Face tokenizer files in {path}"
            )
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer at {path} has no EOS token; completions could not end")
    return tok


def model_config(run: RunConfig, tokenizer):
    """The built-in tiny model's ``ModelConfig`` (``model.path`` empty) for ``tokenizer``.

    The vocabulary size and the special token ids come from the tokenizer (an
    exported model then stops where the tokenizer's EOS says).
    """

    overrides = dict(run.model.overrides)
    fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
    check_known_keys("model", overrides, fields - {"vocab_size"})
    overrides.update(run.model.loader_kwargs())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            overrides.setdefault(key, int(value))
    return models.tiny_config(len(tokenizer), **overrides)


def build_model(run: RunConfig, tokenizer, mesh):
    """(graphdef, params): the tiny model at ``seed`` or a Hugging Face checkpoint."""

    if run.model.path:
        load = models.from_gguf if run.model.path.endswith(".gguf") else models.from_pretrained
        model = load(run.model.path, mesh=mesh, layout=run.mesh.layout, **run.model.loader_kwargs())
    else:
        cfg = model_config(run, tokenizer)
        model = models.create_model(cfg, seed=run.seed, mesh=mesh, layout=run.mesh.layout)
    return nnx.split(model)


def build_policy(run: RunConfig, tokenizer, mesh):
    """(graphdef, params, LoRA or None): :func:`build_model`, with adapters when ``model.lora``.

    With ``model.lora.rank`` > 0 the parameters are the frozen base joined with
    fresh adapters (``grpo_jax.models.lora``), and the third value a
    ``lora.LoRARun`` (the base's graphdef and identity); otherwise it is None.
    """

    graphdef, params = build_model(run, tokenizer, mesh)
    if not run.model.lora.enabled:
        return graphdef, params, None
    key = jax.random.fold_in(jax.random.key(run.seed), 0x10A)
    return lora.setup_params(
        graphdef,
        params,
        run.model.lora,
        key,
        base_path=run.model.path,
        mesh=mesh,
        layout=run.mesh.layout,
    )


def restore_policy(run: RunConfig, tokenizer, mesh, checkpoints, step: int | None = None):
    """(graphdef, params, LoRA or None) of checkpoint ``step`` (latest when None) of a run.

    A LoRA run's checkpoint holds only the adapters: the base is loaded as the
    run loads it (warm-started from the run's ``warm_start`` cache when it was),
    checked against the identity the checkpoint recorded, and joined with them
    (:func:`build_policy`).
    """

    graphdef, params, lora_run = build_policy(run, tokenizer, mesh)
    ck = Checkpointer(checkpoints)
    try:
        if lora_run is None:
            return graphdef, ck.restore_params(step, params_like=params), None
        saved = ck.restore_meta(step).get("lora_base") or {}
        base, fresh = lora.split(params)
        if saved.get("warm_start"):  # the base was warm-started: the run's cache holds it
            cached = sft.load_cached(ck.directory.parent, base, saved["warm_start"])
            if cached is None:
                raise lora.BaseMismatchError(
                    f"the adapters in {ck.directory} were trained on a warm-started base, "
                    f"but {ck.directory.parent / 'warm_start'} does not hold it"
                )
            base = cached[0]
        expected = lora_run.identity(base, warm_start=saved.get("warm_start"))
        lora.check_base(saved or None, expected, str(ck.directory))
        adapters = ck.restore_params(step, params_like=lora.trainable(params))
        return graphdef, lora.with_trainable(lora.join(base, fresh), adapters), lora_run
    finally:
        ck.close()


def restore_warm_start(run: RunConfig, tokenizer, mesh, workdir):
    """(graphdef, params) of the warm-started policy cached in ``<workdir>/warm_start``: the
    whole model, or a LoRA run's base (the warm start trains the base before the adapters)."""
    graphdef, params, lora_run = build_policy(run, tokenizer, mesh)
    if lora_run is not None:
        graphdef, params = lora_run.base_graphdef, lora.split(params)[0]
    return graphdef, sft.restore_cache(workdir, params)


def build_sampler_weights(run: RunConfig, graphdef, params, model_cfg) -> SamplerWeights | None:
    """The sampler's copy of the policy in ``sampling.param_dtype``; None when that is unset
    or is already the model's storage and compute dtype (nothing to copy)."""
    dtype = copy_dtype(run.sampling.param_dtype, model_cfg)
    return None if dtype is None else sampler_weights(graphdef, params, dtype)


def sampler_dtype_warning(run: RunConfig, copy: SamplerWeights | None) -> str | None:
    """A warning when the copy's log-probs stand in for pi_old (``grpo.old_logps`` "sampler")."""
    if copy is None or run.grpo.old_logps != "sampler":
        return None
    return (
        f"WARNING: sampling.param_dtype = {copy.dtype!r} with grpo.old_logps = 'sampler': "
        f"pi_old's log-probs are then the {copy.dtype} copy's, so the update's first ratio "
        "is not 1; grpo.old_logps = 'recompute' rescores them with the trained parameters, "
        "and grpo.behavior_correction = 'tis' weights what the copy drew (docs/engine.md)"
    )


def build_datasets(run: RunConfig, stats: dict | None = None) -> dict[str, list[dict]]:
    """{split: examples}; ``stats`` (when given) gets "skipped/<split>": malformed rows skipped."""
    splits = data.load_dataset(run.data.as_mapping(), stats=stats)
    if "train" not in splits:
        raise ConfigError(f"the dataset has no 'train' split (splits: {sorted(splits)})")
    if run.eval.split not in splits:
        raise ConfigError(
            f"config key 'eval.split' = {run.eval.split!r} is not a split of the dataset "
            f"(splits: {sorted(splits)})"
        )
    return splits


def build_encoder(run: RunConfig, tokenizer) -> PromptEncoder:
    return PromptEncoder(
        tokenizer=tokenizer,
        template=run.prompt.template,
        chat=run.prompt.chat,
        system=run.prompt.system or None,
        buckets=run.sampling.prompt_buckets,
    )


def build_scorer(run: RunConfig, mesh=None) -> Scorer:
    """The run's rewards; with ``reward_model.path``, its reward model placed on ``mesh``."""
    learned = []
    if run.reward_model.path:
        rm = LearnedReward.load(run.reward_model, mesh, layout=run.mesh.layout)
        learned.append((LEARNED, rm, run.reward_model.weight))
    if run.judge.path:  # the reference policy's judge gets its parameters at the start
        judge = Judge.load(run.judge, mesh, layout=run.mesh.layout)
        learned.append((JUDGE, judge, run.judge.weight))
    return Scorer(
        run.rewards.specs,
        correct_reward=run.rewards.correct,
        timeout_s=run.train.reward_timeout_s,
        learned=learned,
    )


def stop_token_ids(stop: tuple[str, ...], tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each ``sampling.stop`` string as ``tokenizer`` encodes it, without special tokens.

    The sampler matches these token sequences, not text: a stop string stops a
    row when the model emits exactly this encoding of it.
    """
    out = []
    for i, text in enumerate(stop):
        ids = tuple(int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise ConfigError(
                f"config key 'sampling.stop[{i}]' = {text!r} encodes to no tokens with the "
                "run's tokenizer, so it could never match; remove it or change it"
            )
        out.append(ids)
    return tuple(out)


def tokenizer_sampling(run: RunConfig, tokenizer, **kw) -> SamplingConfig:
    """The sampler's config: the run's sampling section, temperature, EOS ids and stop strings."""
    eos = int(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    # An instruct checkpoint may end its turns with a token other than the tokenizer's
    # EOS (Gemma 3: <end_of_turn>), listed in generation_config.json: stop there too.
    extra = ()
    if run.model.path:
        extra = tuple(i for i in generation_eos_ids(run.model.path) if i != eos)
    kw.setdefault("temperature", run.grpo.temperature)
    stops = stop_token_ids(run.sampling.stop, tokenizer)
    return run.sampling.sampler(eos_ids=(eos, *extra), pad_id=int(pad), stop_sequences=stops, **kw)


def eval_examples(run: RunConfig, datasets) -> list[dict]:
    examples = datasets[run.eval.split]
    if run.eval.num_problems:
        if len(examples) < run.eval.num_problems:
            raise ConfigError(
                f"config key 'eval.num_problems' = {run.eval.num_problems}, but split "
                f"{run.eval.split!r} has only {len(examples)} problems"
            )
        examples = examples[: run.eval.num_problems]
    return examples


# ---------------------------------------------------------------------------
# The run's setup.


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The optimisation: the optimizer, its learning-rate schedule and the jitted update
    ``(state, RolloutBatch, key, ref_params) -> (state, metrics)``."""

    tx: Any
    schedule: Any
    update: Any


@dataclasses.dataclass(frozen=True)
class Records:
    """What a run writes: its workdir, checkpoints, metrics and console line.

    ``lock``: process 0's hold on the workdir (None on the other processes).
    """

    workdir: pathlib.Path
    checkpointer: Checkpointer
    writer: writers.MetricsWriter
    progress: writers.ProgressLine
    lock: workdir_lib.WorkdirLock | None

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    def close(self) -> None:
        try:
            self.checkpointer.close()  # may raise: a save that failed in the background
        finally:
            getattr(self.progress, "close", lambda: None)()  # its pulses end with the run
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
      iterator: the GRPO prompts (no solutions): this host's rows of each batch.
        Its position is the one thing here that moves (restored from a checkpoint).
    """

    train_examples: list
    eval_examples: list
    stats: dict
    iterator: data.DataIterator


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a training run needs, in bundles; built once by :func:`setup`.

    ``placement`` places arrays, ``policy`` is the model as code and text,
    ``rollouts`` what sampling and scoring a batch needs, ``trainer`` the
    optimizer and the jitted update, ``records`` what the run writes, ``data``
    its problems. Each part of the run takes the bundles it uses; only the run
    layer (this module, ``train``, ``checkpoint``, ``base_policy``) sees them all.
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
    _devices(run)  # too few devices: one line, before anything is opened
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


def build_data(run: RunConfig, rows_B: slice) -> Data:
    """The run's problems: datasets, held-out split and the GRPO prompts' iterator."""
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
    grpo_examples = [{k: v for k, v in ex.items() if k != "solution"} for ex in train_all]
    B = run.train.batch_size
    return Data(
        train_examples=train_all,
        eval_examples=eval_examples(run, datasets),
        stats=stats,
        iterator=data.DataIterator(grpo_examples, B, seed=run.seed, rows=rows_B),
    )


def _print_memory_plan(run: RunConfig, model_cfg, mesh, samp_mesh, stream) -> None:
    """The per-device memory plan of this layout (and the sampler mesh's); one that cannot
    fit what the devices report (GPUs, TPUs) stops the run here, before any training."""
    learned = learned_bytes(run.reward_model.path, run.judge.path, mesh.shape, run.mesh.layout)
    mem = memory.plan_run(run, model_cfg, mesh.shape, learned_bytes=learned)
    samp_mem = None
    if samp_mesh is not None:  # its own copy of the parameters and the KV cache
        samp_mem = memory.plan_sampler(run, model_cfg, samp_mesh.shape)
    if jax.process_index() != 0:
        return
    out = stream or sys.stdout
    print(mem.table(), file=out, flush=True)
    if samp_mem is not None:
        print("sampler mesh: " + samp_mem.table(), file=out, flush=True)
    longest = max(run.sampling.prompt_buckets) + run.sampling.max_new_tokens
    if longest > model_cfg.max_position_embeddings:
        print(
            f"WARNING: the longest prompt bucket ({max(run.sampling.prompt_buckets)}) plus "
            f"sampling.max_new_tokens ({run.sampling.max_new_tokens}) is {longest} "
            f"positions, past the model's context of {model_cfg.max_position_embeddings} "
            "(max_position_embeddings): positions beyond it were never trained",
            file=out,
            flush=True,
        )


def build_trainer(run: RunConfig, policy: Policy, params, mesh):
    """-> (Trainer, the initial TrainState): the optimizer over the trained parameters (the
    adapters alone with LoRA) and the update, jitted with the state's shardings."""
    N = run.train.batch_size * run.grpo.G
    m_rows = run.train.minibatch_size or N
    total_updates = run.train.steps * run.grpo.mu * (N // m_rows)
    tx, schedule = optim_lib.make_optimizer(run.optim, total_updates)
    lora_run = policy.lora
    trained = None if lora_run is None else lora.trainable(params)
    state = optim_lib.init_state(params, tx, mesh, trained=trained)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    step_fn = update_lib.jit_update(
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
        batch_shardings=batch_lib.rollout_batch_shardings(mesh),
        ref_shardings=param_sh if run.grpo.beta > 0 and lora_run is None else None,
        replicated=sharding.replicated(mesh),
        base_graphdef=None if lora_run is None else lora_run.base_graphdef,
        lora_dropout=run.model.lora.dropout,
    )
    return Trainer(tx=tx, schedule=schedule, update=step_fn), state


def _setup(run: RunConfig, workdir: pathlib.Path, lock, checkpointer, stream):
    run = runlocal.resolve(run)
    use_compilation_cache(run.train.compilation_cache_dir)
    is_main = jax.process_index() == 0
    mesh, samp_mesh = build_mesh(run), build_sampler_mesh(run)
    check_batch_layout(run, sharding.batch_shards(mesh))
    B = run.train.batch_size
    rows_B, rows_N = _host_rows(mesh, B, run.grpo.G)
    tokenizer = build_tokenizer(run, workdir)
    data_ = build_data(run, rows_B)
    graphdef, params, lora_run = build_policy(run, tokenizer, mesh)
    model_cfg = nnx.merge(graphdef, params).config
    _print_memory_plan(run, model_cfg, mesh, samp_mesh, stream)
    policy = Policy(graphdef=graphdef, tokenizer=tokenizer, lora=lora_run)
    copy = build_sampler_weights(run, graphdef, params, model_cfg)
    trainer, state = build_trainer(run, policy, params, mesh)
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
            sampling=tokenizer_sampling(run, tokenizer),
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
            writer=writers.MetricsWriter(workdir, enabled=is_main),
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
