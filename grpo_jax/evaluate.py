"""Held-out evaluation: greedy pass@1 and unbiased pass@k, as a library call and a CLI.

    python -m grpo_jax.evaluate --checkpoint=<workdir> [--config=configs/default.py]

``--checkpoint`` is a training workdir (its latest checkpoint), a checkpoint
directory (``<workdir>/checkpoints``, latest step), one step of it
(``<workdir>/checkpoints/120``) or a Hugging Face model directory
(``config.json`` + safetensors, e.g. one written by ``grpo_jax.export``). The
dataset, prompts, correctness reward and eval settings come from the run's
own ``<workdir>/config.json``, or from ``--config`` (override them as usual,
``--config.eval.num_samples=8``); a ``--config`` whose model or tokenizer
differs from the run's is refused, naming the keys.

pass@1 is greedy: one argmax completion per problem, the share that is
correct. pass@k draws n = ``eval.num_samples`` completions per problem at
``eval.temperature`` and averages Chen et al.'s unbiased estimator
1 - C(n-c, k) / C(n, k) over the problems (``grpo_jax.metrics.pass_at_k``).
Batches have a fixed size (the last one padded) so each sampler compiles once.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from grpo_jax import distributed
from grpo_jax import metrics as metrics_lib
from grpo_jax.config import EvalConfig
from grpo_jax.rollout import PromptEncoder, Scorer, decode
from grpo_jax.sampling import SamplingConfig, generate


def generate_texts(
    graphdef,
    params,
    examples: Sequence[Mapping],
    *,
    encoder: PromptEncoder,
    sampling: SamplingConfig,
    num_samples: int,
    prompts_per_call: int,
    key: jax.Array,
    mesh=None,
    progress: Callable[[int], None] | None = None,
):
    """Completions for every example, ``num_samples`` each, in fixed-size calls.

    Returns (texts [len(examples) * num_samples], lengths, truncated), row
    i * num_samples + s being sample s of example i. ``progress`` is called with
    the number of examples done after each call.
    """
    texts, lengths, truncated = [], [], []
    for c, start in enumerate(range(0, len(examples), prompts_per_call)):
        chunk = list(examples[start : start + prompts_per_call])
        real = len(chunk)
        chunk += [chunk[0]] * (prompts_per_call - real)  # Same shape: no recompilation.
        _, tokens_BxP, mask_BxP = encoder.encode(chunk, max_new_tokens=sampling.max_new_tokens)
        out = generate(
            graphdef,
            params,
            tokens_BxP,
            mask_BxP,
            jax.random.fold_in(key, c),
            sampling,
            num_samples=num_samples,
            mesh=mesh,
        )
        tokens_NxT, lengths_N, trunc_N = distributed.fetch((out.tokens, out.lengths, out.truncated))
        keep = real * num_samples
        texts += decode(encoder.tokenizer, tokens_NxT[:keep], lengths_N[:keep])
        lengths.append(lengths_N[:keep])
        truncated.append(trunc_N[:keep])
        if progress is not None:
            progress(start + real)
    return texts, np.concatenate(lengths), np.concatenate(truncated)


def evaluate(
    graphdef,
    params,
    examples: Sequence[Mapping],
    *,
    encoder: PromptEncoder,
    scorer: Scorer,
    sampling: SamplingConfig,
    cfg: EvalConfig,
    key: jax.Array,
    mesh=None,
    prefix: str = "eval",
    message: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Greedy pass@1 (and pass@k when ``cfg.num_samples``) of the policy on ``examples``.

    Returns ``{prefix}/pass_at_1``, ``{prefix}/length_mean``,
    ``{prefix}/truncated_frac``, ``{prefix}/num_problems`` and, with sampling,
    ``{prefix}/pass_at_k``, ``{prefix}/pass_at_{k}``, ``{prefix}/sampled_pass_at_1``.
    ``message``, when given, receives a progress line after each batch of problems.
    """
    if not examples:
        raise ValueError("evaluate got no examples")
    t0 = time.perf_counter()

    def progress(what):
        if message is None:
            return None
        return lambda done: message(
            f"{what}: {done}/{len(examples)} problems ({time.perf_counter() - t0:.0f}s)"
        )

    greedy = dataclasses.replace(sampling, greedy=True)
    texts, lengths, trunc = generate_texts(
        graphdef,
        params,
        examples,
        encoder=encoder,
        sampling=greedy,
        num_samples=1,
        prompts_per_call=cfg.batch_size,
        key=key,
        mesh=mesh,
        progress=progress("greedy"),
    )
    correct = scorer.correct(texts, examples, lengths_N=lengths)
    out = {
        f"{prefix}/pass_at_1": float(correct.mean()),
        f"{prefix}/length_mean": float(lengths.mean()),
        f"{prefix}/truncated_frac": float(trunc.mean()),
        f"{prefix}/num_problems": float(len(examples)),
    }
    if cfg.num_samples:
        n = cfg.num_samples
        sampled = dataclasses.replace(sampling, greedy=False, temperature=cfg.temperature)
        texts, lengths_s, _ = generate_texts(
            graphdef,
            params,
            examples,
            encoder=encoder,
            sampling=sampled,
            num_samples=n,
            prompts_per_call=cfg.batch_size // n,
            key=jax.random.fold_in(key, 1),
            mesh=mesh,
            progress=progress(f"sampled, {n} each"),
        )
        correct_PxS = scorer.correct(texts, examples, repeat=n, lengths_N=lengths_s)
        correct_PxS = correct_PxS.reshape(len(examples), n)
        pass_k = metrics_lib.mean_pass_at_k(correct_PxS, cfg.k)
        out[f"{prefix}/pass_at_k"] = pass_k
        if cfg.k != 1:  # pass_at_1 is the greedy figure; never overwrite it.
            out[f"{prefix}/pass_at_{cfg.k}"] = pass_k
        out[f"{prefix}/sampled_pass_at_1"] = metrics_lib.mean_pass_at_k(correct_PxS, 1)
    return out


