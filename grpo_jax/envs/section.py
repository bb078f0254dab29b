"""The ``env`` section of a run config: :class:`EnvSection`, checked against the registry."""

from __future__ import annotations

import dataclasses

from grpo_jax.core.checks import check_range
from grpo_jax.core.errors import ConfigError
from grpo_jax.envs.base import get, load_user_module, safe_make


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Multi-turn rollouts with an environment (``grpo_jax.rollout.episodes``, docs/multiturn.md).

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
            for item in (m.strip() for m in self.modules.split(",")):
                if item:
                    try:
                        load_user_module(item)
                    except (ImportError, OSError) as e:
                        raise ConfigError(f"config key 'env.modules': {item!r}: {e}") from None
            try:
                get(self.name)
            except (KeyError, ValueError) as e:
                raise ConfigError(f"config key 'env.name' = {self.name!r}: {e}") from None
            # One instance, its constructor's failures (sys.exit included) contained.
            _, error = safe_make(self.name, self.timeout_s)
            if error is not None:
                raise ConfigError(f"config key 'env.name' = {self.name!r}: {error}")
