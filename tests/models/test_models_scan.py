"""Layers as a scan (``scan_layers``) equal the unrolled model: logits, KV-cache decode,
gradients (with and without remat), parameter layout, shardings, HF round trip, memory plan.

The scanned model gets the unrolled model's parameters through ``stack_layers``; Gemma 3
has alternating sliding (window 3, binding) and global layers with two RoPE bases, so the
per-layer window and RoPE table inputs of the scan are exercised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_models import FAMILIES, left_padded_batch, random_model, small_config

from grpo_jax.models import (
    cache_shardings,
    create_model,
    param_shardings,
    positions_from_mask,
    stack_layers,
    unstack_layers,
)
from grpo_jax.run import memory


def scanned_twin(model):
    """The scanned model with ``model``'s (unrolled) parameters."""
    cfg = model.config
    graphdef = nnx.graphdef(create_model(cfg.replace(scan_layers=True)))
    return nnx.merge(graphdef, stack_layers(nnx.state(model), cfg.num_layers))


def _loss_and_grads(model, tokens, mask):
    graphdef, params = nnx.split(model)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens, mask_BxT=mask)
        lse = jax.nn.logsumexp(logits, -1)
        per_token = lse - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(mask, per_token, 0.0)) / mask.sum(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, logits, grads


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_scan_equals_unrolled_in_logits_and_gradients(family, remat):
    cfg = small_config(family, remat=remat)
    tokens, mask = left_padded_batch((9, 6, 2), 9, cfg.vocab_size, seed=4)
    unrolled = random_model(cfg)
    scanned = scanned_twin(unrolled)
    l0, z0, g0 = _loss_and_grads(unrolled, tokens, mask)
    l1, z1, g1 = _loss_and_grads(scanned, tokens, mask)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(z1)[real], np.asarray(z0)[real], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    back = dict(nnx.to_flat_state(unstack_layers(g1, cfg.num_layers)))
    flat0 = dict(nnx.to_flat_state(g0))
    assert back.keys() == flat0.keys()
    for path, g in flat0.items():
        a, b = g.get_value(), back[path].get_value()
        scale = float(np.abs(a).max()) + 1e-6
        np.testing.assert_allclose(b, a, atol=1e-5 * scale + 1e-7, err_msg=str(path))


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["einsum", "blockwise"])
@pytest.mark.parametrize("family", FAMILIES)
def test_scan_cache_decoding_equals_the_unrolled_full_pass(family, attention):
    """Prefill then token-by-token decode with the scanned model's stacked cache equals the
    unrolled model's full forward pass at every step."""
    cfg = small_config(family, attention=attention, attention_block_size=4)
    unrolled = random_model(cfg)
    scanned = scanned_twin(unrolled)
    lengths, P, N = (5, 3, 1), 5, 6
    S = P + N + 2
    prompt, prompt_mask = left_padded_batch(lengths, P, cfg.vocab_size, seed=1)
    cont = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (3, N)), jnp.int32)
    tokens = jnp.concatenate([prompt, cont], axis=1)
    mask = jnp.concatenate([prompt_mask, jnp.ones_like(cont, bool)], axis=1)
    full = jax.jit(lambda t, m: unrolled(t, mask_BxT=m))(tokens, mask)
    positions = positions_from_mask(mask)
    graphdef, params = nnx.split(scanned)

    @jax.jit
    def step(params, tokens, positions, kv_mask, cache, index):
        return nnx.merge(graphdef, params).forward_with_cache(
            tokens, positions_BxT=positions, kv_mask_BxS=kv_mask, cache=cache, cache_index=index
        )

    cache = scanned.init_cache(3, S)
    L, K, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    assert cache["k"].shape == (3, L, K, S, Dh) and cache["v"].shape == (3, L, K, Dh, S)
    kv_mask = jnp.zeros((3, S), bool).at[:, :P].set(prompt_mask)
    logits, cache = step(params, prompt, positions[:, :P], kv_mask, cache, 0)
    real = np.asarray(prompt_mask)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(full[:, :P])[real], atol=2e-5)
    for t in range(P, P + N):
        kv_mask = kv_mask.at[:, t].set(True)
        logits, cache = step(
            params, tokens[:, t : t + 1], positions[:, t : t + 1], kv_mask, cache, t
        )
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_create_model_scanned_has_the_unrolled_weights_stacked():
    cfg = small_config("qwen3")
    unrolled = nnx.state(create_model(cfg, seed=3))
    scanned = nnx.state(create_model(cfg.replace(scan_layers=True), seed=3))
    q = scanned["layers"]["attn"]["q_proj"]
    assert q.shape == (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim)
    assert q.get_metadata()["logical_axes"] == ("layers", "embed", "heads", "head_dim")
    for i in range(cfg.num_layers):
        np.testing.assert_array_equal(q[...][i], unrolled["layers"][i]["attn"]["q_proj"][...])
    round_trip = dict(nnx.to_flat_state(unstack_layers(scanned, cfg.num_layers)))
    for path, v in nnx.to_flat_state(unrolled):
        np.testing.assert_array_equal(round_trip[path][...], v[...])
        assert round_trip[path].get_metadata()["logical_axes"] == v.get_metadata()["logical_axes"]


