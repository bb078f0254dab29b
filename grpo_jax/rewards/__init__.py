"""Verifiable reward functions, their registry, and robust batch scoring.

    from grpo_jax import rewards
    specs = [rewards.RewardSpec("gsm8k", 1.0), rewards.RewardSpec("format", 0.1)]
    result = rewards.score(specs, prompts, completions, {"answer": answers})

Built-in names: ``gsm8k``, ``math_verify``, ``format``, ``overlong``, ``exact_match``,
``countdown``, ``code_tests``. Rewards registered by user code run in worker processes killed
at their deadline (:func:`shutdown` stops them, and runs at interpreter exit). docs/rewards.md.
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
