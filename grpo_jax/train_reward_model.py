"""Train a reward model on preference pairs with the Bradley-Terry loss.

    python -m grpo_jax.train_reward_model --pairs=pairs.jsonl --out=/tmp/rm [--init=/ckpt] \\
        [--steps=200] [--batch_size=16] [--learning_rate=1e-4] [--heldout_frac=0.1] \\
        [--num_devices=0] [--checkpoint_every=100] [--buckets=64,128,256,512,1024]
    python -m grpo_jax.train_reward_model --pairs=tfds:NAME --split=train --data_dir=/data/tfds \\
        [--fields=prompt,chosen,rejected] --out=/tmp/rm ...

The result is a Hugging Face ``*ForSequenceClassification`` directory that
``reward_model.path`` and transformers load. docs/learned_rewards.md has the pairs, the
loss, the mesh, checkpoints and resume, and what ``reward_model.json`` holds.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import sys
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from grpo_jax import cli
from grpo_jax.core import integrity, sharding
from grpo_jax.core.errors import CheckpointError, IntegrityError
from grpo_jax.data.pairs import PAIR_KEYS, TFDS_PREFIX, check_lengths, load_pairs
from grpo_jax.learner.optimizer import OptimConfig, apply_guarded, init_state, make_optimizer
from grpo_jax.models import from_pretrained, load_tokenizer, tiny_config
from grpo_jax.models.builtin_tokenizer import build_tokenizer, is_builtin, warn_missing_characters
from grpo_jax.models.hf_config import read_config_json
from grpo_jax.models.partitioning import param_shardings
from grpo_jax.reward_models import RewardModel, load_reward_model
from grpo_jax.reward_models.training import (
    encode_pairs,
    from_causal_lm,
    pair_loss,
    save_reward_model,
)
from grpo_jax.run.checkpoints import Checkpointer

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
    mesh=None,
    checkpoints=None,
    checkpoint_every: int = 0,
    fingerprint: str = "",
    on_step: Callable[[int], None] | None = None,
) -> tuple[RewardModel, list[dict]]:
    """(the trained model, each step's {"loss", "accuracy", "grad_norm", "finite"}).

    ``mesh``: train there (parameters in the "fsdp" layout, pairs split over the
    batch axes). ``checkpoints``: a directory for Orbax checkpoints, saved every
    ``checkpoint_every`` steps (0: at the end only) and resumed from when it holds
    any, if their ``fingerprint`` (what the pairs and settings were) is this one;
    the steps before a resume come back in the history from the checkpoint.
    ``on_step`` is called after each step's save (tests stop a run there).
    """
    tx, _ = make_optimizer(optim, steps)
    graphdef, params = nnx.split(model)
    state = init_state(_placed(params, mesh, batch_size), tx, mesh)
    ck = Checkpointer(checkpoints, keep=2, async_save=False, say=log) if checkpoints else None
    history, first = [], 1
    try:
        if ck is not None and ck.latest_step() is not None:
            state, history = _resume(ck, state, fingerprint, log)
            first = len(history) + 1
            log(f"resumed from the checkpoint of step {first - 1} in {ck.directory}")

        step = _step(graphdef, tx, label, state, mesh)
        put = (
            (lambda b: b)
            if mesh is None
            else lambda b: jax.device_put(b, sharding.batch_sharding(mesh))
        )
        rng = np.random.default_rng(seed)
        for _ in range(1, first):  # a resumed run's draws continue where the stopped one's were
            rng.choice(len(pairs), batch_size, replace=True)
        for s in range(first, steps + 1):
            chunk = [pairs[i] for i in rng.choice(len(pairs), batch_size, replace=True)]
            state, stats = step(state, put(encode_pairs(tokenizer, chunk, buckets)))
            history.append({k: float(v) for k, v in jax.device_get(stats).items()})
            if s % log_every == 0 or s == steps:
                h = history[-1]
                log(f"step {s}/{steps}: loss {h['loss']:.4f}, batch accuracy {h['accuracy']:.3f}")
            if ck is not None and (s == steps or (checkpoint_every and s % checkpoint_every == 0)):
                _save(ck, s, state, history, fingerprint)
            if on_step is not None:
                on_step(s)
    finally:
        if ck is not None:
            ck.close()
    return nnx.merge(graphdef, state.params), history


def _placed(params, mesh, batch_size: int):
    """``params`` in the "fsdp" layout on ``mesh`` (as they are without one); a ValueError
    when a batch's 2 x ``batch_size`` rows do not split over its batch shards."""
    if mesh is None:
        return params
    _check_split(batch_size, mesh)
    return jax.device_put(params, param_shardings(params, mesh))


def _check_split(batch_size: int, mesh) -> None:
    shards = sharding.batch_shards(mesh)
    if (2 * batch_size) % shards:
        raise ValueError(
            f"--batch_size={batch_size} pairs (2 x {batch_size} rows) must split evenly "
            f"over the mesh's {shards} batch shards"
        )


def _step(graphdef, tx, label: int, state, mesh):
    """The jitted Bradley-Terry step: (state, batch) -> (state, stats).

    On a mesh the state leaves with the shardings it came in with: one program for
    every step, a fresh start's or a restored one's (a resumed run computes the same bits).
    """

    def step_fn(state, batch):
        grad_fn = jax.value_and_grad(pair_loss, has_aux=True)
        (loss, acc), grads = grad_fn(state.params, graphdef, batch, label)
        state, grad_norm, finite = apply_guarded(state, grads, loss, tx)
        stats = {"loss": loss, "accuracy": acc, "grad_norm": grad_norm, "finite": finite}
        return state.replace(step=state.step + 1), stats

    if mesh is None:
        return jax.jit(step_fn)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    # Under the mesh: each device's pairs with the weights gathered, not every pair over part
    # of the model's width with its activations all-reduced (``sharding.OnMesh``).
    return sharding.OnMesh(jax.jit(step_fn, out_shardings=(shardings, None)), mesh)


def _counters(state):
    return {k: getattr(state, k) for k in ("step", "updates", "skipped", "skipped_in_row")}


def _save(ck: Checkpointer, s: int, state, history, fingerprint: str) -> None:
    opt = {"opt_state": state.opt_state, "counters": _counters(state)}
    meta = {"fingerprint": fingerprint, "history": history}
    ck.save(s, params=state.params, opt_state=opt, meta=meta)  # synchronous (async_save=False)


def _resume(ck: Checkpointer, state, fingerprint: str, log: Callable[[str], None]):
    """(state, history) of the newest checkpoint that restores; CheckpointError if it is
    another run's, or if none restores.

    A step that does not restore (a file missing or damaged, an array or the meta
    differing from its checksum) is moved to ``checkpoints.unrestorable/``, one line
    each, once an older one restores, as a GRPO run does (``grpo_jax.run.start``).
    """
    like = {"opt_state": state.opt_state, "counters": _counters(state)}
    bad = []
    for step in sorted(ck.all_steps(), reverse=True):
        try:
            saved = ck.restore_meta(step)
        except Exception as e:  # Orbax raises many types for a damaged step
            bad.append((step, _why(e)))
            continue
        if saved.get("fingerprint") != fingerprint:
            raise CheckpointError(
                f"the checkpoints in {ck.directory} were made with other pairs or settings "
                "(--pairs, --init, --steps, --batch_size, --learning_rate, --heldout_frac, "
                "--seed); rerun with the same flags to resume, or use a new --out"
            )
        try:
            params, opt, meta = ck.restore(step, params_like=state.params, opt_state_like=like)
        except Exception as e:
            bad.append((step, _why(e)))
            continue
        aside = ck.set_aside([k for k, _ in bad])
        for k, why in bad:
            log(
                f"checkpoint step {k} in {ck.directory} could not be restored ({why}); "
                f"set aside in {aside}, resuming from step {step}"
            )
        state = state.replace(params=params, opt_state=opt["opt_state"], **opt["counters"])
        return state, list(meta["history"])
    failures = "; ".join(f"step {k} ({why})" for k, why in bad)
    raise CheckpointError(
        f"no checkpoint in {ck.directory} could be restored: {failures}. Move the checkpoints "
        "aside to start afresh, or restore the missing files"
    )


def _why(e: Exception) -> str:
    return e.problem if isinstance(e, IntegrityError) else integrity.describe(e)


def run_fingerprint(pairs_path, pairs=None, **settings) -> str:
    """sha256 of the pairs (a file's bytes; a dataset's ``pairs`` themselves) and the
    settings that shape the run."""
    if str(pairs_path).startswith(TFDS_PREFIX):
        h = hashlib.sha256(json.dumps([str(pairs_path), *pairs]).encode())
    else:
        h = hashlib.sha256(pathlib.Path(pairs_path).read_bytes())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def check_settings(
    out,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    heldout_frac: float,
    seed: int,
    num_devices: int,
    checkpoint_every: int,
) -> None:
    """A ValueError naming the flag of a setting the command cannot use, before any work."""
    for flag, value, least in [
        ("steps", steps, 1),
        ("batch_size", batch_size, 1),
        ("seed", seed, 0),
        ("num_devices", num_devices, 0),
        ("checkpoint_every", checkpoint_every, 0),
    ]:
        if value < least:
            raise ValueError(f"--{flag}={value} must be >= {least}")
    if not math.isfinite(learning_rate) or learning_rate <= 0:
        raise ValueError(f"--learning_rate={learning_rate} must be a number > 0")
    if not 0.0 < heldout_frac < 1.0:
        raise ValueError(f"--heldout_frac={heldout_frac} must lie strictly between 0 and 1")
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out={out} is a file; the reward model is written as a directory")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--out={out}: {parent} is a file, not a directory")
            break


