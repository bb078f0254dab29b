"""The GRPO training loop: rollout -> rewards -> advantages -> mu updates -> log/eval/checkpoint.

    summary = train(config, workdir)

Each step takes B prompts, samples G completions per prompt with the current
policy (recording pi_old's log-probs), scores them with the reward functions,
computes group advantages, and runs the jitted update (``grpo_jax.train_step``:
mu passes in minibatches, optax AdamW with clipping, schedule and gradient
accumulation, non-finite guard). The PRNG key of step s is
``fold_in(key(seed), s)``, so a resumed run draws exactly what an
uninterrupted one would. Device metrics are read one step late (after the
next update is dispatched) so the host never waits for them.

A fresh run first makes its base policy: the built-in tiny model (or a
Hugging Face checkpoint), optionally warm-started by supervised training on
worked solutions (``grpo_jax.sft``, cached in <workdir>/warm_start), and
evaluates it ("before"). Rerunning the same command resumes from the latest
checkpoint in <workdir>/checkpoints, truncating metrics.jsonl to that step.
SIGTERM saves a checkpoint at the end of the current step and returns. The
run ends with a final evaluation ("after"), a final checkpoint and
<workdir>/summary.json: {"before": {"pass_at_1"}, "after": {"pass_at_1"},
"wall_seconds"}.

Workdir layout: metrics.jsonl, tensorboard/, samples/, checkpoints/,
warm_start/, tokenizer/ (built-in tokenizer), config.json, summary.json.
"""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import distributed, memory
from grpo_jax import metrics as metrics_lib
from grpo_jax import train_step as ts
from grpo_jax.base_policy import base_policy
from grpo_jax.checkpoint import Checkpointer
from grpo_jax.config import ConfigError
from grpo_jax.data import DataIterator
from grpo_jax.evaluate import evaluate
from grpo_jax.rollout import host_prompts, score_host_rows
from grpo_jax.run import (
    build_datasets,
    build_encoder,
    build_mesh,
    build_model,
    build_scorer,
    build_tokenizer,
    check_batch_layout,
    parse_config,
    tokenizer_sampling,
)
from grpo_jax.run_summary import summarize
from grpo_jax.sampling import generate
from grpo_jax.sharding import batch_sharding, batch_shards, replicated

log = logging.getLogger(__name__)

# Keys that measure the machine, not the run: excluded from exact-resume comparisons.
TIMING_PREFIXES = ("perf/", "sft/seconds")


