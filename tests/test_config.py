"""GRPOConfig validation: every bad value names its key and what is allowed."""

import dataclasses

import pytest

from grpo_jax.config import ConfigError, GRPOConfig


def test_defaults_and_epsilon_shorthand():
    c = GRPOConfig.from_mapping({"G": 4, "epsilon": 0.1, "epsilon_high": 0.28})
    assert (c.G, c.epsilon_low, c.epsilon_high) == (4, 0.1, 0.28)
    assert GRPOConfig().kl_estimator == "k3"


@pytest.mark.parametrize(
    "override, message",
    [
        ({"G": 1}, r"'grpo.G' = 1 must be >= 2"),
        ({"G": 2.5}, r"'grpo.G' = 2.5 must be an integer"),
        ({"epsilon": -0.1}, r"'grpo.epsilon' = -0.1 must be >= 0"),
        ({"epsilon_high": -1.0}, r"'grpo.epsilon_high' = -1.0 must be >= 0"),
        ({"beta": -0.01}, r"'grpo.beta' = -0.01 must be >= 0"),
        ({"mu": 0}, r"'grpo.mu' = 0 must be >= 1"),
        ({"kl_estimator": "k4"}, r"'grpo.kl_estimator' = 'k4' is not one of \['k1', 'k2'"),
        ({"reduction": "sum"}, r"'grpo.reduction' = 'sum' is not one of \['dr_grpo', 'grpo'"),
        ({"advantage_estimator": "ppo"}, r"'grpo.advantage_estimator' = 'ppo' is not one of"),
        ({"temperature": 0.0}, r"'grpo.temperature' = 0.0 must be > 0"),
        ({"betta": 0.1}, r"unknown config key\(s\) \['grpo.betta'\]; known keys"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig.from_mapping({"G": 4, **override})


def test_frozen():
    c = GRPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.G = 3  # type: ignore[misc]
