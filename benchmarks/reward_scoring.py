"""Learned-reward scoring: grpo_jax's ``LearnedReward`` against transformers on the same work.

Both systems score the same N texts with the same random Qwen2 sequence classifier
(``grpo_step.qwen2_config`` + ``Qwen2ForSequenceClassification`` under
``torch.manual_seed``, one label, saved once with grpo_jax's character tokenizer and loaded
by both), float32, on this machine's CPU, B texts per forward pass:

* grpo_jax: ``reward_models.LearnedReward.score_tokens``, the path a training run's
  scorer takes (each batch left-padded to the smallest of ``--buckets`` holding its
  longest row, one jitted forward pass per batch). Its compilation (one program per
  bucket) is timed apart, in a first pass over the same texts.
* transformers: ``AutoModelForSequenceClassification`` under ``torch.no_grad``, each batch
  left-padded to its own longest row (no buckets: torch needs none), with its attention
  mask; the score is the logit at the last real token, as grpo_jax's. One untimed batch
  first.

The texts are the same token lists for both, of lengths drawn uniformly from
``--min-len`` .. ``--max-len`` tokens, in a fixed shuffled order. Each system scores them
``--repeats`` times and keeps its fastest pass; the largest |difference| between the two
systems' scores is printed, to show they computed the same thing.

    .venv/bin/python benchmarks/reward_scoring.py
    .venv/bin/python benchmarks/reward_scoring.py --size 1m --n 512 --batch 64
"""

import argparse
import pathlib
import tempfile
import time

import numpy as np
import torch
import transformers
from grpo_step import SIZES, qwen2_config

from grpo_jax.models import builtin_tokenizer
from grpo_jax.reward_models import LearnedReward
from grpo_jax.rewards.section import RewardModelSection
from grpo_jax.sampling.static import pad_prompts


def make_classifier(path: pathlib.Path, size: str, seed: int = 0) -> pathlib.Path:
    """A random one-label Qwen2 classifier on ``grpo_step``'s backbone of ``size``."""
    cfg = qwen2_config(size, num_labels=1, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():  # a random head at a scale that gives scores of order one
        model.score.weight.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    builtin_tokenizer.build_tokenizer().save_pretrained(str(path))
    return path


def make_token_lists(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """Token ids of the tokenizer's printable range, never the pad id."""
    rng = np.random.default_rng(seed)
    first = max(builtin_tokenizer.PAD_ID, builtin_tokenizer.BOS_ID, builtin_tokenizer.EOS_ID) + 1
    lengths = rng.integers(lo, hi + 1, n)
    return [rng.integers(first, builtin_tokenizer.VOCAB_SIZE, k).tolist() for k in lengths]


def score_torch(model, token_lists, batch: int, pad_id: int) -> np.ndarray:
    out = []
    with torch.no_grad():
        for start in range(0, len(token_lists), batch):
            rows = token_lists[start : start + batch]
            # Left-padded to the batch's own longest row: one bucket of exactly that width.
            ids, mask = pad_prompts(rows, pad_id=pad_id, buckets=(max(map(len, rows)),))
            ids, mask = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask).long()
            pos = (mask.cumsum(-1) - 1).clamp(min=0)  # positions count real tokens only
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            out.append(logits[:, 0].float().numpy())
    return np.concatenate(out)


def fastest(fn, repeats: int) -> tuple[float, np.ndarray]:
    best, value = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t)
    return best, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="20m")
    ap.add_argument("--n", type=int, default=256, help="texts scored per pass")
    ap.add_argument("--batch", type=int, default=32, help="texts per forward pass")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=240)
    ap.add_argument("--buckets", default="64,128,256", help="grpo_jax's padded lengths")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    buckets = tuple(int(b) for b in args.buckets.split(","))
    if args.max_len > buckets[-1]:
        ap.error(f"--max-len {args.max_len} exceeds the largest bucket {buckets[-1]}")

    with tempfile.TemporaryDirectory() as tmp:
        path = make_classifier(pathlib.Path(tmp) / "rm", args.size)
        rows = make_token_lists(args.n, args.min_len, args.max_len)
        tokens = sum(len(r) for r in rows)

        section = RewardModelSection(
            path=str(path), buckets=buckets, batch_size=args.batch, normalize="none"
        )
        rm = LearnedReward.load(section)
        t = time.perf_counter()
        rm.score_tokens(rows)  # compiles one program per bucket used
        compile_pass = time.perf_counter() - t
        jax_s, jax_scores = fastest(lambda: rm.score_tokens(rows), args.repeats)

        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()
        score_torch(model, rows[: args.batch], args.batch, builtin_tokenizer.PAD_ID)
        torch_s, torch_scores = fastest(
            lambda: score_torch(model, rows, args.batch, builtin_tokenizer.PAD_ID), args.repeats
        )

    params = sum(p.numel() for p in model.parameters())
    print(
        f"size {args.size} ({params:,} parameters), {args.n} texts, {tokens:,} tokens "
        f"({args.min_len}-{args.max_len} each), batch {args.batch}, grpo_jax buckets "
        f"{buckets}, torch threads {torch.get_num_threads()}, best of {args.repeats}"
    )
    print(
        f"grpo_jax      {args.n / jax_s:9.1f} texts/s  ({jax_s:.3f} s; first pass with "
        f"compilation {compile_pass:.1f} s)"
    )
    print(f"transformers  {args.n / torch_s:9.1f} texts/s  ({torch_s:.3f} s)")
    print(f"ratio grpo_jax / transformers: {torch_s / jax_s:.2f}x texts/s")
    print(f"max |score difference|: {float(np.max(np.abs(jax_scores - torch_scores))):.2e}")


if __name__ == "__main__":
    main()