class NonFiniteError(FloatingPointError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class _Preemption:
    """Records SIGTERM; the loop saves and returns at the end of the step."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        del frame
        self.requested = True
        log.warning("received signal %d: saving a checkpoint after this step", signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _loud(progress, text: str) -> None:
    bar = "!" * 78
    log.warning(text)
    progress.message(f"{bar}\nWARNING: {text}\n{bar}")


def _host(tree) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(tree).items()}


def train(
    config,
    workdir: str | pathlib.Path,
    *,
    step_callback: Callable[[int], None] | None = None,
    start_time: float | None = None,
    stream=None,
) -> dict:
    """Runs (or resumes) GRPO training as ``config`` describes; returns the summary.

    Args:
      config: the run's ``ml_collections.ConfigDict`` (see ``grpo_jax.run``).
      workdir: where checkpoints, logs and the summary go; rerunning with the
        same workdir resumes.
      step_callback: called with the step number after each step's
        bookkeeping (tests use it to interrupt a run).
      start_time: ``time.time()`` at process start (wall time accounting).
      stream: where the progress line goes (stdout by default).

    Raises:
      ConfigError: a bad config key or value (before any work is done).
      NonFiniteError: train.max_nonfinite_in_row updates in a row were skipped.
    """
    t_start = time.time() if start_time is None else start_time
    run = parse_config(config)
    workdir = pathlib.Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    is_main = jax.process_index() == 0
    mesh = build_mesh(run)
    check_batch_layout(run, mesh)
    shards = batch_shards(mesh)
    G, B, T = run.grpo.G, run.train.batch_size, run.sampling["max_new_tokens"]
    N = B * G
    if is_main:
        (workdir / "config.json").write_text(json.dumps(run.raw, indent=2, sort_keys=True) + "\n")

    tokenizer = build_tokenizer(run, workdir)
    datasets = build_datasets(run)
    encoder = build_encoder(run, tokenizer)
    scorer = build_scorer(run)
    samp_cfg = tokenizer_sampling(run, tokenizer)
    test_examples = datasets[run.eval.split]
    if run.eval.num_problems:
        if len(test_examples) < run.eval.num_problems:
            raise ConfigError(
                f"config key 'eval.num_problems' = {run.eval.num_problems}, but split "
                f"{run.eval.split!r} has only {len(test_examples)} problems"
            )
        test_examples = test_examples[: run.eval.num_problems]
    train_all = datasets["train"]
    ws = run.warm_start
    if ws.enabled and len(train_all) <= ws.val_problems + ws.batch_size:
        raise ConfigError(
            f"warm_start.val_problems = {ws.val_problems} leaves too few of the "
            f"{len(train_all)} training problems to train on"
        )
    # The GRPO phase sees prompts and reference answers only, never worked solutions.
    grpo_examples = [{k: v for k, v in ex.items() if k != "solution"} for ex in train_all]

    graphdef, init_params = build_model(run, tokenizer, mesh)
    # The per-device memory plan of this layout; one that cannot fit what the devices
    # report (GPUs, TPUs) stops the run here, before any training.
    mem = memory.plan_run(run, nnx.merge(graphdef, init_params).config, mesh.shape)
    if is_main:
        print(mem.table(), file=stream or sys.stdout, flush=True)
    param_sh = jax.tree.map(lambda x: x.sharding, init_params)
    base_key = jax.random.key(run.seed)
    eval_key = jax.random.fold_in(base_key, 0x5EED)

    def run_eval(params, step: int, examples=test_examples, prefix="eval", cfg=None):
        t0 = time.perf_counter()
        out = evaluate(
            graphdef,
            params,
            examples,
            encoder=encoder,
            scorer=scorer,
            sampling=samp_cfg,
            cfg=run.eval if cfg is None else cfg,
            key=jax.random.fold_in(eval_key, step),
            mesh=mesh,
            prefix=prefix,
        )
        out[f"perf/{prefix}_s"] = time.perf_counter() - t0
        return out

    writer = metrics_lib.MetricsWriter(workdir, enabled=is_main)
    progress = metrics_lib.ProgressLine(
        run.train.steps, stream=stream, enabled=is_main, every=run.train.log_every
    )
    ck = Checkpointer(
        workdir / "checkpoints", keep=run.checkpoint.keep, async_save=run.checkpoint.async_save
    )
    try:
        with _Preemption() as preempt:
            return _train_loop(**locals())
    finally:
        ck.close()
        writer.close()


def _train_loop(
    run,
    workdir,
    mesh,
    shards,
    G,
    B,
    T,
    N,
    tokenizer,
    encoder,
    scorer,
    samp_cfg,
    test_examples,
    train_all,
    grpo_examples,
    graphdef,
    init_params,
    param_sh,
    base_key,
    run_eval,
    writer,
    progress,
    ck,
    preempt,
    is_main,
    t_start,
    step_callback,
    **_,
):
    grpo, tcfg = run.grpo, run.train
    m_rows = tcfg.minibatch_size or N
    total_updates = tcfg.steps * grpo.mu * (N // m_rows)
    tx, schedule = ts.make_optimizer(run.optim, total_updates)
    latest = ck.latest_step()
    resumed = latest is not None
    warm_info = None

    if not resumed or grpo.beta > 0:
        # A resumed run needs the base policy only as the KL reference.
        base_params, warm_info = base_policy(
            run, workdir, graphdef, init_params, param_sh=param_sh, train_all=train_all,
            encoder=encoder, mesh=mesh, run_eval=run_eval, progress=progress, preempt=preempt,
        )  # fmt: skip
        if preempt.requested:
            progress.message("preempted during the warm start; rerun to start again")
            return {"preempted": True, "step": 0}
    else:
        base_params = init_params
    ref_params = jax.tree.map(jnp.copy, base_params) if grpo.beta > 0 else None

    state = ts.init_state(base_params, tx, mesh)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    # Each host reads, samples for and scores only the rows its devices hold.
    rows_B, rows_N = distributed.host_rows(mesh, B), distributed.host_rows(mesh, N)
    if (rows_N.start, rows_N.stop) != (rows_B.start * G, rows_B.stop * G):
        raise distributed.DistributedError(
            f"this host holds prompt rows {rows_B} but completion rows {rows_N}: "
            "the mesh splits groups across hosts"
        )
    it = DataIterator(grpo_examples, B, seed=run.seed, rows=rows_B)
    if jax.process_count() > 1:
        log.info(
            "process %d of %d reads, samples for and scores rows %d:%d of every batch of %d",
            jax.process_index(),
            jax.process_count(),
            rows_B.start,
            rows_B.stop,
            B,
        )
    prior_seconds, before, no_signal_run = 0.0, None, 0
    if resumed:
        params, opt_state, meta = ck.restore(
            latest, params_like=state.params, opt_state_like=state.opt_state
        )
        counters = meta["counters"]
        state = state.replace(
            params=params,
            opt_state=opt_state,
            **{k: distributed.put(np.int32(v), replicated(mesh)) for k, v in counters.items()},
        )
        it.restore(meta["data_iterator"])
        prior_seconds = float(meta.get("wall_seconds", 0.0))
        before = meta.get("before")
        warm_info = meta.get("warm_start", warm_info)
        no_signal_run = int(meta.get("no_signal_run", 0))
        if is_main:
            writer.truncate(latest)
        progress.message(f"resuming from the checkpoint at step {latest} in {ck.directory}")
    else:
        if run.eval.at_start:
            before = run_eval(state.params, 0)
            writer.write(0, before)
            progress.message(
                f"before GRPO: held-out pass@1 {before['eval/pass_at_1']:.3f} "
                f"on {len(test_examples)} problems"
            )
    start_step = int(jax.device_get(state.step))

    step_fn = ts.jit_train_step(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=grpo,
        minibatch_size=m_rows,
        grad_accum=run.optim.grad_accum,
        batch_shards=shards,
        track_update=tcfg.track_update,
        logits_chunk=tcfg.logits_chunk,
        share_prompts=True,  # the sampler writes each prompt's G rows together
        state_shardings=state_sh,
        batch_sharding_fn=lambda nd: batch_sharding(mesh, nd),
        ref_shardings=param_sh if grpo.beta > 0 else None,
        replicated=replicated(mesh),
    )

    def meta_for(step):
        return {
            "counters": {
                k: int(jax.device_get(getattr(state, k)))
                for k in ("step", "updates", "skipped", "skipped_in_row")
            },
            "data_iterator": it.state(),
            "key_data": np.asarray(jax.random.key_data(base_key)).tolist(),
            "config": run.raw,
            "before": before,
            "warm_start": warm_info,
            "wall_seconds": prior_seconds + time.time() - t_start,
            "no_signal_run": no_signal_run,
        }

    def save(step):
        ck.save(step, params=state.params, opt_state=state.opt_state, meta=meta_for(step))

    pending = None  # (step, device metrics, host metrics, dispatch time)

    def finish(p, t_ready=None, extra=None):
        """Reads step p's device metrics, checks them, writes the record (+ ``extra``)."""
        step, dev, host, t_dispatch = p
        m = dict(host)
        m.update(_host(dev))
        m.update(extra or {})
        t_train = (t_ready or time.perf_counter()) - t_dispatch
        m["perf/time_train_s"] = t_train
        m["perf/train_tokens_per_s"] = host["_train_tokens"] / max(t_train, 1e-9)
        m["perf/step_s"] = m["perf/time_sample_s"] + m["perf/time_reward_s"] + t_train
        del m["_train_tokens"]
        writer.write(step, m)
        progress.update(step, m)
        if m["train/skipped_updates"] > 0:
            _loud(
                progress,
                f"step {step}: {int(m['train/skipped_updates'])} update(s) had a "
                "non-finite loss or gradient and were skipped (parameters unchanged)",
            )
        if m["train/skipped_in_row"] >= tcfg.max_nonfinite_in_row:
            raise NonFiniteError(
                f"stopping at step {step}: the last {int(m['train/skipped_in_row'])} updates "
                f"had a non-finite loss or gradient (train.max_nonfinite_in_row = "
                f"{tcfg.max_nonfinite_in_row}); no bad update reached the parameters. Lower "
                "optim.learning_rate, check the rewards, or resume from the last checkpoint."
            )
        kl = m.get("policy/kl_old_new", 0.0)
        if tcfg.update_kl_warn and kl > tcfg.update_kl_warn:
            _loud(
                progress,
                f"step {step}: the policy moved too far in one step: KL(pi_old || pi_new) = "
                f"{kl:.4f} > train.update_kl_warn = {tcfg.update_kl_warn} (ratios "
                f"{m['policy/ratio_min']:.2f}..{m['policy/ratio_max']:.2f}); lower "
                "optim.learning_rate or grpo.mu if this repeats",
            )
        return m

    for step in range(start_step + 1, tcfg.steps + 1):
        key = jax.random.fold_in(base_key, step)
        k_sample, k_train = jax.random.split(key)
        t0 = time.perf_counter()
        examples = it.next()  # this host's rows of the global batch
        prompts, tokens_BxP, mask_BxP, prompt_tokens = host_prompts(
            encoder, examples, mesh=mesh, num_rows=B, max_new_tokens=T
        )
        t_ready = None
        if pending is not None:  # The previous update must finish before sampling anyway.
            jax.block_until_ready(state.step)
            t_ready = time.perf_counter()
            t0 = t_ready  # Sampling time starts when the device is free.
        out = generate(
            graphdef,
            state.params,
            tokens_BxP,
            mask_BxP,
            k_sample,
            samp_cfg,
            num_samples=G,
            mesh=mesh,
        )
        jax.block_until_ready(out.lengths)
        t1 = time.perf_counter()
        roll = score_host_rows(
            out,
            examples,
            prompts,
            prompt_tokens=prompt_tokens,
            rows_n=rows_N,
            tokenizer=tokenizer,
            scorer=scorer,
            G=G,
            grpo=grpo,
            mesh=mesh,
        )
        t2 = time.perf_counter()
        batch = {
            "prompt_tokens": out.prompt_tokens,
            "prompt_mask": out.prompt_mask,
            "tokens": out.tokens,
            "mask": out.mask,
            "old_logps": out.logps,
            "advantages": roll.advantages_N,
        }
        prev = pending
        k_train = distributed.put(k_train, replicated(mesh))  # the same key on every host
        state, dev_metrics = step_fn(state, batch, k_train, ref_params)
        t_dispatch = time.perf_counter()
        host = dict(roll.metrics)
        host.update(
            {
                "perf/time_sample_s": t1 - t0,
                "perf/time_reward_s": t2 - t1,
                "perf/sample_tokens_per_s": roll.completion_tokens / max(t1 - t0, 1e-9),
                "_train_tokens": float((roll.prompt_tokens + roll.completion_tokens) * grpo.mu),
                "train/epoch": float(it.epoch),
            }
        )
        if prev is not None:
            finish(prev, t_ready)
        pending = (step, dev_metrics, host, t_dispatch)

        no_signal_run = no_signal_run + 1 if host["rollout/frac_zero_var_groups"] >= 1.0 else 0
        if tcfg.no_signal_steps and no_signal_run and no_signal_run % tcfg.no_signal_steps == 0:
            _loud(
                progress,
                f"step {step}: no group has had any reward variance for {no_signal_run} steps "
                "in a row, so every advantage is 0 and GRPO is not learning. The policy "
                f"solves all or none of each group (pass rate {host['rollout/pass_rate']:.2f});"
                " warm-start longer, make the task easier or raise grpo.G / temperature",
            )
        if tcfg.samples_every and step % tcfg.samples_every == 0 and tcfg.num_samples_logged:
            writer.write_samples(
                step,
                [
                    {
                        "prompt": roll.prompts_n[i],
                        "completion": roll.completions[i],
                        "answer": examples[i // G].get("answer"),
                        "reward": float(roll.total_n[i]),
                    }
                    for i in range(min(tcfg.num_samples_logged, len(roll.completions)))
                ],
            )

        is_last = step == tcfg.steps
        do_eval = run.eval.every and step % run.eval.every == 0 and not is_last
        do_ckpt = run.checkpoint.every and step % run.checkpoint.every == 0 and not is_last
        if do_eval or do_ckpt or preempt.requested:
            # Checkpoints and evaluations see this step's update: finish it first,
            # so the record of a checkpointed step is always on disk.
            jax.block_until_ready(state.step)
            t_ready = time.perf_counter()
            ev = run_eval(state.params, step) if do_eval else None
            finish(pending, t_ready, ev)
            pending = None
            if do_ckpt or preempt.requested:
                save(step)
            if preempt.requested:
                ck.wait()
                progress.message(
                    f"preempted: saved the checkpoint of step {step}; rerun the "
                    "same command to resume"
                )
                return {"preempted": True, "step": step}
        if step_callback is not None:
            step_callback(step)

    final_step = int(jax.device_get(state.step))
    t_ready = time.perf_counter()
    after = run_eval(state.params, final_step)
    if pending is not None:
        finish(pending, t_ready, after)
    elif not resumed:  # No steps at all (train.steps = 0): "after" is the base policy.
        writer.write(final_step, after)
    # A rerun of a finished run re-evaluates (deterministically) for its summary
    # but leaves metrics.jsonl and the checkpoints as they are.
    if final_step > start_step or not resumed:
        save(final_step)
    ck.wait()
    return summarize(
        run,
        workdir,
        before,
        after,
        warm_info,
        prior_seconds,
        t_start,
        final_step,
        progress,
        is_main,
    )
