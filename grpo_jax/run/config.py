"""The run's configuration: the sections composed into one validated :class:`RunConfig`.

The ml_collections ``ConfigDict`` of a run stops at :func:`parse_config`; library code takes
small frozen dataclasses. Each lower package owns its section and its registry check, and
this module imports them (and re-exports their names), never the reverse; here live the
sections only the run reads (train, eval, checkpoint, mesh, warm start, health) and the
cross-section checks. Every check raises :class:`ConfigError` naming the key, its value and
what is allowed (docs/architecture.md, "Config").
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from typing import Any

from grpo_jax import rewards
from grpo_jax.core.checks import (
    check_bool,
    check_choice,
    check_known_keys,
    check_range,
    from_mapping,
    section_defaults_of,
    to_dict,
)
from grpo_jax.core.errors import ConfigError
from grpo_jax.core.sharding import LAYOUTS
from grpo_jax.data import DataSection
from grpo_jax.data.prompts import PromptConfig
from grpo_jax.envs.section import EnvSection
from grpo_jax.learner.optimizer import SCHEDULES, OptimConfig
from grpo_jax.models.config import (
    ATTENTION,
    LORA_PROJECTIONS,
    MODEL_KEYS,
    LoRAConfig,
    ModelSection,
)
from grpo_jax.objective.config import OLD_LOGPS, GRPOConfig
from grpo_jax.objective.distill import TeacherConfig
from grpo_jax.rewards.section import (
    JudgeSection,
    RewardModelSection,
    RewardsSection,
    load_reward_modules,
    parse_rewards,
)
from grpo_jax.run.health import HealthConfig
from grpo_jax.sampling.config import SamplingSection
from grpo_jax.sampling.engines import Engine, engine_names, get_engine

__all__ = [
    # The bottom layer's, re-exported.
    "ConfigError",
    "check_bool",
    "check_choice",
    "check_known_keys",
    "check_range",
    "from_mapping",
    "to_dict",
    # The lower layers' sections, re-exported.
    "ATTENTION",
    "LORA_PROJECTIONS",
    "MODEL_KEYS",
    "OLD_LOGPS",
    "SCHEDULES",
    "DataSection",
    "EnvSection",
    "GRPOConfig",
    "LoRAConfig",
    "ModelSection",
    "OptimConfig",
    "PromptConfig",
    "JudgeSection",
    "RewardModelSection",
    "RewardsSection",
    "SamplingSection",
    "TeacherConfig",
    "load_reward_modules",
    "parse_rewards",
    # The run's own.
    "BUILTIN_TOKENIZER",
    "METRICS",
    "PACKING",
    "TARGETS",
    "TINY_PREFIX",
    "TOP_KEYS",
    "CheckpointConfig",
    "EvalConfig",
    "HealthConfig",
    "MeshConfig",
    "RunConfig",
    "TrainConfig",
    "WarmStartConfig",
    "check_batch_layout",
    "parse_config",
]


PACKING = ("off", "on")  # train.packing


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The GRPO loop.

    Attributes:
      steps: GRPO steps (one rollout batch each).
      batch_size: B, prompts per step (N = B * G completions).
      minibatch_size: completion rows per optimizer update; 0 means all N
        (one update per pass). Each step makes mu * N / minibatch_size updates.
      log_every: console progress line every this many steps (metrics.jsonl
        gets every step).
      samples_every: write sample completions as text every this many steps
        (0: never).
      num_samples_logged: how many completions each sample file shows.
      wandb: also log the run to Weights & Biases: "off", "offline" (written
        under <workdir>/wandb for ``wandb sync``; no network) or "online"
        (``grpo_jax.run.wandb_writer``; needs the wandb package).
      max_nonfinite_in_row: stop the run after this many consecutive skipped
        (non-finite) updates.
      no_signal_steps: warn loudly when no group had reward variance for
        this many steps in a row (0: never).
      track_update: after the updates, score the batch again with the new
        parameters and report how far the policy moved (policy/* metrics);
        one extra forward pass.
      update_kl_warn: warn loudly when KL(pi_old || pi_new) on the batch
        exceeds this after one step's updates (0: never).
      reward_timeout_s: per-completion time limit of a reward function.
      logits_chunk: score the completion tokens this many at a time (the LM
        head, log-softmax and entropy rematerialised per chunk), so the
        float32 logits are never [rows, T, V] at once; 0: all T together. Must
        divide sampling.max_new_tokens. For large vocabularies (Qwen, Gemma).
      packing: "on": the update, its scoring passes (pi_old recomputed, the
        reference, track_update) and the learned rewards' scoring run on packed
        rows, no slot on padding, in micro-batches of ``microbatch_tokens``
        (``grpo_jax.learner.packing``, docs/packing.md); "off": padded rows, in
        optim.grad_accum equal parts of each minibatch.
      microbatch_tokens: with packing, the token slots of one micro-batch on
        one device: whole packed rows of P + T slots, at least one (0: as many
        as a padded micro-batch's rows hold, minibatch rows / optim.grad_accum
        per batch shard).
      pack_row_tokens: with packing, the slots of one packed row (0: P + T, the
        padded row's). Longer rows hold a group's prompt with more of its
        completions (the prompt run once a row), at the cost of attention
        over the whole row; at least max(sampling.prompt_buckets) +
        sampling.max_new_tokens.
      dynamic_sampling: DAPO's dynamic sampling (Yu et al. 2025): keep only
        groups whose rewards are not all equal, drawing further rounds of B
        prompts until B groups are kept or max_sampling_rounds are spent;
        what is still short is filled with weight-0 groups.
      max_sampling_rounds: sampling rounds per step with dynamic_sampling.
      sampled_tokens_budget: stop once this many completion tokens have been
        sampled in all (0: no budget; train.steps still bounds the run): for
        comparisons at equal sampling cost, e.g. with dynamic sampling.
      max_staleness: k, how many optimizer steps older than on-policy the
        parameters that sample a step's batch may be (0: the on-policy loop,
        sampling and updating one after the other). With k >= 1 the batch of
        step s is sampled by parameter version max(0, s - 1 - k) while earlier
        steps update (``grpo_jax.rollout.staleness``, docs/pipeline.md).
      compilation_cache_dir: JAX's persistent compilation cache in this
        directory ("": off): a relaunch, a resume or a second run of the same
        shapes loads the compiled sampler and update from disk instead of
        compiling them again (docs/long_context.md, "Start-up"). Trusted
        storage only: whoever can write there can make the run execute code.
    """

    steps: int = 100
    batch_size: int = 32
    minibatch_size: int = 0
    log_every: int = 1
    samples_every: int = 25
    num_samples_logged: int = 4
    wandb: str = "off"
    max_nonfinite_in_row: int = 5
    no_signal_steps: int = 10
    track_update: bool = True
    update_kl_warn: float = 0.05
    reward_timeout_s: float = 5.0
    logits_chunk: int = 0
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    sampled_tokens_budget: int = 0
    max_staleness: int = 0
    compilation_cache_dir: str = ""
    packing: str = "off"
    microbatch_tokens: int = 0
    pack_row_tokens: int = 0

    def __post_init__(self):
        check_range("train.steps", self.steps, lo=0, integer=True)
        if not isinstance(self.compilation_cache_dir, str):
            raise ConfigError(
                f"config key 'train.compilation_cache_dir' = {self.compilation_cache_dir!r} "
                "must be a directory path (a string; '' turns the cache off)"
            )
        check_range("train.batch_size", self.batch_size, lo=1, integer=True)
        check_range("train.minibatch_size", self.minibatch_size, lo=0, integer=True)
        check_range("train.log_every", self.log_every, lo=1, integer=True)
        check_range("train.samples_every", self.samples_every, lo=0, integer=True)
        check_range("train.num_samples_logged", self.num_samples_logged, lo=0, integer=True)
        check_choice("train.wandb", self.wandb, ("off", "offline", "online"))
        check_range("train.max_nonfinite_in_row", self.max_nonfinite_in_row, lo=1, integer=True)
        check_range("train.no_signal_steps", self.no_signal_steps, lo=0, integer=True)
        check_bool("train.track_update", self.track_update)
        check_range("train.update_kl_warn", self.update_kl_warn, lo=0.0)
        check_range("train.reward_timeout_s", self.reward_timeout_s, lo=0.0, lo_open=True)
        check_range("train.logits_chunk", self.logits_chunk, lo=0, integer=True)
        check_bool("train.dynamic_sampling", self.dynamic_sampling)
        check_range("train.max_sampling_rounds", self.max_sampling_rounds, lo=1, integer=True)
        check_range("train.sampled_tokens_budget", self.sampled_tokens_budget, lo=0, integer=True)
        check_range("train.max_staleness", self.max_staleness, lo=0, integer=True)
        check_choice("train.packing", self.packing, PACKING)
        check_range("train.microbatch_tokens", self.microbatch_tokens, lo=0, integer=True)
        check_range("train.pack_row_tokens", self.pack_row_tokens, lo=0, integer=True)
        for key in ("microbatch_tokens", "pack_row_tokens"):
            if getattr(self, key) and self.packing != "on":
                raise ConfigError(
                    f"config key 'train.{key}' = {getattr(self, key)} needs "
                    f"train.packing = 'on' (it is {self.packing!r}): padded micro-batches are "
                    "optim.grad_accum equal parts of a minibatch's rows"
                )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: greedy pass@1 and sampled, unbiased pass@k.

    Attributes:
      every: evaluate every this many steps (0: only at the start and end).
      at_start: evaluate before the first step ("before" in summary.json).
      num_problems: held-out problems used (0: the whole split).
      batch_size: prompts per generate call (big: evaluation is throughput).
      num_samples: n samples per problem for pass@k (0: greedy pass@1 only).
      k: the k of pass@k (1 <= k <= num_samples).
      temperature: sampling temperature of the pass@k samples.
      split: dataset split evaluated.
      seeds: sampling seeds of the pass@k samples: each draws ``num_samples`` more
        completions per problem, pooled per problem (``grpo_jax.core.problems``).
    """

    every: int = 50
    at_start: bool = True
    num_problems: int = 500
    batch_size: int = 256
    num_samples: int = 0
    k: int = 4
    temperature: float = 1.0
    split: str = "test"
    seeds: tuple[int, ...] = (0,)

    def __post_init__(self):
        check_range("eval.every", self.every, lo=0, integer=True)
        check_bool("eval.at_start", self.at_start)
        check_range("eval.num_problems", self.num_problems, lo=0, integer=True)
        check_range("eval.batch_size", self.batch_size, lo=1, integer=True)
        check_range("eval.num_samples", self.num_samples, lo=0, integer=True)
        check_range("eval.temperature", self.temperature, lo=0.0, lo_open=True)
        if self.num_samples:
            check_range("eval.k", self.k, lo=1, hi=self.num_samples, integer=True)
        if not isinstance(self.split, str) or not self.split:
            raise ConfigError(f"config key 'eval.split' = {self.split!r} must be a split name")
        seeds = self.seeds
        if (
            not isinstance(seeds, (tuple, list))
            or not seeds
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in seeds)
            or len(set(seeds)) != len(seeds)
        ):
            raise ConfigError(
                f"config key 'eval.seeds' = {seeds!r} must be a non-empty tuple of distinct "
                "integers >= 0, e.g. (0, 1, 2)"
            )
        object.__setattr__(self, "seeds", tuple(seeds))


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under <workdir>/checkpoints.

    Attributes:
      every: save every this many steps (and always at the end); 0: end only.
      keep: keep the last this many checkpoints.
      async_save: write in a background thread while training continues.
      resume_from: resume from this step rather than the newest (0: the newest);
        the newer steps are moved to ``checkpoints.after-<step>/``, kept.
      allow_changed_config: resume even though the config changes keys that
        make the resumed run another run (a lower learning rate after a
        blow-up, say); the changes are reported. False: such a resume is refused.
        A change of the saved parameters' shapes (``model.lora.rank``, ...) is
        refused either way.
    """

    every: int = 50
    keep: int = 2
    async_save: bool = True
    resume_from: int = 0
    allow_changed_config: bool = False

    def __post_init__(self):
        check_range("checkpoint.every", self.every, lo=0, integer=True)
        check_range("checkpoint.keep", self.keep, lo=1, integer=True)
        check_bool("checkpoint.async_save", self.async_save)
        check_range("checkpoint.resume_from", self.resume_from, lo=0, integer=True)
        check_bool("checkpoint.allow_changed_config", self.allow_changed_config)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh. Axis sizes as in ``grpo_jax.core.sharding.make_mesh`` (-1: the rest).

    Attributes:
      data, fsdp, tensor: mesh axis sizes.
      expert: a mixture of experts' experts split over this many devices (docs/moe.md,
        "The expert mesh axis"); it must divide the model's ``num_experts``. 1: no such axis.
      num_devices: use the first this many devices (0: all).
      layout: parameter layout, a key of ``grpo_jax.core.sharding.LAYOUTS``.
      memory_budget_gb: per-device memory the run may use, in GiB; a layout whose
        estimate exceeds it is refused before anything loads. 0: the memory
        the accelerator reports (none on CPU, so no check there).
      sampler_devices: with train.max_staleness >= 1, sample on a mesh of its
        own: each process's first sampler_devices / process_count devices,
        rows split over all of them (parameters replicated); the other devices
        form the learner mesh that data/fsdp/tensor lay out. 0: one mesh.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    num_devices: int = 0
    layout: str = "fsdp"
    memory_budget_gb: float = 0.0
    sampler_devices: int = 0

    def __post_init__(self):
        for axis in ("data", "fsdp", "tensor"):
            v = getattr(self, axis)
            check_range(f"mesh.{axis}", v, lo=-1, integer=True)
            if v == 0:
                raise ConfigError(f"config key 'mesh.{axis}' = 0 must be positive or -1")
        check_range("mesh.expert", self.expert, lo=1, integer=True)
        check_range("mesh.num_devices", self.num_devices, lo=0, integer=True)
        check_range("mesh.memory_budget_gb", self.memory_budget_gb, lo=0.0)
        check_range("mesh.sampler_devices", self.sampler_devices, lo=0, integer=True)
        check_choice("mesh.layout", self.layout, LAYOUTS)


