"""Sharding layouts change where numbers live, never the numbers.

The tiny transformer's GRPO loss and its gradient with respect to every
parameter, computed with the parameters laid out as dp, fsdp and fsdp_tp over
8 fake CPU devices (activation constraints on, via ``jax.set_mesh``), equal
the same computation on one device to float32 tolerance.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.core.sharding import batch_sharding, make_mesh
from grpo_jax.objective import losses
from grpo_jax.objective.config import GRPOConfig

N, P_LEN, T = 8, 3, 5  # rows (B=4 prompts x G=2), prompt and completion tokens


# Compile without LLVM's optimisations: the same numbers, half the compile time.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@pytest.fixture(scope="module")
def setup():
    """The model, a batch, and the one-device loss and gradients (computed once)."""
    from grpo_jax.models import create_model, tiny_config

    cfg = tiny_config(
        vocab_size=96,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=48,
        tie_embeddings=False,
    )
    model = create_model(cfg, seed=3)
    rng = np.random.default_rng(0)
    mask = np.ones((N, P_LEN + T), bool)
    mask[::3, 0] = False  # some left padding in the prompts
    mask[1::2, -2:] = False  # and some completions end early
    batch = {
        "tokens": rng.integers(0, cfg.vocab_size, size=(N, P_LEN + T)).astype(np.int32),
        "mask": mask,
        "old_logps": (-4.5 + 0.1 * rng.normal(size=(N, T))).astype(np.float32),
        "ref_logps": (-4.5 + 0.1 * rng.normal(size=(N, T))).astype(np.float32),
        "advantages": rng.normal(size=(N,)).astype(np.float32),
    }
    graphdef, params = nnx.split(model)
    params, batch_1 = jax.device_put((params, batch), jax.devices()[0])
    step = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1, compiler_options=FAST_COMPILE)
    loss1, grads1 = step(params, graphdef, batch_1)  # no mesh: constraints are no-ops
    return model, batch, float(loss1), grads1


def loss_fn(params, graphdef, batch):
    """GRPO loss (beta > 0) over the completion tokens' log-probs under the model."""
    model = nnx.merge(graphdef, params)
    logits_NxLxV = model(batch["tokens"], mask_BxT=batch["mask"])
    logits_NxTxV = logits_NxLxV[:, P_LEN - 1 : -1]
    logps_NxT = losses.per_token_logps(logits_NxTxV, batch["tokens"][:, P_LEN:])
    loss, _ = losses.grpo_loss(
        logps_NxT,
        batch["old_logps"],
        batch["advantages"],
        batch["mask"][:, P_LEN:],
        GRPOConfig(beta=0.04),
        ref_logps_NxT=batch["ref_logps"],
    )
    return loss


def _sharded_loss_and_grads(model, batch, mesh, layout):
    from grpo_jax.models import Transformer, param_shardings

    # The layout is part of the model's static structure: the graph for this layout.
    graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: Transformer(model.config, rngs=nnx.Rngs(0), layout=layout))
    )
    params = nnx.state(model)
    shardings = param_shardings(params, mesh, layout)
    params = jax.device_put(params, shardings)
    batch = {k: jax.device_put(v, batch_sharding(mesh, v.ndim)) for k, v in batch.items()}
    step = jax.jit(
        jax.value_and_grad(loss_fn),
        static_argnums=1,
        out_shardings=(NamedSharding(mesh, PartitionSpec()), shardings),
        compiler_options=FAST_COMPILE,
    )
    with jax.set_mesh(mesh):  # switches the model's activation constraints on
        loss, grads = step(params, graphdef, batch)
    return float(loss), grads, shardings