# ---------------------------------------------------------------------------
# Command line.


def _is_hf_dir(path: pathlib.Path) -> bool:
    return (path / "config.json").exists() and (
        (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    )


def load_policy(run, checkpoint: str | pathlib.Path, mesh):
    """(graphdef, params, tokenizer) of a workdir / checkpoint dir / step dir / HF directory."""
    from flax import nnx

    from grpo_jax import models
    from grpo_jax.config import BUILTIN_TOKENIZER
    from grpo_jax.setup import build_tokenizer, restore_policy

    path = pathlib.Path(checkpoint)
    if _workdir_of(path) is None and _is_hf_dir(path):
        model = models.from_pretrained(str(path), mesh=mesh, layout=run.mesh.layout)
        if run.tokenizer == BUILTIN_TOKENIZER:
            tokenizer = models.load_tokenizer(path)  # Exports carry their tokenizer.
        else:
            tokenizer = build_tokenizer(run, path)
        return (*nnx.split(model), tokenizer)
    step = None
    if (path / "checkpoints").is_dir():
        workdir, ckdir = path, path / "checkpoints"
    elif path.name.isdigit() and path.parent.is_dir():
        step, ckdir, workdir = int(path.name), path.parent, path.parent.parent
    elif path.is_dir():
        workdir, ckdir = path.parent, path
    else:
        raise FileNotFoundError(
            f"--checkpoint={str(checkpoint)!r} is neither a training workdir, a checkpoint "
            "directory, a checkpoint step nor a Hugging Face model directory"
        )
    tokenizer = build_tokenizer(run, workdir)
    graphdef, params, _ = restore_policy(run, tokenizer, mesh, ckdir, step)  # LoRA: base + adapters
    return graphdef, params, tokenizer


def _set(value):
    """``value`` without the None-valued keys of its mappings, at every depth."""
    if isinstance(value, dict):
        return {k: _set(v) for k, v in value.items() if v is not None}
    return value


def _workdir_of(path: pathlib.Path) -> pathlib.Path | None:
    """The training workdir that ``path`` (workdir, checkpoints dir or step) belongs to."""
    for d in (path, path.parent, path.parent.parent):
        if (d / "checkpoints").is_dir() and (d / "config.json").is_file():
            return d
    return None


def run_config_for(checkpoint, config=None):
    """The ``RunConfig`` to evaluate ``checkpoint`` with: ``config``, or the run's own.

    A training workdir's ``config.json`` is the default; a given ``config``
    must agree with it on the model and tokenizer (else ConfigError naming them).
    """
    from grpo_jax.config import ConfigError, parse_config

    workdir = _workdir_of(pathlib.Path(checkpoint))
    saved = json.loads((workdir / "config.json").read_text()) if workdir is not None else None
    if config is None:
        if saved is None:
            raise ConfigError(
                f"--checkpoint={checkpoint} is not a training workdir (no config.json beside "
                "checkpoints/): give the run's --config"
            )
        return parse_config(saved)
    run = parse_config(config)
    if saved is not None:
        # A key set to None is the default an older run's config.json had no key for.
        differ = [k for k in ("model", "tokenizer") if _set(saved.get(k)) != _set(run.raw.get(k))]
        if differ:
            raise ConfigError(
                f"--config does not match the run in {workdir}: its {differ} differ from "
                f"{workdir / 'config.json'} ({ {k: saved.get(k) for k in differ} }); the "
                "checkpoint's parameters are that model's. Omit --config to evaluate with the "
                "run's own config"
            )
    return run


def main(argv):
    from absl import flags

    from grpo_jax import cli, runlocal
    from grpo_jax.config import ConfigError
    from grpo_jax.setup import (
        build_datasets,
        build_encoder,
        build_mesh,
        build_scorer,
        eval_examples,
        tokenizer_sampling,
    )

    del argv
    cli.quiet()
    FLAGS = flags.FLAGS
    t0 = time.perf_counter()

    def message(text):  # progress on stderr: stdout holds the results alone
        print(f"evaluate: {text}", file=sys.stderr, flush=True)

    try:
        run = runlocal.resolve(run_config_for(FLAGS.checkpoint, FLAGS.config))
        mesh = build_mesh(run)
        message(f"loading {FLAGS.checkpoint}")
        graphdef, params, tokenizer = load_policy(run, FLAGS.checkpoint, mesh)
        examples = eval_examples(run, build_datasets(run))
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    message(
        f"{len(examples)} problems, loaded in {time.perf_counter() - t0:.0f}s; the first "
        "batch also compiles the sampler"
    )
    out = evaluate(
        graphdef,
        params,
        examples,
        encoder=build_encoder(run, tokenizer),
        scorer=build_scorer(run),
        sampling=tokenizer_sampling(run, tokenizer),
        cfg=run.eval,
        key=jax.random.key(run.seed),
        mesh=mesh,
        message=message,
    )
    text = json.dumps(out, indent=2, sort_keys=True)
    print(text)
    if FLAGS.output:
        pathlib.Path(FLAGS.output).write_text(text + "\n")
    return 0


def _define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Run config file (default: the run's own config.json).", lock_config=True
    )
    flags.DEFINE_string("checkpoint", None, "Workdir, checkpoint (step) dir or HF model dir.")
    flags.DEFINE_string("output", "", "Optional path for the results as JSON.")
    flags.mark_flags_as_required(["checkpoint"])


if __name__ == "__main__":
    from absl import app

    from grpo_jax import cli

    _define_flags()
    app.run(main, argv=sys.argv, flags_parser=cli.parse_flags)