TARGETS = ("solution", "answer")
METRICS = ("greedy", "sampled")


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """The supervised phase before GRPO.

    Attributes:
      enabled: run it (needs examples with a "solution" field).
      max_steps: hard cap on optimizer steps.
      min_steps: never stop before this many steps.
      target_pass_at_1: stop once validation pass@1 (``metric``) reaches this.
      metric: "greedy" (pass@1 of the argmax completion) or "sampled" (the
        share of completions sampled at the GRPO temperature that are
        correct, ``val_samples`` per problem): what GRPO will see. A policy
        caught mid-way through learning can be right under argmax yet sample
        correct answers only a few percent of the time, and GRPO, learning
        only from groups with a correct sample, then has almost no signal.
      val_samples: samples per validation problem for the "sampled" metric.
      eval_every: validate every this many steps.
      val_problems: training problems held back for validation (never trained on).
      batch_size: sequences per step.
      learning_rate, warmup_steps, weight_decay, max_grad_norm: AdamW with
        linear warmup, then constant.
      cache: save the result in <workdir>/warm_start and reuse it on rerun.
      target: the example field trained on: "solution" (the worked solution,
        ending in the checked answer format) or "answer" (the bare reference
        answer, for tasks scored by exact match of the whole completion,
        ``exact_match(tag=None)``: the shortest completions, the cheapest
        rollouts).
    """

    enabled: bool = False
    max_steps: int = 2000
    min_steps: int = 0
    target_pass_at_1: float = 0.25
    metric: str = "greedy"
    val_samples: int = 4
    eval_every: int = 50
    val_problems: int = 256
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    cache: bool = True
    target: str = "solution"

    def __post_init__(self):
        for key in ("enabled", "cache"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"config key 'warm_start.{key}' = {getattr(self, key)!r} must be True or False"
                )
        check_range("warm_start.max_steps", self.max_steps, lo=1, integer=True)
        check_range("warm_start.min_steps", self.min_steps, lo=0, hi=self.max_steps, integer=True)
        check_range("warm_start.target_pass_at_1", self.target_pass_at_1, lo=0.0, hi=1.0)
        check_range("warm_start.eval_every", self.eval_every, lo=1, integer=True)
        check_range("warm_start.val_problems", self.val_problems, lo=1, integer=True)
        check_range("warm_start.batch_size", self.batch_size, lo=1, integer=True)
        check_range("warm_start.learning_rate", self.learning_rate, lo=0.0, lo_open=True)
        check_range("warm_start.warmup_steps", self.warmup_steps, lo=0, integer=True)
        check_range("warm_start.weight_decay", self.weight_decay, lo=0.0)
        check_range("warm_start.max_grad_norm", self.max_grad_norm, lo=0.0)
        check_choice("warm_start.target", self.target, TARGETS)
        check_choice("warm_start.metric", self.metric, METRICS)
        check_range("warm_start.val_samples", self.val_samples, lo=1, integer=True)

    def optim(self) -> OptimConfig:
        """The warm start's optimizer: AdamW with linear warmup, then a constant rate.

        The warm start keeps Adam's b2 = 0.999 (with b1 = 0.9, eps = 1e-8),
        where ``OptimConfig`` (the GRPO phase) defaults to b2 = 0.99; the
        learning rate, warmup, weight decay and clipping are this section's.
        """
        return OptimConfig(
            learning_rate=self.learning_rate,
            schedule="constant",
            warmup_steps=self.warmup_steps,
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
        )


