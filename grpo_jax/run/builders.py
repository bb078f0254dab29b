"""What the commands share: the devices and meshes, the tokenizer, the model and policy (fresh
or from a run's checkpoint), the datasets, the prompt encoder, the reward scorer and the
sampler's config, each built from the typed ``RunConfig``. A training run's bundles are
``grpo_jax.run.setup``'s; evaluation and export build what they need here.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
from flax import nnx

from grpo_jax import data, models
from grpo_jax.core import sharding
from grpo_jax.models import builtin_tokenizer, lora, moe
from grpo_jax.models.hf_config import generation_eos_ids
from grpo_jax.reward_models import JUDGE, LEARNED, Judge, LearnedReward
from grpo_jax.rollout.rounds import PromptEncoder
from grpo_jax.rollout.scorer import Scorer
from grpo_jax.run import warm_start
from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.config import BUILTIN_TOKENIZER, ConfigError, RunConfig, check_known_keys
from grpo_jax.sampling.static import SamplingConfig
from grpo_jax.sampling.weights import SamplerWeights, copy_dtype, sampler_weights


def run_devices(run: RunConfig) -> list:
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


def learner_and_sampler_devices(devices, sampler_devices: int):
    """Splits ``devices`` -> (learner devices, sampler devices).

    The sampler gets each process's first ``sampler_devices / process_count``
    devices, the learner the rest; both keep the processes in order, so a
    host's rows of a batch are the same block on both meshes (every host
    samples and scores the rows it trains on). 0: (all devices, []).
    """
    devices = list(devices)
    if not sampler_devices:
        return devices, []
    procs = sorted({d.process_index for d in devices})
    per, rest = divmod(sampler_devices, len(procs))
    where = "config key 'mesh.sampler_devices'"
    if rest:
        raise ConfigError(
            f"{where} = {sampler_devices} must be a multiple of the {len(procs)} processes "
            "(each process gives the sampler the same number of its devices)"
        )
    learner, sampler = [], []
    for p in procs:
        mine = [d for d in devices if d.process_index == p]
        if per >= len(mine):
            raise ConfigError(
                f"{where} = {sampler_devices} leaves no learner device: process {p} has "
                f"{len(mine)} devices in use (mesh.num_devices) and would give {per} of them to "
                "the sampler"
            )
        sampler += mine[:per]
        learner += mine[per:]
    return learner, sampler


def sampler_mesh(devices):
    """The sampler's mesh: rows split over all its devices, parameters replicated."""
    return sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, devices)


def build_mesh(run: RunConfig):
    devices = run_devices(run)
    if run.mesh.sampler_devices:  # the learner's mesh: the devices the sampler leaves
        devices, _ = learner_and_sampler_devices(devices, run.mesh.sampler_devices)
    axes = {"data": run.mesh.data, "fsdp": run.mesh.fsdp, "tensor": run.mesh.tensor}
    axes[sharding.EXPERT_AXIS] = run.mesh.expert  # make_mesh adds the axis only when > 1
    try:
        return sharding.make_mesh(axes, devices)
    except ValueError as e:
        raise ConfigError(f"config section 'mesh' = {axes}: {e}") from None


def build_sampler_mesh(run: RunConfig):
    """The sampler's own mesh with ``mesh.sampler_devices`` (docs/pipeline.md), else None."""
    if not run.mesh.sampler_devices:
        return None

    devices = jax.devices()[: run.mesh.num_devices or None]
    _, sampler = learner_and_sampler_devices(devices, run.mesh.sampler_devices)
    mesh = sampler_mesh(sampler)
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
    from transformers import AutoTokenizer  # seconds to import: only when a tokenizer is built

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
        check_expert_axis(run, model.config)
        check_router_replay(run, model.config)
        run.model.lora.check_model(model.config, run.model.path)
    else:
        cfg = model_config(run, tokenizer)
        check_expert_axis(run, cfg)
        check_router_replay(run, cfg)
        run.model.lora.check_model(cfg, "the built-in tiny model")
        model = models.create_model(cfg, seed=run.seed, mesh=mesh, layout=run.mesh.layout)
    return nnx.split(model)


