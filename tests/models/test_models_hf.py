"""Hugging Face import/export: logits parity with transformers, round trips, tokenizers.

Every checkpoint is a tiny random model built with transformers + PyTorch on
CPU in a temp folder (tests/helpers_hf.py); nothing is downloaded.

Tolerances: float32 logits within 1e-4 (max abs) of transformers' float32
eager forward pass. bfloat16 (parameters and compute): within 0.05 (max abs,
for logits of magnitude ~2) of the float32 reference, the same size as
transformers' own bfloat16 error on these models (0.02-0.04).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import FAMILIES, hf_logits, load_hf_model, make_tiny_hf_checkpoint

from grpo_jax.models import (
    apply_chat_template,
    from_pretrained,
    load_tokenizer,
    positions_from_mask,
    save_pretrained,
)
from grpo_jax.models.safetensors_io import SafetensorsCheckpoint

F32_ATOL = 1e-4
BF16_ATOL = 0.05


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: make_tiny_hf_checkpoint(root / f, f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {f: load_hf_model(p) for f, p in checkpoints.items()}


def logits_of(model, tokens, mask=None, positions=None):
    graphdef, params = nnx.split(model)
    f = jax.jit(lambda p, t, m, pos: nnx.merge(graphdef, p)(t, mask_BxT=m, positions_BxT=pos))
    return np.asarray(f(params, jnp.asarray(tokens), mask, positions))


def random_tokens(shape, seed=0, vocab=320):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


# ---------------------------------------------------------------------------
# Parity.


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_match_transformers(family, checkpoints, references):
    model = from_pretrained(checkpoints[family])
    assert model.config.family == family
    tokens = random_tokens((3, 12), seed=1)  # Longer than Gemma's window of 4.
    ours, ref = logits_of(model, tokens), hf_logits(references[family], tokens)
    assert ours.shape == ref.shape == (3, 12, 320)
    np.testing.assert_allclose(ours, ref, atol=F32_ATOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "gpt_oss", "gemma3"])
def test_left_padded_logits_match_transformers(family, checkpoints, references):
    """Same mask and positions given to both: the real tokens' logits agree."""
    tokens = random_tokens((3, 10), seed=2)
    mask = np.ones((3, 10), bool)
    mask[1, :4] = False
    mask[2, :9] = False
    tokens = np.where(mask, tokens, 0)
    positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
    ours = logits_of(from_pretrained(checkpoints[family]), tokens, jnp.asarray(mask))
    ref = hf_logits(references[family], tokens, attention_mask=mask, position_ids=positions)
    np.testing.assert_allclose(ours[mask], ref[mask], atol=F32_ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3"])
def test_bfloat16_logits_within_the_stated_tolerance(family, checkpoints, references):
    tokens = random_tokens((2, 12), seed=3)
    model = from_pretrained(checkpoints[family], dtype=jnp.bfloat16)
    assert model.config.dtype == model.config.param_dtype == "bfloat16"
    assert model.embed[...].dtype == jnp.bfloat16
    ours, ref = logits_of(model, tokens), hf_logits(references[family], tokens)
    assert ours.dtype == np.float32
    error = np.abs(ours - ref).max()
    assert 1e-4 < error < BF16_ATOL  # Really bfloat16, and within the tolerance.


def test_bfloat16_checkpoint_loads_exactly_into_float32(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / "bf16", "qwen3", dtype="bfloat16", tokenizer=False)
    model = from_pretrained(path, dtype=jnp.float32)
    raw = SafetensorsCheckpoint(path)["model.layers.1.mlp.down_proj.weight"]
    assert str(raw.dtype) == "bfloat16"
    np.testing.assert_array_equal(model.layers[1].mlp.down_proj[...], raw.astype(np.float32).T)
    ref = load_hf_model(path)  # transformers upcasts the same way.
    tokens = random_tokens((2, 8))
    np.testing.assert_allclose(logits_of(model, tokens), hf_logits(ref, tokens), atol=F32_ATOL)


def test_sharded_checkpoint_with_index_loads(tmp_path, checkpoints, references):
    path = make_tiny_hf_checkpoint(tmp_path / "sharded", "llama", seed=0, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 2
    tokens = random_tokens((2, 8))
    np.testing.assert_allclose(
        logits_of(from_pretrained(path), tokens),
        hf_logits(references["llama"], tokens),
        atol=F32_ATOL,
    )


# ---------------------------------------------------------------------------
# Round trip: save_pretrained -> transformers.


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trips_through_transformers(
    family, checkpoints, references, tmp_path
):
    model = from_pretrained(checkpoints[family])
    out = save_pretrained(model, tmp_path / "out", tokenizer=load_tokenizer(checkpoints[family]))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    tokens = random_tokens((2, 10), seed=4)
    reloaded_hf = load_hf_model(out)
    np.testing.assert_allclose(
        hf_logits(reloaded_hf, tokens), hf_logits(references[family], tokens), atol=1e-6
    )
    again = from_pretrained(out)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again))):
        np.testing.assert_array_equal(a, b)
    # The exported tensors carry the original names and values.
    original, saved = SafetensorsCheckpoint(checkpoints[family]), SafetensorsCheckpoint(out)
    assert sorted(saved.keys()) == sorted(
        k for k in original.keys() if k != "lm_head.weight" or not model.config.tie_embeddings
    )
    for k in saved.keys():
        np.testing.assert_array_equal(saved[k], original[k])


