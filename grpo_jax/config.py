"""Validated, frozen configuration for the GRPO objective.

The ml_collections ``ConfigDict`` of a run stops at ``train.py``; library code
takes these small frozen dataclasses, whose fields carry the paper's symbols.
Every check raises :class:`ConfigError` naming the offending key, its value and
what is allowed, so that a bad sweep value fails at start-up, not mid-run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

# The attention implementations (``grpo_jax.models.attention``), for ``model.attention``.
ATTENTION = ("einsum", "blockwise", "dot_product", "splash")


class ConfigError(ValueError):
    """A configuration value is missing, misspelled or out of range."""


def check_choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = sorted(allowed)
    if value not in allowed:
        raise ConfigError(f"config key '{key}' = {value!r} is not one of {allowed}")


def check_range(key: str, value: Any, *, lo=None, hi=None, lo_open=False, integer=False) -> None:
    """Raises unless ``lo <= value <= hi`` (``lo < value`` when ``lo_open``)."""
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"config key '{key}' = {value!r} must be an integer")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"config key '{key}' = {value!r} must be a finite number")
    if lo is not None and (value <= lo if lo_open else value < lo):
        op = ">" if lo_open else ">="
        raise ConfigError(f"config key '{key}' = {value!r} must be {op} {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"config key '{key}' = {value!r} must be <= {hi}")


def check_known_keys(section: str, given: Iterable[str], known: Iterable[str]) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config key{'s' * (len(unknown) > 1)} "
            f"{', '.join(f'{section}.{k}' for k in unknown)}; "
            f"the keys of {section} are {', '.join(sorted(known))}"
        )


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"config key '{key}' = {value!r} must be True or False")


def to_dict(section: Any) -> dict:
    """A config section (ConfigDict, mapping or None) as a plain dict."""
    if section is None:
        return {}
    if hasattr(section, "to_dict"):
        return section.to_dict()
    return dict(section)


def from_mapping(cls, section: str, mapping: Mapping[str, Any] | None):
    """Builds ``cls`` from a config section, rejecting unknown keys by name."""
    cfg = to_dict(mapping)
    check_known_keys(section, cfg, {f.name for f in dataclasses.fields(cls)})
    return cls(**cfg)


OLD_LOGPS = ("sampler", "recompute")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Hyperparameters of the GRPO objective (DeepSeekMath, Shao et al. 2024).

    Attributes:
      G: group size, completions sampled per prompt (>= 2: a group of one has
        no relative advantage).
      beta: weight of the KL penalty to the frozen reference policy. 0 skips
        the reference model entirely (no memory, no forward pass).
      epsilon_low: clip range below 1 for the ratio rho = pi_theta / pi_old;
        None switches clipping off on that side.
      epsilon_high: clip range above 1 (DAPO's "clip-higher" sets it above
        epsilon_low); None switches clipping off on that side.
      mu: gradient passes over each rollout batch against the fixed pi_old.
      kl_estimator: one of ``grpo_jax.losses.KL_ESTIMATORS``.
      reduction: one of ``grpo_jax.losses.REDUCTIONS``.
      advantage_estimator: one of ``grpo_jax.advantages.ESTIMATORS``.
      advantage_eps: eps in A = (r - mean) / (std + eps).
      temperature: sampling temperature; all three policies score tokens from
        logits / temperature.
      policy_loss: one of ``grpo_jax.losses.POLICY_LOSSES`` (docs/objective.md).
      dual_clip_c: dual-clip PPO's c (> 1) for A < 0; None switches it off.
      sapo_tau_pos, sapo_tau_neg: "sapo" gate temperatures for A > 0 / A < 0.
      cov_frac: "clip_cov"/"kl_cov" fraction of valid tokens picked by covariance.
      cov_lb, cov_ub: "clip_cov" covariance band.
      kl_cov_coef: "kl_cov" penalty weight k.
      passk_k: k of the "passk" advantage estimator (<= G).
      behavior_correction: "none" (default), "tis" or "mis": importance
        weights of pi_old against the distribution the sampler drew from
        (after top-k / top-p / min-p, at the sampler's precision), truncated
        at C ("tis") or masking tokens outside [1/C, C] ("mis"); see
        ``grpo_jax.losses.behavior_weights`` and docs/objective.md.
      behavior_level: "token" (default) or "sequence" weights.
      behavior_cap: C (> 1).
      old_logps: "sampler" (default): pi_old's log-probs are those the
        sampler recorded; "recompute": the update scores the batch with the
        sampling parameters once before its first pass (one more forward
        pass), so the first ratio is 1 even when sampler and trainer compute
        at different precision.
    """

    G: int = 8
    beta: float = 0.0
    epsilon_low: float | None = 0.2
    epsilon_high: float | None = 0.2
    mu: int = 1
    kl_estimator: str = "k3"
    reduction: str = "grpo"
    advantage_estimator: str = "grpo"
    advantage_eps: float = 1e-4
    temperature: float = 1.0
    policy_loss: str = "clip"
    dual_clip_c: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cov_frac: float = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    kl_cov_coef: float = 1.0
    passk_k: int = 1
    behavior_correction: str = "none"
    behavior_level: str = "token"
    behavior_cap: float = 2.0
    old_logps: str = "sampler"

    def __post_init__(self):
        from grpo_jax import advantages, losses  # Late import: the registries live there.

        check_range("grpo.G", self.G, lo=2, integer=True)
        check_range("grpo.beta", self.beta, lo=0.0)
        for side in ("epsilon_low", "epsilon_high"):
            value = getattr(self, side)
            if value is not None:
                check_range(f"grpo.{side}", value, lo=0.0)
        check_range("grpo.mu", self.mu, lo=1, integer=True)
        check_choice("grpo.kl_estimator", self.kl_estimator, losses.KL_ESTIMATORS)
        check_choice("grpo.reduction", self.reduction, losses.REDUCTIONS)
        check_choice("grpo.advantage_estimator", self.advantage_estimator, advantages.ESTIMATORS)
        check_range("grpo.advantage_eps", self.advantage_eps, lo=0.0)
        check_range("grpo.temperature", self.temperature, lo=0.0, lo_open=True)
        check_choice("grpo.policy_loss", self.policy_loss, losses.POLICY_LOSSES)
        if self.reduction == "gspo" and self.policy_loss != "clip":
            raise ConfigError(
                f"grpo.policy_loss={self.policy_loss!r} does not combine with "
                "grpo.reduction='gspo'; allowed with 'gspo': ['clip']"
            )
        if self.policy_loss in losses.SEQUENCE_POLICY_LOSSES and self.reduction != "grpo":
            raise ConfigError(
                f"grpo.policy_loss={self.policy_loss!r} needs grpo.reduction='grpo', "
                f"got {self.reduction!r}"
            )
        if self.dual_clip_c is not None:
            check_range("grpo.dual_clip_c", self.dual_clip_c, lo=1.0, lo_open=True)
        check_range("grpo.sapo_tau_pos", self.sapo_tau_pos, lo=0.0, lo_open=True)
        check_range("grpo.sapo_tau_neg", self.sapo_tau_neg, lo=0.0, lo_open=True)
        check_range("grpo.cov_frac", self.cov_frac, lo=0.0, hi=1.0)
        check_range("grpo.cov_lb", self.cov_lb)
        check_range("grpo.cov_ub", self.cov_ub, lo=self.cov_lb)
        check_range("grpo.kl_cov_coef", self.kl_cov_coef, lo=0.0)
        check_range("grpo.passk_k", self.passk_k, lo=1, hi=self.G, integer=True)
        check_choice(
            "grpo.behavior_correction", self.behavior_correction, losses.BEHAVIOR_CORRECTIONS
        )
        check_choice("grpo.behavior_level", self.behavior_level, losses.BEHAVIOR_LEVELS)
        check_range("grpo.behavior_cap", self.behavior_cap, lo=1.0, lo_open=True)
        check_choice("grpo.old_logps", self.old_logps, OLD_LOGPS)
        sequence_terms = (
            self.reduction == "gspo" or self.policy_loss in losses.SEQUENCE_POLICY_LOSSES
        )
        if (
            self.behavior_correction != "none"
            and sequence_terms
            and self.behavior_level != "sequence"
        ):
            raise ConfigError(
                "grpo.behavior_correction with a sequence-level objective "
                f"(reduction={self.reduction!r}, policy_loss={self.policy_loss!r}) needs "
                f"grpo.behavior_level='sequence', got {self.behavior_level!r}"
            )

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> GRPOConfig:
        """Builds from the ``grpo`` section of a run config.

        ``epsilon`` sets both clip sides; ``epsilon_low``/``epsilon_high`` left
        at None there inherit it (a run config turns a side's clipping off with
        a huge value such as 1e9, which never binds since rho > 0).
        """
        cfg = dict(cfg)
        fields = {f.name for f in dataclasses.fields(cls)}
        check_known_keys("grpo", cfg, fields | {"epsilon"})
        eps = cfg.pop("epsilon", 0.2)
        check_range("grpo.epsilon", eps, lo=0.0)
        for side in ("epsilon_low", "epsilon_high"):
            if cfg.get(side) is None:
                cfg[side] = eps
        return cls(**cfg)


SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm gradient clipping and a warmup + decay schedule.

    Attributes:
      learning_rate: peak learning rate.
      schedule: "constant", "cosine" or "linear" decay after warmup, to
        ``learning_rate * end_lr_factor`` at the last update.
      warmup_steps: optimizer updates of linear warmup from 0.
      end_lr_factor: final learning rate as a fraction of the peak.
      b1, b2, eps: Adam moments.
      weight_decay: decoupled weight decay (AdamW).
      max_grad_norm: clip the global gradient norm to this; 0 switches it off.
      grad_accum: micro-batches whose gradients are averaged per update (the
        minibatch is split into this many equal parts: less memory, same
        update for the "grpo" reduction).
    """

    learning_rate: float = 3e-4
    schedule: str = "constant"
    warmup_steps: int = 0
    end_lr_factor: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    grad_accum: int = 1

    def __post_init__(self):
        check_range("optim.learning_rate", self.learning_rate, lo=0.0, lo_open=True)
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_range("optim.warmup_steps", self.warmup_steps, lo=0, integer=True)
        check_range("optim.end_lr_factor", self.end_lr_factor, lo=0.0, hi=1.0)
        check_range("optim.b1", self.b1, lo=0.0, hi=1.0)
        check_range("optim.b2", self.b2, lo=0.0, hi=1.0)
        check_range("optim.eps", self.eps, lo=0.0, lo_open=True)
        check_range("optim.weight_decay", self.weight_decay, lo=0.0)
        check_range("optim.max_grad_norm", self.max_grad_norm, lo=0.0)
        check_range("optim.grad_accum", self.grad_accum, lo=1, integer=True)


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
        steps update (``grpo_jax.pipeline``, docs/pipeline.md).
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
    """

    every: int = 0
    at_start: bool = True
    num_problems: int = 500
    batch_size: int = 256
    num_samples: int = 0
    k: int = 4
    temperature: float = 1.0
    split: str = "test"

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
    """Device mesh. Axis sizes as in ``grpo_jax.sharding.make_mesh`` (-1: the rest).

    Attributes:
      data, fsdp, tensor: mesh axis sizes.
      num_devices: use the first this many devices (0: all).
      layout: parameter layout, a key of ``grpo_jax.sharding.LAYOUTS``.
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
    num_devices: int = 0
    layout: str = "fsdp"
    memory_budget_gb: float = 0.0
    sampler_devices: int = 0

    def __post_init__(self):
        from grpo_jax.sharding import LAYOUTS

        for axis in ("data", "fsdp", "tensor"):
            v = getattr(self, axis)
            check_range(f"mesh.{axis}", v, lo=-1, integer=True)
            if v == 0:
                raise ConfigError(f"config key 'mesh.{axis}' = 0 must be positive or -1")
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


# ---------------------------------------------------------------------------
# The sections whose runtime objects carry another name (``models.ModelConfig``,
# ``sampling.SamplingConfig``): the run config's view of them.

LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the frozen base's projections (``grpo_jax.models.lora``).

    A target projection W [in, out] computes x W + (alpha / rank) (x A) B, with
    A [in, rank] and B [rank, out] the trainable adapters (Hu et al. 2021,
    "LoRA"); B starts at zero, so the adapted model starts as the base.

    Attributes:
      rank: r; 0 switches LoRA off (full fine-tuning).
      alpha: the scale's numerator (scale = alpha / rank, as PEFT's default).
      dropout: dropout on the adapters' input x in the update's forward pass
        (never in sampling, scoring of pi_old or the reference).
      targets: the projections that get adapters: short names (q, k, v, o,
        gate, up, down), full names (q_proj, ...) or regular expressions
        matched against the full names ("(q|v)_proj"); a string is split at
        commas.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self):
        targets = self.targets
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
            raise ConfigError(
                f"config key 'model.lora.targets' = {self.targets!r} must be a list of "
                "projection names or regular expressions"
            )
        object.__setattr__(self, "targets", tuple(targets))
        check_range("model.lora.rank", self.rank, lo=0, integer=True)
        check_range("model.lora.alpha", self.alpha, lo=0.0, lo_open=True)
        check_range("model.lora.dropout", self.dropout, lo=0.0)
        if self.dropout >= 1.0:
            raise ConfigError(f"config key 'model.lora.dropout' = {self.dropout!r} must be < 1")
        if self.rank and not self.targets:
            raise ConfigError("config key 'model.lora.targets' is empty: name the projections")
        for t in self.targets:
            if not self._matches(t):
                raise ConfigError(
                    f"config key 'model.lora.targets' entry {t!r} matches no projection; "
                    f"projections: {[p[:-5] for p in LORA_PROJECTIONS]} (or their full names "
                    f"{list(LORA_PROJECTIONS)}, or a regular expression over the full names)"
                )

    @staticmethod
    def _matches(target: str) -> tuple[str, ...]:
        try:
            pattern = re.compile(target)
        except re.error as e:
            raise ConfigError(
                f"config key 'model.lora.targets' entry {target!r} is not a valid regular "
                f"expression ({e})"
            ) from None
        return tuple(p for p in LORA_PROJECTIONS if target in (p, p[:-5]) or pattern.fullmatch(p))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def projections(self) -> tuple[str, ...]:
        """The full names of the target projections, in ``LORA_PROJECTIONS`` order."""
        hit = {p for t in self.targets for p in self._matches(t)}
        return tuple(p for p in LORA_PROJECTIONS if p in hit)


MODEL_KEYS = ("path", "dtype", "param_dtype", "remat", "attention", "scan_layers")
BUILTIN_TOKENIZER = "builtin"
TINY_PREFIX = "tiny:"  # model.path "tiny:<family>": a small random checkpoint, made at start


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy model.

    Attributes:
      path: a Hugging Face checkpoint directory; "" is the built-in tiny model;
        "tiny:<family>" (qwen2, qwen3, llama, gemma3) a small random
        checkpoint of that family, written when the run starts
        (``grpo_jax.runlocal``).
      dtype: compute dtype (None: the checkpoint's, float32 for the tiny model).
      param_dtype: storage dtype of the parameters (None: ``dtype``).
      remat: recompute each layer in the backward pass.
      attention: "einsum", "blockwise", "dot_product" or "splash"
        (``grpo_jax.models.attention``).
      scan_layers: run the layers as one scan over stacked parameters.
      lora: low-rank adapters on a frozen base (:class:`LoRAConfig`; rank 0: off).
      overrides: for the built-in tiny model only, ``grpo_jax.models.ModelConfig``
        fields (hidden_size, num_layers, ...), given as further keys of the
        ``model`` section.
    """

    path: str = ""
    dtype: str | None = None
    param_dtype: str | None = None
    remat: bool | None = None
    attention: str | None = None
    scan_layers: bool | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lora: LoRAConfig = LoRAConfig()

    def __post_init__(self):
        if not isinstance(self.path, str):
            raise ConfigError(f"config key 'model.path' = {self.path!r} must be a string")
        if self.remat is not None:
            check_bool("model.remat", self.remat)
        if self.scan_layers is not None:
            check_bool("model.scan_layers", self.scan_layers)
        if self.attention is not None:
            check_choice("model.attention", self.attention, ATTENTION)
        if self.path and self.overrides:
            raise ConfigError(
                f"config keys {[f'model.{k}' for k in sorted(self.overrides)]} only apply to "
                f"the built-in tiny model; model.path = {self.path!r} loads its architecture "
                "from config.json"
            )

    @classmethod
    def from_mapping(cls, mapping) -> ModelSection:
        cfg = to_dict(mapping)
        known = {k: cfg.pop(k) for k in MODEL_KEYS if k in cfg}
        lora = from_mapping(LoRAConfig, "model.lora", cfg.pop("lora", None))
        return cls(**known, overrides=cfg, lora=lora)

    def loader_kwargs(self) -> dict:
        """The keys that were set among dtype, param_dtype, remat, attention and scan_layers."""
        return {k: getattr(self, k) for k in MODEL_KEYS[1:] if getattr(self, k) is not None}


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    """How GRPO samples completions (``grpo_jax.sampling.SamplingConfig`` at run time).

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
    """

    max_new_tokens: int
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    prompt_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    stop: tuple[str, ...] = ()

    def __post_init__(self):
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
    ):
        """The jitted sampler's static ``SamplingConfig`` for this section.

        ``stop_sequences`` are the token ids of ``stop`` (the section holds
        strings; ``grpo_jax.setup.tokenizer_sampling`` encodes them).
        """
        from grpo_jax.sampling import SamplingConfig

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
        )


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The dataset: ``source`` and that loader's options (``grpo_jax.data.load_dataset``).

    Sources: "synthetic" (task, seed, n_train, n_test, ...), "gsm8k" (TFDS
    ``data_dir``, or GSM8K-format JSONL files in ``jsonl_dir``; "tiny:word_problems"
    makes a small synthetic set at start), "jsonl" (train_path, test_path,
    field names). docs/data.md describes each.
    """

    source: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_mapping(cls, mapping) -> DataSection:
        from grpo_jax import data

        cfg = data.check_keys(to_dict(mapping))
        source = cfg.pop("source")
        return cls(source=source, options=cfg)

    def as_mapping(self) -> dict:
        return {"source": self.source, **self.options}


@dataclasses.dataclass(frozen=True)
class RewardsSection:
    """The weighted training rewards and the reward that judges correctness.

    Attributes:
      specs: ``rewards.RewardSpec`` (registry name, options allowed, and weight),
        from the ``rewards`` key: "name:weight,..." or a mapping name -> weight.
      correct: the reward whose value 1.0 means "correct" (pass rate, pass@k),
        from the ``correct_reward`` key; scored apart when not among ``specs``.
      modules: user modules imported first, from the ``reward_modules`` key
        (:func:`load_reward_modules`): their import registers further rewards.
    """

    specs: tuple
    correct: str = "exact_match"
    modules: tuple[str, ...] = ()


def load_reward_modules(value: Any) -> tuple[str, ...]:
    """Imports the ``reward_modules`` key's modules, whose import registers rewards.

    A comma-separated string or a list of dotted module names
    (``my_pkg.rewards``) or ``.py`` paths (``rewards.load_user_module``).
    """
    from grpo_jax import rewards

    if value in (None, ""):
        return ()
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(
            f"config key 'reward_modules' = {value!r} must be a comma-separated string or "
            "a list of module names or .py paths"
        )
    for item in items:
        rewards.load_user_module(item)
    return tuple(items)


def _split_top_level(text: str) -> list[str]:
    """Splits "a:1,b(x=1, y=2):0.5" at commas outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_rewards(value: Any) -> tuple:
    """Parses the ``rewards`` key: "name:weight,..." or a mapping name -> weight.

    Names may carry options, "format(think_tag=None):0.1"; a missing weight is
    1.0. Both spellings are sweepable from the command line
    (``--config.rewards=exact_match:1.0,format:0.2``).
    """
    from grpo_jax import rewards

    if isinstance(value, str):
        specs = []
        for item in _split_top_level(value):
            name, weight = item, "1.0"
            head, sep, tail = item.rpartition(":")
            if sep and ")" not in tail:
                name, weight = head, tail
            try:
                w = float(weight)
            except ValueError:
                raise ConfigError(
                    f"config key 'rewards' = {value!r}: weight {weight!r} of reward "
                    f"{name.strip()!r} is not a number (expected 'name:weight,...')"
                ) from None
            specs.append((name.strip(), w))
    elif hasattr(value, "items"):
        specs = [(str(k), v) for k, v in to_dict(value).items()]
    else:
        raise ConfigError(
            f"config key 'rewards' = {value!r} must be a string 'name:weight,...' "
            "or a mapping of name to weight"
        )
    if not specs:
        raise ConfigError("config key 'rewards' names no reward function")
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"config key 'rewards' = {value!r} names a reward twice")
    out = tuple(rewards.RewardSpec(n, w) for n, w in specs)
    for s in out:
        rewards.get(s.name)  # An unknown name fails here, listing the available ones.
    return out


