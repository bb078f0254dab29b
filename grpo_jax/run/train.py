"""The GRPO training loop: setup -> restore_or_init -> (take -> update -> report)* -> summary.

    summary = train(config, workdir)

One loop serves every kind of run, with no branch on the kind of source: each step takes a
batch from a rollout source behind the staleness wrapper, runs the jitted update and hands
the metrics to the reporter, one step late. What moves as it trains is the run's state,
which every checkpoint saves, so rerunning the command resumes exactly.
docs/architecture.md, "The loop".
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
from flax import nnx

from grpo_jax.core import batch as batch_lib
from grpo_jax.core import distributed, problems
from grpo_jax.core.errors import WorkdirWriteError
from grpo_jax.core.sharding import replicated
from grpo_jax.data import DataIterator
from grpo_jax.learner import ahead as ahead_lib
from grpo_jax.rollout import sources
from grpo_jax.rollout.staleness import Staleness
from grpo_jax.run import evaluation, record
from grpo_jax.run.builders import route_spec
from grpo_jax.run.config import parse_config
from grpo_jax.run.report import Reporter
from grpo_jax.run.schedule import Schedule
from grpo_jax.run.setup import Setup, setup
from grpo_jax.run.start import restore_or_init, save_run
from grpo_jax.run.state import RunState
from grpo_jax.run.summary import summarize

log = logging.getLogger(__name__)

# A write to the workdir failed (a full disk, a quota, a file size limit, a file system that
# went read-only): one line, and the checkpoints already saved are what a rerun resumes from.
_WRITE_FAILED = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)

# Keys that measure the machine, not the run: excluded from exact-resume comparisons.
TIMING_PREFIXES = ("perf/", "sft/seconds")

__all__ = ["TIMING_PREFIXES", "train"]


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


def _stop(s: Setup, rs: RunState, step: int) -> dict:
    """The end of a run stopped by SIGTERM or a health alarm, its checkpoint of ``step``
    saved: an alarm raises ``AlarmStop`` (nothing resumes past it unasked)."""
    s.records.checkpointer.wait()
    if rs.report.stop_requested:
        raise rs.report.alarms.stop_error(step)
    rs.report.message(
        f"preempted: saved the checkpoint of step {step}; rerun the same command to resume"
    )
    return {"preempted": True, "step": step}


def _update_compiled_ahead(s: Setup, state, prompt_width: int, key, ref_params):
    """The update compiled, in a background thread, for a batch of prompts ``prompt_width``
    wide: a context manager (:class:`grpo_jax.learner.ahead.CompiledAhead`) whose value is the
    update. A packed update's shapes follow the lengths the step draws (docs/packing.md):
    it compiles when the first batch is there."""
    run = s.run
    if run.train.packing == "on":
        return contextlib.nullcontext(s.trainer.update)
    routes = route_spec(run, nnx.merge(s.policy.graphdef, state.params).config)
    spec = batch_lib.batch_spec(
        batch_lib.rollout_batch_shardings(s.placement.mesh, routes=routes is not None),
        run.train.batch_size * run.grpo.G,
        prompt_width,
        run.completion_slots[0],
        routes=routes,
    )
    return ahead_lib.CompiledAhead(s.trainer.update, state, spec, key, ref_params)


def _train_key(s: Setup, step: int):
    """The PRNG key of step ``step``'s update, the same on every host (the sampler's is
    ``sources.sample_key``)."""
    key = jax.random.split(jax.random.fold_in(s.base_key, step))[1]
    return distributed.put(key, replicated(s.placement.mesh))


class _Update:
    """The run's update: ``s.trainer.update``, or the same compiled ahead for the first
    batch once a source knows its prompt width (``compile_for``), while the sampler
    compiles and samples. The compilation's thread ends with the run (``run_scoped``)."""

    def __init__(self, s: Setup, run_scoped):
        self.fn = s.trainer.update
        self._s, self._run_scoped = s, run_scoped
        self._ahead = None  # (state, ref_params, first step): known once the run has started

    def starts(self, state, ref_params, first_step: int) -> None:
        self._ahead = (state, ref_params, first_step)

    def compile_for(self, prompt_width: int) -> None:
        s, (state, ref_params, first_step) = self._s, self._ahead
        key = _train_key(s, first_step)
        ahead = _update_compiled_ahead(s, state, prompt_width, key, ref_params)
        self.fn = self._run_scoped.enter_context(ahead)


