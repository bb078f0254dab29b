"""The memory plan of a packed run: a train.microbatch_tokens budget sets the rows of one
forward/backward pass, the LM head runs over a micro-batch's slots (or train.logits_chunk at a
time), and the gradient is carried across micro-batches (docs/packing.md)."""

import dataclasses

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
V, T = HAND.vocab_size, 5


def _activations(rows, mesh, head_tokens=0):
    kw = dict(mesh_shape=mesh, layout="fsdp", beta=0.0, sample_rows=32, seq_len=T, prompt_len=3)
    est = memory.estimate(HAND, batch_rows=rows, head_tokens=head_tokens, **kw)
    return est.activations


def test_a_packed_budget_sets_the_micro_batch_rows_and_the_heads_positions():
    mesh = {"fsdp": 2}
    padded = memory.plan_run(run_config(**RUN), HAND, mesh)
    # 32 rows / 2 accumulation steps, 8 on a device; the head over their T = 5 positions.
    assert padded.activations == _activations(16, mesh)
    assert padded.activations - _activations(16, mesh, head_tokens=1) == (8 * T - 1) * 8 * V
    # The default budget is the padded micro-batch's slots (8 rows of P + T = 8 a shard):
    # the same rows, but the packed head runs over all 64 slots, prompts' included.
    on = memory.plan_run(run_config(**RUN, **{"train.packing": "on"}), HAND, mesh)
    assert on.activations == _activations(16, mesh, head_tokens=64)
    assert on.activations - padded.activations == (64 - 8 * T) * 8 * V
    assert dataclasses.replace(on, activations=padded.activations) == padded
    # 20 slots a shard hold 2 packed rows of 8; 2 shards: 4 rows, a head of 16 positions.
    small = run_config(**RUN, **{"train.packing": "on", "train.microbatch_tokens": 20})
    assert memory.plan_run(small, HAND, mesh).activations == _activations(4, mesh, 16)
    # A budget under one row still holds one.
    tiny = run_config(**RUN, **{"train.packing": "on", "train.microbatch_tokens": 3})
    assert memory.plan_run(tiny, HAND, mesh).activations == _activations(2, mesh, 8)
    # train.logits_chunk bounds the packed head: one chunk at a time.
    chunked = run_config(**RUN, **{"train.packing": "on", "train.logits_chunk": 1})
    assert memory.plan_run(chunked, HAND, mesh).activations == _activations(16, mesh, 1)


def test_the_packed_update_carries_its_gradient_without_grad_accum():
    mesh = {"fsdp": 2}
    one = {**RUN, "optim.grad_accum": 1}
    padded = memory.plan_run(run_config(**one), HAND, mesh)
    packed = memory.plan_run(run_config(**one, **{"train.packing": "on"}), HAND, mesh)
    # The padded update with one part has no carry; the packed one scans its micro-batches
    # with the gradient as the carry, however many a step has.
    assert packed.update_buffers - padded.update_buffers == padded.grads > 0
