"""The update keeps each device's rows on it: compiled for 8 devices with fsdp, it reduces
no activation. Jitted with its arguments' shardings alone (no mesh set while tracing), the
model's activation constraints were no-ops and GSPMD carried the parameters' fsdp sharding
into the activations: every device computed every row over part of the model width and
all-reduced the whole result (on a v5e-16 the Qwen2.5-0.5B recipe's update needed 13.4 GiB
per chip for 5.8 with rows split; docs/pods.md)."""

import jax
import pytest
from flax import nnx
from helpers_hlo import reduced_activations

from grpo_jax.core import batch as batch_lib
from grpo_jax.core import sharding
from grpo_jax.learner import optimizer
from grpo_jax.learner import update as upd
from grpo_jax.learner.optimizer import OptimConfig
from grpo_jax.models import create_model
from grpo_jax.objective.config import GRPOConfig

# No model size among them (the tiny model's are 1, 2, 16, 32, 64, 100).
B, G, P, T = 8, 3, 10, 6


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_update_reduces_no_activation_on_a_mesh(beta, tiny_model_config):
    mesh = sharding.make_mesh({"fsdp": 8})
    graphdef, params = nnx.split(create_model(tiny_model_config, seed=0, mesh=mesh, layout="fsdp"))
    tx, schedule = optimizer.make_optimizer(OptimConfig(), 4)
    state = optimizer.init_state(params, tx, mesh)
    bsh = batch_lib.rollout_batch_shardings(mesh)
    step = upd.jit_update(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=GRPOConfig(G=G, beta=beta),
        minibatch_size=0,
        grad_accum=1,
        batch_shards=sharding.batch_shards(mesh),
        track_update=True,
        logits_chunk=3,
        share_prompts=True,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=bsh,
        ref_shardings=jax.tree.map(lambda x: x.sharding, params) if beta else None,
        replicated=sharding.replicated(mesh),
    )
    batch = batch_lib.batch_spec(bsh, B * G, P, T)
    ref = params if beta else None
    text = step.lower(state, batch, jax.random.key(0), ref).compile().as_text()
    rows = reduced_activations(text, B * G, (3, T, P, P + T))  # completions, chunks, prompts
    prompts = reduced_activations(text, B, (P,))  # the prompt-once pass
    assert rows == [] and prompts == []