def _run_state(s: Setup, state, t_start: float, on_prompts, run_scoped) -> RunState:
    """The run's state as it starts afresh, with the source of its batches
    (``on_prompts``: called with the first batch's prompt width)."""
    run = s.run
    iterator = DataIterator(
        s.data.prompts, run.train.batch_size, seed=run.seed, rows=s.placement.rows_B
    )
    source = sources.make_source(run, s.rollouts, iterator, s.base_key, on_prompts=on_prompts)
    pipe = Staleness(source, run.train.max_staleness, last=run.train.steps, mesh=s.placement.mesh)
    return RunState(
        train=state,
        iterator=iterator,
        scorer=s.rollouts.scorer,
        pipe=run_scoped.enter_context(pipe),
        report=Reporter(run, s.records, iterator),
        schedule=Schedule(run, t_start, say=s.records.progress.message),
    )


def _loop(s: Setup, state, preempt, t_start: float, step_callback, run_scoped) -> dict:
    """The one training loop, for every source and staleness (docs/architecture.md)."""
    run = s.run
    evaluate_fn = functools.partial(evaluate_policy, s)
    update = _Update(s, run_scoped)
    rs = _run_state(s, state, t_start, update.compile_for, run_scoped)
    start = restore_or_init(s, rs, evaluate=evaluate_fn, preempt=preempt)
    if start is None:
        return {"preempted": True, "step": 0}
    ref_params, report, schedule, pipe = start.ref_params, rs.report, rs.schedule, rs.pipe
    report.begin(start.start_step)
    update.starts(rs.train, ref_params, start.start_step + 1)
    pipe.fill(start.start_step, rs.train.params)

    for step in range(start.start_step + 1, run.train.steps + 1):
        if schedule.budget_spent():  # train.sampled_tokens_budget
            break
        k_train = _train_key(s, step)
        cur = pipe.take(step, rs.train.params)
        t_update = time.perf_counter()  # before the call: a CPU may run it inside the call
        rs.train, dev_metrics = update.fn(rs.train, cur.batch, k_train, ref_params)
        host, late = pipe.settle(step, t_update, dev_metrics)
        tokens = schedule.sampled(host.sampled_tokens)
        report.step_done(step, dev_metrics, host, t_update, sampled_tokens=tokens, late=late)
        preempt.requested |= report.stop_requested  # a health alarm (health.stop_on_alarm)

        do_eval, do_ckpt = schedule.due(step)
        # With health.stop_on_alarm every record is written at its own step (the host
        # waits for the update rather than reading its metrics one step late), so an alarm
        # stops the run at the step it fires and the checkpoint saved is that step's.
        at_once = (
            run.health.stop_on_alarm and step < run.train.steps and not schedule.budget_spent()
        )
        if do_eval or do_ckpt or preempt.requested or at_once:
            # Checkpoints and evaluations see this step's update: its record goes
            # first, so the record of a checkpointed step is always on disk.
            evaluate = functools.partial(evaluate_fn, rs.train.params, step) if do_eval else None
            report.flush(rs.train, evaluate, late=pipe.finish_step(step))
            preempt.requested |= report.stop_requested
            if do_ckpt or preempt.requested:
                save_run(s, rs, step, start)
            if preempt.requested:
                return _stop(s, rs, step)
        if step_callback is not None:
            step_callback(step)

    final_step = int(jax.device_get(rs.train.step))
    ended_by = schedule.ended_by(final_step)
    # A rerun of a finished run re-evaluates (deterministically) for its summary but
    # leaves metrics.jsonl and the checkpoints as they are.
    after = report.flush(
        rs.train,
        functools.partial(evaluate_fn, rs.train.params, final_step),
        write_alone=not start.resumed,
        late=pipe.finish_step(final_step),
    )
    if final_step > start.start_step or not start.resumed:
        save_run(s, rs, final_step, start)
    s.records.checkpointer.wait()
    return summarize(
        run,
        s.records.workdir,
        start.before,
        after,
        start.warm_info,
        schedule.prior_seconds,
        schedule.t_start,
        final_step,
        s.records.progress,
        s.records.is_main,
        data_stats=s.data.stats,
        sampled_tokens=schedule.sampled_tokens,
        ended_by=ended_by,
        record=record.run_record(run, s.data.eval_examples),
    )
