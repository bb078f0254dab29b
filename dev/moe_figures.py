"""Prints docs/moe.md's figures: Qwen3-MoE logits against transformers, and routing replay.

    PYTHONPATH=.:tests:tests/models .venv/bin/python dev/moe_figures.py

The inputs are the tests' own (tests/models/test_models_moe.py, test_models_moe_replay.py),
built on CPU in a temporary folder; nothing is downloaded.
"""

import importlib
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.models import from_pretrained, positions_from_mask
from grpo_jax.models import moe as moe_lib


def parity(root: pathlib.Path) -> None:
    hf = importlib.import_module("helpers_hf")
    variants = importlib.import_module("test_models_moe").VARIANTS
    for name, overrides in sorted(variants.items()):
        path = hf.make_tiny_hf_checkpoint(
            root / name, "qwen3_moe", seed=7, tokenizer=False, **overrides
        )
        ref, model = hf.load_hf_model(path), from_pretrained(path)
        tokens = np.random.default_rng(3).integers(0, 320, (3, 14)).astype(np.int32)
        mask = np.ones((3, 14), bool)
        mask[1, :5] = False
        mask[2, :11] = False
        tokens = np.where(mask, tokens, 0)
        positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
        graphdef, params = nnx.split(model)
        run = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, mask_BxT=m))
        padded = np.asarray(run(params, tokens, mask))
        theirs = hf.hf_logits(ref, tokens, attention_mask=mask, position_ids=positions)
        whole = np.asarray(run(params, tokens, np.ones_like(mask)))
        cfg = model.config
        print(
            f"{name}: sparse layers {cfg.sparse_layers}, E={cfg.num_experts}, "
            f"k={cfg.experts_per_token}, norm_topk_prob={cfg.norm_topk_prob}: max |diff| "
            f"{np.abs(whole - hf.hf_logits(ref, tokens)).max():.1e} unpadded, "
            f"{np.abs(padded - theirs)[mask].max():.1e} left-padded"
        )


def replay() -> None:
    t = importlib.import_module("test_models_moe_replay")
    graphdef, params = nnx.split(t.random_model(t.CFG, seed=0))
    tokens, mask = t.left_padded_batch((16, 12, 9, 16), 16, t.CFG.vocab_size, seed=1)
    logps = t._logps(graphdef)
    real = np.asarray(mask[:, 1:]) & np.asarray(mask[:, :-1])
    for source in ("bfloat16 copy", "small parameter change"):
        rollout_logp, routes = t._rollout_routes(source, graphdef, params, tokens, mask)
        old, _ = logps(params, tokens, mask, routes)
        own, own_routes = logps(params, tokens, mask, None)
        replayed, _ = logps(params, tokens, mask, routes)
        flips = np.asarray(moe_lib.route_flips(own_routes, routes))
        flipped = flips.any(-1)[:, :-1] & real
        ratio = lambda lp: np.abs(np.exp(np.asarray(lp - old)) - 1)[real].max()
        gap = lambda lp: np.abs(np.asarray(lp - rollout_logp))[flipped].mean()
        print(
            f"{source}: tokens with a flipped route {flips.any(-1)[np.asarray(mask)].mean():.3f}"
            f", (token, layer) pairs {flips[np.asarray(mask)].mean():.3f}; first-step "
            f"max |ratio - 1| {ratio(own):.1e} without replay, {ratio(replayed):.1e} with; "
            f"mean |logp - rollout logp| of flipped tokens {gap(own):.4f} without, "
            f"{gap(replayed):.4f} with"
        )


if __name__ == "__main__":
    parity(pathlib.Path(tempfile.mkdtemp()))
    replay()