BUILTIN_TOKENIZER = "builtin"
TINY_PREFIX = "tiny:"  # model.path "tiny:<family>": a small random checkpoint, made at start


# ---------------------------------------------------------------------------
# The whole run.

TOP_KEYS = (
    "seed",
    "reward_modules",
    "model",
    "tokenizer",
    "data",
    "prompt",
    "rewards",
    "correct_reward",
    "grpo",
    "sampling",
    "optim",
    "train",
    "eval",
    "checkpoint",
    "mesh",
    "warm_start",
    "health",
    "env",
    "reward_model",
    "judge",
    "teacher",
)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A training run's config, every section validated (``parse_config``).

    ``raw`` is the config as plain data, kept for the record (config.json,
    checkpoints); nothing reads settings from it.
    """

    seed: int
    model: ModelSection
    tokenizer: str
    data: DataSection
    prompt: PromptConfig
    rewards: RewardsSection
    grpo: GRPOConfig
    sampling: SamplingSection
    optim: OptimConfig
    train: TrainConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    mesh: MeshConfig
    warm_start: WarmStartConfig
    health: HealthConfig
    raw: Mapping[str, Any]
    env: EnvSection = EnvSection()
    reward_model: RewardModelSection = RewardModelSection()
    judge: JudgeSection = JudgeSection()
    teacher: TeacherConfig = TeacherConfig()

    @property
    def completion_slots(self) -> tuple[int, str]:
        """T, the completion slots a row holds, and the key that sets it: with an environment
        the episode's transcript (``env.max_tokens``), else ``sampling.max_new_tokens``.
        The update, the scoring passes, the memory plan and the compiled programs take their
        rows' length from it."""
        if self.env.name:
            return self.env.max_tokens, "env.max_tokens"
        return self.sampling.max_new_tokens, "sampling.max_new_tokens"

    def section(self, name: str) -> dict:
        """A section as plain data (fingerprints, logs)."""
        value = getattr(self, name)
        if dataclasses.is_dataclass(value):
            return json.loads(json.dumps(dataclasses.asdict(value), default=str))
        return value


