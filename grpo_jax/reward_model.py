"""Train a reward model on preference pairs with the Bradley-Terry loss.

    python -m grpo_jax.reward_model --pairs=pairs.jsonl --out=/tmp/rm [--init=/ckpt] \\
        [--steps=200] [--batch_size=16] [--learning_rate=1e-4] [--heldout_frac=0.1]

``pairs.jsonl`` holds one ``{"prompt", "chosen", "rejected"}`` object a line
(``reward_models.training.load_pairs``: a malformed line is an error naming the
file and line). A seeded share ``heldout_frac`` of the pairs is held out; the
rest train the model, ``batch_size`` pairs drawn at random per step, with the
project's optimizer (``grpo_jax.optimizer``: global-norm clipping, AdamW, the
non-finite guard) on the loss mean(-log sigmoid(r_chosen - r_rejected)).
``--init`` is a Hugging Face checkpoint: a ``*ForSequenceClassification`` one is
trained further, a causal LM gets a fresh scalar head on its decoder; without it
the built-in tiny model starts from random weights with the built-in tokenizer.

The result is a Hugging Face ``*ForSequenceClassification`` directory
(``reward_models.training.save_reward_model``) that ``reward_model.path`` and
transformers load, with ``reward_model.json``: the held-out pairwise accuracy
and loss before and after training, and the steps' last loss.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from grpo_jax import cli
from grpo_jax.models import from_pretrained, load_tokenizer, tiny_config
from grpo_jax.models.builtin_tokenizer import build_tokenizer
from grpo_jax.models.hf_config import read_config_json
from grpo_jax.optimizer import OptimConfig, apply_guarded, init_state, make_optimizer
from grpo_jax.reward_models import RewardModel, load_reward_model
from grpo_jax.reward_models.training import (
    encode_pairs,
    from_causal_lm,
    load_pairs,
    pair_loss,
    save_reward_model,
)

BUCKETS = (64, 128, 256, 512, 1024)


def split_pairs(pairs: Sequence, heldout_frac: float, seed: int):
    """(train, held-out): a seeded shuffle, the first ``heldout_frac`` (at least one) held out."""
    if not 0.0 < heldout_frac < 1.0:
        raise ValueError(f"--heldout_frac={heldout_frac} must lie strictly between 0 and 1")
    order = np.random.default_rng(seed).permutation(len(pairs))
    n = max(1, int(round(heldout_frac * len(pairs))))
    if n >= len(pairs):
        raise ValueError(f"{len(pairs)} pairs leave none to train on after holding out {n}")
    return [pairs[i] for i in order[n:]], [pairs[i] for i in order[:n]]


def evaluate_pairs(model: RewardModel, tokenizer, pairs, *, batch_size: int, buckets, label=0):
    """{"accuracy", "loss"}: pairwise accuracy (r_c > r_r) and mean Bradley-Terry loss."""
    graphdef, params = nnx.split(model)
    loss_fn = jax.jit(pair_loss, static_argnums=(1, 3))
    losses, right = [], []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        loss, acc = loss_fn(params, graphdef, encode_pairs(tokenizer, chunk, buckets), label)
        losses.append(float(loss) * len(chunk))
        right.append(float(acc) * len(chunk))
    return {"accuracy": sum(right) / len(pairs), "loss": sum(losses) / len(pairs)}


def train_pairs(
    model: RewardModel,
    tokenizer,
    pairs,
    *,
    steps: int,
    batch_size: int,
    optim: OptimConfig,
    seed: int = 0,
    buckets=BUCKETS,
    label: int = 0,
    log: Callable[[str], None] = print,
    log_every: int = 50,
) -> tuple[RewardModel, list[dict]]:
    """(the trained model, each step's {"loss", "accuracy", "grad_norm", "finite"})."""
    tx, _ = make_optimizer(optim, steps)
    graphdef, params = nnx.split(model)
    state = init_state(params, tx)

    @jax.jit
    def step(state, batch):
        grad_fn = jax.value_and_grad(pair_loss, has_aux=True)
        (loss, acc), grads = grad_fn(state.params, graphdef, batch, label)
        state, grad_norm, finite = apply_guarded(state, grads, loss, tx)
        stats = {"loss": loss, "accuracy": acc, "grad_norm": grad_norm, "finite": finite}
        return state.replace(step=state.step + 1), stats

    rng = np.random.default_rng(seed)
    history = []
    for s in range(1, steps + 1):
        chunk = [pairs[i] for i in rng.choice(len(pairs), batch_size, replace=True)]
        state, stats = step(state, encode_pairs(tokenizer, chunk, buckets))
        history.append({k: float(v) for k, v in jax.device_get(stats).items()})
        if s % log_every == 0 or s == steps:
            h = history[-1]
            log(f"step {s}/{steps}: loss {h['loss']:.4f}, batch accuracy {h['accuracy']:.3f}")
    return nnx.merge(graphdef, state.params), history


def initial_model(init: str, tokenizer_dir: str, seed: int):
    """(reward model, tokenizer) to start from: ``init``'s checkpoint, or the built-in tiny one."""
    if not init:
        tokenizer = build_tokenizer()
        cfg = tiny_config(len(tokenizer))
        return RewardModel(cfg, 1, rngs=nnx.Rngs(seed)), tokenizer
    tokenizer = load_tokenizer(tokenizer_dir or init)
    hf = read_config_json(init)
    if any("ForSequenceClassification" in a for a in hf.get("architectures") or ()):
        return load_reward_model(init), tokenizer
    return from_causal_lm(from_pretrained(init), 1, seed), tokenizer


def train_reward_model(
    pairs_path,
    out,
    *,
    init: str = "",
    tokenizer: str = "",
    steps: int = 200,
    batch_size: int = 16,
    learning_rate: float = 1e-4,
    heldout_frac: float = 0.1,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Trains on ``pairs_path``, writes the model to ``out``; returns reward_model.json's dict."""
    train, heldout = split_pairs(load_pairs(pairs_path), heldout_frac, seed)
    model, tok = initial_model(init, tokenizer, seed)
    before = evaluate_pairs(model, tok, heldout, batch_size=batch_size, buckets=BUCKETS)
    log(f"{len(train)} pairs to train on, {len(heldout)} held out; before: {before}")
    optim = OptimConfig(learning_rate=learning_rate)
    model, history = train_pairs(
        model, tok, train, steps=steps, batch_size=batch_size, optim=optim, seed=seed, log=log
    )
    after = evaluate_pairs(model, tok, heldout, batch_size=batch_size, buckets=BUCKETS)
    log(f"held-out pairwise accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}")
    out = save_reward_model(model, out, tokenizer=tok)
    summary = {
        "pairs": str(pairs_path),
        "train_pairs": len(train),
        "heldout_pairs": len(heldout),
        "steps": steps,
        "heldout_before": before,
        "heldout_after": after,
        "last_loss": history[-1]["loss"],
        "skipped_updates": sum(not h["finite"] for h in history),
    }
    (pathlib.Path(out) / "reward_model.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv):
    from absl import flags

    del argv
    cli.quiet()
    F = flags.FLAGS
    try:
        train_reward_model(
            F.pairs,
            F.out,
            init=F.init,
            tokenizer=F.tokenizer,
            steps=F.steps,
            batch_size=F.batch_size,
            learning_rate=F.learning_rate,
            heldout_frac=F.heldout_frac,
            seed=F.seed,
        )
    except (*cli.user_errors(), ValueError) as e:
        return cli.report_user_error(e)
    print(f"saved to {F.out}")
    return 0


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("pairs", None, "JSONL of {prompt, chosen, rejected} objects.")
    flags.DEFINE_string("out", None, "Output Hugging Face *ForSequenceClassification directory.")
    flags.DEFINE_string("init", "", "HF checkpoint to start from ('': the built-in tiny model).")
    flags.DEFINE_string("tokenizer", "", "Tokenizer directory ('': --init's).")
    flags.DEFINE_integer("steps", 200, "Optimizer steps.")
    flags.DEFINE_integer("batch_size", 16, "Pairs per step.")
    flags.DEFINE_float("learning_rate", 1e-4, "Peak learning rate (AdamW).")
    flags.DEFINE_float("heldout_frac", 0.1, "Share of the pairs held out for the accuracy.")
    flags.DEFINE_integer("seed", 0, "Seed of the split, the batches and a fresh head.")
    flags.mark_flags_as_required(["pairs", "out"])
    app.run(main, argv=sys.argv, flags_parser=cli.parse_flags)
