"""The run config's reward keys: rewards, correct_reward, reward_modules, reward_model.

:class:`RewardsSection` is what ``grpo_jax.config.parse_config`` keeps of the first three,
:class:`RewardModelSection` the ``reward_model`` section (a learned reward, scored by
``grpo_jax.reward_models``: this module only checks its settings, with no JAX);
:func:`parse_rewards` and :func:`load_reward_modules` check them against the registry
(``grpo_jax.rewards.registry``), raising ``grpo_jax.errors.ConfigError``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from grpo_jax.checks import check_bool, check_choice, check_range, to_dict
from grpo_jax.errors import ConfigError
from grpo_jax.rewards.registry import get, load_user_module
from grpo_jax.rewards.scoring import RewardSpec


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


NORMALIZE = ("none", "running", "group")


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """A learned reward: a sequence-classification model's score of prompt + completion.

    Attributes:
      path: a Hugging Face ``*ForSequenceClassification`` checkpoint directory
        (Llama, Qwen2/2.5, Qwen3, Gemma 3); "" is none.
      weight: its weight in the total reward, beside the ``rewards`` entries.
      normalize: "none" (the raw score); "running" (standardised by the mean
        and std of every score so far, this batch included); "group" (standardised
        within each prompt's G completions).
      label: which class logit is the reward when the head has several.
      chat: apply the reward model tokenizer's chat template to
        [user: the example's prompt, assistant: the completion]; else the text
        scored is the policy's prompt text followed by the completion.
      tokenizer: the reward model's tokenizer directory ("": ``path``).
      buckets: allowed padded lengths (prompt + completion tokens), increasing;
        a longer text is not scored (NaN, counted as an error).
      batch_size: rows per forward pass (a multiple of the mesh's batch shards).
    """

    path: str = ""
    weight: float = 1.0
    normalize: str = "none"
    label: int = 0
    chat: bool = False
    tokenizer: str = ""
    buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    batch_size: int = 16

    def __post_init__(self):
        if not isinstance(self.path, str) or not isinstance(self.tokenizer, str):
            raise ConfigError(
                f"config keys 'reward_model.path' = {self.path!r} and 'reward_model.tokenizer' "
                f"= {self.tokenizer!r} must be strings"
            )
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"config key 'reward_model.weight' = {w!r} must be a finite number")
        check_choice("reward_model.normalize", self.normalize, NORMALIZE)
        check_range("reward_model.label", self.label, lo=0, integer=True)
        check_bool("reward_model.chat", self.chat)
        check_range("reward_model.batch_size", self.batch_size, lo=1, integer=True)
        buckets = self.buckets
        if isinstance(buckets, int) and not isinstance(buckets, bool):
            buckets = (buckets,)
        if isinstance(buckets, str):  # "128,256" from the command line
            buckets = tuple(b.strip() for b in buckets.split(",") if b.strip())
            buckets = tuple(int(b) if b.isdigit() else b for b in buckets)
        buckets = tuple(buckets)
        for i, b in enumerate(buckets):
            check_range(f"reward_model.buckets[{i}]", b, lo=1, integer=True)
        if not buckets or any(a >= b for a, b in zip(buckets, buckets[1:])):
            raise ConfigError(
                f"config key 'reward_model.buckets' = {self.buckets!r} must be a non-empty, "
                "strictly increasing tuple of lengths"
            )
        object.__setattr__(self, "buckets", tuple(int(b) for b in buckets))


def load_reward_modules(value: Any) -> tuple[str, ...]:
    """Imports the ``reward_modules`` key's modules, whose import registers rewards.

    A comma-separated string or a list of dotted module names
    (``my_pkg.rewards``) or ``.py`` paths (``rewards.load_user_module``).
    """
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
        load_user_module(item)
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
    out = tuple(RewardSpec(n, w) for n, w in specs)
    for s in out:
        get(s.name)  # An unknown name fails here, listing the available ones.
    return out
