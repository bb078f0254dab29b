"""GRPOConfig validation: every bad value names its key and what is allowed."""

import dataclasses

import pytest

from grpo_jax.run.config import ConfigError, GRPOConfig


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
        ({"gae_gamma": 1.5}, r"'grpo.gae_gamma' = 1.5 must be <= 1"),
        ({"gae_lambda": -0.1}, r"'grpo.gae_lambda' = -0.1 must be >= 0"),
        ({"whiten_advantages": "yes"}, r"'grpo.whiten_advantages' = 'yes' must be True or False"),
        ({"value_loss_coef": 0.0}, r"'grpo.value_loss_coef' = 0.0 must be > 0"),
        ({"value_clip": -1.0}, r"'grpo.value_clip' = -1.0 must be > 0"),
        ({"critic_warmup_steps": 1.5}, r"'grpo.critic_warmup_steps' = 1.5 must be an integer"),
        (
            {"advantage_estimator": "gae", "reduction": "gspo"},
            r"'gae' gives one advantage per token, which grpo.reduction='gspo'",
        ),
        (
            {"advantage_estimator": "gae", "policy_loss": "gmpo"},
            r"'gae' gives one advantage per token.*grpo.policy_loss='gmpo'",
        ),
        ({"betta": 0.1}, r"unknown config key grpo.betta; the keys of grpo are G, advantage_eps, "),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig.from_mapping({"G": 4, **override})


def test_frozen():
    c = GRPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.G = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------
# The env section (multi-turn rollouts) as parse_config checks it.

_RUN = {"data": {"source": "synthetic"}, "rewards": "exact_match:1.0"}


def _parse(env, **sections):
    from grpo_jax.run.config import parse_config

    return parse_config({**_RUN, "sampling": {"max_new_tokens": 8}, "env": env, **sections})


@pytest.mark.parametrize(
    "env, sections, message",
    [
        (
            {"name": "guess_number"},
            {"train": {"dynamic_sampling": True}},
            r"'train.dynamic_sampling' = True does not combine with an environment",
        ),
        (
            {"name": "guess_number"},
            {"train": {"max_staleness": 1}, "mesh": {"sampler_devices": 1}},
            r"'mesh.sampler_devices' = 1 does not combine with env.name: .*learner's mesh",
        ),
        (
            {"name": "nope"},
            {},
            r"'env.name' = 'nope': .*unknown environment 'nope'; registered: \[.*'guess_number'",
        ),
        (
            {"name": "guess_number(colour=1)"},
            {},
            r"'env.name' = 'guess_number\(colour=1\)': .*bad options",
        ),
        ({"name": "guess_number(1)"}, {}, r"'env.name' = 'guess_number\(1\)': .*keyword=literal"),
        (
            {"name": "guess_number", "modules": "/no/such/dir/env.py"},
            {},
            r"'env.modules': '/no/such/dir/env.py': .*no such file",
        ),
        (
            {"name": "guess_number", "modules": "no_such_env_module"},
            {},
            r"'env.modules': 'no_such_env_module': No module named",
        ),
        ({"name": 7}, {}, r"'env.name' = 7 must be a string"),
        (
            {"name": "guess_number", "max_turn_tokens": 100},
            {},
            r"'env.max_turn_tokens' = 100 exceeds 'env.max_tokens' = 64",
        ),
    ],
)
def test_env_section_errors_name_the_key(env, sections, message):
    with pytest.raises(ConfigError, match=message):
        _parse(env, **sections)


def test_an_environment_whose_constructor_fails_is_a_config_error():
    import sys

    from grpo_jax import envs

    @envs.register("exits_when_made_test")
    class _Exits:
        def __init__(self):
            sys.exit(0)

    with pytest.raises(ConfigError, match=r"'env.name' = 'exits_when_made_test': make: SystemExit"):
        _parse({"name": "exits_when_made_test"})


def test_env_module_by_path_registers_the_environment(tmp_path):
    path = tmp_path / "config_env.py"
    path.write_text(
        "from grpo_jax import envs\n"
        "@envs.register('config_path_env_test')\n"
        "class E:\n"
        "    def reset(self, example):\n"
        "        return None\n"
        "    def step(self, text):\n"
        "        return None, 0.0, True, {}\n"
    )
    run = _parse({"name": "config_path_env_test", "modules": f"  {path} ,"})
    assert run.env.name == "config_path_env_test"


def test_gae_refuses_packing_in_one_line():
    from grpo_jax.run.config import parse_config

    raw = {**_RUN, "sampling": {"max_new_tokens": 8}, "grpo": {"advantage_estimator": "gae"}}
    raw["train"] = {"packing": "on"}
    with pytest.raises(ConfigError, match=r"'train.packing' = 'on' does not combine with "):
        parse_config(raw)


def test_gae_refuses_a_teacher_in_one_line():
    from grpo_jax.run.config import parse_config

    raw = {**_RUN, "sampling": {"max_new_tokens": 8}, "grpo": {"advantage_estimator": "gae"}}
    raw["teacher"] = {"path": "reference"}
    with pytest.raises(
        ConfigError, match=r"'teacher.path' = 'reference' does not combine with "
    ) as e:
        parse_config(raw)
    assert "\n" not in str(e.value)
