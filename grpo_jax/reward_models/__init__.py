"""Learned rewards: sequence-classification reward models and LLM judges.

    model = reward_models.load_reward_model(path, mesh=mesh)   # *ForSequenceClassification
    learned = reward_models.LearnedReward.load(run.reward_model, mesh)
    values_N = learned(prompts, completions, questions, group_size=G)
    judge = reward_models.Judge.load(run.judge, mesh)            # an LLM judge's expected score

Above ``grpo_jax.rewards`` and ``grpo_jax.models`` in the layers: a reward model needs JAX
and the model code, which the verifiable rewards must not import (docs/learned_rewards.md).
"""

from grpo_jax.reward_models.judge import JUDGE, REFERENCE, Judge, expected_score
from grpo_jax.reward_models.model import (
    RewardModel,
    checkpoint_bytes,
    learned_bytes,
    load_reward_model,
    reward_model_bytes,
    reward_table,
)
from grpo_jax.reward_models.scorer import (
    LEARNED,
    LearnedReward,
    RunningMoments,
    add_learned,
    group_standardize,
    learned_metrics,
    run_learned,
)

__all__ = [
    "JUDGE",
    "REFERENCE",
    "Judge",
    "expected_score",
    "LEARNED",
    "add_learned",
    "learned_metrics",
    "run_learned",
    "LearnedReward",
    "RewardModel",
    "RunningMoments",
    "group_standardize",
    "checkpoint_bytes",
    "learned_bytes",
    "load_reward_model",
    "reward_model_bytes",
    "reward_table",
]
