"""Frozen, validated sections of a training run's config.

The run's ``ml_collections.ConfigDict`` (``configs/*.py``) stops at
``grpo_jax.train.train``; there each section becomes one of these frozen
dataclasses. An unknown key fails naming ``section.key`` and the known keys;
a bad value fails naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from grpo_jax.config import ConfigError, check_choice, check_known_keys, check_range


def _to_dict(section: Any) -> dict:
    if hasattr(section, "to_dict"):
        return section.to_dict()
    return dict(section)


def from_mapping(cls, section: str, mapping: Mapping[str, Any] | None):
    """Builds ``cls`` from a config section, rejecting unknown keys by name."""
    cfg = _to_dict(mapping or {})
    check_known_keys(section, cfg, {f.name for f in dataclasses.fields(cls)})
    return cls(**cfg)


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"config key '{key}' = {value!r} must be True or False")


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

    def __post_init__(self):
        check_range("train.steps", self.steps, lo=0, integer=True)
        check_range("train.batch_size", self.batch_size, lo=1, integer=True)
        check_range("train.minibatch_size", self.minibatch_size, lo=0, integer=True)
        check_range("train.log_every", self.log_every, lo=1, integer=True)
        check_range("train.samples_every", self.samples_every, lo=0, integer=True)
        check_range("train.num_samples_logged", self.num_samples_logged, lo=0, integer=True)
        check_range("train.max_nonfinite_in_row", self.max_nonfinite_in_row, lo=1, integer=True)
        check_range("train.no_signal_steps", self.no_signal_steps, lo=0, integer=True)
        _check_bool("train.track_update", self.track_update)
        check_range("train.update_kl_warn", self.update_kl_warn, lo=0.0)
        check_range("train.reward_timeout_s", self.reward_timeout_s, lo=0.0, lo_open=True)
        check_range("train.logits_chunk", self.logits_chunk, lo=0, integer=True)


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
        _check_bool("eval.at_start", self.at_start)
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
    """

    every: int = 50
    keep: int = 2
    async_save: bool = True

    def __post_init__(self):
        check_range("checkpoint.every", self.every, lo=0, integer=True)
        check_range("checkpoint.keep", self.keep, lo=1, integer=True)
        _check_bool("checkpoint.async_save", self.async_save)


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
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    num_devices: int = 0
    layout: str = "fsdp"
    memory_budget_gb: float = 0.0

    def __post_init__(self):
        from grpo_jax.sharding import LAYOUTS

        for axis in ("data", "fsdp", "tensor"):
            v = getattr(self, axis)
            check_range(f"mesh.{axis}", v, lo=-1, integer=True)
            if v == 0:
                raise ConfigError(f"config key 'mesh.{axis}' = 0 must be positive or -1")
        check_range("mesh.num_devices", self.num_devices, lo=0, integer=True)
        check_range("mesh.memory_budget_gb", self.memory_budget_gb, lo=0.0)
        check_choice("mesh.layout", self.layout, LAYOUTS)
