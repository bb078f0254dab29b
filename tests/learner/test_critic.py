"""PPO's critic in the update: a value head in the train state, GAE advantages, warm-up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_batches import rollout_batch

from grpo_jax.core import sharding
from grpo_jax.learner import critic, optimizer
from grpo_jax.learner import update as upd
from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.config import GRPOConfig, OptimConfig

N, P, T, V = 8, 6, 5, 100
REWARDS = np.array([1.0, 0.0, 0.5, -1.0, 2.0, 0.0, 1.0, 0.25], np.float32)
# No gradient clipping: the head's gradient would then share the policy's global norm.
OPTIM = OptimConfig(learning_rate=1e-2, max_grad_norm=0.0)


@pytest.fixture(scope="module")
def setup(tiny_policy, tiny_model_config, one_device_mesh):
    graphdef, params = tiny_policy
    rng = np.random.default_rng(0)
    pm = np.ones((N, P), bool)
    pm[:, :2] = False
    m = np.ones((N, T), bool)
    m[::2, 3:] = False
    m[1, 1:3] = False  # a transcript: tokens 1-2 are an environment's
    rows = dict(
        prompt_tokens=rng.integers(4, V, (N, P)).astype(np.int32),
        prompt_mask=pm,
        tokens=rng.integers(4, V, (N, T)).astype(np.int32),
        mask=m,
    )
    batch = rollout_batch(graphdef, params, rows, np.zeros(N, np.float32))
    batch = batch.replace(rewards_N=REWARDS)
    return graphdef, params, one_device_mesh, batch, tiny_model_config.hidden_size


def _run(setup, grpo, steps=1, batch=None, head=True):
    """``steps`` updates of a fresh state (with a zero value head when ``head``) on the batch."""
    graphdef, params, mesh, default_batch, hidden = setup
    tx, schedule = optimizer.make_optimizer(OPTIM, 10)
    head_params = critic.init_head(hidden, mesh) if head else None
    state = optimizer.init_state(jax.tree.map(jnp.copy, params), tx, mesh, critic=head_params)
    fn = upd.jit_update(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=grpo,
        minibatch_size=0,
        grad_accum=1,
        batch_shards=1,
        track_update=False,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=upd.rollout_batch_shardings(mesh),
        ref_shardings=None,
        replicated=sharding.replicated(mesh),
    )
    metrics = []
    for _ in range(steps):
        state, m = fn(state, default_batch if batch is None else batch, jax.random.key(0), None)
        metrics.append(jax.device_get(m))
    return state, metrics


def _same(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


GAE_MC = dict(G=4, advantage_estimator="gae", whiten_advantages=False)


@pytest.mark.slow
def test_zero_critic_with_gamma_lambda_one_gives_grpo_update_with_reward_advantages(setup):
    # A zero value head and gamma = lambda = 1: every token's advantage is its row's reward,
    # so the policy moves exactly as GRPO's update with advantages_N = the rewards (Adam is
    # elementwise and nothing is clipped by norm, so the head's own update does not mix in).
    state, (m,) = _run(setup, GRPOConfig(**GAE_MC))
    batch = setup[3].replace(advantages_N=REWARDS)
    grpo_state, _ = _run(setup, GRPOConfig(G=4), batch=batch, head=False)
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(grpo_state.params), strict=True):
        # Adam's first step moves a parameter by about lr sign(g) = 1e-2 whatever |g|: a
        # parameter of near-zero gradient takes the rounding of the two loss sums, up to 1e-6.
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    assert not _same(state.critic, critic.init_head(setup[4]))  # the head learned
    assert m["critic/value_mean"] == 0.0 and m["critic/warmup"] == 0.0
    assert m["train/value_loss"] > 0 and np.isfinite(m["critic/explained_variance"])


@pytest.mark.slow
def test_warmup_trains_the_head_alone_then_the_policy(setup):
    graphdef, params, *_ = setup
    grpo = GRPOConfig(**GAE_MC, critic_warmup_steps=2)
    state, ms = _run(setup, grpo, steps=3)
    assert [m["critic/warmup"] for m in ms] == [1.0, 1.0, 0.0]
    two, _ = _run(setup, grpo, steps=2)
    assert _same(two.params, params)  # warm-up: the trunk and LM head did not move
    assert not _same(two.critic, critic.init_head(setup[4]))
    assert not _same(state.params, params)  # step 3: the policy term is on
    # The head fits the returns: the value loss falls over the three steps on one batch.
    losses = [m["train/value_loss"] for m in ms]
    assert losses[2] < losses[1] < losses[0]


def test_moments_are_sharded_like_the_policy_and_the_head(tiny_model_config):
    from flax import nnx

    from grpo_jax.models import create_model

    mesh = sharding.make_mesh({"fsdp": 8})
    gd, params = nnx.split(create_model(tiny_model_config, seed=0, mesh=mesh, layout="fsdp"))
    tx, _ = optimizer.make_optimizer(OptimConfig(), 4)
    head = critic.init_head(tiny_model_config.hidden_size, mesh)
    state = optimizer.init_state(params, tx, mesh, critic=head)
    want = jax.tree.leaves(
        jax.tree.map(lambda x: x.sharding, {"policy": params, "value": state.critic})
    )
    assert any(not sh.is_fully_replicated for sh in want)
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=_is_adam) if _is_adam(s)][0]
    for moments in (adam.mu, adam.nu):
        assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, moments)) == want


def _is_adam(x):
    return hasattr(x, "mu") and hasattr(x, "nu")


@pytest.mark.slow
def test_checkpoint_holds_the_head_and_its_moments_exactly(setup, tmp_path):
    state, _ = _run(setup, GRPOConfig(**GAE_MC), steps=2)
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(1, params=state.params, opt_state=optimizer.saved_opt_state(state), meta={})
    fresh, _ = _run(setup, GRPOConfig(**GAE_MC), steps=0)
    like = optimizer.saved_opt_state(fresh)
    params, saved, _ = ck.restore(1, params_like=fresh.params, opt_state_like=like)
    restored = optimizer.with_saved_opt_state(fresh.replace(params=params), saved)
    assert not _same(fresh.critic, state.critic)
    for name in ("params", "opt_state", "critic"):
        assert _same(getattr(restored, name), getattr(state, name)), name
    ck.close()
