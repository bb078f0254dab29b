"""Expert parallelism on 8 fake CPU devices: a mixture of experts whose experts are split over
an "expert" mesh axis of 4 (and its width over fsdp 2) computes the single-device logits
(Qwen3-MoE, and GPT-OSS with its fused gate/up weight, expert biases and attention sinks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_models import left_padded_batch

from grpo_jax.core import sharding
from grpo_jax.models import create_model, family_config
from grpo_jax.models.param_tensors import shard_numel
from grpo_jax.sampling import static as sampling
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

CFG = family_config(
    "qwen3_moe", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, mlp_dim=32, moe_mlp_dim=16, num_experts=8, experts_per_token=2,
)  # fmt: skip
GPT_OSS = family_config(
    "gpt_oss", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, mlp_dim=16, num_experts=8, experts_per_token=2, sliding_window=4,
)  # fmt: skip


def test_a_mesh_has_the_expert_axis_only_when_it_is_larger_than_one():
    devices = jax.devices()[:8]
    assert sharding.make_mesh({"fsdp": 8}, devices).axis_names == ("data", "fsdp", "tensor")
    mesh = sharding.make_mesh({"expert": 4, "fsdp": 2}, devices)
    assert mesh.axis_names == ("data", "fsdp", "tensor", "expert")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 4}
    # The memory plan's count of one device's share agrees, with or without the axis.
    axes = ("experts", "embed", "mlp")
    assert shard_numel((8, 32, 16), axes, dict(mesh.shape), "fsdp") == 2 * 16 * 16
    assert (
        shard_numel((8, 32, 16), axes, {"data": 1, "fsdp": 2, "tensor": 1}, "fsdp") == 8 * 16 * 16
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_expert_sharded_forward_equals_single_device(layout, family):
    cfg = CFG if family == "qwen3_moe" else GPT_OSS
    mesh = sharding.make_mesh({"expert": 4, "fsdp": 2}, jax.devices()[:8])
    tokens, mask = left_padded_batch((9, 5, 9, 2), 9, cfg.vocab_size, seed=2)
    single = create_model(cfg, seed=1)
    sharded = create_model(cfg, seed=1, mesh=mesh, layout=layout)
    mlp = sharded.layers[0].mlp
    gate = (mlp.gate_experts if family == "qwen3_moe" else mlp.gate_up_experts)[...]
    assert gate.sharding.spec == P("expert", "fsdp", None if layout == "fsdp" else "tensor")
    # 8 experts / 4, 32 / 2; GPT-OSS's fused gate/up is 2F wide
    assert gate.addressable_shards[0].data.shape == (2, 16, 16 if family == "qwen3_moe" else 32)
    want_z, want_routes = _logits_and_routes(single, tokens, mask)
    rows = sharding.batch_sharding(mesh)
    with jax.set_mesh(mesh):
        got_z, got_routes = _logits_and_routes(
            sharded, jax.device_put(tokens, rows), jax.device_put(mask, rows)
        )
    assert got_z.addressable_shards[0].data.shape[0] == 2  # rows stayed split over fsdp
    m = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(got_routes)[m], np.asarray(want_routes)[m])
    np.testing.assert_allclose(np.asarray(got_z)[m], np.asarray(want_z)[m], atol=1e-5, rtol=0)


def _logits_and_routes(model, tokens, mask):
    """(logits, routes) with the weights sharpened (x4): routing and logits far from uniform;
    biases and sinks (zeros at creation) moved off zero so that they count."""
    graphdef, params = nnx.split(model)
    wave = lambda x: 0.1 * jnp.cos(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape))

    @jax.jit
    def f(params, tokens, mask):
        sharp = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
        sharp = jax.tree.map(lambda x: jnp.where(jnp.any(x != 0), x, x + wave(x)), sharp)
        model = nnx.merge(graphdef, sharp)
        x, routes = model.routed_features(tokens, mask_BxT=mask)
        return model.logits(x), routes

    return f(params, tokens, mask)


@pytest.mark.slow
def test_expert_sharded_greedy_decode_equals_single_device():
    """The static sampler's greedy completions and their log-probs, expert 4 x fsdp 2."""
    prompts = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6], [60, 33], [8, 8, 8], [3, 1], [40], [2, 4]]
    toks, mask = pad_prompts(prompts, pad_id=0, buckets=(8,))
    cfg = SamplingConfig(max_new_tokens=6, greedy=True, prompt_buckets=(8,))
    sharpen = lambda params: jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
    graphdef, params = nnx.split(create_model(CFG, seed=1))
    params = jax.device_put(sharpen(params), jax.devices()[0])
    want = sampling.generate(graphdef, params, toks, mask, jax.random.key(0), cfg, num_samples=2)
    mesh = sharding.make_mesh({"expert": 4, "fsdp": 2}, jax.devices()[:8])
    graphdef, params = nnx.split(create_model(CFG, seed=1, mesh=mesh))
    params = sharpen(params)
    assert params["layers"][1]["mlp"]["up_experts"][...].sharding.spec[0] == "expert"
    got = sampling.generate(
        graphdef, params, toks, mask, jax.random.key(0), cfg, num_samples=2, mesh=mesh
    )
    assert len(set(np.asarray(want.tokens).ravel().tolist())) > 4  # not one repeated token
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logps), np.asarray(want.logps), atol=1e-5)
    assert got.tokens.sharding.spec[0] == ("data", "fsdp")