def parse_config(config) -> RunConfig:
    """Validates a run config (ConfigDict or mapping) into a :class:`RunConfig`.

    A misspelled key fails naming it and the known keys of its section; a bad
    value fails naming the key, the value and what is allowed.
    """
    raw = to_dict(config)
    check_known_keys("config", raw, TOP_KEYS)
    missing = [k for k in ("data", "rewards") if k not in raw]
    if missing:
        raise ConfigError(f"config is missing the required key(s) {missing}")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"config key 'seed' = {seed!r} must be a non-negative integer")
    tokenizer = raw.get("tokenizer", BUILTIN_TOKENIZER)
    if not isinstance(tokenizer, str):
        raise ConfigError(f"config key 'tokenizer' = {tokenizer!r} must be a string")
    modules = load_reward_modules(raw.get("reward_modules"))  # before names are looked up
    correct = raw.get("correct_reward", "exact_match")
    rewards.get(correct)
    run = RunConfig(
        seed=seed,
        model=ModelSection.from_mapping(raw.get("model")),
        tokenizer=tokenizer,
        data=DataSection.from_mapping(raw["data"]),
        prompt=from_mapping(PromptConfig, "prompt", raw.get("prompt")),
        rewards=RewardsSection(
            specs=parse_rewards(raw["rewards"]), correct=correct, modules=modules
        ),
        grpo=GRPOConfig.from_mapping(to_dict(raw.get("grpo"))),
        sampling=SamplingSection.from_mapping(raw.get("sampling")),
        optim=from_mapping(OptimConfig, "optim", raw.get("optim")),
        train=from_mapping(TrainConfig, "train", raw.get("train")),
        eval=from_mapping(EvalConfig, "eval", raw.get("eval")),
        checkpoint=from_mapping(CheckpointConfig, "checkpoint", raw.get("checkpoint")),
        mesh=from_mapping(MeshConfig, "mesh", raw.get("mesh")),
        warm_start=from_mapping(WarmStartConfig, "warm_start", raw.get("warm_start")),
        health=from_mapping(HealthConfig, "health", raw.get("health")),
        raw=json.loads(json.dumps(raw, default=str)),
        env=from_mapping(EnvSection, "env", raw.get("env")),
        reward_model=from_mapping(RewardModelSection, "reward_model", raw.get("reward_model")),
        judge=from_mapping(JudgeSection, "judge", raw.get("judge")),
        teacher=from_mapping(TeacherConfig, "teacher", raw.get("teacher")),
    )
    if run.judge.path == "reference" and (run.grpo.beta == 0 or run.model.lora.rank):
        raise ConfigError(
            "config key 'judge.path' = 'reference' needs the run's reference policy as a "
            f"plain model: grpo.beta > 0 (it is {run.grpo.beta}) and no LoRA "
            f"(model.lora.rank = {run.model.lora.rank})"
        )
    _check_teacher(run)
    chunk, (t, t_key) = run.train.logits_chunk, run.completion_slots
    if chunk and t % chunk:
        raise ConfigError(
            f"config key 'train.logits_chunk' = {chunk} must divide "
            f"{t_key} = {t} (or be 0: no chunking)"
        )
    row = run.train.pack_row_tokens
    if row and row < max(run.sampling.prompt_buckets) + t:
        raise ConfigError(
            f"config key 'train.pack_row_tokens' = {row} must hold the longest prompt and "
            f"completion: at least max(sampling.prompt_buckets) + {t_key} = "
            f"{max(run.sampling.prompt_buckets) + t} (or be 0: that length)"
        )
    if run.train.dynamic_sampling and run.env.name:
        raise ConfigError(
            "config key 'train.dynamic_sampling' = True does not combine with an environment "
            f"(env.name = {run.env.name!r}) yet: multi-turn rollouts sample one round per step"
        )
    if run.grpo.advantage_estimator == "gae" and run.train.packing == "on":
        raise ConfigError(
            "config key 'train.packing' = 'on' does not combine with "
            "grpo.advantage_estimator = 'gae' yet: the critic's update runs on padded rows"
        )
    _check_engine(run)
    _check_router_replay(run)
    k = run.train.max_staleness
    if run.mesh.sampler_devices and (run.train.dynamic_sampling or run.env.name):
        what = "train.dynamic_sampling = True" if run.train.dynamic_sampling else "env.name"
        raise ConfigError(
            f"config key 'mesh.sampler_devices' = {run.mesh.sampler_devices} does not combine "
            f"with {what}: those rollouts decide what to sample next from what they have "
            "sampled, on the learner's mesh; a sampler mesh of its own serves single-turn "
            "rollouts only"
        )
    if run.mesh.sampler_devices and not k:
        raise ConfigError(
            f"config key 'mesh.sampler_devices' = {run.mesh.sampler_devices} needs "
            "train.max_staleness >= 1: a sampler mesh of its own runs beside the learner, "
            "sampling with parameters at least one update old"
        )
    return run