@pytest.mark.parametrize(
    "layout,axes",
    [
        ("dp", {"data": 8}),
        pytest.param("fsdp", {"fsdp": 8}, marks=pytest.mark.slow),
        pytest.param("fsdp", {"data": 2, "fsdp": 4}, marks=pytest.mark.slow),
        pytest.param("fsdp_tp", {"fsdp": 4, "tensor": 2}, marks=pytest.mark.slow),
        pytest.param("fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}, marks=pytest.mark.slow),
    ],
)
def test_layout_matches_one_device(setup, layout, axes):
    model, batch, loss1, grads1 = setup
    mesh = make_mesh(axes)
    loss, grads, shardings = _sharded_loss_and_grads(model, batch, mesh, layout)

    # The layout really shards, and the gradients keep the parameters' shardings.
    q_spec = grads["layers"][0]["attn"]["q_proj"][...].sharding.spec
    expected = {"dp": (None, None), "fsdp": ("fsdp", None), "fsdp_tp": ("fsdp", "tensor")}
    assert tuple(q_spec)[:2] == expected[layout]
    got_specs = jax.tree.map(lambda g: g.sharding.spec, grads)
    assert got_specs == jax.tree.map(lambda s: s.spec, shardings)

    assert abs(loss1) > 1e-3  # not a degenerate zero loss
    np.testing.assert_allclose(loss, loss1, rtol=1e-5, atol=1e-7)
    flat1 = dict(nnx.to_flat_state(grads1))
    flat = dict(nnx.to_flat_state(grads))
    assert flat.keys() == flat1.keys()
    for path, g1 in flat1.items():
        g1 = np.asarray(g1[...])
        g = np.asarray(flat[path][...])
        scale = np.abs(g1).max()
        assert scale > 0, f"zero gradient at {path}"
        np.testing.assert_allclose(g, g1, rtol=1e-4, atol=1e-5 * scale, err_msg=str(path))


@pytest.mark.parametrize(
    "layout,axes",
    [("fsdp", {"data": 2, "fsdp": 4}), ("fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2})],
)
@pytest.mark.slow
def test_prompt_once_per_group_matches_one_device_per_row(setup, layout, axes):
    """The update's shared-prompt path (KV cache repeated to the group) under a mesh."""
    from grpo_jax.models import Transformer, param_shardings
    from grpo_jax.objective import logprobs

    model, batch, _, _ = setup
    G = 2
    prompt_NxP = np.repeat(batch["tokens"][::G, :P_LEN], G, axis=0)
    pmask_NxP = np.repeat(batch["mask"][::G, :P_LEN], G, axis=0)
    grouped = {
        "prompt_tokens": prompt_NxP,
        "prompt_mask": pmask_NxP,
        "tokens": batch["tokens"][:, P_LEN:],
        "mask": batch["mask"][:, P_LEN:],
    }
    w_NxT = np.asarray(grouped["mask"], np.float32) * np.arange(1.0, T + 1)

    def score(params, graphdef, b, g):
        rows = (b["prompt_tokens"], b["prompt_mask"], b["tokens"], b["mask"])
        logps, _ = logprobs.completion_logps_and_entropy(graphdef, params, *rows, 1.0, group_size=g)
        return (logps * w_NxT).sum()

    graphdef1, params1 = nnx.split(model)
    want, want_g = jax.jit(jax.value_and_grad(score), static_argnums=(1, 3))(
        params1, graphdef1, grouped, 1
    )

    mesh = make_mesh(axes)
    graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: Transformer(model.config, rngs=nnx.Rngs(0), layout=layout))
    )
    params = jax.device_put(nnx.state(model), param_shardings(nnx.state(model), mesh, layout))
    b = {k: jax.device_put(v, batch_sharding(mesh, v.ndim)) for k, v in grouped.items()}
    step = jax.jit(jax.value_and_grad(score), static_argnums=(1, 3), compiler_options=FAST_COMPILE)
    with jax.set_mesh(mesh):
        got, got_g = step(params, graphdef, b, G)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    flat1, flat = dict(nnx.to_flat_state(want_g)), dict(nnx.to_flat_state(got_g))
    for path, g1 in flat1.items():
        g1 = np.asarray(g1[...])
        scale = np.abs(g1).max()
        np.testing.assert_allclose(
            np.asarray(flat[path][...]), g1, rtol=1e-4, atol=1e-5 * scale, err_msg=str(path)
        )
