"""Orbax checkpoints of a training run: save every N steps, keep the last K, resume.

A checkpoint at step s holds three items (four with ``train.max_staleness`` >= 1):

  params     the policy parameter pytree (sharded arrays, restored in place)
  opt_state  the optax state
  meta       JSON: step, PRNG key data, data-iterator state, the run config,
             counters (skipped updates, ...) and the health alarms' history
             (``Reporter.health_state``: with the alarms that stopped the run,
             if one did) needed for an exact resume.
  inflight   the batches of steps s + 1 .. s + k, sampled before the save
             (``grpo_jax.pipeline``); meta["inflight"] gives their steps,
             parameter versions, shapes and host-side rollouts.

Saves are asynchronous (the host writes while the device trains) and atomic:
orbax writes into a temporary directory and renames it when complete, so a run
killed mid-save resumes from the previous checkpoint.

``restore_or_init`` starts a training run from its workdir (resuming from the
latest checkpoint, or making the base policy), and ``save_run`` saves one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp

from grpo_jax import distributed
from grpo_jax import optimizer as optim_lib
from grpo_jax.base_policy import base_policy, lora_base_policy
from grpo_jax.config import ConfigError
from grpo_jax.models import lora
from grpo_jax.report import AlarmStop, describe_stop
from grpo_jax.sharding import abstract_like as _abstract
from grpo_jax.sharding import replicated

if TYPE_CHECKING:
    from grpo_jax.setup import Setup


class Checkpointer:
    """A thin wrapper over ``orbax.checkpoint.CheckpointManager`` for params, optimizer, meta."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        async_save: bool = True,
    ):
        if keep < 1:
            raise ValueError(f"checkpoint.keep = {keep} must be >= 1")
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_names=("params", "opt_state", "meta", "inflight"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, *, params, opt_state, meta: Mapping[str, Any], inflight=None) -> bool:
        """Starts saving step ``step`` (returns at once when asynchronous).

        ``inflight``: arrays of the batches sampled ahead of their steps
        (``grpo_jax.pipeline``), saved as a fourth item when given.
        """
        items = {
            "params": ocp.args.StandardSave(params),
            "opt_state": ocp.args.StandardSave(opt_state),
            "meta": ocp.args.JsonSave(dict(meta, step=int(step))),
        }
        if inflight:
            items["inflight"] = ocp.args.StandardSave(inflight)
        args = ocp.args.Composite(**items)
        with self._saving(step):
            return self._manager.save(int(step), args=args, force=True)

    @contextlib.contextmanager
    def _saving(self, step=None):
        """Turns a failed save (a full disk, a lost mount) into one CheckpointError."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:  # Orbax / TensorStore raise many types, often from threads.
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "No space left" in str(e) or getattr(e, "errno", None) == errno.ENOSPC:
                first = f"no space left on device ({first[:200]})"
            kept = [k for k in self._manager.all_steps() if step is None or k < step]
            intact = f"the checkpoint of step {max(kept)} is intact" if kept else "no earlier one"
            what = "a checkpoint" if step is None else f"the checkpoint of step {step}"
            raise CheckpointError(
                f"saving {what} in {self.directory} failed: {first[:400]}; {intact}. Fix the "
                "cause (free disk space), then rerun the same command to resume"
            ) from e

    def restore(self, step: int | None = None, *, params_like, opt_state_like):
        """Restores (params, opt_state, meta) of ``step`` (the latest when None).

        ``params_like`` / ``opt_state_like`` give the structure, shapes, dtypes
        and shardings to restore into (arrays or ``jax.ShapeDtypeStruct``).
        """
        step = self._resolve(step)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(params_like)),
                opt_state=ocp.args.StandardRestore(_abstract(opt_state_like)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out["params"], out["opt_state"], dict(out["meta"])

    def restore_params(self, step: int | None = None, *, params_like):
        """Only the parameters (evaluation and export need no optimizer state)."""
        step = self._resolve(step)
        out = self._manager.restore(
            step, args=ocp.args.Composite(params=ocp.args.StandardRestore(_abstract(params_like)))
        )
        return out["params"]

    def restore_inflight(self, step: int, *, like):
        """The "inflight" item of ``step`` into ``like`` (ShapeDtypeStructs with shardings)."""
        step = self._resolve(step)
        out = self._manager.restore(
            step, args=ocp.args.Composite(inflight=ocp.args.StandardRestore(_abstract(like)))
        )
        return out["inflight"]

    def restore_meta(self, step: int | None = None) -> dict:
        step = self._resolve(step)
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def _resolve(self, step):
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; "
                f"available steps: {self.all_steps()}"
            )
        return step

    def set_aside(self, steps, suffix: str = "unrestorable") -> pathlib.Path | None:
        """Moves ``steps`` to ``<directory>.<suffix>/`` (kept, no longer listed).

        For steps a run does not continue from (unrestorable ones, or those
        after ``checkpoint.resume_from``): its next saves may reuse their numbers.
        """
        import shutil

        from jax.experimental import multihost_utils

        steps = list(steps)
        if not steps:
            return None
        aside = self.directory.with_name(f"{self.directory.name}.{suffix}")
        if jax.process_index() == 0:
            aside.mkdir(exist_ok=True)
            for step in steps:
                k, target = 0, aside / str(step)
                while target.exists():
                    k += 1
                    target = aside / f"{step}.{k}"
                shutil.move(str(self.directory / str(step)), target)
        multihost_utils.sync_global_devices("grpo_jax checkpoints set aside")
        self._manager.reload()
        return aside

    def wait(self) -> None:
        """Blocks until every pending asynchronous save is on disk."""
        with self._saving():
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            with self._saving():
                self._manager.wait_until_finished()
        finally:
            self._manager.close()


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
    """Resumes from ``s.checkpointer``'s latest step, or makes the base policy and starts.

    ``state`` is the setup's initial ``TrainState``. A fresh run makes the base
    policy (``grpo_jax.base_policy``: warm-started when configured) and
    evaluates it when ``eval.at_start``; a resumed run restores parameters,
    optimizer state, counters and the data iterator, truncates metrics.jsonl to
    the checkpoint's step, and remakes the base policy only as the KL
    reference (beta > 0). Returns None when SIGTERM (``preempt.requested``)
    arrived during the warm start.
    """
    import jax.numpy as jnp
    import numpy as np

    run, ck = s.run, s.checkpointer
    resumed = ck.latest_step() is not None
    warm_info = None
    base_params = state.params
    # With LoRA the reference is the base inside the policy's own parameters
    # (adapters off, grpo_jax.models.lora): never a second copy.
    separate_ref = run.grpo.beta > 0 and s.lora is None
    lora_base = None
    if s.lora is not None:  # the frozen base (warm-started when configured), resumed or not
        state, warm_info, lora_base = lora_base_policy(s, state, evaluate=evaluate, preempt=preempt)
        if state is None:
            s.progress.message("preempted during the warm start; rerun to start again")
            return None
        base_params = state.params
    elif not resumed or separate_ref:
        # A resumed run needs the base policy only as the KL reference.
        base_params, warm_info = base_policy(s, state.params, evaluate=evaluate, preempt=preempt)
        if preempt.requested:
            s.progress.message("preempted during the warm start; rerun to start again")
            return None
    ref_params = jax.tree.map(jnp.copy, base_params) if separate_ref else None
    if base_params is not state.params:
        state = optim_lib.init_state(base_params, s.tx, s.mesh)
    before, prior_seconds, no_signal_run, sampled_tokens, health_state = None, 0.0, 0, 0, None
    if resumed:
        latest, params, opt_state, meta = restore_newest(s, state, lora_base=lora_base)
        rep = replicated(s.mesh)
        state = state.replace(
            params=params,
            opt_state=opt_state,
            # A resumed run gets train.max_nonfinite_in_row fresh tries.
            **{
                k: distributed.put(np.int32(0 if k == "skipped_in_row" else v), rep)
                for k, v in meta["counters"].items()
            },
        )
        s.iterator.restore(meta["data_iterator"])
        prior_seconds = float(meta.get("wall_seconds", 0.0))
        before = meta.get("before")
        warm_info = meta.get("warm_start", warm_info)
        no_signal_run = int(meta.get("no_signal_run", 0))
        sampled_tokens = int(meta.get("sampled_tokens", 0))
        health_state = meta.get("health")
        if s.is_main:
            s.writer.truncate(latest)
        s.progress.message(f"resuming from the checkpoint at step {latest} in {ck.directory}")
    elif run.eval.at_start:
        before = evaluate(state.params, 0)
        s.writer.write(0, before)
        s.progress.message(
            f"before GRPO: held-out pass@1 {before['eval/pass_at_1']:.3f} "
            f"on {len(s.eval_examples)} problems"
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


# Keys a resumed run may change: how long it runs, what it logs and evaluates, where
# it checkpoints, how it is laid out on the devices. Any other change would make
# the resumed run a different run than the one its checkpoints continue.
RESUME_MAY_CHANGE = (
    "train.steps",
    "train.sampled_tokens_budget",
    "train.log_every",
    "train.samples_every",
    "train.num_samples_logged",
    "train.max_nonfinite_in_row",
    "train.no_signal_steps",
    "train.track_update",
    "train.update_kl_warn",
    "train.reward_timeout_s",
    "train.compilation_cache_dir",
    "eval.",
    "checkpoint.",
    "mesh.",
    "health.",
    "model.remat",
)


# Model keys a resumed run may change under checkpoint.allow_changed_config: every other
# model key (LoRA rank and targets, scan_layers, the tiny model's sizes) gives the saved
# parameters other shapes, so no checkpoint of the run could be restored.
SAME_SHAPES = ("path", "dtype", "param_dtype", "remat", "attention", "lora.alpha", "lora.dropout")


def _changes_shapes(key: str) -> bool:
    return key.startswith("model.") and key[len("model.") :] not in SAME_SHAPES


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume_config(run, ck: Checkpointer) -> list[str] | None:
    """Refuses to resume ``ck``'s run with a config that changes what the run computes.

    Compares ``run`` with the config saved in the newest readable checkpoint;
    only the keys of ``RESUME_MAY_CHANGE`` may differ. Raises ``ConfigError``
    naming each changed key with its old and new value, unless
    ``checkpoint.allow_changed_config``: then returns those changes.
    """
    saved = _newest_meta(ck).get("config")
    if saved is None:
        return None
    old, new = _flat(saved), _flat(dict(run.raw))
    # Only keys both configs have: a key one lacks is a setting another version of
    # grpo_jax did not have (its default is what that version did).
    keys = [
        k
        for k in sorted(set(old) & set(new))
        if old[k] != new[k] and not k.startswith(RESUME_MAY_CHANGE)
    ]
    changed = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in keys]
    shapes = [c for k, c in zip(keys, changed, strict=True) if _changes_shapes(k)]
    if shapes:
        raise ConfigError(
            f"the checkpoints in {ck.directory} hold parameters of other shapes than this "
            f"config makes ({'; '.join(shapes)}); not even "
            "checkpoint.allow_changed_config can resume them. Set these back, or use another "
            "--workdir"
        )
    if changed and run.checkpoint.allow_changed_config:
        return changed
    if changed:
        raise ConfigError(
            f"the checkpoints in {ck.directory} continue a run with another config "
            f"({'; '.join(changed)}); resuming would not continue that run. Set these back, "
            "or use another --workdir (a resumed run may change train.steps, logging, "
            "evaluation, checkpointing and the mesh), or resume anyway with "
            "--config.checkpoint.allow_changed_config=True"
        )
    return None


def _newest_meta(ck: Checkpointer) -> dict:
    """The meta of the newest step whose meta reads ({} when none does)."""
    for step in sorted(ck.all_steps(), reverse=True):
        try:
            return ck.restore_meta(step)
        except Exception:  # An unreadable step: restore_newest reports it.
            continue
    return {}


def check_alarm_stop(run, ck: Checkpointer) -> str | None:
    """Refuses to resume from a checkpoint that a stop on a health alarm saved.

    The step resumed from (``checkpoint.resume_from``, else the newest) is checked:
    when health alarms stopped the run there, raises ``AlarmStop`` naming them and
    ``health.resume_after_stop``, unless that key is set: then returns what stopped it.
    """
    want = run.checkpoint.resume_from
    if want and want not in ck.all_steps():
        return None  # restore_newest names the missing step
    meta = ck.restore_meta(want) if want else _newest_meta(ck)
    stopped = (meta.get("health") or {}).get("stopped_by")
    if not stopped:
        return None
    what = describe_stop(stopped)
    if run.health.resume_after_stop:
        return what
    raise AlarmStop(
        f"the run in {ck.directory.parent} was stopped by {what} (health.stop_on_alarm; "
        f"checkpoint of step {meta['step']}) and resuming would train past it. Look at "
        "samples/alarm_*.txt, then rerun with --config.health.resume_after_stop=True to "
        "continue anyway"
    )


class CheckpointError(RuntimeError):
    """No checkpoint of the workdir could be restored."""


def restore_newest(s: Setup, state, *, lora_base: dict | None = None):
    """(step, params, opt_state, meta) of the newest checkpoint that restores.

    A step that fails to restore (a file missing or corrupt) is skipped with a
    message naming it and the error, and the one before is tried; the steps
    skipped are moved to ``checkpoints.unrestorable/`` (nothing is deleted)
    once an older one restores. Raises CheckpointError when none restores.
    """
    ck, failures, bad = s.checkpointer, [], []
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
            s.progress.message(f"resuming from step {want}: steps {later} moved to {aside}")
    params_like = state.params
    if s.lora is not None:  # a LoRA checkpoint holds the adapters; the base is loaded
        params_like = lora.trainable(state.params)
    for step in sorted(ck.all_steps(), reverse=True):
        try:
            params, opt_state, meta = ck.restore(
                step, params_like=params_like, opt_state_like=state.opt_state
            )
            if s.lora is not None:
                params = lora.with_trainable(state.params, params)
        except Exception as e:  # Orbax / TensorStore raise many types for a bad step.
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}"
            failures.append(f"step {step} ({why})")
            bad.append(step)
            s.progress.message(
                f"checkpoint step {step} in {ck.directory} could not be restored ({why}); "
                "trying the one before (the bad step is left in place)"
            )
            continue
        if s.lora is not None:  # adapters of another base would not continue this run
            where = f"checkpoint step {step} in {ck.directory}"
            lora.check_base(meta.get("lora_base"), lora_base, where)
        aside = ck.set_aside(bad)
        if aside is not None:
            s.progress.message(f"checkpoint step(s) {bad} moved to {aside}")
        return step, params, opt_state, meta
    raise CheckpointError(
        f"no checkpoint in {ck.directory} could be restored: {'; '.join(failures)}. Move the "
        "checkpoints aside to start afresh, or restore the missing files"
    )


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
    their steps with ``train.max_staleness`` >= 1 (``grpo_jax.pipeline``).
    """
    import numpy as np

    meta = {
        "counters": {k: int(jax.device_get(getattr(state, k))) for k in COUNTERS},
        "data_iterator": s.iterator.state(),
        "key_data": np.asarray(jax.random.key_data(s.base_key)).tolist(),
        "config": dict(s.run.raw),
        "before": start.before,
        "warm_start": start.warm_info,
        "wall_seconds": wall_seconds,
        "no_signal_run": no_signal_run,
        "sampled_tokens": sampled_tokens,
        "health": health,
    }
    arrays = None
    if inflight is not None:
        arrays, meta["inflight"] = inflight
    params = state.params
    if s.lora is not None:  # the adapters only, and which base they belong to
        params, meta["lora_base"] = lora.trainable(params), start.lora_base
    s.checkpointer.save(step, params=params, opt_state=state.opt_state, meta=meta, inflight=arrays)