def test_save_in_bfloat16_and_sharded(checkpoints, references, tmp_path):
    model = from_pretrained(checkpoints["gemma3"])
    out = save_pretrained(model, tmp_path / "out", dtype=jnp.bfloat16, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    saved = SafetensorsCheckpoint(out)
    w = saved["model.layers.0.self_attn.q_proj.weight"]
    assert str(w.dtype) == "bfloat16"
    original = SafetensorsCheckpoint(checkpoints["gemma3"])[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    np.testing.assert_array_equal(w, original.astype(w.dtype))
    tokens = random_tokens((2, 10))
    error = np.abs(
        hf_logits(load_hf_model(out), tokens) - hf_logits(references["gemma3"], tokens)
    ).max()
    assert error < BF16_ATOL


def test_a_random_model_exports_and_transformers_agrees(tmp_path):
    """create_model -> save_pretrained -> transformers: the export path alone."""
    from grpo_jax.models import create_model, tiny_config

    cfg = tiny_config(
        300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96
    )
    model = create_model(cfg, seed=3)
    out = save_pretrained(model, tmp_path / "tiny")
    tokens = random_tokens((2, 9), vocab=300)
    np.testing.assert_allclose(
        logits_of(model, tokens), hf_logits(load_hf_model(out), tokens), atol=F32_ATOL
    )


# ---------------------------------------------------------------------------
# Tokenizers.


def test_tokenizer_and_chat_template_from_the_checkpoint(checkpoints):
    tok = load_tokenizer(checkpoints["qwen2"])
    ids = tok("1+1=2", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "1+1=2"
    text = apply_chat_template(tok, [{"role": "user", "content": "What is 2+2?"}])
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = apply_chat_template(
        tok, [{"role": "user", "content": "hi"}], add_generation_prompt=False
    )
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"


def test_tokenizer_errors(tmp_path, checkpoints):
    from grpo_jax.models import CheckpointError

    with pytest.raises(CheckpointError, match="no such tokenizer directory"):
        load_tokenizer(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty: no tokenizer files"):
        load_tokenizer(tmp_path / "empty")
    tok = load_tokenizer(checkpoints["qwen2"])
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])


def test_gemma3_attention_softcapping_is_ignored_as_transformers_does(tmp_path, caplog):
    """transformers' Gemma3 never applies attn_logit_softcapping; matching its logits means
    ignoring it too (with a warning). A cap of 0.5 would change the logits if applied."""
    path = make_tiny_hf_checkpoint(
        tmp_path / "g", "gemma3", tokenizer=False, attn_logit_softcapping=0.5
    )
    with caplog.at_level("WARNING"):
        model = from_pretrained(path)
    assert "attn_logit_softcapping=0.5 is ignored" in caplog.text
    assert model.config.attn_logit_softcap is None
    tokens = random_tokens((2, 9))
    np.testing.assert_allclose(
        logits_of(model, tokens), hf_logits(load_hf_model(path), tokens), atol=F32_ATOL
    )
