"""The GRPO training loop: setup -> restore_or_init -> (take -> update -> report)* -> summary.

    summary = train(config, workdir)

Each step takes B prompts, samples G completions per prompt with the current
policy (recording pi_old's log-probs), scores them with the reward functions
and normalises the rewards into group advantages (a rollout source,
``grpo_jax.rollout.sources``: single-turn, dynamic sampling or multi-turn episodes,
behind ``pipeline.Staleness``, which with ``train.max_staleness`` = k >= 1
samples each batch k updates ahead), then runs the jitted update
(``grpo_jax.learner.update``: mu passes in minibatches, AdamW, gradient accumulation,
non-finite guard). One loop serves every kind of run. The PRNG key of step s
is ``fold_in(key(seed), s)``, so a resumed run draws exactly what an
uninterrupted one would. Device metrics are read one step late
(``grpo_jax.run.report``) so the host never waits for them.
docs/architecture.md describes the parts and the data flow.

A fresh run first makes its base policy: the built-in tiny model (or a
Hugging Face checkpoint), optionally warm-started by supervised training on
worked solutions (``grpo_jax.run.warm_start``, cached in <workdir>/warm_start), and
evaluates it ("before"). Rerunning the same command resumes from the latest
checkpoint in <workdir>/checkpoints, truncating metrics.jsonl to that step.
SIGTERM saves a checkpoint at the end of the current step and returns; a
health alarm with ``health.stop_on_alarm`` saves one and raises ``AlarmStop``. The
run ends with a final evaluation ("after"), a final checkpoint and
<workdir>/summary.json (``grpo_jax.run.summary``): the "before" and "after"
evaluations, wall seconds, steps, seed, number of problems, what the warm
start did, the completion tokens sampled and what ended the run (``train.steps``,
or ``train.sampled_tokens_budget``, which also says so in one line).

Workdir layout: metrics.jsonl, tensorboard/, samples/, checkpoints/,
warm_start/, tokenizer/ (built-in tokenizer), config.json, summary.json,
eval/step_<N>.jsonl (each evaluation's per-problem results, ``grpo_jax.core.problems``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import pathlib
import signal
import threading
import time
from collections.abc import Callable

import jax

from grpo_jax.core import batch as batch_lib
from grpo_jax.core import distributed, problems
from grpo_jax.core.errors import AlarmStop, NonFiniteError, WorkdirWriteError
from grpo_jax.core.sharding import replicated
from grpo_jax.learner import update as update_lib
from grpo_jax.reward_models import Judge
from grpo_jax.rollout import sources
from grpo_jax.rollout import staleness as pipeline
from grpo_jax.run import evaluation, record
from grpo_jax.run import start as checkpoint
from grpo_jax.run.config import parse_config
from grpo_jax.run.report import Reporter
from grpo_jax.run.setup import Setup, setup
from grpo_jax.run.summary import summarize

log = logging.getLogger(__name__)

# A write to the workdir failed (a full disk, a quota, a file size limit, a file system that
# went read-only): one line, and the checkpoints already saved are what a rerun resumes from.
_WRITE_FAILED = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)

# Keys that measure the machine, not the run: excluded from exact-resume comparisons.
TIMING_PREFIXES = ("perf/", "sft/seconds")

__all__ = ["TIMING_PREFIXES", "AlarmStop", "NonFiniteError", "train"]


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


def evaluate_policy(s: Setup, params, step: int, examples=None, prefix="eval", cfg=None) -> dict:
    """Held-out evaluation of ``params`` (``grpo_jax.run.evaluation``), keyed by ``step``.

    The run's own evaluations (``examples`` None) also write their per-problem
    results, figures and the run's record to ``<workdir>/eval/step_<step>.jsonl``.
    """
    cfg = s.run.eval if cfg is None else cfg
    on_problems = None
    if examples is None and s.records.is_main:
        on_problems = lambda prob: _write_problems(s, step, prob, cfg, prefix)
    return evaluation.evaluate_policy(
        s.rollouts,
        s.run.env,
        params,
        s.data.eval_examples if examples is None else examples,
        jax.random.fold_in(s.eval_key, step),
        cfg=cfg,
        prefix=prefix,
        on_problems=on_problems,
    )


def _write_problems(s: Setup, step: int, prob, cfg, prefix: str) -> None:
    """``<workdir>/eval/step_<step>.jsonl`` (``grpo_jax.core.problems``'s file)."""
    k = cfg.k if cfg.num_samples else None
    header = {
        "step": step,
        "k": k,
        "num_samples": cfg.num_samples,
        "temperature": cfg.temperature,
        "seeds": list(cfg.seeds),
        "figures": problems.figures(prob, k, prefix),
        "record": record.run_record(s.run, s.data.eval_examples),
    }
    problems.write(s.records.workdir / "eval" / f"step_{step}.jsonl", prob, header)


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
      config: the run's ``ml_collections.ConfigDict`` (see ``grpo_jax.run.config``).
      workdir: where checkpoints, logs and the summary go; rerunning with the
        same workdir resumes.
      step_callback: called with the step number after each step's
        bookkeeping (tests use it to interrupt a run).
      start_time: ``time.time()`` at process start (wall time accounting).
      stream: where the progress line goes (stdout by default).

    Raises:
      ConfigError: a bad config key or value (before any work is done).
      CheckpointError: a save failed (a full disk), naming the newest intact checkpoint.
      WorkdirWriteError: another write to the workdir found the disk full.
      NonFiniteError: train.max_nonfinite_in_row updates in a row were skipped.
      AlarmStop: a health alarm stopped the run (health.stop_on_alarm; its checkpoint
        saved), or the workdir's run was stopped so and health.resume_after_stop is not set.
    """
    t_start = time.time() if start_time is None else start_time
    try:
        s, state = setup(parse_config(config), workdir, stream=stream)
        try:
            with _Preemption() as preempt, contextlib.ExitStack() as run_scoped:
                summary = _loop(s, state, preempt, t_start, step_callback, run_scoped)
        except BaseException:
            # The first error is the one to report: closing after a full disk fails too.
            _close(s, quietly=True)
            raise
        _close(s, quietly=False)
        return summary
    except OSError as e:
        if e.errno not in _WRITE_FAILED:
            raise
        where = e.filename or f"to {workdir}"
        cure = "free disk space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "fix the cause"
        raise WorkdirWriteError(
            f"writing {where} failed: {e.strerror}; {cure}, then rerun the same command: it "
            "resumes from the newest checkpoint"
        ) from e


def _close(s: Setup, *, quietly: bool) -> None:
    """Closes the run's writers; the workdir's lock is let go even when that fails."""
    try:
        s.close()
    except Exception:
        if not quietly:
            raise
    finally:
        if s.records.lock is not None:
            s.records.lock.release()


def _save(
    s: Setup, state, step: int, *, start, report: Reporter, t_start: float, inflight=None
) -> None:
    wall = start.prior_seconds + time.time() - t_start
    checkpoint.save_run(
        s,
        state,
        step,
        start,
        no_signal_run=report.no_signal_run,
        wall_seconds=wall,
        sampled_tokens=report.sampled_tokens,
        health=report.health_state(),
        inflight=inflight,
    )


def _stop(s: Setup, report: Reporter, step: int) -> dict:
    """The end of a run stopped by SIGTERM or a health alarm, its checkpoint of ``step``
    saved: an alarm raises ``AlarmStop`` (nothing resumes past it unasked)."""
    s.records.checkpointer.wait()
    if report.stop_requested:
        raise report.alarm_stop(step)
    report.message(
        f"preempted: saved the checkpoint of step {step}; rerun the same command to resume"
    )
    return {"preempted": True, "step": step}


def _update_compiled_ahead(s: Setup, state, prompt_width: int, key, ref_params):
    """The update compiled, in a background thread, for a batch of prompts ``prompt_width``
    wide: a context manager (:class:`grpo_jax.learner.update.CompiledAhead`) whose value is the
    update."""
    run = s.run
    spec = batch_lib.batch_spec(
        batch_lib.rollout_batch_shardings(s.placement.mesh),
        run.train.batch_size * run.grpo.G,
        prompt_width,
        run.sampling.max_new_tokens,
    )
    return update_lib.CompiledAhead(s.trainer.update, state, spec, key, ref_params)


def _train_key(s: Setup, step: int):
    """The PRNG key of step ``step``'s update, the same on every host (the sampler's is
    ``sources.sample_key``)."""
    key = jax.random.split(jax.random.fold_in(s.base_key, step))[1]
    return distributed.put(key, replicated(s.placement.mesh))


class _Update:
    """The run's update: ``s.trainer.update``, or the same compiled ahead for the first
    batch once a source knows its prompt width (``compile_for``), while the sampler
    compiles and samples. The compilation's thread ends with the run (``run_scoped``)."""

    def __init__(self, s: Setup, state, ref_params, first_step: int, run_scoped):
        self.fn = s.trainer.update
        self._ahead = (s, state, ref_params, first_step, run_scoped)

    def compile_for(self, prompt_width: int) -> None:
        s, state, ref_params, first_step, run_scoped = self._ahead
        key = _train_key(s, first_step)
        ahead = _update_compiled_ahead(s, state, prompt_width, key, ref_params)
        self.fn = run_scoped.enter_context(ahead)


