"""grpo_jax side of ``benchmarks/grpo_step.py``: the library's own training loop, timed per step.

Run by the driver with the project's ``.venv/bin/python`` as

    python benchmarks/_grpo_step_grpo_jax.py WORKLOAD.json

It calls ``grpo_jax.run.train.train(config, workdir, step_callback=...)``, the
same loop ``python -m grpo_jax.main`` runs: per step the jitted KV-cache
sampler, decoding, the reward, group advantages and the jitted update. The
config loads the shared checkpoint (``model.path``), reads the shared prompts
from JSONL, scores with the shared ``digit_fraction`` reward (registered
here under the name ``bench_digit_fraction``), and turns off everything that
is not the GRPO step: evaluations, periodic checkpoints, the warm start,
sample logging, and the ``train.track_update`` diagnostic (an extra
forward pass per step that the other systems do not make).

Forcing T tokens: the library stops a row at the tokenizer's EOS and has no
switch to ignore it, so this side loads the checkpoint's tokenizer (the
character tokenizer of the tiny sizes, Gemma 3's 262,144-token one) with one
extra special token, ``<never_eos>``, as EOS: its id (= the model's
vocabulary size) is outside the model's logits and is never sampled. The
checkpoints carry no generation_config.json, so no other stop id is added.

Timing: ``step_callback`` fires after each step's host work; the loop keeps
one update in flight (metrics are read one step late), so the span from the
callback of the last warm-up step to that of the last timed step covers
exactly ``steps`` samplings and ``steps`` updates in steady state. Sampling
is timed by wrapping the loop's ``generate`` (blocking on its tokens, which
the loop reads to the host at once anyway); the loop's own reward time and
update time (perf/time_reward_s, perf/time_train_s in metrics.jsonl) are
averaged over the timed steps and reported alongside. The first step is
timed from the moment the loop begins (``grpo_jax.run.start.restore_or_init``
returned: tokenizer, model, data and optimizer made), as TRL's side starts its
clock at ``on_train_begin`` once its model, tokenizer and trainer exist; the
setup before it is reported as ``setup_s``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _grpo_step_common as common  # noqa: E402

REWARD_NAME = "bench_digit_fraction"
NEVER_EOS = "<never_eos>"


def write_data(wl: common.Workload, work: pathlib.Path) -> dict:
    rows = common.workload_prompts(wl)
    paths = {}
    for split in ("train", "test"):
        path = work / f"{split}.jsonl"
        with open(path, "w") as f:
            for row in rows if split == "train" else rows[: wl.B]:
                f.write(json.dumps(row) + "\n")
        paths[f"{split}_path"] = str(path)
    return paths


def write_tokenizer(checkpoint: str, out: pathlib.Path) -> str:
    """The checkpoint's tokenizer with an EOS id outside the model's vocabulary."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    with open(os.path.join(checkpoint, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tok.add_special_tokens({"eos_token": NEVER_EOS})
    if tok.eos_token_id < vocab:
        raise RuntimeError(f"{NEVER_EOS} got id {tok.eos_token_id}, inside the vocabulary {vocab}")
    tok.save_pretrained(str(out))
    return str(out)


def make_config(wl: common.Workload, work: pathlib.Path):
    from ml_collections import ConfigDict

    c = ConfigDict()
    c.seed = wl.seed
    c.model = ConfigDict(dict(path=wl.checkpoint, dtype="float32", **wl.grpo_jax_model))
    c.tokenizer = write_tokenizer(wl.checkpoint, work / "tokenizer_never_eos")
    c.data = ConfigDict(dict(source="jsonl", **write_data(wl, work)))
    c.prompt = ConfigDict(dict(template="{prompt}", chat=False, system=""))
    c.rewards = f"{REWARD_NAME}:1.0"
    c.correct_reward = "exact_match"
    c.grpo = ConfigDict(
        dict(
            G=wl.G,
            beta=wl.beta,
            epsilon=wl.epsilon,
            mu=1,
            kl_estimator="k3",
            reduction="grpo",
            advantage_estimator="grpo",
            advantage_eps=1e-4,
            temperature=wl.temperature,
        )
    )
    c.sampling = ConfigDict(
        dict(
            max_new_tokens=wl.T,
            top_k=0,
            top_p=1.0,
            prompt_buckets=(wl.prompt_len, 2 * wl.prompt_len),
        )
    )
    c.optim = ConfigDict(
        dict(
            learning_rate=wl.learning_rate,
            schedule="constant",
            warmup_steps=0,
            end_lr_factor=0.0,
            b1=wl.b1,
            b2=wl.b2,
            eps=wl.adam_eps,
            weight_decay=0.0,
            max_grad_norm=wl.max_grad_norm,
            grad_accum=1,
        )
    )
    c.train = ConfigDict(
        dict(
            steps=wl.total_steps,
            batch_size=wl.B,
            minibatch_size=0,
            log_every=1,
            samples_every=0,
            num_samples_logged=0,
            max_nonfinite_in_row=5,
            no_signal_steps=0,
            track_update=False,
            logits_chunk=wl.logits_chunk,
            update_kl_warn=0.0,
            reward_timeout_s=5.0,
            compilation_cache_dir=wl.compilation_cache_dir,
        )
    )
    c.eval = ConfigDict(
        dict(
            every=0,
            at_start=False,
            num_problems=wl.B,
            batch_size=wl.B,
            num_samples=0,
            k=1,
            temperature=1.0,
            split="test",
        )
    )
    c.checkpoint = ConfigDict(dict(every=0, keep=1, async_save=False))
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1, num_devices=1, layout="fsdp"))
    c.warm_start = ConfigDict(dict(enabled=False))
    return c


