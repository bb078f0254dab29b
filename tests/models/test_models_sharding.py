"""The model on 8 fake CPU devices: parameter shardings per layout, and sharded == 1 device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import make_tiny_hf_checkpoint
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.core.sharding import batch_sharding, make_mesh
from grpo_jax.models import (
    cache_shardings,
    create_model,
    family_config,
    from_pretrained,
    param_shardings,
    positions_from_mask,
)

MESHES = {
    "dp": {"data": 8},
    "fsdp": {"data": 2, "fsdp": 4},
    "fsdp_tp": {"data": 1, "fsdp": 4, "tensor": 2},
}


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory):
    # 4 query heads, 2 KV heads, hidden 64, window 4: every axis kind gets split.
    return make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("hf") / "gemma3", "gemma3", tokenizer=False
    )


def batch(B=8, T=10, vocab=320, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    for b in range(B):
        mask[b, : rng.integers(0, T - 1)] = False  # Left padding of varied length.
    return jnp.asarray(np.where(mask, tokens, 0)), jnp.asarray(mask)


def sharded_forward(model, mesh, tokens, mask):
    graphdef, params = nnx.split(model)
    f = jax.jit(
        lambda p, t, m: nnx.merge(graphdef, p)(t, mask_BxT=m),
        out_shardings=NamedSharding(mesh, P(("data", "fsdp"))),
    )
    with jax.set_mesh(mesh):  # Turns the activation constraints on.
        tokens, mask = jax.device_put((tokens, mask), batch_sharding(mesh))
        return f(params, tokens, mask)


def single_forward(model, tokens, mask):
    graphdef, params = nnx.split(model)
    return jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, mask_BxT=m))(params, tokens, mask)


def test_parameter_specs_follow_the_layouts():
    cfg = family_config(
        "qwen2",
        vocab_size=96,
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
    )
    model = create_model(cfg)
    mesh = make_mesh(MESHES["fsdp_tp"])
    specs = jax.tree.map(lambda s: s.spec, param_shardings(model, mesh, "fsdp_tp"))
    attn, mlp = specs["layers"][0]["attn"], specs["layers"][0]["mlp"]
    assert attn["q_proj"].get_value() == P("fsdp", "tensor", None)
    assert attn["k_proj"].get_value() == P("fsdp", "tensor", None)
    assert attn["o_proj"].get_value() == P("tensor", None, "fsdp")
    assert attn["q_bias"].get_value() == P("tensor", None)
    assert mlp["gate_proj"].get_value() == P("fsdp", "tensor")
    assert mlp["down_proj"].get_value() == P("tensor", "fsdp")
    assert specs["embed"].get_value() == P("tensor", "fsdp")
    assert specs["final_norm"]["scale"].get_value() == P(None)
    fsdp = jax.tree.map(lambda s: s.spec, param_shardings(model, make_mesh(MESHES["fsdp"]), "fsdp"))
    assert fsdp["layers"][0]["mlp"]["down_proj"].get_value() == P(None, "fsdp")
    dp = jax.tree.map(lambda s: s.spec, param_shardings(model, make_mesh(MESHES["dp"]), "dp"))
    assert all(s == P() or set(s) == {None} for s in jax.tree.leaves(dp))


def test_indivisible_dimensions_fall_back_to_replicated():
    # 2 KV heads over 4-way tensor parallelism, vocab 97 over anything.
    cfg = family_config(
        "llama",
        vocab_size=97,
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
    )
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    specs = jax.tree.map(lambda s: s.spec, param_shardings(create_model(cfg), mesh, "fsdp_tp"))
    attn = specs["layers"][0]["attn"]
    assert attn["q_proj"].get_value() == P("fsdp", "tensor", None)
    assert attn["k_proj"].get_value() == P("fsdp", None, None)
    assert specs["embed"].get_value() == P(None, "fsdp")
    assert specs["lm_head"].get_value() == P("fsdp", None)


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
@pytest.mark.slow
def test_sharded_forward_equals_single_device(layout, gemma_checkpoint):
    mesh = make_mesh(MESHES[layout])
    single = from_pretrained(gemma_checkpoint)
    sharded = from_pretrained(gemma_checkpoint, mesh=mesh, layout=layout)
    q = sharded.layers[0].attn.q_proj[...]
    assert q.sharding.spec == (
        P("fsdp", "tensor", None) if layout == "fsdp_tp" else P("fsdp", None, None)
    )
    assert len(q.addressable_shards) == 8
    tokens, mask = batch()
    expected = single_forward(single, tokens, mask)
    got = sharded_forward(sharded, mesh, tokens, mask)
    real = np.asarray(mask)
    np.testing.assert_allclose(
        np.asarray(got)[real], np.asarray(expected)[real], atol=2e-5, rtol=1e-5
    )


@pytest.mark.slow
def test_create_model_on_a_mesh_equals_the_single_device_model():
    cfg = family_config(
        "qwen3",
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=96,
    )
    mesh = make_mesh(MESHES["fsdp_tp"])
    a, b = create_model(cfg, seed=5), create_model(cfg, seed=5, mesh=mesh, layout="fsdp_tp")
    assert b.layers[1].mlp.up_proj[...].sharding.spec == P("fsdp", "tensor")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(x, y)
    tokens, mask = batch(vocab=128)
    np.testing.assert_allclose(
        sharded_forward(b, mesh, tokens, mask),
        single_forward(a, tokens, mask),
        atol=2e-5,
        rtol=1e-5,
    )


@pytest.mark.slow
def test_sharded_cache_decoding_equals_single_device(gemma_checkpoint):
    mesh = make_mesh(MESHES["fsdp_tp"])
    single = from_pretrained(gemma_checkpoint)
    sharded = from_pretrained(gemma_checkpoint, mesh=mesh, layout="fsdp_tp")
    tokens, mask = batch(B=4, T=7, seed=1)
    positions = positions_from_mask(mask)
    S = 9
    kv_mask = jnp.zeros((4, S), bool).at[:, :7].set(mask)

    def run(model, cache, put):
        graphdef, params = nnx.split(model)
        step = jax.jit(
            lambda p, t, pos, kv, c, i: nnx.merge(graphdef, p).forward_with_cache(
                t, positions_BxT=pos, kv_mask_BxS=kv, cache=c, cache_index=i
            )
        )
        prefill, cache = step(
            params, put(tokens[:, :6]), put(positions[:, :6]), put(kv_mask), cache, 0
        )
        last, _ = step(params, put(tokens[:, 6:]), put(positions[:, 6:]), put(kv_mask), cache, 6)
        return np.asarray(prefill), np.asarray(last)

    cache = sharded.init_cache(4, S)
    cache = jax.device_put(cache, cache_shardings(cache, mesh, "fsdp_tp"))
    assert cache["k"][0].sharding.spec == P(("data", "fsdp"), "tensor", None, None)
    assert cache["v"][-1].sharding.spec == P(("data", "fsdp"), "tensor", None, None)
    with jax.set_mesh(mesh):
        got = run(sharded, cache, lambda x: jax.device_put(x, batch_sharding(mesh)))
    expected = run(single, single.init_cache(4, S), lambda x: x)
    real = np.asarray(mask)
    np.testing.assert_allclose(got[0][real[:, :6]], expected[0][real[:, :6]], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], expected[1], atol=2e-5, rtol=1e-5)