def check_pairs(pairs, tokenizer, model: RewardModel, buckets) -> None:
    """A MalformedRowError naming the file and line of a pair longer than the reward model
    reads (the largest of ``buckets``, or the model's context); a warning naming the
    characters the built-in tokenizer lacks and the pairs they came from."""
    context = model.config.max_position_embeddings
    limit = min(buckets[-1], context)
    why = (
        f"tokens of the largest of --buckets={','.join(map(str, buckets))}"
        if buckets[-1] <= context
        else "positions of the model's context"
    )
    check_lengths(pairs, tokenizer, limit, why)
    if is_builtin(tokenizer):
        warn_missing_characters(
            (text, f"{getattr(p, 'path', 'pairs')}:{getattr(p, 'lineno', i + 1)}")
            for i, p in enumerate(pairs)
            for text in p
        )


def _check_buckets(buckets) -> tuple[int, ...]:
    buckets = tuple(buckets)
    if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
        raise ValueError(f"--buckets={list(buckets)} must be positive token counts")
    return tuple(sorted(buckets))


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
    num_devices: int = 0,
    checkpoint_every: int = 100,
    buckets: Sequence[int] = BUCKETS,
    split: str = "train",
    data_dir: str | None = None,
    fields: Sequence[str] = PAIR_KEYS,
    log: Callable[[str], None] = print,
    on_step: Callable[[int], None] | None = None,
) -> dict:
    """Trains on ``pairs_path``, writes the model to ``out``; returns reward_model.json's dict.

    ``num_devices``: the mesh's devices (0: all); ``checkpoint_every``: Orbax
    checkpoints under ``<out>/checkpoints`` (module doc). ``buckets``: the padded lengths
    of a batch (the smallest that holds its longest text). ``split``, ``data_dir`` and
    ``fields``: how ``pairs_path`` is read (``grpo_jax.data.pairs.load_pairs``).
    """
    check_settings(
        out,
        steps=steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        heldout_frac=heldout_frac,
        seed=seed,
        num_devices=num_devices,
        checkpoint_every=checkpoint_every,
    )
    buckets = _check_buckets(buckets)
    pairs = load_pairs(pairs_path, split=split, data_dir=data_dir, fields=fields)
    train, heldout = split_pairs(pairs, heldout_frac, seed)
    mesh = _mesh(num_devices)
    _check_split(batch_size, mesh)
    model, tok = initial_model(init, tokenizer, seed)
    check_pairs(pairs, tok, model, buckets)
    before = evaluate_pairs(model, tok, heldout, batch_size=batch_size, buckets=buckets)
    log(f"{len(train)} pairs to train on, {len(heldout)} held out; before: {before}")
    optim = OptimConfig(learning_rate=learning_rate)
    settings = dict(init=init, tokenizer=tokenizer, steps=steps, batch_size=batch_size)
    settings.update(learning_rate=learning_rate, heldout_frac=heldout_frac, seed=seed)
    if buckets != BUCKETS:  # only then: checkpoints from before the flag keep resuming
        settings.update(buckets=buckets)
    model, history = train_pairs(
        model,
        tok,
        train,
        steps=steps,
        batch_size=batch_size,
        optim=optim,
        seed=seed,
        buckets=buckets,
        log=log,
        mesh=mesh,
        checkpoints=pathlib.Path(out) / "checkpoints",
        checkpoint_every=checkpoint_every,
        fingerprint=run_fingerprint(pairs_path, pairs, **settings),
        on_step=on_step,
    )
    after = evaluate_pairs(model, tok, heldout, batch_size=batch_size, buckets=buckets)
    log(f"held-out pairwise accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}")
    out = save_reward_model(model, out, tokenizer=tok)
    summary = {
        "pairs": str(pairs_path)
        + (f"[{split}]" if str(pairs_path).startswith(TFDS_PREFIX) else ""),
        "train_pairs": len(train),
        "heldout_pairs": len(heldout),
        "steps": steps,
        "heldout_before": before,
        "heldout_after": after,
        "last_loss": history[-1]["loss"],
        "skipped_updates": sum(not h["finite"] for h in history),
    }
    _write_summary(out, summary)
    return summary


