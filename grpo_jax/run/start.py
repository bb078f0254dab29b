"""Orbax checkpoints of a training run: save every N steps, keep the last K, resume.

A checkpoint at step s holds three items (four with ``train.max_staleness`` >= 1):

  params     the policy parameter pytree (sharded arrays, restored in place)
  opt_state  the optax state
  meta       JSON: step, PRNG key data, data-iterator state, the run config,
             counters (skipped updates, ...), the health alarms' history
             (``Reporter.health_state``: with the alarms that stopped the run,
             if one did) and the learned rewards' running-normalisation moments
             (``Scorer.moments_state``) needed for an exact resume, and the
             checksums of every array saved and of the meta itself
             (``grpo_jax.run.checkpoints``, verified on every restore).
  inflight   the batches of steps s + 1 .. s + k, sampled before the save
             (``grpo_jax.rollout.staleness``); meta["inflight"] gives their steps,
             parameter versions, shapes and host-side rollouts.

Saves are asynchronous (the host writes while the device trains) and atomic:
orbax writes into a temporary directory and renames it when complete, so a run
killed mid-save resumes from the previous checkpoint.

``restore_or_init`` starts a training run from its workdir (resuming from the
latest checkpoint, or making the base policy), and ``save_run`` saves one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from grpo_jax.core import distributed, integrity
from grpo_jax.core.errors import CheckpointError, IntegrityError
from grpo_jax.core.sharding import replicated
from grpo_jax.learner import optimizer as optim_lib
from grpo_jax.models import lora
from grpo_jax.run.base_policy import base_policy, lora_base_policy
from grpo_jax.run.checkpoints import Checkpointer  # noqa: F401 - importable here as before

if TYPE_CHECKING:
    from grpo_jax.run.setup import Setup


# ---------------------------------------------------------------------------
# A training run's start: resume from the workdir's latest checkpoint, or begin.

COUNTERS = ("step", "updates", "skipped", "skipped_in_row")


@dataclasses.dataclass(frozen=True)
class RunStart:
    """Where a run starts: its train state, reference policy and bookkeeping.

    Attributes:
      state: the ``TrainState`` to train on.
      ref_params: the frozen reference policy (the base policy), None when beta = 0.
      resumed: whether ``state`` came from a checkpoint.
      start_step: GRPO steps already taken.
      before: the evaluation of the base policy ("before" in summary.json).
      warm_info: what the warm start did (None without one).
      prior_seconds: wall time of the run's earlier processes.
      no_signal_run: steps in a row without reward variance so far.
      sampled_tokens: completion tokens sampled so far (train.sampled_tokens_budget).
      lora_base: with LoRA, the frozen base's identity (``grpo_jax.models.lora``).
      health_state: the health alarms' history (``Reporter.health_state``), None when fresh.
    """

    state: Any
    ref_params: Any
    resumed: bool
    start_step: int
    before: dict | None
    warm_info: dict | None
    prior_seconds: float
    no_signal_run: int
    sampled_tokens: int = 0
    lora_base: dict | None = None
    health_state: dict | None = None


def restore_or_init(s: Setup, state, *, evaluate, preempt) -> RunStart | None:
    """Resumes from ``s.records.checkpointer``'s latest step, or makes the base policy and starts.

    ``state`` is the setup's initial ``TrainState``. A fresh run makes the base
    policy (``grpo_jax.run.base_policy``: warm-started when configured) and
    evaluates it when ``eval.at_start``; a resumed run restores parameters,
    optimizer state, counters and the data iterator, truncates metrics.jsonl to
    the checkpoint's step, and remakes the base policy only as the KL
    reference (beta > 0). Returns None when SIGTERM (``preempt.requested``)
    arrived during the warm start.
    """
    import jax.numpy as jnp
    import numpy as np

    run, ck = s.run, s.records.checkpointer
    resumed = ck.latest_step() is not None
    warm_info = None
    base_params = state.params
    # With LoRA the reference is the base inside the policy's own parameters
    # (adapters off, grpo_jax.models.lora): never a second copy.
    separate_ref = run.grpo.beta > 0 and s.policy.lora is None
    lora_base = None
    if s.policy.lora is not None:  # the frozen base (warm-started when configured), resumed or not
        state, warm_info, lora_base = lora_base_policy(s, state, evaluate=evaluate, preempt=preempt)
        if state is None:
            s.records.progress.message("preempted during the warm start; rerun to start again")
            return None
        base_params = state.params
    elif not resumed or separate_ref:
        # A resumed run needs the base policy only as the KL reference.
        base_params, warm_info = base_policy(s, state.params, evaluate=evaluate, preempt=preempt)
        if preempt.requested:
            s.records.progress.message("preempted during the warm start; rerun to start again")
            return None
    ref_params = jax.tree.map(jnp.copy, base_params) if separate_ref else None
    if base_params is not state.params:
        state = optim_lib.init_state(base_params, s.trainer.tx, s.placement.mesh)
    before, prior_seconds, no_signal_run, sampled_tokens, health_state = None, 0.0, 0, 0, None
    if resumed:
        latest, params, opt_state, meta = restore_newest(s, state, lora_base=lora_base)
        rep = replicated(s.placement.mesh)
        state = state.replace(
            params=params,
            opt_state=opt_state,
            # A resumed run gets train.max_nonfinite_in_row fresh tries.
            **{
                k: distributed.put(np.int32(0 if k == "skipped_in_row" else v), rep)
                for k, v in meta["counters"].items()
            },
        )
        s.data.iterator.restore(meta["data_iterator"])
        prior_seconds = float(meta.get("wall_seconds", 0.0))
        before = meta.get("before")
        warm_info = meta.get("warm_start", warm_info)
        no_signal_run = int(meta.get("no_signal_run", 0))
        sampled_tokens = int(meta.get("sampled_tokens", 0))
        health_state = meta.get("health")
        # Checkpoints written before the moments were saved restore none: they start afresh.
        s.rollouts.scorer.restore_moments(meta.get("reward_moments", {}))
        if s.records.is_main:
            s.records.writer.truncate(latest)
        s.records.progress.message(
            f"resuming from the checkpoint at step {latest} in {ck.directory}"
        )
    elif run.eval.at_start:
        before = evaluate(state.params, 0)
        s.records.writer.write(0, before)
        s.records.progress.message(
            f"before GRPO: held-out pass@1 {before['eval/pass_at_1']:.3f} "
            f"on {len(s.data.eval_examples)} problems"
        )
    return RunStart(
        state=state,
        ref_params=ref_params,
        resumed=resumed,
        start_step=int(jax.device_get(state.step)),
        before=before,
        warm_info=warm_info,
        prior_seconds=prior_seconds,
        no_signal_run=no_signal_run,
        sampled_tokens=sampled_tokens,
        lora_base=lora_base,
        health_state=health_state,
    )


def restore_newest(s: Setup, state, *, lora_base: dict | None = None):
    """(step, params, opt_state, meta) of the newest checkpoint that restores.

    A step that fails to restore (a file missing or corrupt, an array or the meta
    differing from its checksum) is skipped and the one before is tried; once an
    older one restores, the steps skipped are moved to ``checkpoints.unrestorable/``
    (nothing is deleted), one line each naming the error. Raises CheckpointError
    when none restores (nothing is moved then).
    """
    ck, failures, bad = s.records.checkpointer, [], []
    want = s.run.checkpoint.resume_from
    if want:
        if want not in ck.all_steps():
            raise CheckpointError(
                f"checkpoint.resume_from = {want}: no such step in {ck.directory} "
                f"(steps: {ck.all_steps()})"
            )
        later = [k for k in ck.all_steps() if k > want]
        aside = ck.set_aside(later, suffix=f"after-{want}")
        if aside is not None:
            s.records.progress.message(f"resuming from step {want}: steps {later} moved to {aside}")
    params_like = state.params
    if s.policy.lora is not None:  # a LoRA checkpoint holds the adapters; the base is loaded
        params_like = lora.trainable(state.params)
    for step in sorted(ck.all_steps(), reverse=True):
        try:
            params, opt_state, meta = ck.restore(
                step, params_like=params_like, opt_state_like=state.opt_state
            )
            _check_inflight(s, step, meta)
            if s.policy.lora is not None:
                params = lora.with_trainable(state.params, params)
        except Exception as e:  # Orbax / TensorStore raise many types for a bad step.
            why = e.problem if isinstance(e, IntegrityError) else integrity.describe(e)
            failures.append(f"step {step} ({why})")
            bad.append((step, why))
            continue
        if s.policy.lora is not None:  # adapters of another base would not continue this run
            where = f"checkpoint step {step} in {ck.directory}"
            lora.check_base(meta.get("lora_base"), lora_base, where)
        aside = ck.set_aside([k for k, _ in bad])
        for k, why in bad:
            s.records.progress.message(
                f"checkpoint step {k} in {ck.directory} could not be restored ({why}); "
                f"set aside in {aside}, resuming from step {step}"
            )
        return step, params, opt_state, meta
    raise CheckpointError(
        f"no checkpoint in {ck.directory} could be restored: {'; '.join(failures)}. Move the "
        "checkpoints aside to start afresh, or restore the missing files"
    )


def _check_inflight(s: Setup, step: int, meta: dict) -> None:
    """Reads the batches in flight that ``step`` saved (``meta["inflight"]``), replicated,
    so that their checksums are verified before the run settles on the step (the
    pipeline and partial rollouts read them again, laid out, once it has)."""
    import numpy as np

    info = meta.get("inflight")
    if not info:
        return
    if isinstance(info, dict):  # grpo_jax.rollout.partial's rows in flight
        shapes = {k: v["shapes"] for k, v in info.items() if v and v.get("shapes")}
    else:  # grpo_jax.rollout.staleness's batches sampled ahead
        shapes = {str(j): item["shapes"] for j, item in enumerate(info)}
    if not shapes:
        return
    rep = replicated(s.placement.mesh)
    like = {
        key: {
            name: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=rep)
            for name, (shape, dtype) in arrays.items()
        }
        for key, arrays in shapes.items()
    }
    s.records.checkpointer.restore_inflight(step, like=like)


def save_run(
    s: Setup,
    state,
    step: int,
    start: RunStart,
    *,
    no_signal_run: int,
    wall_seconds,
    sampled_tokens: int = 0,
    health: dict | None = None,
    inflight=None,
):
    """Starts saving ``state`` as step ``step``, with what an exact resume needs.

    ``health``: the alarms' history (``Reporter.health_state``).
    ``inflight``: (arrays, JSON description) of the batches sampled ahead of
    their steps with ``train.max_staleness`` >= 1 (``grpo_jax.rollout.staleness``).
    """
    import numpy as np

    meta = {
        "counters": {k: int(jax.device_get(getattr(state, k))) for k in COUNTERS},
        "data_iterator": s.data.iterator.state(),
        "key_data": np.asarray(jax.random.key_data(s.base_key)).tolist(),
        "config": dict(s.run.raw),
        "before": start.before,
        "warm_start": start.warm_info,
        "wall_seconds": wall_seconds,
        "no_signal_run": no_signal_run,
        "sampled_tokens": sampled_tokens,
        "health": health,
        "reward_moments": s.rollouts.scorer.moments_state(),
    }
    arrays = None
    if inflight is not None:
        arrays, meta["inflight"] = inflight
    params = state.params
    if s.policy.lora is not None:  # the adapters only, and which base they belong to
        params, meta["lora_base"] = lora.trainable(params), start.lora_base
    s.records.checkpointer.save(
        step, params=params, opt_state=state.opt_state, meta=meta, inflight=arrays
    )