def _check_teacher(run: RunConfig) -> None:
    """A teacher's per-token term needs a per-token objective and a group estimator, and its
    full-vocabulary KL padded rows (docs/objective.md, 13)."""
    g = run.grpo
    if run.teacher.enabled and (g.reduction == "gspo" or g.policy_loss == "gmpo"):
        raise ConfigError(
            f"config key 'teacher.path' = {run.teacher.path!r} needs a per-token objective: "
            f"the distillation term is a per-token advantage, and grpo.reduction = "
            f"{g.reduction!r} with grpo.policy_loss = {g.policy_loss!r} has one ratio per row"
        )
    if run.teacher.enabled and run.teacher.kl == "full" and run.train.packing == "on":
        raise ConfigError(
            "config key 'teacher.kl' = 'full' does not combine with train.packing = 'on' yet: "
            "the teacher's LM head runs beside the student's over padded rows; use "
            "teacher.kl = 'sampled' or train.packing = 'off'"
        )
    if run.teacher.enabled and g.advantage_estimator == "gae":
        raise ConfigError(
            f"config key 'teacher.path' = {run.teacher.path!r} does not combine with "
            "grpo.advantage_estimator = 'gae' yet: the critic's update takes its per-token "
            "advantages from GAE alone; use a group estimator (e.g. 'grpo') with a teacher"
        )


