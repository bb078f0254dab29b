"""The memory plan of a packed run: a train.microbatch_tokens budget sets the rows of one
forward/backward pass (docs/packing.md)."""

from helpers_config import run_config
from test_memory import HAND

from grpo_jax.run import memory

RUN = {
    "grpo.G": 4,
    "train.batch_size": 8,
    "optim.grad_accum": 2,
    "sampling.max_new_tokens": 5,
    "sampling.prompt_buckets": (2, 3),
    "warm_start.enabled": False,
}


def _activations(rows, mesh):
    est = memory.estimate(HAND, mesh_shape=mesh, layout="fsdp", beta=0.0, batch_rows=rows,
                          sample_rows=32, seq_len=5, prompt_len=3)  # fmt: skip
    return est.activations


def test_a_packed_budget_sets_the_micro_batch_rows():
    mesh = {"fsdp": 2}
    padded = memory.plan_run(run_config(**RUN), HAND, mesh)
    assert padded.activations == _activations(16, mesh)  # 32 rows / 2 accumulation steps
    # The default budget is the padded micro-batch's slots: the same plan.
    on = run_config(**RUN, **{"train.packing": "on"})
    assert memory.plan_run(on, HAND, mesh) == padded
    # 20 slots a shard hold 2 packed rows of P + T = 8; 2 shards.
    small = run_config(**RUN, **{"train.packing": "on", "train.microbatch_tokens": 20})
    assert memory.plan_run(small, HAND, mesh).activations == _activations(4, mesh)
    # A budget under one row still holds one.
    tiny = run_config(**RUN, **{"train.packing": "on", "train.microbatch_tokens": 3})
    assert memory.plan_run(tiny, HAND, mesh).activations == _activations(2, mesh)
