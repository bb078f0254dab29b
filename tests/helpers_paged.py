"""Shared by several test folders; moved from test_paged.py."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models import tiny_config
from grpo_jax.objective import losses
from grpo_jax.sampling import paged
from grpo_jax.sampling import static as sampling
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

V = 64


MODEL_CFG = tiny_config(
    V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)


# Different lengths, left-padded to the bucket of 8: a prompt of 1 token, one of a full page.
PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6], [60, 33], [8, 8, 8, 8, 8], [3, 1, 4, 1]]


BUCKETS = (8, 16)


def _both(policy, prompts, g, key=0, **kw):
    """(static output, paged output, paged stats) for the same prompts and settings."""
    engine = {k: kw.pop(k) for k in ("page_size", "slots", "pages", "prefill_chunk") if k in kw}
    cfg = SamplingConfig(prompt_buckets=BUCKETS, **kw)
    toks, mask = pad_prompts(prompts, pad_id=0, buckets=BUCKETS)
    graphdef, params = policy
    ref = sampling.generate(graphdef, params, toks, mask, jax.random.key(key), cfg, num_samples=g)
    cfg_p = SamplingConfig(prompt_buckets=BUCKETS, engine="paged", **kw, **engine)
    out, st = paged.generate_with_stats(
        graphdef, params, toks, mask, jax.random.key(key), cfg_p, num_samples=g
    )
    return ref, out, st


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward(params, seq_NxL, mask_NxL, *, graphdef):
    return nnx.merge(graphdef, params)(seq_NxL, mask_BxT=mask_NxL)


def _full_logps(policy, out, temperature):
    """per_token_logps of one full forward pass over [prompt | completion]."""
    p, t = out.prompt_tokens.shape[1], out.tokens.shape[1]
    seq = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.mask.astype(bool)], axis=1)
    logits = _forward(policy[1], seq, mask, graphdef=policy[0])
    return losses.per_token_logps(logits[:, p - 1 : p - 1 + t], out.tokens, temperature=temperature)
