"""The policy GRPO starts from: the initial model, warm-started when configured.

With ``warm_start.enabled`` the initial model is first trained on worked
solutions (``grpo_jax.run.warm_start``) until its validation pass rate reaches the
target, on training problems held back from it; the result is cached in
``<workdir>/warm_start`` under a fingerprint of everything it depends on, so
a rerun (or a resumed run that needs the reference) loads it instead. A cache
that does not match its checksums or does not read is set aside and trained again.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

import jax

from grpo_jax.core.errors import CheckpointError
from grpo_jax.learner import optimizer as optim_lib
from grpo_jax.models import lora
from grpo_jax.run import warm_start
from grpo_jax.run import workdir as workdir_lib

if TYPE_CHECKING:
    from grpo_jax.run.setup import Setup


def warm_start_fingerprints(run) -> tuple[str, str]:
    """(fingerprint of what the warm start depends on, the one earlier versions wrote).

    ``model.lora`` is left out: the warm start trains the base alone, so a LoRA
    run resumed with another alpha or dropout reuses its cache rather than training
    it again over ``warm_start/``. Caches written with the LoRA keys still load.
    """
    parts = {
        "model": run.section("model"),
        "tokenizer": run.tokenizer,
        "data": run.section("data"),
        "prompt": run.section("prompt"),
        "warm_start": run.section("warm_start"),
        "seed": run.seed,
        "max_new_tokens": run.sampling.max_new_tokens,
        "eval": run.section("eval"),
        "correct_reward": run.rewards.correct,
    }
    base = {k: v for k, v in parts["model"].items() if k != "lora"}
    return warm_start.fingerprint({**parts, "model": base}), warm_start.fingerprint(parts)


def base_policy(s: Setup, init_params, *, evaluate, preempt):
    """(params, warm-start info or None): the initial model, warm-started when configured.

    ``evaluate(params, step, examples, prefix=, cfg=)`` scores the validation
    problems; ``preempt.requested`` stops the warm start early (nothing is
    cached then).
    """
    run, workdir, progress = s.run, s.records.workdir, s.records.progress
    ws = run.warm_start
    if not ws.enabled:
        return init_params, None
    fp, legacy_fp = warm_start_fingerprints(run)
    cached = _cached_warm_start(s, init_params, (fp, legacy_fp)) if ws.cache else None
    if cached is not None:
        params, info = cached
        progress.message(
            f"warm start: loaded from {workdir / 'warm_start'} "
            f"(validation pass@1 {info['val_pass_at_1']:.3f} after {info['steps']} steps)"
        )
        return params, dict(info, cached=True)
    val_examples = s.data.train_examples[-ws.val_problems :]
    sft_examples = s.data.train_examples[: -ws.val_problems]
    _announce_warm_start(progress, ws)
    params, info = warm_start.warm_start(
        s.policy.graphdef,
        init_params,
        sft_examples,
        val_examples,
        cfg=ws,
        encoder=s.rollouts.encoder,
        max_new_tokens=run.sampling.max_new_tokens,
        validate=_validator(run, val_examples, evaluate),
        seed=run.seed,
        mesh=s.placement.mesh,
        param_shardings=s.placement.param_shardings,
        log_fn=_warm_start_logger(workdir, progress),
        should_stop=lambda: preempt.requested,
    )
    info["fingerprint"] = fp
    if ws.cache and not info["interrupted"]:  # every process joins the multi-host save
        warm_start.save_cache(workdir, params, info)
    return params, dict(info, cached=False)


def _cached_warm_start(s: Setup, init_params, fingerprints):
    """(params, info) from the workdir's warm-start cache, or None. A damaged cache is set
    aside, and the warm start trains again."""
    workdir, progress = s.records.workdir, s.records.progress
    try:
        return warm_start.load_cached(workdir, init_params, fingerprints, say=progress.message)
    except CheckpointError as e:
        aside = warm_start.set_cache_aside(workdir)
        progress.message(f"{e}; set aside in {aside}, training the warm start again")
        return None


def _validator(run, val_examples, evaluate):
    """The warm start's validation: greedy pass@1, and sampled pass@1 when that is the
    metric it stops on."""
    ws = run.warm_start
    val_cfg = dataclasses.replace(
        run.eval,
        num_samples=ws.val_samples if ws.metric == "sampled" else 0,
        k=1,
        temperature=run.grpo.temperature,
    )

    def validate(params):
        out = evaluate(params, 0, val_examples, prefix="v", cfg=val_cfg)
        vals = {"greedy": out["v/pass_at_1"]}
        if ws.metric == "sampled":
            vals["sampled"] = out["v/sampled_pass_at_1"]
        return vals

    return validate


def _warm_start_logger(workdir, progress):
    """log_fn(step, metrics): a line of ``warm_start/metrics.jsonl`` (process 0; an earlier,
    unfinished warm start's records set aside first) and one of progress."""
    sft_log = workdir / "warm_start" / "metrics.jsonl"
    if jax.process_index() == 0:
        workdir_lib.set_aside(sft_log)

    def log_fn(step, m):
        if jax.process_index() == 0:
            sft_log.parent.mkdir(parents=True, exist_ok=True)
            with open(sft_log, "a") as f:
                f.write(json.dumps({"step": step, **m}, sort_keys=True) + "\n")
        sampled = m.get("sft/val_sampled_pass_at_1")
        progress.message(
            f"warm start step {step}: loss {m['sft/loss']:.4f}, token acc "
            f"{m['sft/token_accuracy']:.3f}, validation pass@1 greedy "
            f"{m['sft/val_greedy_pass_at_1']:.3f}"
            + ("" if sampled is None else f", sampled {sampled:.3f}")
            + f" ({m['sft/seconds']:.0f}s)"
        )

    return log_fn


def _announce_warm_start(progress, ws) -> None:
    progress.message(
        (
            f"warm start: {ws.max_steps} steps of supervised training"
            if ws.min_steps == ws.max_steps
            else f"warm start: supervised training until {ws.metric} validation pass@1 >= "
            f"{ws.target_pass_at_1} (at most {ws.max_steps} steps)"
        )
        + f"; a line every {ws.eval_every} steps, the first after compiling"
    )


def lora_base_policy(s: Setup, state, *, evaluate, preempt):
    """(state, warm-start info or None, base identity) of a LoRA run (``s.policy.lora``).

    The base is the initial model, warm-started when configured (on a resume
    too: the warm start's cache gives it back); the warm start trains the base
    alone, and the adapters (B = 0) stay as they were. Returns (None, None,
    None) when SIGTERM arrived during the warm start.
    """
    base, adapters = lora.split(state.params)
    base_sh, _ = lora.split(s.placement.param_shardings)
    s_base = dataclasses.replace(
        s,
        policy=dataclasses.replace(s.policy, graphdef=s.policy.lora.base_graphdef),
        placement=dataclasses.replace(s.placement, param_shardings=base_sh),
    )

    def evaluate_base(params, *args, **kwargs):  # through the policy: B = 0 adds exact zeros
        return evaluate(lora.join(params, adapters), *args, **kwargs)

    new_base, info = base_policy(s_base, base, evaluate=evaluate_base, preempt=preempt)
    if preempt.requested:
        return None, None, None
    if new_base is not base:
        params = lora.join(new_base, adapters)
        state = optim_lib.init_state(
            params,
            s.trainer.tx,
            s.placement.mesh,
            trained=lora.trainable(params),
            critic=state.critic,
        )
    warm_fp = info.get("fingerprint") if info else None
    return state, info, s.policy.lora.identity(new_base, warm_start=warm_fp)