def _check_router_replay(run: RunConfig) -> None:
    """Routing replay needs rollouts that record routes (an engine that records them,
    ``static`` or ``paged``: single-turn rounds, partial rollouts and multi-turn episodes,
    observation tokens included) and an update whose passes take them (docs/moe.md); whether
    the model is a mixture of experts is checked as it is built (``grpo_jax.run.builders``)."""
    if run.grpo.router_replay == "none":
        return
    where = f"config key 'grpo.router_replay' = {run.grpo.router_replay!r}"
    engine = get_engine(run.sampling.engine)
    if not engine.records_routes:
        able = " or ".join(repr(n) for n in engine_names() if get_engine(n).records_routes)
        raise ConfigError(
            f"{where} needs sampling.engine = {able} (it is {run.sampling.engine!r}): only "
            "that engine records the experts each token's router chose"
        )
    refused = [
        (run.train.packing == "on", "train.packing = 'on'"),
        (run.grpo.advantage_estimator == "gae", "grpo.advantage_estimator = 'gae'"),
        (run.teacher.enabled and run.teacher.kl == "full", "teacher.kl = 'full'"),
    ]
    for on, what in refused:
        if on:
            raise ConfigError(
                f"{where} does not combine with {what} yet: its rollouts or its update's "
                "passes do not carry the recorded routes; set grpo.router_replay = 'none'"
            )


