"""config.json layouts from many transformers versions, and every checkpoint error message."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_logits, load_hf_model, make_tiny_hf_checkpoint
from safetensors.numpy import load_file, save_file

from grpo_jax.models import (
    CheckpointError,
    RopeScaling,
    create_model,
    from_pretrained,
    save_pretrained,
    tiny_config,
)
from grpo_jax.models.hf_config import config_from_hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: make_tiny_hf_checkpoint(root / f, f, tokenizer=False) for f in ("llama", "gemma3")}


def without(name):
    def edit(tensors):
        del tensors[name]

    return edit


def copy(src, dst, config_edit=None, tensor_edit=None):
    """A copy of checkpoint ``src`` at ``dst`` with its config and/or tensors edited."""
    shutil.copytree(src, dst)
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg = config_edit(cfg) or cfg
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensor_edit is not None:
        tensors = load_file(dst / "model.safetensors")
        tensors = tensor_edit(tensors) or tensors
        save_file(tensors, dst / "model.safetensors")
    return dst


def logits(model, tokens):
    graphdef, params = nnx.split(model)
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))


TOKENS = np.random.default_rng(0).integers(0, 320, (2, 9)).astype(np.int32)

# ---------------------------------------------------------------------------
# config.json layouts.

LLAMA_31_V4 = {  # As Llama 3.1 shipped (transformers 4.43).
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "torch_dtype": "bfloat16",
    "eos_token_id": [128001, 128008, 128009],
    "bos_token_id": 128000,
    "tie_word_embeddings": False,
}


def test_llama_4x_and_5x_layouts_read_the_same():
    v5 = {
        k: v
        for k, v in LLAMA_31_V4.items()
        if k not in ("rope_theta", "rope_scaling", "torch_dtype")
    }
    v5["rope_parameters"] = {**LLAMA_31_V4["rope_scaling"], "rope_theta": 500000.0}
    v5["dtype"] = "bfloat16"
    old_type_key = dict(LLAMA_31_V4, rope_scaling={**LLAMA_31_V4["rope_scaling"], "type": "llama3"})
    del old_type_key["rope_scaling"]["rope_type"]
    a, b, c = (config_from_hf(x) for x in (LLAMA_31_V4, v5, old_type_key))
    assert a == b == c
    assert a.rope_theta == 500000.0
    assert a.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert a.head_dim == 16 and a.eos_token_ids == (128001, 128008, 128009)
    assert not a.tie_embeddings and not a.qkv_bias


GEMMA3_4B_IT = {  # The multimodal config as published: a sparse text_config.
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eos_token_id": [1, 106],
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
    "torch_dtype": "bfloat16",
}


def test_gemma3_nested_sparse_config_takes_transformers_defaults():
    cfg = config_from_hf(GEMMA3_4B_IT)
    assert cfg.family == "gemma3"
    assert (cfg.hidden_size, cfg.mlp_dim, cfg.num_layers) == (2560, 10240, 34)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262208)
    assert cfg.query_pre_attn_scalar == 256 and cfg.sliding_window == 1024
    assert cfg.rope_theta == 1e6 and cfg.local_rope_theta == 1e4
    assert cfg.rope_scaling == RopeScaling("linear", 8.0)
    assert cfg.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert sum(t == "full_attention" for t in cfg.layer_types) == 5
    assert cfg.tie_embeddings and cfg.eos_token_ids == (1, 106)
    assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
    assert cfg.layer_rope_scaling(0) is None and cfg.layer_rope_scaling(5) == RopeScaling(
        "linear", 8.0
    )


def test_gemma3_flat_4x_layout_equals_the_5x_layout():
    common = dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, head_dim=16, sliding_window=4
    )
    v4 = dict(
        common,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"type": "linear", "factor": 2.0},
        sliding_window_pattern=2,
    )
    v5 = dict(
        common,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    assert config_from_hf(v4) == config_from_hf(v5)


def test_qwen_sliding_window_and_default_head_dim():
    hf = dict(
        model_type="qwen2",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    cfg = config_from_hf(hf)
    assert cfg.head_dim == 16 and cfg.qkv_bias
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert config_from_hf(dict(hf, use_sliding_window=False)).layer_types is None


def test_llama_4x_config_file_gives_the_same_logits(checkpoints, tmp_path):
    def to_v4(cfg):
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        cfg["torch_dtype"] = cfg.pop("dtype")

    path = copy(checkpoints["llama"], tmp_path / "v4", config_edit=to_v4)
    assert "rope_scaling" in json.loads((path / "config.json").read_text())
    np.testing.assert_allclose(
        logits(from_pretrained(path), TOKENS),
        hf_logits(load_hf_model(checkpoints["llama"]), TOKENS),
        atol=1e-4,
    )


@pytest.mark.slow  # over 1.25 s on a 2-core CPU
@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_checkpoint_loads_its_text_model(prefix, checkpoints, tmp_path):
    def nest(cfg):
        text = {k: v for k, v in cfg.items() if k not in ("architectures", "dtype")}
        return {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": text,
            "vision_config": {"model_type": "siglip_vision_model"},
            "dtype": cfg["dtype"],
        }

    def rename(tensors):
        out = {prefix + k.removeprefix("model."): v for k, v in tensors.items()}
        out["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros(
            (2, 3), np.float32
        )
        return out

    path = copy(checkpoints["gemma3"], tmp_path / "mm", config_edit=nest, tensor_edit=rename)
    np.testing.assert_allclose(
        logits(from_pretrained(path), TOKENS),
        logits(from_pretrained(checkpoints["gemma3"]), TOKENS),
        atol=1e-6,
    )


# ---------------------------------------------------------------------------
# Errors, each with its message.


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="absent: no such checkpoint directory"):
        from_pretrained(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty/config.json: not found"):
        from_pretrained(tmp_path / "empty")


def test_invalid_json_names_the_line(checkpoints, tmp_path):
    path = copy(checkpoints["llama"], tmp_path / "bad")
    (path / "config.json").write_text('{\n  "model_type": "llama",\n  oops\n}')
    with pytest.raises(CheckpointError, match=r"config.json: invalid JSON at line 3"):
        from_pretrained(path)


def test_unsupported_model_type(checkpoints, tmp_path):
    path = copy(
        checkpoints["llama"], tmp_path / "gpt2", config_edit=lambda c: c.update(model_type="gpt2")
    )
    with pytest.raises(
        CheckpointError, match=r"unsupported model_type 'gpt2'; supported model types are \["
    ):
        from_pretrained(path)


def test_unsupported_rope_type():
    hf = dict(LLAMA_31_V4, rope_scaling={"type": "longrope", "factor": 4.0})
    with pytest.raises(
        CheckpointError, match="unsupported rope_type 'longrope' in rope parameters; supported"
    ):
        config_from_hf(hf)
    hf = dict(LLAMA_31_V4, rope_scaling={"type": "yarn", "factor": 4.0})  # YaRN (GPT-OSS)
    with pytest.raises(CheckpointError, match="of rope_type 'yarn' lacks 'original_max_pos"):
        config_from_hf(hf)
    hf = dict(LLAMA_31_V4, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(CheckpointError, match="of rope_type 'llama3' lacks 'low_freq_factor'"):
        config_from_hf(hf)


def test_bad_config_values_name_the_key():
    with pytest.raises(
        CheckpointError, match=r"config.json: config key 'model.num_kv_heads' = 3 must divide"
    ):
        config_from_hf(dict(LLAMA_31_V4, num_key_value_heads=3))
    with pytest.raises(CheckpointError, match=r"unsupported activation 'relu'"):
        config_from_hf(dict(LLAMA_31_V4, hidden_act="relu"))


def test_missing_tensor(checkpoints, tmp_path):
    drop = without("model.layers.1.mlp.up_proj.weight")
    path = copy(checkpoints["llama"], tmp_path / "missing", tensor_edit=drop)
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' "
        r"\(for parameter layers.1.mlp.up_proj\)",
    ):
        from_pretrained(path)
    no_head = copy(
        checkpoints["llama"],
        tmp_path / "no_head",
        tensor_edit=without("lm_head.weight"),
    )
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight'"):
        from_pretrained(no_head)


def test_shape_mismatch(checkpoints, tmp_path):
    path = copy(
        checkpoints["llama"],
        tmp_path / "shape",
        config_edit=lambda c: c.update(intermediate_size=96),
    )
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' "
        r"has shape \(128, 64\), "
        r"but config.json implies \(96, 64\)",
    ):
        from_pretrained(path)


def test_unused_tensors_mean_config_and_weights_disagree(checkpoints, tmp_path):
    path = copy(
        checkpoints["llama"],
        tmp_path / "fewer",
        config_edit=lambda c: c.update(num_hidden_layers=1),
    )
    with pytest.raises(
        CheckpointError,
        match=r"tensor\(s\) not used by the model .*'model.layers.1.input_layernorm",
    ):
        from_pretrained(path)


def test_missing_or_broken_weight_files(checkpoints, tmp_path):
    path = copy(checkpoints["llama"], tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match="no model.safetensors, model.safetensors.index.json or"
    ):
        from_pretrained(path)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-1.safetensors"}})
    )
    with pytest.raises(
        CheckpointError,
        match="model-1.safetensors: listed in model.safetensors.index.json but missing",
    ):
        from_pretrained(path)
    (path / "model.safetensors.index.json").unlink()
    (path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CheckpointError, match="model.safetensors: not a safetensors file"):
        from_pretrained(path)


def test_unknown_layout(checkpoints):
    with pytest.raises(ValueError, match="unknown sharding layout 'tp'"):
        from_pretrained(checkpoints["llama"], layout="tp")


def test_save_refuses_a_config_its_family_cannot_express(tmp_path):
    model = create_model(
        tiny_config(64, hidden_size=32, num_layers=1, head_dim=8, mlp_dim=32, qkv_bias=False)
    )
    with pytest.raises(
        CheckpointError, match=r"family='qwen2' and \{'qkv_bias': False\} cannot be written"
    ):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # Nothing half-written.


@pytest.mark.slow
def test_save_replaces_an_earlier_checkpoint(tmp_path):
    cfg = tiny_config(64, hidden_size=32, num_layers=1, head_dim=8, mlp_dim=32)
    save_pretrained(create_model(cfg, seed=0), tmp_path / "out", max_shard_size=2000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    model = create_model(cfg, seed=1)
    save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert not list((tmp_path / "out").glob("model-*"))
    again = from_pretrained(tmp_path / "out")
    np.testing.assert_array_equal(again.embed[...], model.embed[...])
    assert again.embed[...].dtype == jnp.float32


def test_save_refuses_soft_capping_transformers_would_drop(tmp_path):
    cfg = tiny_config(64, family="gemma3", hidden_size=32, num_layers=2, head_dim=8, mlp_dim=32)
    with pytest.raises(CheckpointError, match=r"\{'attn_logit_softcap': 50.0\} cannot be written"):
        save_pretrained(create_model(cfg.replace(attn_logit_softcap=50.0)), tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"\{'final_logit_softcap': 30.0\} cannot be written"):
        save_pretrained(create_model(tiny_config(64, final_logit_softcap=30.0)), tmp_path / "b")


def test_generation_config_adds_end_of_turn_ids(checkpoints, tmp_path):
    path = copy(checkpoints["llama"], tmp_path / "instruct")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert from_pretrained(path).config.eos_token_ids == (2, 7, 9)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert from_pretrained(path).config.eos_token_ids == (2, 5)
    (path / "generation_config.json").unlink()
    assert from_pretrained(path).config.eos_token_ids == (2,)
    (path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="generation_config.json: not a JSON object"):
        from_pretrained(path)


def test_stray_safetensors_beside_model_safetensors_are_ignored(checkpoints, tmp_path):
    path = copy(checkpoints["llama"], tmp_path / "adapter")
    save_file(
        {"model.layers.0.extra.weight": np.zeros(3, np.float32)}, path / "adapter.safetensors"
    )
    from_pretrained(path)  # No "unused tensor" error: only model.safetensors is read.
