"""The optimizer: schedules, the warm start's AdamW, the non-finite guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.learner import optimizer
from grpo_jax.run.config import OptimConfig, WarmStartConfig


def _params():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
    }


def _grads(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
    }


def _leaves_equal(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_lr_schedules():
    warm = optimizer.lr_schedule(OptimConfig(learning_rate=1.0, warmup_steps=4), 10)
    assert [float(warm(i)) for i in (0, 2, 4, 9)] == [0.0, 0.5, 1.0, 1.0]
    cos = optimizer.lr_schedule(
        OptimConfig(learning_rate=1.0, schedule="cosine", end_lr_factor=0.1), 11
    )
    assert float(cos(0)) == pytest.approx(1.0) and float(cos(10)) == pytest.approx(0.1)
    lin = optimizer.lr_schedule(OptimConfig(learning_rate=1.0, schedule="linear"), 5)
    assert float(lin(0)) == 1.0 and float(lin(4)) == pytest.approx(0.0)


def test_warm_start_optimizer_is_adamw_with_b2_0999_and_a_constant_rate():
    """WarmStartConfig.optim(): clip, then optax's AdamW at its default moments, bit for bit."""
    ws = WarmStartConfig(learning_rate=3e-3, warmup_steps=3, weight_decay=0.01, max_grad_norm=0.5)
    cfg = ws.optim()
    assert (cfg.b1, cfg.b2, cfg.eps, cfg.schedule) == (0.9, 0.999, 1e-8, "constant")
    tx, schedule = optimizer.make_optimizer(cfg, 100)
    want_schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, 3e-3, 3), optax.constant_schedule(3e-3)], [3]
    )
    want_tx = optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(want_schedule, weight_decay=0.01)
    )
    assert [float(schedule(u)) for u in (0, 1, 3, 99)] == [
        float(want_schedule(u)) for u in (0, 1, 3, 99)
    ]

    @jax.jit
    def run(params):
        out = []
        for opt in (tx, want_tx):
            s = opt.init(params)
            p = params
            for i in range(6):
                u, s = opt.update(_grads(i), s, p)
                p = optax.apply_updates(p, u)
            out.append((p, s))
        return out

    (p_a, s_a), (p_b, s_b) = run(_params())
    assert _leaves_equal(p_a, p_b) and _leaves_equal(s_a, s_b)


@pytest.mark.slow
def test_apply_guarded_applies_a_finite_update_and_skips_a_nonfinite_one():
    tx, _ = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    state = optimizer.init_state(_params(), tx)
    step = jax.jit(lambda st, g, loss: optimizer.apply_guarded(st, g, loss, tx))

    state, norm, finite = step(state, _grads(1), jnp.float32(1.0))
    assert bool(finite) and float(norm) == pytest.approx(float(optax.global_norm(_grads(1))))
    assert (int(state.updates), int(state.skipped), int(state.skipped_in_row)) == (1, 0, 0)
    before = jax.device_get((state.params, state.opt_state))

    nan_grads = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(2))
    for i, (g, loss) in enumerate(((nan_grads, 1.0), (_grads(2), jnp.inf)), start=1):
        state, _, finite = step(state, g, jnp.float32(loss))
        assert not bool(finite)
        # Parameters and both Adam moments keep their values bit for bit.
        assert _leaves_equal(state.params, before[0])
        assert _leaves_equal(state.opt_state, before[1])
        assert (int(state.updates), int(state.skipped), int(state.skipped_in_row)) == (1, i, i)

    state, _, finite = step(state, _grads(3), jnp.float32(1.0))
    assert bool(finite) and not _leaves_equal(state.params, before[0])
    assert (int(state.updates), int(state.skipped), int(state.skipped_in_row)) == (2, 2, 0)
    assert int(state.step) == 0  # the caller's counter


def _moments_follow_params(state):
    """Every Adam moment has the sharding of the parameter it belongs to."""
    mu_nu = [s for s in jax.tree.leaves(state.opt_state, is_leaf=_is_adam) if _is_adam(s)]
    assert len(mu_nu) == 1
    param_sh = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state.params))
    for moments in (mu_nu[0].mu, mu_nu[0].nu):
        moment_sh = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, moments))
        assert moment_sh == param_sh


