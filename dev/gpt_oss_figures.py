"""Prints docs/moe.md's GPT-OSS figures: float32 logits against transformers.

    PYTHONPATH=.:tests:tests/models .venv/bin/python dev/gpt_oss_figures.py

The checkpoint and inputs are the tests' own (tests/models/test_models_gpt_oss.py), built on
CPU in a temporary folder; nothing is downloaded.
"""

import importlib
import pathlib
import tempfile

import jax.numpy as jnp
import numpy as np


def parity(root: pathlib.Path) -> None:
    from grpo_jax.models import from_pretrained, positions_from_mask

    hf = importlib.import_module("helpers_hf")
    t = importlib.import_module("test_models_gpt_oss")
    path = hf.make_tiny_hf_checkpoint(root / "gpt_oss", "gpt_oss", seed=11)
    ref = hf.load_hf_model(path)
    tokens, mask = t._padded_batch()
    positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
    for attention in ("einsum", "blockwise"):
        model = from_pretrained(path, attention=attention)
        whole, _ = t._ours(model, tokens, np.ones_like(mask))
        padded, _ = t._ours(model, tokens, mask)
        theirs = hf.hf_logits(ref, tokens, attention_mask=mask, position_ids=positions)
        print(
            f"{attention}: max |diff| {np.abs(whole - hf.hf_logits(ref, tokens)).max():.1e} "
            f"unpadded, {np.abs(padded - theirs)[mask].max():.1e} left-padded "
            f"(|logits| up to {np.abs(theirs).max():.2f})"
        )


if __name__ == "__main__":
    parity(pathlib.Path(tempfile.mkdtemp()))
