"""The workdir's checkpoints as files: an Orbax manager of params, optimizer state, meta and
the batches in flight, and the checks a resumed run passes before it touches anything.

``Checkpointer`` saves asynchronously and atomically (Orbax writes into a temporary
directory and renames it when complete, so a run killed mid-save resumes from the
previous checkpoint), keeps the last K, restores in place and sets damaged steps aside.
``check_resume_config`` refuses a config that would make the resumed run a different
run; ``check_alarm_stop`` refuses to train past a stop on a health alarm unasked.
What a checkpoint holds and how a run starts from one: ``grpo_jax.checkpoint``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from grpo_jax.checks import flat_keys
from grpo_jax.errors import AlarmStop, CheckpointError, ConfigError
from grpo_jax.health import describe_stop
from grpo_jax.sharding import abstract_like as _abstract


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
    old, new = flat_keys(saved), flat_keys(dict(run.raw))
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
