"""Validated, frozen configuration for the GRPO objective.

The ml_collections ``ConfigDict`` of a run stops at ``train.py``; library code
takes these small frozen dataclasses, whose fields carry the paper's symbols.
Every check raises :class:`ConfigError` naming the offending key, its value and
what is allowed, so that a bad sweep value fails at start-up, not mid-run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any


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
            f"unknown config key(s) {[f'{section}.{k}' for k in unknown]}; "
            f"known keys of '{section}' are {sorted(known)}"
        )


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
