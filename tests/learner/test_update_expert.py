"""Expert parallelism in the update: one GRPO step of a mixture of experts on 8 fake CPU devices
(expert 4 x fsdp 2) gives the single-device loss, gradient and parameters, and each expert
weight's Adam moments are split over the expert axis as the weight is."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers_batches import rollout_batch
from jax.sharding import PartitionSpec as P

from grpo_jax.core import sharding
from grpo_jax.learner import optimizer
from grpo_jax.learner import update as upd
from grpo_jax.models import create_model, family_config
from grpo_jax.run import memory
from grpo_jax.run.config import GRPOConfig, OptimConfig

CFG = family_config(
    "qwen3_moe", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, mlp_dim=32, moe_mlp_dim=16, num_experts=8, experts_per_token=2,
)  # fmt: skip
N, G, PL, T = 8, 4, 5, 4
# A large eps keeps Adam's first step smooth in the gradient (g / (|g| + eps)), so round-off
# in a near-zero gradient cannot flip a parameter's step from +lr to -lr.
OPTIM = OptimConfig(learning_rate=1e-2, eps=1e-3)


def _rows():
    rng = np.random.default_rng(3)
    pmask = np.ones((N, PL), bool)
    pmask[::3, :2] = False
    mask = np.ones((N, T), bool)
    mask[1::2, -1:] = False
    return dict(
        prompt_tokens=np.repeat(rng.integers(4, CFG.vocab_size, (N // G, PL)), G, 0).astype(
            np.int32
        ),
        prompt_mask=pmask,
        tokens=rng.integers(4, CFG.vocab_size, (N, T)).astype(np.int32),
        mask=mask,
    ), rng.normal(size=N).astype(np.float32)


def _one_step(mesh, layout):
    """(state after one update, its metrics) of the sharpened model on ``mesh``."""
    graphdef, params = nnx.split(create_model(CFG, seed=1, mesh=mesh, layout=layout))
    # Sharpened (elementwise: the shardings stay): routes and logits far from ties.
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
    tx, schedule = optimizer.make_optimizer(OPTIM, 4)
    state = optimizer.init_state(params, tx, mesh)
    rows, advantages = _rows()
    batch = rollout_batch(graphdef, params, rows, advantages, G=G)
    step = upd.jit_update(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=GRPOConfig(G=G, beta=0.0),
        minibatch_size=0,
        grad_accum=1,
        batch_shards=sharding.batch_shards(mesh),
        track_update=False,
        logits_chunk=0,
        share_prompts=False,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=upd.rollout_batch_shardings(mesh),
        ref_shardings=None,
        replicated=sharding.replicated(mesh),
    )
    state, metrics = step(state, batch, jax.random.key(0), None)
    return state, jax.device_get(metrics)


def _adam(state):
    return next(s for s in jax.tree.leaves(state.opt_state, is_leaf=_is_adam) if _is_adam(s))


def _is_adam(x):
    return isinstance(x, optax.ScaleByAdamState)


def _device_bytes(tree, device):
    return sum(
        s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
        if s.device == device
    )  # fmt: skip


def _assert_trees_close(got, want, rtol, scale_atol):
    flat_want, flat_got = dict(nnx.to_flat_state(want)), dict(nnx.to_flat_state(got))
    assert flat_got.keys() == flat_want.keys()
    for path, w in flat_want.items():
        w, g = np.asarray(w[...]), np.asarray(flat_got[path][...])
        scale = np.abs(w).max()
        assert scale > 0, f"zero at {path}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=scale_atol * scale, err_msg=str(path))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_expert_sharded_update_equals_single_device(layout):
    want, want_m = _one_step(sharding.make_mesh({"data": 1}, jax.devices()[:1]), "fsdp")
    mesh = sharding.make_mesh({"expert": 4, "fsdp": 2}, jax.devices()[:8])
    got, got_m = _one_step(mesh, layout)

    # The experts really are split: 2 of 8 per device, and their moments with them.
    gate = got.params["layers"][0]["mlp"]["gate_experts"][...]
    spec = P("expert", "fsdp", None if layout == "fsdp" else "tensor")
    assert gate.sharding.spec == spec and gate.addressable_shards[0].data.shape[0] == 2
    adam = _adam(got)
    for moments in (adam.mu, adam.nu):
        assert moments["layers"][0]["mlp"]["down_experts"][...].sharding.spec[0] == "expert"
        want_sh = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, got.params))
        assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, moments)) == want_sh
    # The memory plan counts what a device really holds of the parameters and the moments.
    est = memory.estimate(
        CFG, mesh_shape=mesh.shape, layout=layout, batch_rows=N, seq_len=T, prompt_len=PL, beta=0
    )
    dev = mesh.devices.flat[0]
    assert est.params == _device_bytes(got.params, dev)
    assert est.optimizer == _device_bytes([adam.mu, adam.nu], dev)

    assert int(got.updates) == 1 and got_m["train/skipped_updates"] == 0
    assert abs(want_m["train/loss"]) > 1e-4  # not a degenerate zero loss
    np.testing.assert_allclose(got_m["train/loss"], want_m["train/loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_m["train/grad_norm"], want_m["train/grad_norm"], rtol=1e-5)
    # The first moment is (1 - b1) times the (clipped) gradient: the gradient, leaf by leaf.
    _assert_trees_close(adam.mu, _adam(want).mu, rtol=1e-4, scale_atol=1e-5)
    _assert_trees_close(got.params, want.params, rtol=1e-5, scale_atol=1e-6)