def _check_engine(run: RunConfig) -> None:
    """``sampling.engine`` names a registered engine, which checks its own settings against
    the sequences a row holds; partial rollouts need one that carries rows."""
    engine = get_engine(run.sampling.engine)
    # A row holds its completion after the prompt, or, with an environment, its transcript.
    t, what = run.completion_slots
    engine.check(run.sampling, run.model, completion=t, completion_key=what)
    _check_partial_rollouts(run, engine)


def _check_partial_rollouts(run: RunConfig, engine: Engine) -> None:
    if not run.sampling.partial_rollouts:
        return
    where = "config key 'sampling.partial_rollouts' = True"
    if not engine.carries_rows:
        able = " or ".join(repr(n) for n in engine_names() if get_engine(n).carries_rows)
        raise ConfigError(
            f"{where} needs sampling.engine = {able} (it is {run.sampling.engine!r}): rows "
            "carry over between the runs of an engine that continues them"
        )
    if not run.train.max_staleness:
        raise ConfigError(
            f"{where} needs train.max_staleness >= 1: a carried row's tokens are up to that "
            "many updates old when its step trains on them"
        )
    if run.train.dynamic_sampling or run.mesh.sampler_devices or run.env.name:
        what = (
            "train.dynamic_sampling = True"
            if run.train.dynamic_sampling
            else f"mesh.sampler_devices = {run.mesh.sampler_devices}"
            if run.mesh.sampler_devices
            else f"an environment (env.name = {run.env.name!r})"
        )
        raise ConfigError(
            f"{where} does not combine with {what}: partial rollouts sample each step's groups "
            "on the learner's mesh, in prompt order"
        )


