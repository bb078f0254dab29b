"""The run config's reward keys: rewards, correct_reward, reward_modules, reward_model.

:class:`RewardsSection` is what ``grpo_jax.run.config.parse_config`` keeps of the first three,
:class:`RewardModelSection` the ``reward_model`` section (a learned reward, scored by
``grpo_jax.reward_models``: this module only checks its settings, with no JAX);
:func:`parse_rewards` and :func:`load_reward_modules` check them against the registry
(``grpo_jax.rewards.registry``), raising ``grpo_jax.core.errors.ConfigError``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from grpo_jax.core.checks import check_bool, check_choice, check_range, to_dict
from grpo_jax.core.errors import ConfigError
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
        object.__setattr__(self, "buckets", _buckets("reward_model.buckets", self.buckets))


DEFAULT_RUBRIC = (
    "Rate how well the answer solves the problem, from 1 (wrong) to 5 (fully correct).\n\n"
    "Problem: {question}\n\nAnswer: {completion}\n\nRating (1-5): "
)


@dataclasses.dataclass(frozen=True)
class JudgeSection:
    """An LLM judge: the expected score of a frozen causal LM over a rubric prompt's score tokens.

    Attributes:
      path: a Hugging Face causal-LM checkpoint directory, "reference" (the run's
        reference policy, no second copy of its weights; needs grpo.beta > 0 and no
        LoRA), or "" (none).
      weight: its weight in the total reward.
      rubric: the judge's prompt, a template with ``{question}`` (the example's
        prompt) and ``{completion}``.
      score_tokens: the texts whose next-token probabilities are the judge's
        verdict; each must be one token of the judge's tokenizer, each listed once.
      values: each score token's value (default: the tokens read as numbers);
        the reward is sum_k p_k values_k, p the softmax over the score tokens' logits.
      chat: put the rubric in a user turn of the judge tokenizer's chat template.
      tokenizer: the judge's tokenizer directory ("": ``path``'s, or the policy's
        for "reference").
      buckets, batch_size: the rubric prompts' padded lengths and rows per pass,
        as for ``reward_model``.
    """

    path: str = ""
    weight: float = 1.0
    rubric: str = DEFAULT_RUBRIC
    score_tokens: tuple[str, ...] = ("1", "2", "3", "4", "5")
    values: tuple[float, ...] = ()
    chat: bool = False
    tokenizer: str = ""
    buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    batch_size: int = 16

    def __post_init__(self):
        for key in ("path", "tokenizer", "rubric"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(
                    f"config key 'judge.{key}' = {getattr(self, key)!r} must be a string"
                )
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"config key 'judge.weight' = {w!r} must be a finite number")
        try:
            self.rubric.format(question="", completion="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"config key 'judge.rubric' = {self.rubric!r:.80} is not a template of "
                f"{{question}} and {{completion}} ({type(e).__name__}: {e}); write a literal "
                "brace as {{ or }}"
            ) from None
        if "{completion}" not in self.rubric:
            raise ConfigError("config key 'judge.rubric' must contain {completion}")
        tokens = tuple(self.score_tokens)
        if not tokens or not all(isinstance(t, str) and t for t in tokens):
            raise ConfigError(
                f"config key 'judge.score_tokens' = {self.score_tokens!r} must be non-empty strings"
            )
        twice = next((t for i, t in enumerate(tokens) if t in tokens[:i]), None)
        if twice is not None:
            raise ConfigError(
                f"config key 'judge.score_tokens' = {tokens!r} lists {twice!r} twice; list each "
                "score token once (a duplicate would count its probability twice)"
            )
        values = tuple(self.values)
        if not values:
            try:
                values = tuple(float(t) for t in tokens)
            except ValueError:
                raise ConfigError(
                    f"config key 'judge.values' is needed: the score tokens {tokens} are not "
                    "all numbers (e.g. Yes/No: values = (1.0, 0.0))"
                ) from None
        if len(values) != len(tokens) or not all(math.isfinite(float(v)) for v in values):
            raise ConfigError(
                f"config key 'judge.values' = {self.values!r} must give one finite number per "
                f"score token {tokens}"
            )
        object.__setattr__(self, "score_tokens", tokens)
        object.__setattr__(self, "values", tuple(float(v) for v in values))
        check_bool("judge.chat", self.chat)
        check_range("judge.batch_size", self.batch_size, lo=1, integer=True)
        object.__setattr__(self, "buckets", _buckets("judge.buckets", self.buckets))


def _buckets(key: str, value) -> tuple[int, ...]:
    """A learned reward's prompt-length buckets: one length, a tuple, or "128,256" from the
    command line; a non-empty, strictly increasing tuple of positive integers."""
    buckets = value
    if isinstance(buckets, int) and not isinstance(buckets, bool):
        buckets = (buckets,)
    if isinstance(buckets, str):
        buckets = tuple(b.strip() for b in buckets.split(",") if b.strip())
        buckets = tuple(int(b) if b.isdigit() else b for b in buckets)
    buckets = tuple(buckets)
    for i, b in enumerate(buckets):
        check_range(f"{key}[{i}]", b, lo=1, integer=True)
    if not buckets or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ConfigError(
            f"config key '{key}' = {value!r} must be a non-empty, strictly increasing tuple "
            "of lengths"
        )
    return tuple(int(b) for b in buckets)


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
