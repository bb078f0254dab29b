"""The optimizer: schedules, the warm start's AdamW, the non-finite guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax import optimizer
from grpo_jax.config import OptimConfig, WarmStartConfig


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
