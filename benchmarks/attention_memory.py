"""Peak memory and step time of the GRPO update at long contexts: einsum vs blockwise attention.

    .venv/bin/python benchmarks/attention_memory.py [--lengths 1024,4096,8192] [--rows 2]

The update is the library's own jitted ``grpo_jax.learner.update.jit_update`` (one
minibatch, AdamW, beta = 0) on a synthetic rollout batch of ``rows``
completions (one group) of T tokens after a 16-token prompt, for a small random Qwen2-style
model (D 64, 2 layers, 2 query heads of 32 sharing 1 KV head, vocabulary
128): small enough that the attention, not the weights, decides the memory.

Memory: XLA's own analysis of the compiled update
(``jitted.lower(...).compile().memory_analysis()``): ``temp`` is the scratch
the program needs beyond its arguments and outputs (activations, scores,
gradients), ``peak`` = arguments + outputs + temp, an upper bound (donated
state aliases its output). Time: median wall time of ``--repeats`` updates
after one compiling call, skipped where the analysis says the step needs
more than ``--max-gib`` (default 4 GiB: the machine is shared).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from grpo_jax.core import sharding
from grpo_jax.learner import optimizer
from grpo_jax.learner import update as upd
from grpo_jax.models import create_model, tiny_config
from grpo_jax.rollout.rounds import RolloutBatch
from grpo_jax.run.config import GRPOConfig, OptimConfig

P = 16


def make_batch(rows: int, T: int, vocab: int) -> RolloutBatch:
    rng = np.random.default_rng(0)
    n = rows
    return RolloutBatch(
        prompt_tokens_NxP=rng.integers(0, vocab, (n, P)).astype(np.int32),
        prompt_mask_NxP=np.ones((n, P), bool),
        tokens_NxT=rng.integers(0, vocab, (n, T)).astype(np.int32),
        mask_NxT=np.ones((n, T), bool),
        old_logps_NxT=np.full((n, T), -np.log(vocab), np.float32),
        behavior_logps_NxT=np.full((n, T), -np.log(vocab), np.float32),
        rewards_N=np.zeros(n, np.float32),
        advantages_N=np.linspace(-1, 1, n).astype(np.float32),
        weights_N=np.ones(n, np.float32),
        group_ids_N=np.zeros(n, np.int32),
    )


def measure(attention: str, T: int, rows: int, repeats: int, max_gib: float, block: int):
    cfg = tiny_config(
        128,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        mlp_dim=128,
        max_position_embeddings=P + T,
        attention=attention,
        attention_block_size=block,
    )
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    from flax import nnx

    graphdef, params = nnx.split(create_model(cfg, mesh=mesh))
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-4), 10)
    state = optimizer.init_state(params, tx, mesh)
    fn = upd.jit_update(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=GRPOConfig(G=rows),
        minibatch_size=0,
        grad_accum=1,
        batch_shards=1,
        track_update=False,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=upd.rollout_batch_shardings(mesh),
        ref_shardings=None,
        replicated=sharding.replicated(mesh),
    )
    batch = make_batch(rows, T, cfg.vocab_size)
    key = jax.random.key(0)
    t0 = time.perf_counter()
    compiled = fn.lower(state, batch, key, None).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp = mem.temp_size_in_bytes
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + temp
    times = []
    if peak <= max_gib * 2**30:
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch, key, None)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t0)
        times = times[1:]
    step = f"{statistics.median(times):8.2f}" if times else "  (skip)"
    return temp, peak, compile_s, step


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-gib", type=float, default=4.0)
    p.add_argument("--block", type=int, default=512)
    args = p.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, rows {args.rows}, prompt {P}")
    print("| T | attention | XLA temp (MiB) | XLA peak (MiB) | compile (s) | step (s) |")
    print("|---|---|---|---|---|---|")
    for T in (int(t) for t in args.lengths.split(",")):
        for attention in ("einsum", "blockwise"):
            temp, peak, compile_s, step = measure(
                attention, T, args.rows, args.repeats, args.max_gib, args.block
            )
            print(
                f"| {T} | {attention} | {temp / 2**20:.1f} | {peak / 2**20:.1f} | "
                f"{compile_s:.1f} | {step.strip()} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
