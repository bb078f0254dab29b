"""Rollout speed: grpo_jax's sampler against transformers' ``generate`` on the same model.

Builds one tiny random Qwen2-style model with transformers (PyTorch, CPU),
saves it, loads the same weights into grpo_jax, checks that both give the
same logits, then samples the same prompts with the same batch, group size
and lengths on both sides (do_sample, no EOS, so every row generates exactly
max_new_tokens). Prints tokens/s of each (median of several timed runs after
a warm-up; grpo_jax's compile time reported separately) and, as its last
line, ``speedup_vs_transformers=<x>`` (grpo_jax tokens/s over transformers').

    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/sampling.py                      # the defaults below
    python benchmarks/sampling.py --prompts 8 --num-samples 8 --max-new-tokens 128

Tokens counted: generated tokens only (rows x max_new_tokens), prefill included
in the time. Both sides use all CPU cores (torch's default intra-op threads,
XLA's CPU thread pool).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import _transformers_sampling as transformers_sampling  # noqa: E402 - beside this file
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from grpo_jax.models import from_pretrained
from grpo_jax.sampling import static as sampling


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4, help="B, distinct prompts")
    p.add_argument("--num-samples", type=int, default=4, help="G, completions per prompt")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt (others shorter)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5, help="timed runs per side (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--mlp", type=int, default=768)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="pin this process to the first N CPU cores and give torch N threads "
        "(0: all cores, torch's default). On a busy machine 1 gives steadier figures.",
    )
    return p.parse_args(argv)


def make_hf_model(args) -> transformers.Qwen2ForCausalLM:
    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.mlp,
        max_position_embeddings=2048,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(args.seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    # The default init (std 0.02) gives near-uniform next-token distributions;
    # wider weights make sampling look like a trained model's (and cost the same).
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(4.0)
    return model


def make_prompts(args) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lengths = np.linspace(args.prompt_len // 2, args.prompt_len, args.prompts).astype(int)
    return [rng.integers(1, args.vocab, size=int(n)).tolist() for n in lengths]


def time_runs(fn, runs: int, warmup: int) -> tuple[float, list[float]]:
    """(seconds of the first call, seconds of each timed call after ``warmup`` more)."""
    t0 = time.perf_counter()
    fn(0)
    first = time.perf_counter() - t0
    for i in range(warmup):
        fn(1 + i)
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        fn(1 + warmup + i)
        times.append(time.perf_counter() - t0)
    return first, times


def main(argv=None) -> float:
    args = parse_args(argv)
    if args.threads:
        # Before jax creates its CPU client, so XLA's pool sees the same cores.
        cores = sorted(os.sched_getaffinity(0))[: args.threads]
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    n_rows = args.prompts * args.num_samples
    new_tokens = n_rows * args.max_new_tokens
    hf = make_hf_model(args)
    prompts = make_prompts(args)

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = from_pretrained(tmp)
    graphdef, params = nnx.split(model)

    buckets = (args.prompt_len,)
    tokens_BxP, mask_BxP = sampling.pad_prompts(prompts, pad_id=0, buckets=buckets)

    # Same weights: one forward pass on both sides.
    with torch.no_grad():
        ref = hf(
            input_ids=torch.from_numpy(tokens_BxP.astype(np.int64)),
            attention_mask=torch.from_numpy(mask_BxP.astype(np.int64)),
        ).logits.numpy()
    ours = np.asarray(model(jnp.asarray(tokens_BxP), mask_BxT=jnp.asarray(mask_BxP)))
    diff = float(np.abs(ref - ours)[mask_BxP].max())
    print(
        f"model: Qwen2-style, {sum(p.numel() for p in hf.parameters()):,} parameters; "
        f"max |logit difference| transformers vs grpo_jax on real tokens: {diff:.2e}"
    )
    if diff > 1e-3:
        sys.exit(f"the two models disagree (max logit difference {diff:.2e}); not comparable")

    cfg = sampling.SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_ids=(),
        pad_id=0,
        prompt_buckets=buckets,
    )

    def run_jax(i):
        out = sampling.generate(
            graphdef,
            params,
            tokens_BxP,
            mask_BxP,
            jax.random.key(i),
            cfg,
            num_samples=args.num_samples,
        )
        jax.block_until_ready(out)
        assert out.tokens.shape == (n_rows, args.max_new_tokens)

    def run_hf(i):
        out = transformers_sampling.sample(
            hf, tokens_BxP, mask_BxP, i, num_samples=args.num_samples,
            max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        assert out.shape == (n_rows, tokens_BxP.shape[1] + args.max_new_tokens), out.shape

    print(
        f"work: {args.prompts} prompts x {args.num_samples} samples = {n_rows} rows, "
        f"prompt length <= {args.prompt_len}, {args.max_new_tokens} new tokens per row, "
        f"temperature {args.temperature}, top_k {args.top_k}, top_p {args.top_p}; "
        f"{args.runs} timed runs after {args.warmup} warm-up"
    )
    print(
        f"cpu: {len(os.sched_getaffinity(0))} of {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"jax {jax.__version__} ({jax.devices()[0].platform})"
    )

    first_jax, jax_times = time_runs(run_jax, args.runs, args.warmup)
    first_hf, hf_times = time_runs(run_hf, args.runs, args.warmup)
    med_jax, med_hf = statistics.median(jax_times), statistics.median(hf_times)
    tps_jax, tps_hf = new_tokens / med_jax, new_tokens / med_hf
    print(
        f"grpo_jax:     {tps_jax:10.1f} tokens/s  (median {med_jax * 1e3:.1f} ms per call; "
        f"first call {first_jax:.2f} s, of which compile ~{first_jax - med_jax:.2f} s)"
    )
    print(
        f"transformers: {tps_hf:10.1f} tokens/s  (median {med_hf * 1e3:.1f} ms per call; "
        f"first call {first_hf:.2f} s)"
    )
    speedup = tps_jax / tps_hf
    print(f"speedup_vs_transformers={speedup:.2f}")
    return speedup


if __name__ == "__main__":
    main()
