"""Environments for multi-turn rollouts: the interface, a registry by name, examples.

    from grpo_jax import envs
    env = envs.make("guess_number(high=9, max_turns=4)")
    first = env.reset({"answer": "7"})            # 'guess 0-9:'
    obs, reward, done, info = env.step("5")       # ('H', 0.0, False, {...})

Registered: ``guess_number`` and ``tool_use``; register your own with
``@envs.register("name")`` in a module named in ``env.modules`` (docs/multiturn.md).
"""

from grpo_jax.envs import guess_number as guess_number
from grpo_jax.envs import tool_use as tool_use
from grpo_jax.envs.base import (
    Environment,
    EnvTimeout,
    StepResult,
    available,
    deadline,
    get,
    load_user_module,
    make,
    parse_spec,
    register,
    safe_make,
    safe_reset,
    safe_step,
)

__all__ = [
    "EnvTimeout",
    "Environment",
    "StepResult",
    "available",
    "deadline",
    "get",
    "load_user_module",
    "make",
    "parse_spec",
    "register",
    "safe_make",
    "safe_reset",
    "safe_step",
]
