"""Verifiable reward functions, their registry, and robust batch scoring.

A reward function is ``fn(prompts, completions, **fields) -> list[float]``
(one float per completion, NaN where it cannot score); ``fields`` holds the
examples' dataset columns as lists (``answer``, ...) and ``completion_lengths``.

    from grpo_jax import rewards
    specs = [rewards.RewardSpec("gsm8k", 1.0), rewards.RewardSpec("format", 0.1)]
    result = rewards.score(specs, prompts, completions, {"answer": answers})
    result.total            # float32[N], weighted sum, NaN -> advantage 0
    result.per_reward       # each reward on its own, for logging
    result.errors           # completions whose reward raised, timed out or was infinite
    result.clipped          # completions whose reward was clipped to +-REWARD_LIMIT

Built-in names: ``gsm8k``, ``math_verify``, ``format``, ``overlong``,
``exact_match``, ``countdown``, ``code_tests`` (runs code in the sandbox of
``grpo_jax.tools``); options as ``"overlong(max_len=256, buffer=64)"``.
They run in this process; rewards registered by user code run in worker
processes that are killed at their deadline (:mod:`grpo_jax.rewards.isolation`;
:func:`shutdown` stops the workers, and runs at interpreter exit).
"""

from grpo_jax.rewards import builtin as builtin
from grpo_jax.rewards import code as code
from grpo_jax.rewards import isolation as isolation
from grpo_jax.rewards import symbolic as symbolic
from grpo_jax.rewards.builtin import (
    make_exact_match,
    make_format_reward,
    make_overlong_reward,
    overlong_penalty,
)
from grpo_jax.rewards.extract import extract_answer, normalize_number
from grpo_jax.rewards.isolation import shutdown
from grpo_jax.rewards.registry import available, get, load_user_module, register
from grpo_jax.rewards.scoring import (
    REWARD_LIMIT,
    RewardResult,
    RewardSpec,
    fields_from_examples,
    run_reward,
    score,
)
from grpo_jax.rewards.symbolic import make_math_verify_reward

__all__ = [
    "REWARD_LIMIT",
    "RewardResult",
    "RewardSpec",
    "available",
    "extract_answer",
    "fields_from_examples",
    "get",
    "load_user_module",
    "make_exact_match",
    "make_format_reward",
    "make_math_verify_reward",
    "make_overlong_reward",
    "normalize_number",
    "overlong_penalty",
    "register",
    "run_reward",
    "score",
    "shutdown",
]