def _mesh(num_devices: int):
    """The training mesh: fsdp over the first ``num_devices`` devices (0: all of them)."""
    devices = jax.devices()
    if num_devices > len(devices) or num_devices < 0:
        raise ValueError(f"--num_devices={num_devices}, but {len(devices)} devices are available")
    return sharding.make_mesh({"fsdp": -1}, devices[: num_devices or None])


def _write_summary(out, summary: dict) -> None:
    """reward_model.json, then the directory's checksums, which cover it too."""
    (pathlib.Path(out) / "reward_model.json").write_text(json.dumps(summary, indent=2) + "\n")
    integrity.write_sums(out, [*integrity.sums_names(out), "reward_model.json"])


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
            num_devices=F.num_devices,
            checkpoint_every=F.checkpoint_every,
            buckets=[int(b) for b in F.buckets],
            split=F.split,
            data_dir=F.data_dir or None,
            fields=F.fields,
        )
    except (*cli.user_errors(), ValueError) as e:
        return cli.report_error(e)
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
    flags.DEFINE_integer("num_devices", 0, "Devices of the training mesh (0: all).")
    flags.DEFINE_integer(
        "checkpoint_every", 100, "Orbax checkpoint every this many steps (0: at the end only)."
    )
    flags.DEFINE_list("buckets", [str(b) for b in BUCKETS], "Padded text lengths (tokens).")
    flags.DEFINE_string("split", "train", "The split of a tfds:NAME dataset (TFDS slicing works).")
    flags.DEFINE_string("data_dir", "", "The TFDS data_dir of a tfds:NAME dataset ('': TFDS's).")
    flags.DEFINE_list("fields", list(PAIR_KEYS), "The prompt's, chosen and rejected fields.")
    flags.mark_flags_as_required(["pairs", "out"])
    app.run(main, argv=sys.argv, flags_parser=cli.parse_flags)
