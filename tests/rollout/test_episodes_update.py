"""The update on multi-turn transcripts: environment tokens are context, never a loss term."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_episodes import _model, _run

from grpo_jax.core import sharding
from grpo_jax.learner import optimizer
from grpo_jax.learner import update as upd
from grpo_jax.rollout.rounds import RolloutBatch
from grpo_jax.run.config import GRPOConfig, OptimConfig

G = 2


@pytest.fixture(scope="module")
def episode_batch(one_device_mesh):
    graphdef, params = _model("qwen2")
    with jax.default_device(one_device_mesh.devices.flat[0]):
        ep = _run(graphdef, params, g=G, max_turn_tokens=5)
    n = len(ep.rewards_N)
    rng = np.random.default_rng(0)
    batch = RolloutBatch(
        prompt_tokens_NxP=ep.prompt_tokens_NxP,
        prompt_mask_NxP=ep.prompt_mask_NxP,
        tokens_NxT=ep.tokens_NxT,
        mask_NxT=ep.mask_NxT,
        old_logps_NxT=ep.logps_NxT,
        behavior_logps_NxT=ep.behavior_logps_NxT,
        rewards_N=np.zeros(n, np.float32),
        advantages_N=rng.normal(size=n).astype(np.float32),
        weights_N=np.ones(n, np.float32),
        group_ids_N=np.arange(n, dtype=np.int32) // G,
    )
    env_NxT = ~ep.mask_NxT & (np.arange(ep.tokens_NxT.shape[1]) < ep.lengths_N[:, None])
    assert env_NxT.sum() >= 4
    return graphdef, params, batch, env_NxT


def _update(graphdef, params, batch, mesh):
    grpo = GRPOConfig(G=G, beta=0.0)
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    state = optimizer.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    fn = upd.jit_update(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=grpo,
        minibatch_size=0,
        grad_accum=1,
        batch_shards=1,
        track_update=False,
        share_prompts=True,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=upd.rollout_batch_shardings(mesh),
        ref_shardings=None,
        replicated=sharding.replicated(mesh),
    )
    batch = jax.device_put(batch, upd.rollout_batch_shardings(mesh))
    state, metrics = fn(state, batch, jax.random.key(0), None)
    return jax.device_get(state.params), jax.device_get(metrics)


@pytest.mark.slow
def test_first_update_has_ratio_one_on_transcripts(episode_batch, one_device_mesh):
    graphdef, params, batch, _ = episode_batch
    _, metrics = _update(graphdef, params, batch, one_device_mesh)
    # The update's scoring of the transcripts reproduces the sampler's log-probs.
    assert abs(float(metrics["train/ratio_min"]) - 1) < 1e-4
    assert abs(float(metrics["train/ratio_max"]) - 1) < 1e-4


@pytest.mark.slow
def test_environment_tokens_get_no_gradient(episode_batch, one_device_mesh):
    graphdef, params, batch, env_NxT = episode_batch
    base, _ = _update(graphdef, params, batch, one_device_mesh)
    # Whatever is recorded at environment positions is ignored by the update.
    garbage = dataclasses.replace(
        batch,
        old_logps_NxT=np.where(env_NxT, 3.0, batch.old_logps_NxT).astype(np.float32),
        behavior_logps_NxT=np.where(env_NxT, -7.0, batch.behavior_logps_NxT).astype(np.float32),
    )
    same, _ = _update(graphdef, params, garbage, one_device_mesh)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(same)):
        np.testing.assert_array_equal(a, b)
    # Control: scoring the environment tokens as if the model wrote them changes the update.
    scored = dataclasses.replace(
        batch,
        mask_NxT=batch.mask_NxT | env_NxT,
        old_logps_NxT=np.where(env_NxT, -3.0, batch.old_logps_NxT).astype(np.float32),
        behavior_logps_NxT=np.where(env_NxT, -3.0, batch.behavior_logps_NxT).astype(np.float32),
    )
    other, _ = _update(graphdef, params, scored, one_device_mesh)
    assert any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(other))
    )