@dataclasses.dataclass(frozen=True)
class PromptConfig:
    """How an example becomes a prompt (``grpo_jax.data.format_prompt``).

    template: str.format template over the example's fields ("{prompt}").
    chat: wrap in the tokenizer's chat template.
    system: system message (chat) or preamble (plain); "" for none.
    """

    template: str = "{prompt}"
    chat: bool = False
    system: str = ""

    def __post_init__(self):
        if not isinstance(self.template, str) or "{" not in self.template:
            raise ConfigError(
                f"config key 'prompt.template' = {self.template!r} must be a format string "
                "over the example's fields, such as '{prompt}'"
            )
        check_bool("prompt.chat", self.chat)


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Multi-turn rollouts with an environment (``grpo_jax.multiturn``, docs/multiturn.md).

    Attributes:
      name: the environment, "name" or "name(k=v, ...)" (``grpo_jax.envs``); "" is
        single-turn GRPO with the reward functions.
      modules: comma-separated modules or ``.py`` files whose import registers
        environments.
      max_tokens: transcript slots per episode (model and environment tokens).
      max_turns: model turns per episode.
      max_turn_tokens: model tokens per turn (0: up to max_tokens).
      max_obs_tokens: the most tokens one observation may add.
      timeout_s: time budget of each reset / step call.
    """

    name: str = ""
    modules: str = ""
    max_tokens: int = 64
    max_turns: int = 4
    max_turn_tokens: int = 0
    max_obs_tokens: int = 32
    timeout_s: float = 10.0

    def __post_init__(self):
        for key in ("name", "modules"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(
                    f"config key 'env.{key}' = {getattr(self, key)!r} must be a string"
                )
        check_range("env.max_tokens", self.max_tokens, lo=2, integer=True)
        check_range("env.max_turns", self.max_turns, lo=1, integer=True)
        check_range("env.max_turn_tokens", self.max_turn_tokens, lo=0, integer=True)
        check_range("env.max_obs_tokens", self.max_obs_tokens, lo=1, integer=True)
        check_range("env.timeout_s", self.timeout_s, lo=0.0, lo_open=True)
        if self.max_turn_tokens > self.max_tokens:
            raise ConfigError(
                f"config key 'env.max_turn_tokens' = {self.max_turn_tokens} exceeds "
                f"'env.max_tokens' = {self.max_tokens}"
            )
        if self.name:
            from grpo_jax import envs

            for item in (m.strip() for m in self.modules.split(",")):
                if item:
                    try:
                        envs.load_user_module(item)
                    except (ImportError, OSError) as e:
                        raise ConfigError(f"config key 'env.modules': {item!r}: {e}") from None
            try:
                envs.get(self.name)
            except (KeyError, ValueError) as e:
                raise ConfigError(f"config key 'env.name' = {self.name!r}: {e}") from None
            # One instance, its constructor's failures (sys.exit included) contained.
            _, error = envs.safe_make(self.name, self.timeout_s)
            if error is not None:
                raise ConfigError(f"config key 'env.name' = {self.name!r}: {error}")


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    """Training-health alarms (``grpo_jax.health``: the rules; ``grpo_jax.report``: the reports).

    The defaults keep a healthy run quiet; windows count steps (metric records).

    Attributes:
      enabled: check the run's metrics after every step.
      stop_on_alarm: when an alarm fires, save a checkpoint of the step and end
        the run with ``AlarmStop`` (the command: exit status 4).
      resume_after_stop: resume from a checkpoint that such a stop saved (a rerun
        refuses to otherwise).
      rearm_steps: an alarm that fired fires again only after it has been
        quiet for more than this many steps.
      entropy_window: steps averaged for the early and current entropy.
      entropy_frac: entropy collapse below this fraction of its early level.
      entropy_floor: entropy collapse below this absolute level (nats/token).
      length_window: recent steps of the completion length.
      length_baseline: the steps before them it is compared with.
      length_blowup: alarm when recent / earlier length exceeds this.
      length_collapse: alarm when recent / earlier length is below this.
      truncation_window: steps averaged for the truncation rate.
      truncation_max: alarm above this truncated share.
      clip_frac_max: alarm when one step's clipped share (low + high) exceeds this.
      ratio_max: alarm when one step's largest ratio pi_theta / pi_old exceeds this.
      kl_window: steps whose median KL a step's KL is compared with.
      kl_spike_factor: alarm when the KL exceeds this times that median ...
      kl_min: ... and this absolute level.
      zero_var_steps: steps in a row ...
      zero_var_max: ... with at least this share of zero-variance groups.
      reward_window: steps of reward averaged up to each evaluation.
      reward_rise_min: reward rise between two evaluations that counts ...
      pass_drop_min: ... with a held-out pass@1 drop above this.
      mismatch_window: recent steps of a log-prob mismatch.
      mismatch_baseline: the steps before them whose median it is compared with.
      mismatch_growth: alarm when the recent mean exceeds this times that median ...
      mismatch_min: ... and this absolute level.
    """

    enabled: bool = True
    stop_on_alarm: bool = False
    resume_after_stop: bool = False
    rearm_steps: int = 20
    entropy_window: int = 5
    entropy_frac: float = 0.2
    entropy_floor: float = 0.01
    length_window: int = 10
    length_baseline: int = 20
    length_blowup: float = 2.0
    length_collapse: float = 0.5
    truncation_window: int = 5
    truncation_max: float = 0.25
    clip_frac_max: float = 0.2
    ratio_max: float = 10.0
    kl_window: int = 20
    kl_spike_factor: float = 5.0
    kl_min: float = 1e-3
    zero_var_steps: int = 20
    zero_var_max: float = 0.9
    reward_window: int = 10
    reward_rise_min: float = 0.05
    pass_drop_min: float = 0.02
    mismatch_window: int = 10
    mismatch_baseline: int = 40
    mismatch_growth: float = 3.0
    mismatch_min: float = 0.05

    def __post_init__(self):
        check_bool("health.enabled", self.enabled)
        check_bool("health.stop_on_alarm", self.stop_on_alarm)
        check_bool("health.resume_after_stop", self.resume_after_stop)
        for key in ("rearm_steps", "length_baseline", "kl_window", "mismatch_baseline"):
            check_range(f"health.{key}", getattr(self, key), lo=0, integer=True)
        for key in (
            "entropy_window",
            "length_window",
            "truncation_window",
            "zero_var_steps",
            "reward_window",
            "mismatch_window",
        ):
            check_range(f"health.{key}", getattr(self, key), lo=1, integer=True)
        for key in (
            "entropy_frac",
            "entropy_floor",
            "length_blowup",
            "length_collapse",
            "truncation_max",
            "clip_frac_max",
            "ratio_max",
            "kl_spike_factor",
            "kl_min",
            "zero_var_max",
            "reward_rise_min",
            "pass_drop_min",
            "mismatch_growth",
            "mismatch_min",
        ):
            check_range(f"health.{key}", getattr(self, key), lo=0.0)


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
    from grpo_jax import rewards

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
    )
    chunk, t = run.train.logits_chunk, run.sampling.max_new_tokens
    if chunk and t % chunk:
        raise ConfigError(
            f"config key 'train.logits_chunk' = {chunk} must divide "
            f"sampling.max_new_tokens = {t} (or be 0: no chunking)"
        )
    if run.train.dynamic_sampling and run.env.name:
        raise ConfigError(
            "config key 'train.dynamic_sampling' = True does not combine with an environment "
            f"(env.name = {run.env.name!r}) yet: multi-turn rollouts sample one round per step"
        )
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


def check_batch_layout(run: RunConfig, shards: int, num_processes: int = 1) -> None:
    """Cross-section checks that need the mesh: whole groups and minibatches per shard.

    ``shards``: the mesh's batch shards (``grpo_jax.sharding.batch_shards``).
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
