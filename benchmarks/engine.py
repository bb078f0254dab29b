"""Rollout engines side by side: the paged engine against the static sampler on a long tail.

One random model (grpo_jax's own ``tiny_config`` family, float32, built in
process: nothing is downloaded), B prompts of different lengths, G samples
each, sampled at temperature 1 up to ``--max-new-tokens``. The completion
lengths are long-tailed: ``--eos-count`` token ids end a row, so on the
random model's near-uniform next-token distribution a row stops at each step
with probability about eos_count / V, geometric lengths of mean about
V / eos_count truncated at T; the run prints the lengths it drew (mean, p50,
p90, max). The static sampler decodes every row until the longest ends; the
paged engine packs the live rows into fewer rows per step as rows end
(docs/engine.md).

Both engines run in this process, alternating (static, paged, static,
paged, ...) ``--runs`` times after a warm-up that compiles them, each with a
fresh key per run. Reported per engine: useful completion tokens (the
lengths' sum, EOS included) per second of wall time, median over runs; the
last line is ``paged_vs_static=<x>``, the ratio of the medians.

    python benchmarks/engine.py                          # the defaults below
    python benchmarks/engine.py --prompts 8 --num-samples 8 --max-new-tokens 512 --slots 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from grpo_jax.models import create_model, tiny_config
from grpo_jax.sampling import paged
from grpo_jax.sampling import static as sampling
from grpo_jax.sampling.static import SamplingConfig, pad_prompts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8, help="B, distinct prompts")
    p.add_argument("--num-samples", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--prompt-len", type=int, default=48, help="longest prompt (others shorter)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--eos-count", type=int, default=32, help="ids that end a row (of V)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine (median)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--mlp", type=int, default=768)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--slots", type=int, default=0, help="paged decode slots (0: B * G)")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    model_cfg = tiny_config(
        a.vocab,
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.hidden // a.heads,
        mlp_dim=a.mlp,
    )
    graphdef, params = nnx.split(create_model(model_cfg, seed=a.seed))
    rng = np.random.default_rng(a.seed)
    lengths = np.linspace(a.prompt_len // 3, a.prompt_len, a.prompts).astype(int)
    prompts = [rng.integers(a.eos_count, a.vocab, n).tolist() for n in lengths]
    tokens_BxP, mask_BxP = pad_prompts(prompts, pad_id=0, buckets=(a.prompt_len,))
    common = dict(
        max_new_tokens=a.max_new_tokens,
        eos_ids=tuple(range(a.eos_count)),
        prompt_buckets=(a.prompt_len,),
    )
    static_cfg = SamplingConfig(**common)
    paged_cfg = SamplingConfig(
        **common,
        engine="paged",
        page_size=a.page_size,
        slots=a.slots,
        prefill_chunk=a.prefill_chunk,
    )
    engines = {
        "static": lambda key: sampling.generate(
            graphdef, params, tokens_BxP, mask_BxP, key, static_cfg, num_samples=a.num_samples
        ),
        "paged": lambda key: paged.generate(
            graphdef, params, tokens_BxP, mask_BxP, key, paged_cfg, num_samples=a.num_samples
        ),
    }
    n = a.prompts * a.num_samples
    print(
        f"model D={a.hidden} L={a.layers} H={a.heads}/{a.kv_heads} V={a.vocab} "
        f"({sum(x.size for x in jax.tree.leaves(params)):,} parameters); B={a.prompts} "
        f"G={a.num_samples} ({n} rows), prompts {lengths.min()}-{lengths.max()} tokens, "
        f"T={a.max_new_tokens}, {a.eos_count} EOS ids; paged: page {a.page_size}, "
        f"slots {a.slots or n}, prefill chunk {a.prefill_chunk}; backend {jax.default_backend()}"
    )
    for name, run in engines.items():  # warm-up: compiles every program the runs use
        t0 = time.perf_counter()
        for i in range(2):
            jax.block_until_ready(run(jax.random.key(10_000 + i)).lengths)
        print(f"{name}: warm-up (compilation included) {time.perf_counter() - t0:.1f}s")
    rates: dict[str, list[float]] = {k: [] for k in engines}
    drawn = []
    for r in range(a.runs):
        for name, run in engines.items():
            t0 = time.perf_counter()
            out = run(jax.random.key(r))
            lengths_N = np.asarray(jax.device_get(out.lengths))
            dt = time.perf_counter() - t0
            rates[name].append(lengths_N.sum() / dt)
            drawn.append(lengths_N)
            print(
                f"run {r} {name:>6}: {lengths_N.sum():6d} tokens in {dt:6.2f}s = "
                f"{rates[name][-1]:8.1f} tokens/s (longest row {lengths_N.max()})"
            )
    all_lengths = np.concatenate(drawn)
    q50, q90 = np.percentile(all_lengths, [50, 90])
    print(
        f"completion lengths drawn: mean {all_lengths.mean():.1f}, p50 {q50:.0f}, "
        f"p90 {q90:.0f}, max {all_lengths.max()}"
    )
    med = {k: statistics.median(v) for k, v in rates.items()}
    for name, v in med.items():
        print(f"{name}: median {v:.1f} useful completion tokens/s")
    _, st = paged.generate_with_stats(
        graphdef, params, tokens_BxP, mask_BxP, jax.random.key(0), paged_cfg,
        num_samples=a.num_samples,
    )  # fmt: skip
    print(
        f"paged engine, run 0: {st.decode_steps} decode steps, {st.prefill_chunks} prefill "
        f"chunks, slot occupancy {st.slot_occupancy:.2f}, row occupancy "
        f"{st.row_occupancy:.2f}, peak pages {st.peak_pages} of {st.pool_pages}"
    )
    print(f"paged_vs_static={med['paged'] / med['static']:.2f}")


if __name__ == "__main__":
    main()