def main(path: str) -> None:
    wl = common.Workload.from_file(path)
    work = pathlib.Path(path).parent / f"grpo_jax_{wl.size}"
    work.mkdir(parents=True, exist_ok=True)
    import io

    import jax
    from flax import nnx

    from grpo_jax import models, rewards
    from grpo_jax.run import train as train_lib
    from grpo_jax.sampling import static as static_sampler

    @rewards.register(REWARD_NAME, override=True)
    def bench_digit_fraction(prompts, completions, **_):
        return [common.digit_fraction(c) for c in completions]

    config = make_config(wl, work)
    # Parameter count of the same checkpoint, as the library loads it.
    model = models.from_pretrained(wl.checkpoint)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    del model

    # The loop reads the sampled tokens to the host right after generate, so
    # blocking on them here adds no wait; it only stops the clock at the right time.
    sample_s: list[float] = []
    # The static engine calls static.generate through the module, so this wraps its calls.
    static_sampler.generate = common.timed(
        static_sampler.generate, sample_s, block=lambda out: jax.block_until_ready(out.tokens)
    )
    # The clock starts where TRL's does (on_train_begin: model, tokenizer and trainer
    # made): when the loop begins, after setup (tokenizer, model, data, optimizer) and
    # the run's start (run.start.restore_or_init). Setup's own time is reported apart.
    clock = common.StepClock()
    restore_or_init = train_lib.restore_or_init

    def start_clock_after(*args, **kwargs):
        out = restore_or_init(*args, **kwargs)
        clock.start()
        return out

    train_lib.restore_or_init = start_clock_after  # the name the loop calls
    t_call = time.perf_counter()
    workdir = work / "run"
    # A workdir with a checkpoint would resume; every benchmark run starts fresh.
    shutil.rmtree(workdir, ignore_errors=True)
    train_lib.train(config, workdir, step_callback=lambda step: clock.tick(), stream=io.StringIO())

    records = [json.loads(ln) for ln in open(workdir / "metrics.jsonl")]
    by_step = {}
    for r in records:
        by_step.setdefault(r["step"], {}).update(r)
    timed = [by_step[s] for s in range(wl.warmup_steps + 1, wl.total_steps + 1)]

    def mean(key):
        vals = [r[key] for r in timed if key in r]
        return sum(vals) / len(vals) if vals else None

    lengths = [by_step[s].get("rollout/length_mean") for s in range(1, wl.total_steps + 1)]
    tokens_per_step = [
        round(n * wl.B * wl.G) if n is not None else wl.B * wl.G * wl.T for n in lengths
    ]
    want = wl.B * wl.G * wl.T
    if any(n != want for n in tokens_per_step):
        raise RuntimeError(
            f"grpo_jax: completion tokens per step {tokens_per_step}, expected {want}"
        )
    common.emit(
        common.summarize(
            wl,
            clock,
            params=params,
            completion_tokens_per_step=tokens_per_step,
            sample_s_per_step=sample_s,
            extra={
                "versions": {"jax": jax.__version__},
                "devices": 1,
                "reward_s": mean("perf/time_reward_s"),
                # The loop's own perf/time_train_s: update dispatch -> parameters ready.
                "train_s": mean("perf/time_train_s"),
                "logits_chunk": wl.logits_chunk,
                # train() called -> loop begins: imports, tokenizer, model, data, optimizer.
                "setup_s": clock.t0 - t_call,
            },
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
