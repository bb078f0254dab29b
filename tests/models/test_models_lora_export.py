"""LoRA export: the PEFT adapters load in ``peft`` on the transformers base and give our
logits; merged weights saved with save_pretrained give them too (transformers' forward)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.models import from_pretrained, lora, save_pretrained
from grpo_jax.run.config import LoRAConfig

pytestmark = pytest.mark.slow  # tiny transformers models, torch and peft


def _adapted(path, cfg: LoRAConfig, scan: bool):
    """Our model of the checkpoint at ``path`` with adapters whose B are random."""
    gd, params = nnx.split(from_pretrained(path, scan_layers=scan))
    gd2, p2, base_gd = lora.attach_params(gd, params, cfg, jax.random.key(7))
    flat = dict(nnx.to_flat_state(lora.trainable(p2)))
    for i, (k, v) in enumerate(sorted(flat.items(), key=lambda kv: str(kv[0]))):
        if str(k[-1]).endswith("_lora_b"):
            flat[k] = v.replace(0.2 * jax.random.normal(jax.random.key(i), v.shape))
    return gd2, lora.with_trainable(p2, nnx.from_flat_state(flat)), base_gd


@pytest.mark.parametrize(
    "family, targets, scan",
    [("qwen2", "q,k,v,o,gate,up,down", False), ("llama", "(q|v)_proj,down", True)],
)
def test_peft_export_loads_in_peft_and_gives_the_same_logits(family, targets, scan, tmp_path):
    import peft
    from helpers_hf import hf_logits, load_hf_model, make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(tmp_path / "base", family, seed=3, tokenizer=False)
    cfg = LoRAConfig(rank=4, alpha=12.0, targets=targets)
    gd, params, base_gd = _adapted(path, cfg, scan)
    tokens = np.random.default_rng(0).integers(0, 320, (2, 9)).astype(np.int32)
    ours = np.asarray(nnx.merge(gd, params)(jnp.asarray(tokens)))
    model_cfg = nnx.merge(gd, params).config

    out = lora.save_peft(params, model_cfg, cfg, tmp_path / "adapter", base_model=str(path))
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 12.0
    assert written["target_modules"] == sorted(cfg.projections)
    peft_model = peft.PeftModel.from_pretrained(load_hf_model(path), str(out)).eval()
    assert peft_model.peft_config["default"].r == 4
    theirs = hf_logits(peft_model, tokens)
    base_logits = hf_logits(load_hf_model(path), tokens)
    assert np.abs(theirs - base_logits).max() > 1e-2  # the adapters were applied
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    # Merged: W + s A B saved as a plain checkpoint; transformers reproduces the policy.
    merged = nnx.merge(base_gd, lora.merged(params, cfg.scale))
    save_pretrained(merged, tmp_path / "merged")
    np.testing.assert_allclose(
        hf_logits(load_hf_model(tmp_path / "merged"), tokens), ours, atol=1e-4, rtol=0
    )
