"""Held-out evaluation: greedy pass@1 and unbiased pass@k, for single- and multi-turn runs.

:func:`evaluate_policy` is the one evaluator a run calls: :func:`evaluate_problems` for
single-turn runs, ``grpo_jax.rollout.episodes.evaluate_problems`` with an environment, both
into the same per-problem results and figures. A run's evaluation at step s draws from
:func:`eval_key` (seed, s), and so does ``grpo_jax.evaluate`` on that step's checkpoint, so it
reproduces the run's figures (docs/evaluation.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from grpo_jax.core import distributed
from grpo_jax.core import problems as problems_lib
from grpo_jax.rollout import episodes as episodes_lib
from grpo_jax.rollout.rounds import PromptEncoder, Rollouts, decode
from grpo_jax.rollout.scorer import Scorer
from grpo_jax.run.config import EvalConfig
from grpo_jax.sampling.static import SamplingConfig, generate, problem_keys

# Folded into the run's key to give the evaluations a stream of their own (setup's eval_key).
EVAL_STREAM = 0x5EED


def eval_base_key(seed: int) -> jax.Array:
    """The run's evaluation key, ``fold_in(key(seed), EVAL_STREAM)`` (``Setup.eval_key``)."""
    return jax.random.fold_in(jax.random.key(seed), EVAL_STREAM)


def eval_key(seed: int, step: int) -> jax.Array:
    """The key of the run's evaluation at ``step``: ``fold_in(eval_base_key(seed), step)``."""
    return jax.random.fold_in(eval_base_key(seed), step)


def evaluate_policy(
    r: Rollouts,
    env,
    params,
    examples,
    key: jax.Array,
    *,
    cfg,
    prefix: str = "eval",
    on_problems: Callable[[problems_lib.Problems], None] | None = None,
) -> dict[str, float]:
    """Held-out evaluation of ``params`` on ``examples`` -> ``{prefix}/...`` metrics.

    ``r``: the run's rollout bundle; ``env``: its ``env`` section (``env.name``
    set: episodes against the environment); ``cfg``: an ``eval`` section. Also
    ``perf/{prefix}_s``, the evaluation's wall time. ``on_problems`` receives the
    per-problem results (``grpo_jax.core.problems``); a multi-turn evaluation's come from
    ``grpo_jax.rollout.episodes.evaluate_problems`` (a problem is correct when its episode
    succeeds), with its episode figures (reward, turns, environment errors) beside.
    """
    t0 = time.perf_counter()
    k = cfg.k if cfg.num_samples else None
    if env is not None and env.name:
        prob, episodes = episodes_lib.evaluate_problems(r, env, params, examples, key, cfg=cfg)
        out = problems_lib.figures(prob, k, prefix)
        out.update({f"{prefix}/{name}": value for name, value in episodes.items()})
    else:
        prob = evaluate_problems(
            r.policy.graphdef,
            params,
            examples,
            encoder=r.encoder,
            scorer=r.scorer,
            sampling=r.sampling,
            cfg=cfg,
            key=key,
            mesh=r.mesh,
        )
        out = problems_lib.figures(prob, k, prefix)
    if on_problems is not None:
        on_problems(prob)
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
    row_keys: bool = False,
):
    """Completions for every example, ``num_samples`` each, in fixed-size calls.

    Returns (texts [len(examples) * num_samples], lengths, truncated), row
    i * num_samples + s being sample s of example i. ``row_keys``: example i
    draws from ``fold_in(key, i)`` alone (``grpo_jax.sampling.static.generate``'s row
    keys), so its completions do not depend on ``prompts_per_call`` or the mesh;
    else call c draws from ``fold_in(key, c)``. ``progress`` is called with the
    number of examples done after each call.
    """
    texts, lengths, truncated = [], [], []
    for c, start in enumerate(range(0, len(examples), prompts_per_call)):
        chunk = list(examples[start : start + prompts_per_call])
        real = len(chunk)
        chunk += [chunk[0]] * (prompts_per_call - real)  # Same shape: no recompilation.
        _, tokens_BxP, mask_BxP = encoder.encode(chunk, max_new_tokens=sampling.max_new_tokens)
        if row_keys:
            call_key = problem_keys(key, start, real, prompts_per_call)
        else:
            call_key = jax.random.fold_in(key, c)
        out = generate(
            graphdef,
            params,
            tokens_BxP,
            mask_BxP,
            call_key,
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
    graphdef, params, examples: Sequence[Mapping], *, cfg: EvalConfig, prefix="eval", **kw
):
    """Greedy pass@1 (and pass@k when ``cfg.num_samples``) of the policy on ``examples``,
    with their intervals: :func:`grpo_jax.core.problems.figures` of :func:`evaluate_problems`.

    Returns ``{prefix}/pass_at_1`` (with ``_lo``/``_hi``, ``_cp_lo``/``_cp_hi``),
    ``{prefix}/length_mean``, ``{prefix}/truncated_frac``, ``{prefix}/num_problems``
    and, with sampling, ``{prefix}/pass_at_k``, ``{prefix}/pass_at_{k}``,
    ``{prefix}/sampled_pass_at_1`` (each with ``_lo``/``_hi``) and ``{prefix}/num_seeds``.
    """
    prob = evaluate_problems(graphdef, params, examples, cfg=cfg, **kw)
    return problems_lib.figures(prob, cfg.k if cfg.num_samples else None, prefix)


