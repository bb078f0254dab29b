"""Held-out evaluation: greedy pass@1 and unbiased pass@k, for single- and multi-turn runs.

pass@1 is greedy: one argmax completion per problem, the share that is
correct. pass@k draws n = ``eval.num_samples`` completions per problem at
``eval.temperature`` and averages Chen et al.'s unbiased estimator
1 - C(n-c, k) / C(n, k) over the problems (``grpo_jax.metrics.pass_at_k``).
Batches have a fixed size (the last one padded) so each sampler compiles once.

:func:`evaluate_policy` is the one evaluator a run calls: :func:`evaluate` for
single-turn runs, ``grpo_jax.multiturn.evaluate`` (greedy episodes) with an
environment. The command line is ``grpo_jax.evaluate``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from grpo_jax import distributed, multiturn
from grpo_jax import metrics as metrics_lib
from grpo_jax.config import EvalConfig
from grpo_jax.rollout import PromptEncoder, Rollouts, Scorer, decode
from grpo_jax.sampling import SamplingConfig, generate


def evaluate_policy(
    r: Rollouts, env, params, examples, key: jax.Array, *, cfg, prefix: str = "eval"
) -> dict[str, float]:
    """Held-out evaluation of ``params`` on ``examples`` -> ``{prefix}/...`` metrics.

    ``r``: the run's rollout bundle; ``env``: its ``env`` section (``env.name``
    set: episodes against the environment); ``cfg``: an ``eval`` section. Also
    ``perf/{prefix}_s``, the evaluation's wall time.
    """
    t0 = time.perf_counter()
    if env is not None and env.name:
        out = multiturn.evaluate(r, env, params, examples, key, cfg=cfg, prefix=prefix)
    else:
        out = evaluate(
            r.policy.graphdef,
            params,
            examples,
            encoder=r.encoder,
            scorer=r.scorer,
            sampling=r.sampling,
            cfg=cfg,
            key=key,
            mesh=r.mesh,
            prefix=prefix,
        )
    out[f"perf/{prefix}_s"] = time.perf_counter() - t0
    return out


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