def check_expert_axis(run: RunConfig, cfg) -> None:
    """A one-line ConfigError unless ``mesh.expert`` splits the model's experts evenly: a
    size that does not divide them would leave them whole on every device (docs/moe.md)."""
    expert, num = run.mesh.expert, cfg.num_experts
    if expert == 1 or (num and num % expert == 0):
        return
    model = run.model.path or "the built-in tiny model"
    if not num:
        raise ConfigError(
            f"config key 'mesh.expert' = {expert} needs a mixture-of-experts model; "
            f"{model} is dense (num_experts = 0): set mesh.expert = 1"
        )
    raise ConfigError(
        f"config key 'mesh.expert' = {expert} must divide the model's num_experts = {num} ({model})"
    )


def check_router_replay(run: RunConfig, cfg) -> None:
    """A one-line ConfigError for routing replay on a dense model: it has no routes."""
    if run.grpo.router_replay == "none" or cfg.num_experts:
        return
    model = run.model.path or "the built-in tiny model"
    raise ConfigError(
        f"config key 'grpo.router_replay' = {run.grpo.router_replay!r} needs a "
        f"mixture-of-experts model; {model} is dense (num_experts = 0): set "
        "grpo.router_replay = 'none'"
    )


def route_spec(run: RunConfig, cfg):
    """(R, K, dtype) of the routes a batch carries with routing replay, else None."""
    if run.grpo.router_replay == "none" or not cfg.num_experts:
        return None
    return len(cfg.sparse_layers), cfg.experts_per_token, moe.routes_dtype(cfg.num_experts)


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
            cached = warm_start.load_cached(ck.directory.parent, base, saved["warm_start"])
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
    return graphdef, warm_start.restore_cache(workdir, params)


def build_teacher(run: RunConfig, tokenizer, mesh, student_vocab: int = 0):
    """(graphdef, params) of the ``teacher.path`` checkpoint, placed like the policy (its
    layout on the run's mesh); None without a teacher or for "reference" (the reference's
    arrays). Its tokenizer must be the student's (:func:`check_teacher_tokenizer`), and for
    ``teacher.kl = "full"`` its vocabulary cover the student's ``student_vocab`` ids."""
    path = run.teacher.path
    if not run.teacher.enabled or run.teacher.is_reference:
        return None
    if not pathlib.Path(path).exists():
        raise ConfigError(f"config key 'teacher.path' = {path!r}: no such file or directory")
    gguf = path.endswith(".gguf")
    check_teacher_tokenizer(run, tokenizer, _teacher_tokenizer(path, gguf))
    load = models.from_gguf if gguf else models.from_pretrained
    model = load(path, mesh=mesh, layout=run.mesh.layout)
    if run.teacher.kl == "full" and model.config.vocab_size < student_vocab:
        raise ConfigError(
            f"config key 'teacher.path' = {path!r}: the teacher's vocabulary has "
            f"{model.config.vocab_size} rows, fewer than the student's {student_vocab}; "
            "teacher.kl = 'full' needs every student token in it (or use 'sampled')"
        )
    return nnx.split(model)


def _teacher_tokenizer(path: str, gguf: bool):
    from transformers import AutoTokenizer  # seconds to import: only with a teacher

    if gguf:
        return models.load_gguf_tokenizer(path)
    where = pathlib.Path(path)
    if not (where / "tokenizer_config.json").exists() and not (where / "tokenizer.json").exists():
        raise ConfigError(
            f"config key 'teacher.path' = {path!r}: no Hugging Face tokenizer files there, "
            "so it cannot be checked against the student's"
        )
    return AutoTokenizer.from_pretrained(str(where))


def check_teacher_tokenizer(run: RunConfig, student, teacher) -> None:
    """ConfigError in one line unless ``teacher`` is the student's tokenizer: the same
    vocabulary (every token and its id) and the same EOS. The teacher scores the student's
    token ids, so any other tokenizer would score other texts."""
    same = student.get_vocab() == teacher.get_vocab()
    if same and student.eos_token_id == teacher.eos_token_id:
        return
    mine = run.tokenizer or run.model.path
    raise ConfigError(
        f"config key 'teacher.path' = {run.teacher.path!r}: the teacher's tokenizer "
        f"({len(teacher)} tokens, EOS {teacher.eos_token_id}) is not the student's "
        f"({mine!r}: {len(student)} tokens, EOS {student.eos_token_id}); distillation needs "
        "one tokenizer"
    )


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
        rm = LearnedReward.load(
            run.reward_model, mesh, layout=run.mesh.layout, packing=run.train.packing == "on"
        )
        learned.append((LEARNED, rm, run.reward_model.weight))
    if run.judge.path:  # the reference policy's judge gets its parameters at the start
        judge = Judge.load(
            run.judge, mesh, layout=run.mesh.layout, packing=run.train.packing == "on"
        )
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
