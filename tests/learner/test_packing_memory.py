"""Peak memory of the packed update: set by the token budget of a micro-batch, not by the
batch (docs/packing.md). XLA's own figure for the compiled program, its temporaries."""

import functools

import jax
import numpy as np
import pytest
from helpers_batches import grouped_batch, rollout_batch

from grpo_jax.core import sharding
from grpo_jax.core.batch import rollout_batch_shardings
from grpo_jax.learner import optimizer, packing
from grpo_jax.learner import update as upd
from grpo_jax.run.config import GRPOConfig, OptimConfig

G, P, T, V = 4, 6, 10, 100


def _batch(graphdef, params, mesh, B):
    """B prompts' groups with a long tail of completion lengths (geometric, mean ~6)."""
    rng = np.random.default_rng(0)
    rows = grouped_batch(rng, B, G, P, T, V)
    rows["mask"] = np.arange(T)[None] < rng.geometric(0.15, size=B * G).clip(1, T)[:, None]
    adv = rng.normal(size=B * G).astype(np.float32)
    return jax.device_put(rollout_batch(graphdef, params, rows, adv), rollout_batch_shardings(mesh))


@pytest.fixture(scope="module")
def temporaries(tiny_policy, one_device_mesh):
    """temporaries(B, budget): the compiled update's temporary bytes for B prompts (B G
    rows), packed in micro-batches of ``budget`` slots, or padded (budget None: one
    micro-batch of every row)."""
    graphdef, params = tiny_policy
    mesh = one_device_mesh
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-5), 10)
    state = optimizer.init_state(params, tx, mesh)
    kw = dict(
        graphdef=graphdef, tx=tx, schedule=schedule, grpo=GRPOConfig(G=G, beta=0.0),
        minibatch_size=0, grad_accum=1, batch_shards=1, track_update=False, share_prompts=True,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=rollout_batch_shardings(mesh), ref_shardings=None,
        replicated=sharding.replicated(mesh),
    )  # fmt: skip

    @functools.cache
    def temps(B, budget):
        batch = _batch(graphdef, params, mesh, B)
        key = jax.random.key(0)
        if budget is None:
            lowered = upd.jit_update(**kw).lower(state, batch, key, None)
        else:
            settings = packing.PackSettings(
                group_size=G, shards=1, num_minibatches=1, microbatch_tokens=budget,
                default_rows=B * G,
            )  # fmt: skip
            step = packing.jit_packed_update(settings=settings, **kw)
            packs, _ = step.plan(batch)
            lowered = step.jitted.lower(state, batch, key, None, packs)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    return temps


@pytest.mark.slow
def test_the_token_budget_not_the_batch_sets_the_packed_updates_memory(temporaries):
    small, large = 4, 16  # 16 and 64 rows of P + T = 16 slots
    added_slots = (large - small) * G * (P + T)
    for budget in (32, 128):  # 2 and 8 packed rows of 16 slots a micro-batch
        grown = temporaries(large, budget) - temporaries(small, budget)
        # Four times the rows add no more than the whole batch's per-token arrays (log-probs,
        # masks, advantages, the plan's indices): 48 bytes, twelve float32 values, a slot.
        assert grown <= 48 * added_slots, (budget, grown)
    # The budget does set it: four times the slots, over twice the temporaries ...
    assert temporaries(small, 128) > 2 * temporaries(small, 32)
    # ... where the padded update, all rows in one micro-batch, grows with the batch.
    padded = temporaries(large, None) - temporaries(small, None)
    assert padded > 10 * (temporaries(large, 32) - temporaries(small, 32))
