"""A training run's start (resumed from its workdir's newest checkpoint, or begun from the
base policy) and its saves.

A checkpoint of step s holds the parameters and the optimizer state (Orbax items
``params`` and ``opt_state``), a JSON ``meta`` and, with batches in flight, their arrays
(``inflight``). The meta holds what the run is (its config, PRNG key, the "before"
evaluation, what the warm start did, a LoRA run's base) and where it is: each part of
the run's state under its name (``grpo_jax.run.state.RunState.parts``), and the
checksums of everything saved (``grpo_jax.run.checkpoints``). docs/architecture.md,
"Checkpoints".
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.core import integrity
from grpo_jax.core.errors import CheckpointError, ConfigError, IntegrityError
from grpo_jax.learner import optimizer as optim_lib
from grpo_jax.learner.update import FrozenModels
from grpo_jax.models import lora
from grpo_jax.reward_models import Judge
from grpo_jax.run.base_policy import base_policy, lora_base_policy

if TYPE_CHECKING:
    from grpo_jax.run.setup import Setup
    from grpo_jax.run.state import RunState


@dataclasses.dataclass(frozen=True)
class RunStart:
    """Where a run starts (its state, in ``RunState``, is restored or fresh).

    Attributes:
      ref_params: the frozen reference policy (the base policy), None when beta = 0; with
        a teacher, a ``FrozenModels`` of it and the teacher (:func:`_frozen`).
      resumed: whether the run's state came from a checkpoint.
      start_step: GRPO steps already taken.
      before: the evaluation of the base policy ("before" in summary.json).
      warm_info: what the warm start did (None without one).
      lora_base: with LoRA, the frozen base's identity (``grpo_jax.models.lora``).
    """

    ref_params: Any
    resumed: bool
    start_step: int
    before: dict | None
    warm_info: dict | None
    lora_base: dict | None = None


def restore_or_init(s: Setup, rs: RunState, *, evaluate, preempt) -> RunStart | None:
    """Resumes ``rs`` from ``s.records.checkpointer``'s newest step, or makes the base policy.

    ``rs.train`` is the setup's initial ``TrainState``. A fresh run makes the base
    policy (``grpo_jax.run.base_policy``: warm-started when configured) and evaluates it
    when ``eval.at_start``; a resumed run restores the parameters, the optimizer state
    and every part of ``rs`` (``RunState.parts``), and remakes the base policy only as
    the KL reference (beta > 0). The reference judge, if any, gets the reference's
    parameters. Returns None when SIGTERM (``preempt.requested``) arrived during the warm
    start.
    """
    run, ck = s.run, s.records.checkpointer
    resumed = ck.latest_step() is not None
    warm_info = None
    state = rs.train
    base_params = state.params
    # With LoRA the reference is the base inside the policy's own parameters
    # (adapters off, grpo_jax.models.lora): never a second copy.
    separate_ref = run.grpo.beta > 0 and s.policy.lora is None
    # The reference as teacher (teacher.path = "reference") needs the base policy too.
    base_teacher = run.teacher.is_reference and not separate_ref and s.policy.lora is None
    lora_base = None
    if s.policy.lora is not None:  # the frozen base (warm-started when configured), resumed or not
        state, warm_info, lora_base = lora_base_policy(s, state, evaluate=evaluate, preempt=preempt)
        if state is None:
            s.records.progress.message("preempted during the warm start; rerun to start again")
            return None
        base_params = state.params
    elif not resumed or separate_ref or base_teacher:
        # A resumed run needs the base policy only as the KL reference.
        base_params, warm_info = base_policy(s, state.params, evaluate=evaluate, preempt=preempt)
        if preempt.requested:
            s.records.progress.message("preempted during the warm start; rerun to start again")
            return None
    ref_params = jax.tree.map(jnp.copy, base_params) if separate_ref else None
    teacher = jax.tree.map(jnp.copy, base_params) if base_teacher else s.trainer.teacher_params
    if base_params is not state.params:
        state = optim_lib.init_state(
            base_params, s.trainer.tx, s.placement.mesh, critic=state.critic
        )
    rs.train = state
    _bind_judges(s, ref_params)
    before = None
    if resumed:
        latest, params, opt_state, meta, arrays = restore_newest(s, rs, lora_base=lora_base)
        rs.train = optim_lib.with_saved_opt_state(state.replace(params=params), opt_state)
        rs.load_state_dict(meta, arrays)
        before = meta.get("before")
        warm_info = meta.get("warm_start", warm_info)
        s.records.progress.message(
            f"resuming from the checkpoint at step {latest} in {ck.directory}"
        )
    elif run.eval.at_start:
        before = evaluate(state.params, 0)
        rs.report.write(0, before)
        s.records.progress.message(
            f"before GRPO: held-out pass@1 {before['eval/pass_at_1']:.3f} "
            f"on {len(s.data.eval_examples)} problems"
        )
    return RunStart(
        ref_params=FrozenModels(ref_params, teacher) if run.teacher.enabled else ref_params,
        resumed=resumed,
        start_step=int(jax.device_get(rs.train.step)),
        before=before,
        warm_info=warm_info,
        lora_base=lora_base,
    )


def _bind_judges(s: Setup, ref_params) -> None:
    """The reference policy as judge (``judge.path`` = "reference") judges with the
    reference's own arrays."""
    for _, learned, _ in s.rollouts.scorer.learned:
        if isinstance(learned, Judge) and learned.params is None:
            learned.bind(s.policy.graphdef, ref_params, s.policy.tokenizer)