def check_batch_layout(run: RunConfig, shards: int, num_processes: int = 1) -> None:
    """Cross-section checks that need the mesh: whole groups and minibatches per shard.

    ``shards``: the mesh's batch shards (``grpo_jax.core.sharding.batch_shards``).
    """
    G, B = run.grpo.G, run.train.batch_size
    n = B * G
    if B % shards:
        raise ConfigError(
            f"config key 'train.batch_size' = {B} must be a multiple of the {shards} batch "
            "shards of the mesh (each shard holds whole groups)"
        )
    m = run.train.minibatch_size or n
    if n % m or m % shards:
        raise ConfigError(
            f"config key 'train.minibatch_size' = {run.train.minibatch_size} must divide "
            f"N = batch_size * G = {n} and be a multiple of the {shards} batch shards"
        )
    if (m // shards) % run.optim.grad_accum:
        raise ConfigError(
            f"config key 'optim.grad_accum' = {run.optim.grad_accum} must divide the "
            f"{m // shards} rows per shard of a minibatch"
        )
    ev = run.eval
    if ev.batch_size % shards:
        raise ConfigError(
            f"config key 'eval.batch_size' = {ev.batch_size} must be a multiple of the "
            f"{shards} batch shards"
        )
    if ev.num_samples and (
        ev.batch_size % ev.num_samples or (ev.batch_size // ev.num_samples) % shards
    ):
        raise ConfigError(
            f"config key 'eval.batch_size' = {ev.batch_size} must be a multiple of "
            f"eval.num_samples = {ev.num_samples} times the {shards} batch shards"
        )
    ws = run.warm_start
    if ws.enabled and ws.batch_size % shards:
        raise ConfigError(
            f"config key 'warm_start.batch_size' = {ws.batch_size} must be a multiple of the "
            f"{shards} batch shards"
        )


@functools.cache
def section_defaults() -> dict:
    """{flat key: default} of the sections of :class:`RunConfig` that need no argument, as
    plain JSON data (as a run's recorded config holds them): what a version of grpo_jax
    that did not have one of these settings yet did (resume checks, compare's groups)."""
    return section_defaults_of(RunConfig)