def _is_adam(x):
    return isinstance(x, optax.ScaleByAdamState)


def _device_bytes(tree, device):
    """Bytes of ``tree``'s arrays that ``device`` holds."""
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"fsdp": 8}, {"data": 2, "fsdp": 4}])
def test_fsdp_moments_are_sharded_like_their_parameters(axes, tiny_model_config, tmp_path):
    """With an fsdp layout each device holds its share of the moments, not all of them: after
    init, after an update and after a restore from a checkpoint. ``tx.init`` never reads the
    parameters' values, so a plain ``jax.jit(tx.init)`` made the moments on one device and
    replicated them (8 bytes per parameter on every device). The memory plan, which assumes
    sharded moments, must count the bytes a device really holds."""
    from flax import nnx
    from helpers_batches import rollout_batch

    from grpo_jax.core import sharding
    from grpo_jax.learner import update as upd
    from grpo_jax.models import create_model
    from grpo_jax.run import memory
    from grpo_jax.run.checkpoints import Checkpointer
    from grpo_jax.run.config import GRPOConfig

    mesh = sharding.make_mesh(axes)
    cfg = tiny_model_config
    graphdef, params = nnx.split(create_model(cfg, seed=0, mesh=mesh, layout="fsdp"))
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 4)
    state = optimizer.init_state(params, tx, mesh)
    _moments_follow_params(state)
    # The test means something only if fsdp shards the large parameters.
    sharded = [x for x in jax.tree.leaves(state.params) if not x.sharding.is_fully_replicated]
    assert len(sharded) >= 5

    dev = mesh.devices.flat[0]
    est = memory.estimate(
        cfg, mesh_shape=mesh.shape, layout="fsdp", batch_rows=8, seq_len=3, prompt_len=4, beta=0
    )
    assert est.optimizer == _device_bytes(state.opt_state, dev) - _device_bytes(
        [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 0], dev
    )
    assert est.params == _device_bytes(state.params, dev)

    n, p, t = 8, 4, 3
    rng = np.random.default_rng(1)
    rows = dict(
        prompt_tokens=rng.integers(4, cfg.vocab_size, (n, p)).astype(np.int32),
        prompt_mask=np.ones((n, p), bool),
        tokens=rng.integers(4, cfg.vocab_size, (n, t)).astype(np.int32),
        mask=np.ones((n, t), bool),
    )
    batch = rollout_batch(graphdef, params, rows, rng.normal(size=n).astype(np.float32))
    step = upd.jit_update(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=GRPOConfig(G=4),
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
    state, _ = step(state, batch, jax.random.key(0), None)
    assert int(state.updates) == 1
    _moments_follow_params(state)

    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(1, params=state.params, opt_state=state.opt_state, meta={})
    _, opt_state, _ = ck.restore(1, params_like=state.params, opt_state_like=state.opt_state)
    _moments_follow_params(state.replace(opt_state=opt_state))
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(state.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # about 1.7 s: the fast tier stays under 90 s cold
def test_lora_moments_are_sharded_like_their_adapters(tiny_model_config):
    """With LoRA the optimizer follows the adapters alone, each moment laid out as its adapter."""
    from flax import nnx

    from grpo_jax.core import sharding
    from grpo_jax.models import create_model, lora
    from grpo_jax.run.config import LoRAConfig

    mesh = sharding.make_mesh({"fsdp": 8})
    gd, params = nnx.split(create_model(tiny_model_config, seed=0, mesh=mesh, layout="fsdp"))
    cfg = LoRAConfig(rank=8, alpha=8.0)
    _, params, _ = lora.attach_params(gd, params, cfg, jax.random.key(1), mesh=mesh)
    tx, _ = optimizer.make_optimizer(OptimConfig(), 4)
    trained = lora.trainable(params)
    state = optimizer.init_state(params, tx, mesh, trained=trained)
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=_is_adam) if _is_adam(s)][0]
    adapter_sh = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, trained))
    assert any(not sh.is_fully_replicated for sh in adapter_sh)
    for moments in (adam.mu, adam.nu):
        assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, moments)) == adapter_sh
