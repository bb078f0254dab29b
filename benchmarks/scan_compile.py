"""Compile time and step time of the GRPO update, layers unrolled vs as a scan, by depth.

    .venv/bin/python benchmarks/scan_compile.py [--depths 4,12,24,36] [--repeats 5] [--hidden 64]

For each depth L a small random Qwen2-style model (D = ``--hidden``, default
64, with D / 16 query heads of 16 sharing D / 32 KV heads, MLP 2 D,
vocabulary 128) is built unrolled and with
``scan_layers=True`` (the same weights, stacked), and the library's jitted
update (``grpo_jax.learner.update.jit_update``: one AdamW step on 8 rollouts of a
16-token prompt and 64 completion tokens, beta = 0) is compiled
(``lower(...).compile()``, wall time: the first step's compilation) and then
run ``--repeats`` times (median step time). Each configuration compiles in
a fresh jit, in this process, on one CPU device; ``--remat`` adds remat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from grpo_jax.core import sharding
from grpo_jax.learner import optimizer
from grpo_jax.learner import update as upd
from grpo_jax.models import create_model, tiny_config
from grpo_jax.rollout.rounds import RolloutBatch
from grpo_jax.run.config import GRPOConfig, OptimConfig

N, P, T = 8, 16, 64


def make_batch(vocab: int) -> RolloutBatch:
    rng = np.random.default_rng(0)
    return RolloutBatch(
        prompt_tokens_NxP=rng.integers(0, vocab, (N, P)).astype(np.int32),
        prompt_mask_NxP=np.ones((N, P), bool),
        tokens_NxT=rng.integers(0, vocab, (N, T)).astype(np.int32),
        mask_NxT=np.ones((N, T), bool),
        old_logps_NxT=np.full((N, T), -np.log(vocab), np.float32),
        behavior_logps_NxT=np.full((N, T), -np.log(vocab), np.float32),
        rewards_N=np.zeros(N, np.float32),
        advantages_N=np.linspace(-1, 1, N).astype(np.float32),
        weights_N=np.ones(N, np.float32),
        group_ids_N=np.arange(N, dtype=np.int32) // 4,
    )


def measure(layers: int, scan: bool, remat: bool, repeats: int, hidden: int = 64):
    cfg = tiny_config(
        128,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 16,
        num_kv_heads=hidden // 32,
        head_dim=16,
        mlp_dim=2 * hidden,
        scan_layers=scan,
        remat=remat,
    )
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    graphdef, params = nnx.split(create_model(cfg, mesh=mesh))
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-4), 10)
    state = optimizer.init_state(params, tx, mesh)
    fn = upd.jit_update(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=GRPOConfig(G=4),
        minibatch_size=0,
        grad_accum=1,
        batch_shards=1,
        track_update=False,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=upd.rollout_batch_shardings(mesh),
        ref_shardings=None,
        replicated=sharding.replicated(mesh),
    )
    batch, key = make_batch(cfg.vocab_size), jax.random.key(0)
    t0 = time.perf_counter()
    compiled = fn.lower(state, batch, key, None).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch, key, None)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    return compile_s, statistics.median(times[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depths", default="4,12,24,36")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--remat", action="store_true")
    p.add_argument("--hidden", type=int, default=64, help="model width D (a multiple of 32)")
    args = p.parse_args()
    if args.hidden < 32 or args.hidden % 32:
        raise SystemExit(f"--hidden must be a positive multiple of 32, got {args.hidden}")
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, remat {args.remat}, "
        f"width {args.hidden}"
    )
    print(
        "| layers | compile unrolled (s) | compile scanned (s) | step unrolled (ms) "
        "| step scanned (ms) | scanned / unrolled step |"
    )
    print("|---|---|---|---|---|---|")
    for L in (int(d) for d in args.depths.split(",")):
        cu, su = measure(L, False, args.remat, args.repeats, args.hidden)
        cs, ss = measure(L, True, args.remat, args.repeats, args.hidden)
        print(
            f"| {L} | {cu:.2f} | {cs:.2f} | {su * 1e3:.1f} | {ss * 1e3:.1f} | {ss / su:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
