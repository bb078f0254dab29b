"""The built-in table of model sizes: each entry as big as the model it names, and found
from the names a run uses; a config.json read without any weight."""

import json

import pytest

from grpo_jax.aot import architectures
from grpo_jax.core.errors import ConfigError
from grpo_jax.models.hf_config import config_from_hf

# Parameters as the models' cards state them (billions; Gemma 3 27B's text model alone).
PUBLISHED = {
    "qwen2.5-0.5b": 0.494, "qwen2.5-1.5b": 1.54, "qwen3-0.6b": 0.596, "qwen3-8b": 8.19,
    "qwen3-32b": 32.8, "llama3.2-1b": 1.24, "llama3.1-8b": 8.03, "gemma3-270m": 0.268,
    "gemma3-1b": 1.0, "gemma3-27b": 27.0, "qwen3-30b-a3b": 30.5,
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(architectures.CONFIGS))
def test_each_model_has_its_published_size(name):
    cfg = config_from_hf(architectures.CONFIGS[name], source=name)
    assert cfg.num_params / 1e9 == pytest.approx(PUBLISHED[name], rel=0.01)


def test_a_mixture_of_experts_has_its_published_active_size():
    """Qwen3-30B-A3B: 3.3B of its parameters compute each token (8 of 128 experts)."""
    cfg = config_from_hf(architectures.CONFIGS["qwen3-30b-a3b"], source="qwen3-30b-a3b")
    assert (cfg.family, cfg.num_experts, cfg.experts_per_token, cfg.expert_mlp_dim) == (
        "qwen3_moe", 128, 8, 768,
    )  # fmt: skip
    assert len(cfg.sparse_layers) == cfg.num_layers == 48
    assert cfg.active_params / 1e9 == pytest.approx(3.3, rel=0.02)


def test_the_recipes_models_are_all_in_the_table():
    import configs.gsm8k as gsm8k

    assert set(gsm8k.MODELS) | set(gsm8k.GGUF_MODELS) <= set(architectures.CONFIGS)


def _run(path="", **model):
    """A run of the gsm8k recipe with model.path ``path``, or the default run's tiny model."""
    from configs import default, gsm8k
    from grpo_jax.run.config import parse_config

    c = gsm8k.get_config("model=qwen2.5-0.5b") if path else default.get_config()
    c.model.path = path
    for k, v in model.items():
        c.model[k] = v
    return parse_config(c)


@pytest.mark.parametrize(
    "path",
    [
        "<set --config.model.path to your local Qwen/Qwen3-8B directory>",  # the recipes' text
        "/models/Qwen3-8B",
        "/models/qwen3-8b/",
    ],
)
def test_a_model_path_names_its_table_entry_without_files(path):
    cfg, source = architectures.resolve(_run(path, scan_layers=True))  # as the recipe sets
    assert (cfg.hidden_size, cfg.num_layers, cfg.dtype, cfg.param_dtype, cfg.scan_layers) == (
        4096, 36, "bfloat16", "float32", True,
    )  # fmt: skip
    assert "Qwen/Qwen3-8B" in source


def test_a_config_json_is_read_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(architectures.CONFIGS["gemma3-1b"]))
    cfg, source = architectures.resolve(_run("/nowhere"), model_config=str(tmp_path))
    assert cfg.num_layers == 26 and cfg.sliding_window == 512
    # the checkpoint directory itself, when it has a config.json and no weights
    cfg2, _ = architectures.resolve(_run(str(tmp_path)))
    assert cfg2 == cfg


def test_the_builtin_tiny_model_takes_the_runs_overrides():
    cfg, source = architectures.resolve(_run("", num_layers=3))
    assert cfg.num_layers == 3 and source == "the built-in tiny model"


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(model="qwen9"), "--model=qwen9 is not a known model"),
        (dict(model_config="/nowhere/config.json"), "no such file"),
    ],
)
def test_unknown_models_are_one_line(kw, says):
    with pytest.raises(ConfigError) as e:
        architectures.resolve(_run("/models/mine"), **kw)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_path_that_names_nothing_says_what_to_give():
    with pytest.raises(ConfigError, match="give --model=NAME"):
        architectures.resolve(_run("/models/mine"))