def evaluate_problems(
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
    message: Callable[[str], None] | None = None,
) -> problems_lib.Problems:
    """Every problem's greedy completion and, when ``cfg.num_samples``, n sampled ones per
    seed of ``cfg.seeds``, scored: a :class:`grpo_jax.core.problems.Problems`.

    Seed s samples problem i from ``fold_in(fold_in(key, 1 + s), i)``: the results
    are the same for any ``cfg.batch_size`` and mesh. ``message``, when given,
    receives a progress line after each batch of problems.
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

    common = dict(encoder=encoder, mesh=mesh, row_keys=True)
    sampling = dataclasses.replace(sampling, record_routes=False)  # routes train, not score
    greedy = dataclasses.replace(sampling, greedy=True)
    texts, lengths, trunc = generate_texts(
        graphdef, params, examples, sampling=greedy, num_samples=1,
        prompts_per_call=cfg.batch_size, key=key, progress=progress("greedy"), **common,
    )  # fmt: skip
    kw = {}
    if cfg.num_samples:
        n = cfg.num_samples
        sampled = dataclasses.replace(sampling, greedy=False, temperature=cfg.temperature)
        correct, length = [], []
        many = len(cfg.seeds) > 1
        for seed in cfg.seeds:
            what = f"sampled, {n} each" + (f", seed {seed}" if many else "")
            texts_s, lengths_s, _ = generate_texts(
                graphdef, params, examples, sampling=sampled, num_samples=n,
                prompts_per_call=max(1, cfg.batch_size // n),
                key=jax.random.fold_in(key, 1 + seed), progress=progress(what), **common,
            )  # fmt: skip
            c = scorer.correct(texts_s, examples, repeat=n, lengths_N=lengths_s)
            correct.append(np.asarray(c, bool).reshape(len(examples), n))
            length.append(np.asarray(lengths_s).reshape(len(examples), n))
        kw = dict(
            seeds=tuple(cfg.seeds),
            sampled_correct=np.stack(correct),
            sampled_length=np.stack(length),
        )
    return problems_lib.Problems(
        ids=tuple(problems_lib.problem_id(e) for e in examples),
        greedy_correct=np.asarray(scorer.correct(texts, examples, lengths_N=lengths), bool),
        greedy_length=np.asarray(lengths),
        greedy_truncated=np.asarray(trunc, bool),
        **kw,
    )