def _loop(s: Setup, state, preempt, t_start: float, step_callback, run_scoped) -> dict:
    """The one training loop, for every source and staleness (docs/architecture.md)."""
    run = s.run
    evaluate_fn = functools.partial(evaluate_policy, s)
    start = checkpoint.restore_or_init(s, state, evaluate=evaluate_fn, preempt=preempt)
    if start is None:
        return {"preempted": True, "step": 0}
    state, ref_params = start.state, start.ref_params
    for _, learned, _ in s.rollouts.scorer.learned:  # the reference as judge: its own arrays
        if isinstance(learned, Judge) and learned.params is None:
            learned.bind(s.policy.graphdef, ref_params, s.policy.tokenizer)
    report = Reporter(
        run,
        s.records,
        s.data.iterator,
        no_signal_run=start.no_signal_run,
        start_step=start.start_step,
        sampled_tokens=start.sampled_tokens,
        health_state=start.health_state,
    )
    update = _Update(s, state, ref_params, start.start_step + 1, run_scoped)
    # Partial rollouts spend the staleness bound on rows carried between the engine's
    # runs (grpo_jax.rollout.partial), so their batches are sampled at their own step.
    partial = run.sampling.partial_rollouts
    k = 0 if partial else run.train.max_staleness
    queue = []
    if start.resumed and k:
        queue = pipeline.restore_inflight(
            s.records.checkpointer, s.placement.mesh, start.start_step
        )
    source = sources.make_source(
        run, s.rollouts, s.data.iterator, s.base_key, on_prompts=update.compile_for
    )
    if start.resumed and partial:
        source.restore(s.records.checkpointer, s.placement.mesh, start.start_step)
    pipe = pipeline.Staleness(source, k, last=run.train.steps, queue=queue)
    run_scoped.enter_context(pipe)
    pipe.fill(start.start_step, state.params)

    def save(state, step):
        inflight = source.to_save() if partial else pipe.to_save()
        _save(s, state, step, start=start, report=report, t_start=t_start, inflight=inflight)

    for step in range(start.start_step + 1, run.train.steps + 1):
        if report.budget_spent():  # train.sampled_tokens_budget
            break
        k_train = _train_key(s, step)
        cur = pipe.take(step, state.params)
        t_update = time.perf_counter()  # before the call: a CPU may run it inside the call
        state, dev_metrics = update.fn(state, cur.batch, k_train, ref_params)
        host, late = pipe.settle(step, t_update, dev_metrics)
        report.step_done(step, dev_metrics, host, t_update, late=late)
        preempt.requested |= report.stop_requested  # a health alarm (health.stop_on_alarm)

        do_eval, do_ckpt = report.due(step)
        # With health.stop_on_alarm every record is written at its own step (the host
        # waits for the update rather than reading its metrics one step late), so an alarm
        # stops the run at the step it fires and the checkpoint saved is that step's.
        at_once = run.health.stop_on_alarm and step < run.train.steps and not report.budget_spent()
        if do_eval or do_ckpt or preempt.requested or at_once:
            # Checkpoints and evaluations see this step's update: its record goes
            # first, so the record of a checkpointed step is always on disk.
            evaluate = functools.partial(evaluate_fn, state.params, step) if do_eval else None
            report.flush(state, evaluate, late=pipe.finish_step(step))
            preempt.requested |= report.stop_requested
            if do_ckpt or preempt.requested:
                save(state, step)
            if preempt.requested:
                return _stop(s, report, step)
        if step_callback is not None:
            step_callback(step)

    final_step = int(jax.device_get(state.step))
    ended_by = report.ended_by(final_step)
    # A rerun of a finished run re-evaluates (deterministically) for its summary but
    # leaves metrics.jsonl and the checkpoints as they are.
    after = report.flush(
        state,
        functools.partial(evaluate_fn, state.params, final_step),
        write_alone=not start.resumed,
        late=pipe.finish_step(final_step),
    )
    if final_step > start.start_step or not start.resumed:
        save(state, final_step)
    s.records.checkpointer.wait()
    return summarize(
        run,
        s.records.workdir,
        start.before,
        after,
        start.warm_info,
        start.prior_seconds,
        t_start,
        final_step,
        s.records.progress,
        s.records.is_main,
        data_stats=s.data.stats,
        sampled_tokens=report.sampled_tokens,
        ended_by=ended_by,
        record=record.run_record(run, s.data.eval_examples),
    )