def test_stacked_parameters_shard_like_their_layers():
    """fsdp_tp on a 2 x 4 mesh: the layer axis stays whole, the rest as in one layer."""
    from grpo_jax.core import sharding

    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
    cfg = small_config("qwen2", num_heads=4, num_kv_heads=4)
    unrolled = param_shardings(create_model(cfg), mesh, "fsdp_tp")
    scanned = param_shardings(create_model(cfg.replace(scan_layers=True)), mesh, "fsdp_tp")
    for name in ("q_proj", "o_proj"):
        one = unrolled["layers"][0]["attn"][name].get_value().spec
        assert scanned["layers"]["attn"][name].get_value().spec == P(None, *one)
    cache = create_model(cfg.replace(scan_layers=True)).init_cache(4, 8)
    specs = cache_shardings(cache, mesh, "fsdp_tp")
    assert specs["k"].spec == P(("data", "fsdp"), None, "tensor", None, None)


def test_memory_plan_counts_stacked_parameters_the_same():
    cfg = small_config("gemma3")
    kw = dict(
        mesh_shape={"fsdp": 2}, layout="fsdp", batch_rows=4, seq_len=8, prompt_len=8, beta=0.1
    )
    a = memory.estimate(cfg, **kw)
    b = memory.estimate(cfg.replace(scan_layers=True), **kw)
    assert a == b
    assert memory.param_count(cfg.replace(scan_layers=True)) == cfg.num_params


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_scanned_hf_import_matches_transformers_and_exports_the_same_tensors(family, tmp_path):
    """from_pretrained(scan_layers=True), placed sharded over fsdp = 4 so each device reads a
    slice of every layer: transformers' logits within 1e-4; save_pretrained writes the
    checkpoint's tensors, every one and identical."""
    from helpers_hf import hf_logits, load_hf_model, make_tiny_hf_checkpoint

    from grpo_jax.core import sharding
    from grpo_jax.models import from_pretrained, save_pretrained
    from grpo_jax.models.safetensors_io import SafetensorsCheckpoint

    # Every Qwen3-MoE layer sparse: a scan needs its layers alike.
    every = {"mlp_only_layers": []} if family == "qwen3_moe" else {}
    path = make_tiny_hf_checkpoint(tmp_path / "hf", family, seed=5, tokenizer=False, **every)
    mesh = sharding.make_mesh({"fsdp": 4}, jax.devices()[:4])
    model = from_pretrained(path, scan_layers=True, mesh=mesh, layout="fsdp")
    assert model.config.scan_layers
    mlp = model.layers.mlp
    up = {"qwen3_moe": "up_experts", "gpt_oss": "gate_up_experts"}.get(family, "up_proj")
    up = getattr(mlp, up)
    assert up[...].shape[0] == model.config.num_layers
    tokens = np.random.default_rng(0).integers(0, 320, (2, 12)).astype(np.int32)
    graphdef, params = nnx.split(model)
    ours = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens))
    np.testing.assert_allclose(ours, hf_logits(load_hf_model(path), tokens), atol=1e-4, rtol=0)
    out = save_pretrained(model, tmp_path / "out")
    a, b = SafetensorsCheckpoint(path), SafetensorsCheckpoint(out)
    # Every tensor of the checkpoint comes back, except a tied LM head (the embedding's copy,
    # which transformers may save and save_pretrained does not).
    expected = set(a.keys()) - ({"lm_head.weight"} if model.config.tie_embeddings else set())
    assert set(b.keys()) == expected
    for name in b.keys():
        np.testing.assert_array_equal(np.asarray(b[name]), np.asarray(a[name]), err_msg=name)