def restore_newest(s: Setup, rs: RunState, *, lora_base: dict | None = None):
    """(step, params, opt_state, meta, the state's arrays) of the newest checkpoint that
    restores: its arrays, the batches in flight included, read and verified before the
    run settles on it.

    A step that fails to restore (a file missing or corrupt, an array or the meta
    differing from its checksum) is skipped and the one before is tried; once an
    older one restores, the steps skipped are moved to ``checkpoints.unrestorable/``
    (nothing is deleted), one line each naming the error. Raises CheckpointError
    when none restores (nothing is moved then), and ConfigError when what a step holds
    does not fit this run's config.
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
    state = rs.train
    params_like = state.params
    if s.policy.lora is not None:  # a LoRA checkpoint holds the adapters; the base is loaded
        params_like = lora.trainable(state.params)
    for step in sorted(ck.all_steps(), reverse=True):
        try:
            params, opt_state, meta = ck.restore(
                step, params_like=params_like, opt_state_like=optim_lib.saved_opt_state(state)
            )
            read = lambda name, like, step=step: ck.restore_arrays(step, name, like=like)
            arrays = rs.read_arrays(meta, read)
            if s.policy.lora is not None:
                params = lora.with_trainable(state.params, params)
        except ConfigError as e:  # it holds what this run's config cannot continue
            raise ConfigError(f"{e} (checkpoint step {step} in {ck.directory})") from None
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
        return step, params, opt_state, meta, arrays
    raise CheckpointError(
        f"no checkpoint in {ck.directory} could be restored: {'; '.join(failures)}. Move the "
        "checkpoints aside to start afresh, or restore the missing files"
    )


def save_run(s: Setup, rs: RunState, step: int, start: RunStart) -> None:
    """Starts saving the run's state as step ``step``: the parameters and the optimizer
    state, what the run is, and what each part of ``rs`` gives (``RunState.parts``)."""
    meta = {
        "key_data": np.asarray(jax.random.key_data(s.base_key)).tolist(),
        "config": dict(s.run.raw),
        "before": start.before,
        "warm_start": start.warm_info,
    }
    parts, arrays = rs.state_dict()
    meta.update(parts)
    params = rs.train.params
    if s.policy.lora is not None:  # the adapters only, and which base they belong to
        params, meta["lora_base"] = lora.trainable(params), start.lora_base
    s.records.checkpointer.save(
        step,
        params=params,
        opt_state=optim_lib.saved_opt_state(rs.train),  # with a critic, its head too
        meta=meta,
        arrays=arrays,
    )
