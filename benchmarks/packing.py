"""The update and its scoring pass, packed against padded, on a long tail of completion lengths.

One random model (``tiny_config`` family, float32, built in process, as ``engine.py``), B
prompts of lengths from P/3 to P, G completions each whose lengths are ``engine.py``'s long
tail: geometric, a row ending at each token with probability ``--eos-count`` / V, truncated at
T (the lengths are drawn, not sampled: the update's cost depends on them alone). Two programs,
each padded (train.packing = "off") and packed ("on"), side by side in this process,
alternating, ``--runs`` times after a warm-up that compiles them:

- update: one GRPO update of the whole batch (mu = 1, one minibatch, beta 0), the padded one
  in ``--grad-accum`` micro-batches of N / A rows, the packed one in micro-batches of as many
  slots (``train.microbatch_tokens`` = N / A (P + T)), its host-side plan included;
- scoring: the reference pass's log-probs of the whole batch (forward only).

Reported per program: completion tokens (the lengths' sum) per second, median over runs, and
the ratio packed / padded; the update's compiled temporary memory (XLA's memory analysis) of
each, the padded micro-batch's slots and the packed's.

    python benchmarks/packing.py                      # the defaults below
    python benchmarks/packing.py --max-new-tokens 512 --eos-count 16
    python benchmarks/packing.py --memory             # the update's memory, below

``--memory`` times nothing: it compiles the update for B and 4 B prompts, packed with
micro-batches of 1, 4 and 16 rows of P + T slots (``train.microbatch_tokens``) and padded
in ``--grad-accum`` micro-batches, and prints XLA's temporary memory of each: the packed
update's follows its token budget, the padded one's its batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.core import sharding
from grpo_jax.core.batch import RolloutBatch, rollout_batch_shardings
from grpo_jax.learner import optimizer, packing, step
from grpo_jax.learner import update as upd
from grpo_jax.models import create_model, tiny_config
from grpo_jax.objective.config import GRPOConfig
from grpo_jax.objective.logprobs import completion_logps
from grpo_jax.run.config import OptimConfig
from grpo_jax.sampling.static import pad_prompts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8, help="B, distinct prompts")
    p.add_argument("--num-samples", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--prompt-len", type=int, default=48, help="longest prompt (others shorter)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="T")
    p.add_argument("--eos-count", type=int, default=32, help="ids that end a row (of V)")
    p.add_argument("--grad-accum", type=int, default=8, help="the padded update's micro-batches")
    p.add_argument("--runs", type=int, default=5, help="timed runs per program (median)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--mlp", type=int, default=768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory", action="store_true", help="compiled memory by budget and batch")
    return p.parse_args(argv)


def _batch(a, rng) -> RolloutBatch:
    B, G, P, T = a.prompts, a.num_samples, a.prompt_len, a.max_new_tokens
    n = B * G
    lengths = np.linspace(P // 3, P, B).astype(int)
    prompts = [rng.integers(a.eos_count, a.vocab, k).tolist() for k in lengths]
    tokens_BxP, mask_BxP = pad_prompts(prompts, pad_id=0, buckets=(P,))
    done = np.minimum(rng.geometric(a.eos_count / a.vocab, n), T)  # EOS included
    mask_NxT = np.arange(T)[None, :] < done[:, None]
    tokens_NxT = np.where(mask_NxT, rng.integers(a.eos_count, a.vocab, (n, T)), 0)
    zeros = np.zeros((n, T), np.float32)
    return RolloutBatch(
        prompt_tokens_NxP=np.repeat(tokens_BxP, G, axis=0).astype(np.int32),
        prompt_mask_NxP=np.repeat(mask_BxP, G, axis=0),
        tokens_NxT=tokens_NxT.astype(np.int32),
        mask_NxT=mask_NxT,
        old_logps_NxT=zeros - 7.0 * mask_NxT,
        behavior_logps_NxT=zeros - 7.0 * mask_NxT,
        rewards_N=np.zeros(n, np.float32),
        advantages_N=rng.standard_normal(n).astype(np.float32),
        weights_N=np.ones(n, np.float32),
        group_ids_N=np.arange(n, dtype=np.int32) // G,
    )


def main(argv=None) -> None:
    a = parse_args(argv)
    cfg = tiny_config(
        a.vocab,
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.hidden // a.heads,
        mlp_dim=a.mlp,
    )
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    graphdef, params = nnx.split(create_model(cfg, seed=a.seed, mesh=mesh))
    rng = np.random.default_rng(a.seed)
    batch = jax.device_put(_batch(a, rng), rollout_batch_shardings(mesh))
    n, (P, T), G = batch.num_rows, (a.prompt_len, a.max_new_tokens), a.num_samples
    lengths = np.asarray(batch.mask_NxT).sum(1)
    grpo = GRPOConfig(G=G, beta=0.0)
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-5), 10)
    state = optimizer.init_state(params, tx, mesh)
    kw = dict(
        graphdef=graphdef, tx=tx, schedule=schedule, grpo=grpo, minibatch_size=0,
        grad_accum=a.grad_accum, batch_shards=1, track_update=False, share_prompts=True,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=rollout_batch_shardings(mesh), ref_shardings=None,
        replicated=sharding.replicated(mesh),
    )  # fmt: skip
    if a.memory:
        return _memory_table(a, graphdef, params, state, kw, mesh)
    rows = n // a.grad_accum
    budget = rows * (P + T)
    settings = packing.PackSettings(
        group_size=G, shards=1, num_minibatches=1, microbatch_tokens=budget, default_rows=rows
    )
    padded_update = upd.jit_update(**kw)
    packed_update = packing.jit_packed_update(settings=settings, **kw)
    key = jax.random.key(0)
    no_donate = lambda s: jax.tree.map(jnp.copy, s)

    score_padded = jax.jit(
        lambda p, b: completion_logps(
            graphdef, p, b.prompt_tokens_NxP, b.prompt_mask_NxP, b.tokens_NxT, b.mask_NxT, 1.0,
            group_size=G,
        )
    )  # fmt: skip

    def score_packed_fn(p, b, packs):
        plan = step.StepPlan(
            graphdef=graphdef, base_graphdef=None, tx=tx, schedule=schedule, objective=grpo,
            logits_chunk=0, grad_accum=1, batch_shards=1, g_full=G, g_micro=G, lora_dropout=0.0,
            packs=packs,
        )  # fmt: skip
        return plan.logps(p, b, G)

    score_packed_jit = jax.jit(score_packed_fn)

    def score_packed(p, b):
        packs, _ = packed_update.plan(b)
        return score_packed_jit(p, b, packs)

    programs = {
        ("update", "padded"): lambda: padded_update(no_donate(state), batch, key, None)[1][
            "train/loss"
        ],
        ("update", "packed"): lambda: packed_update(no_donate(state), batch, key, None)[1][
            "train/loss"
        ],
        ("scoring", "padded"): lambda: score_padded(params, batch),
        ("scoring", "packed"): lambda: score_packed(params, batch),
    }
    q50, q90 = np.percentile(lengths, [50, 90])
    _, stats = packed_update.plan(batch)
    print(
        f"model D={a.hidden} L={a.layers} H={a.heads}/{a.kv_heads} V={a.vocab}; B={a.prompts} "
        f"G={G} ({n} rows), prompts {P // 3}-{P} tokens, T={T}, {a.eos_count} EOS ids; "
        f"backend {jax.default_backend()}"
    )
    print(
        f"completion lengths: mean {lengths.mean():.1f}, p50 {q50:.0f}, p90 {q90:.0f}, "
        f"max {lengths.max()}; padded: {a.grad_accum} micro-batches of {rows} rows x {P + T} "
        f"slots; packed: {stats['micro_batches']} micro-batch(es) of {budget} slots "
        f"({stats['compiled_micro_batches']} compiled), fill {stats['tokens'] / stats['slots']:.2f}"
    )
    for name, run in programs.items():  # warm-up: compiles every program the runs use
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        print(
            f"{name[0]} {name[1]}: warm-up (compilation included) {time.perf_counter() - t0:.1f}s"
        )
    rates: dict = {k: [] for k in programs}
    for r in range(a.runs):
        for name, run in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            dt = time.perf_counter() - t0
            rates[name].append(lengths.sum() / dt)
            print(f"run {r} {name[0]:>7} {name[1]}: {dt:6.3f}s = {rates[name][-1]:9.1f} tokens/s")
    med = {k: statistics.median(v) for k, v in rates.items()}
    for what in ("update", "scoring"):
        pad, pack = med[(what, "padded")], med[(what, "packed")]
        print(
            f"{what}: padded {pad:.1f}, packed {pack:.1f} completion tokens/s (median); "
            f"packed_vs_padded={pack / pad:.2f}"
        )
    packs, _ = packed_update.plan(batch)
    mem = {
        "padded": padded_update.lower(no_donate(state), batch, key, None).compile(),
        "packed": packed_update.jitted.lower(no_donate(state), batch, key, None, packs).compile(),
    }
    for name, compiled in mem.items():
        m = compiled.memory_analysis()
        temp = getattr(m, "temp_size_in_bytes", None) if m is not None else None
        print(f"update {name}: compiled temporary memory {temp / 2**20:.1f} MiB" if temp else
              f"update {name}: no memory analysis on this backend")  # fmt: skip


def _memory_table(a, graphdef, params, state, kw, mesh) -> None:
    """XLA's temporary memory of the compiled update, packed at three token budgets and
    padded, for ``--prompts`` and four times as many."""
    G, P, T = a.num_samples, a.prompt_len, a.max_new_tokens
    key = jax.random.key(0)
    mib = lambda c: c.memory_analysis().temp_size_in_bytes / 2**20
    print(f"model D={a.hidden} L={a.layers} V={a.vocab}; G={G}, P={P}, T={T}; XLA temporaries")
    print("| prompts | rows | update | micro-batch | temporaries (MiB) |")
    print("|---|---|---|---|---|")
    for B in (a.prompts, 4 * a.prompts):
        b = argparse.Namespace(**{**vars(a), "prompts": B})
        batch = jax.device_put(_batch(b, np.random.default_rng(a.seed)), kw["batch_shardings"])
        n = B * G
        for rows in (1, 4, 16):
            settings = packing.PackSettings(
                group_size=G, shards=1, num_minibatches=1, microbatch_tokens=rows * (P + T),
                default_rows=n // a.grad_accum,
            )  # fmt: skip
            step = packing.jit_packed_update(settings=settings, **kw)
            packs, _ = step.plan(batch)
            c = step.jitted.lower(state, batch, key, None, packs).compile()
            print(f"| {B} | {n} | packed | {rows * (P + T)} slots | {mib(c):.1f} |")
        c = upd.jit_update(**kw).lower(state, batch, key, None).compile()
        print(f"| {B} | {n} | padded | {n // a.grad_accum} rows of {P + T} | {mib(c):.1f} |")


if __name__ == "__main__":
    main()
