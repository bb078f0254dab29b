"""The paged decode step's Pallas kernel (models.attention.paged_decode_attention, with
model.attention = "splash"), run by Pallas's interpreter here: the same kernel code a TPU
compiles. Against the gather path on the same pages, and end to end on the paged engine."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_paged import _both

from grpo_jax.models import attention as attn
from grpo_jax.models import create_model, tiny_config


def _pages_case(seed=0, b=3, k=2, g=2, dh=8, pages=9, z=4, m=3):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, k, g, dh)), jnp.float32)
    kp = jnp.asarray(rng.normal(size=(pages, z, k, dh)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(pages, z, k, dh)), jnp.float32)
    # Rows of different lengths; row 1 ends in a scratch entry; its masked tail never visible.
    table = jnp.asarray([[1, 2, 3], [4, 5, 0], [6, 7, 8]], jnp.int32)
    pos = np.tile(np.arange(m * z, dtype=np.int32), (b, 1))
    pos[1, 6:] = attn.NO_WINDOW
    pos[2, :2] = attn.NO_WINDOW  # a prompt's padding
    kv = attn.PagedKV(kp, vp, None, None, table, jnp.asarray(pos))
    return q, kv, jnp.asarray([11, 5, 9], jnp.int32)


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 5.0)])
def test_the_kernel_equals_the_gather_path(window, softcap):
    q, kv, q_pos = _pages_case()
    got = attn.paged_decode_attention(q, kv, q_pos, window, 0.3, softcap)
    k, v = kv.gather()
    want = attn.paged_attention(q[:, None], k, v, q_pos[:, None], kv.pos_BxS, window, 0.3, softcap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, 0]), atol=1e-6)


def test_the_kernel_with_sinks_equals_the_gather_path():
    """Attention sinks (GPT-OSS): each head's softmax starts from its sink in the kernel."""
    q, kv, q_pos = _pages_case(seed=1)
    sinks = jnp.asarray(np.random.default_rng(2).normal(size=(2, 2)), jnp.float32)
    got = attn.paged_decode_attention(q, kv, q_pos, 4, 0.3, None, sinks)
    k, v = kv.gather()
    want = attn.paged_attention(q[:, None], k, v, q_pos[:, None], kv.pos_BxS, 4, 0.3, None, sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, 0]), atol=1e-6)
    without = attn.paged_attention(q[:, None], k, v, q_pos[:, None], kv.pos_BxS, 4, 0.3, None)
    assert np.abs(np.asarray(want - without)).max() > 1e-2  # the sinks matter here


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_oss"])
def test_the_paged_engine_with_the_kernel_equals_the_gather_path(family):
    """Greedy tokens equal and log-probs within 1e-5 on a tiny model (Gemma 3: a window of 4
    on the local layer, shorter than the rows)."""
    extra = {}
    if family in ("gemma3", "gpt_oss"):
        extra = dict(sliding_window=4, layer_types=("sliding_attention", "full_attention"))
    if family == "gpt_oss":
        extra.update(num_experts=4, experts_per_token=2)
    cfg = tiny_config(64, family=family, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, mlp_dim=64, **extra)  # fmt: skip
    graphdef, params = nnx.split(create_model(cfg, seed=0))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
    kernel_gd = nnx.split(create_model(dataclasses.replace(cfg, attention="splash"), seed=0))[0]
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6], [7], [1, 2, 3, 4, 5, 6]]
    kw = dict(max_new_tokens=10, greedy=True, page_size=4, slots=4)
    _, want, _ = _both((graphdef, params), prompts, 2, **kw)
    _, got, _ = _both((kernel_gd, params), prompts, 2, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logps, want.logps, atol=1e-5)


def test_on_a_mesh_the_decode_step_runs_the_kernel():
    """On a mesh the kernel runs under shard_map, rows over the batch axes and the pool
    whole on each device, as the engine keeps it (XLA does not partition a Pallas call; the
    step used the gather path on every mesh of several devices)."""
    from grpo_jax.core.sharding import make_mesh

    cfg = tiny_config(64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64, attention="splash")  # fmt: skip
    model = create_model(cfg, seed=0)
    rows, entries, z = 4, 3, 4
    pages = model.init_pages(1 + rows * entries, z)
    table = jnp.arange(1, 1 + rows * entries, dtype=jnp.int32).reshape(rows, entries)
    pos = jnp.tile(jnp.arange(entries * z, dtype=jnp.int32), (rows, 1))
    at = jnp.full((rows, 1), 5, jnp.int32)

    def step(tokens, pages):
        write = (table[:, 1], jnp.ones((rows,), jnp.int32))
        return model.features_paged(
            tokens, positions_BxT=at, pages=pages, write=write, table_BxN=table, pos_BxS=pos
        )[0]

    with jax.set_mesh(make_mesh({"data": 2, "fsdp": 2}, jax.devices()[:4])):
        text = str(jax.make_jaxpr(step)(jnp.ones((rows, 1), jnp.int32), pages))
    assert "pallas_call" in text and "shard_map" in text


@pytest.mark.slow
def test_the_paged_engine_on_a_mesh_with_the_kernel_equals_the_gather_path():
    """4 devices (2 data x 2 fsdp): greedy tokens equal, log-probs within 1e-5."""
    from grpo_jax.core.sharding import make_mesh
    from grpo_jax.sampling import paged
    from grpo_jax.sampling.static import SamplingConfig, pad_prompts

    cfg = tiny_config(64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64)  # fmt: skip
    graphdef, params = nnx.split(create_model(cfg, seed=0))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
    kernel_gd = nnx.split(create_model(dataclasses.replace(cfg, attention="splash"), seed=0))[0]
    mesh = make_mesh({"data": 2, "fsdp": 2}, jax.devices()[:4])
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6], [7], [1, 2, 3, 4, 5, 6], [9, 9]]
    toks, mask = pad_prompts(prompts, pad_id=0, buckets=(16,))
    scfg = SamplingConfig(prompt_buckets=(16,), engine="paged", max_new_tokens=10, greedy=True,
                          page_size=4, slots=4)  # fmt: skip
    run = lambda gd: paged.generate(gd, params, toks, mask, jax.random.key(0), scfg,
                                    num_samples=2, mesh=mesh)  # fmt: skip
    want, got = run(graphdef), run(kernel_gd)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logps), np.asarray(want.logps), atol=1e-5)
