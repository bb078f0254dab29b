"""The workdir's checkpoints as files: an Orbax manager of params, optimizer state, meta and
the batches in flight, and the checks a resumed run passes before it touches anything.

``Checkpointer`` saves asynchronously and atomically, keeps the last K, verifies every
restore against the checksums in the step's meta and sets damaged steps aside;
``check_resume_config`` refuses a config that would make the resumed run a different run,
``check_alarm_stop`` a resume past a health alarm's stop. What a checkpoint holds and how a
run starts from one: ``grpo_jax.run.start`` and docs/architecture.md, "Checkpoints".
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from grpo_jax.core import integrity
from grpo_jax.core.checks import flat_keys, section_defaults_of
from grpo_jax.core.errors import AlarmStop, CheckpointError, ConfigError, IntegrityError
from grpo_jax.core.sharding import abstract_like as _abstract
from grpo_jax.run.health import describe_stop

# errno values whose cure is disk space: said so, and only for them.
_NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


def _to_stderr(text: str) -> None:
    if jax.process_index() == 0:
        print(text, file=sys.stderr, flush=True)


class _OrbaxErrorsReported(logging.Filter):
    """Drops Orbax's own ERROR logs (a traceback from each of its threads, several per
    failed save): the failure reaches the Checkpointer as an exception, reported in one
    line (``Checkpointer._saving``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


# The items of a run's state that hold arrays, besides the parameters and the optimizer
# state: the batches in flight (grpo_jax.run.state.RunState.parts names them).
STATE_ITEMS = ("inflight",)


class Checkpointer:
    """A thin wrapper over ``orbax.checkpoint.CheckpointManager`` for params, optimizer, meta."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        async_save: bool = True,
        say: Callable[[str], None] | None = None,
    ):
        """``say``: where a line about a step read without checksums goes (stderr)."""
        if keep < 1:
            raise ValueError(f"checkpoint.keep = {keep} must be >= 1")
        self.directory = pathlib.Path(directory).absolute()
        self._say = say or _to_stderr
        self._unverified: set[int] = set()  # steps read without checksums, said once each
        self._pending: int | None = None  # the asynchronous save not yet known to be on disk
        self._failed = False  # a failed save was reported: closing does not report it again
        self._quiet = _OrbaxErrorsReported()
        logging.getLogger("absl").addFilter(self._quiet)
        integrity.leave_out_orbax_stragglers()  # a failed save's, before it is reported
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_names=("params", "opt_state", "meta", *STATE_ITEMS),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, *, params, opt_state, meta: Mapping[str, Any], arrays=None) -> bool:
        """Starts saving step ``step`` (returns at once when asynchronous).

        ``arrays``: ``{item: arrays}`` of the run's state beside the parameters (the
        batches in flight, ``STATE_ITEMS``), each saved as an item of its own. The
        checksums of every array and of the meta go into the meta (module doc).
        """
        meta = dict(meta, step=int(step))
        arrays = {"params": params, "opt_state": opt_state, **(arrays or {})}
        unknown = set(arrays) - {"params", "opt_state", *STATE_ITEMS}
        if unknown:
            raise ValueError(f"no checkpoint item for {sorted(unknown)} (items: {STATE_ITEMS})")
        record = {
            "version": integrity.VERSION,
            "meta": integrity.json_digest(meta),
            "arrays": {name: integrity.tree_digests(tree) for name, tree in arrays.items()},
        }
        items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
        items["meta"] = ocp.args.JsonSave(dict(meta, integrity=record))
        if self._pending is not None:  # the save before: a failure there is its own
            with self._saving(self._pending):
                self._manager.wait_until_finished()
        self._pending = None
        with self._saving(step):
            saved = self._manager.save(int(step), args=ocp.args.Composite(**items), force=True)
        self._pending = int(step)
        return saved

    @contextlib.contextmanager
    def _saving(self, step=None):
        """Turns a failed save (a full disk, a lost mount) into one CheckpointError."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:  # Orbax / TensorStore raise many types, often from threads.
            self._failed, self._pending = True, None
            text = str(e).strip()
            first = text.splitlines()[0] if text else type(e).__name__
            code = getattr(e, "errno", None)
            space = _NO_SPACE.get(code) or next(
                (why for c, why in _NO_SPACE.items() if f"os_error_code='{c}'" in text), None
            )
            if space is None and "No space left" in text:
                space = _NO_SPACE[errno.ENOSPC]
            if space:
                first = f"{space} ({first[:200]})"
            kept = [k for k in self._manager.all_steps() if step is None or k < step]
            intact = f"the checkpoint of step {max(kept)} is intact" if kept else "no earlier one"
            what = "a checkpoint" if step is None else f"the checkpoint of step {step}"
            cure = "Free disk space" if space else "Fix the cause"
            raise CheckpointError(
                f"saving {what} in {self.directory} failed: {first[:400]}; {intact}. {cure}, "
                "then rerun the same command to resume"
            ) from e

    def _where(self, step: int) -> str:
        return f"checkpoint step {step} in {self.directory}"

    def _read_meta(self, step: int) -> tuple[dict, dict | None]:
        """(meta, its checksums or None when saved without) of ``step``, verified."""
        with integrity.reading():
            out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(out["meta"])
        record = meta.pop("integrity", None)
        if record is None:
            if step not in self._unverified:
                self._unverified.add(step)
                self._say(
                    f"{self._where(step)} was saved without checksums (by an earlier "
                    "version of grpo_jax): restored unverified"
                )
            return meta, None
        if not isinstance(record, dict) or record.get("meta") != integrity.json_digest(meta):
            raise IntegrityError(
                self._where(step),
                "its meta (counters, data position, config) differs from the checksum saved "
                "with it (damaged on disk)",
            )
        return meta, record

    def _restore_arrays(self, step: int, record: dict | None, **likes) -> dict:
        """The items ``likes`` names of ``step``, verified against ``record``.

        They are read in the dtypes they were saved in (their checksums are of those
        bits), then cast to the ``like``'s when it differs (a changed model.param_dtype).
        """
        saved = (record or {}).get("arrays") or {}
        targets = {
            name: _in_dtypes(_abstract(like), integrity.saved_dtypes(saved.get(name, {})))
            for name, like in likes.items()
        }
        args = {name: ocp.args.StandardRestore(t) for name, t in targets.items()}
        with integrity.reading():
            out = self._manager.restore(step, args=ocp.args.Composite(**args))
        result = {}
        for name, like in likes.items():
            if record is not None:
                integrity.check_tree(out[name], saved.get(name, {}), self._where(step), name)
            result[name] = _cast_like(out[name], _abstract(like))
        return result

    def restore(self, step: int | None = None, *, params_like, opt_state_like):
        """Restores (params, opt_state, meta) of ``step`` (the latest when None).

        ``params_like`` / ``opt_state_like`` give the structure, shapes, dtypes
        and shardings to restore into (arrays or ``jax.ShapeDtypeStruct``).
        IntegrityError when an array or the meta differs from its checksum.
        """
        step = self._resolve(step)
        meta, record = self._read_meta(step)
        out = self._restore_arrays(step, record, params=params_like, opt_state=opt_state_like)
        return out["params"], out["opt_state"], meta

    def restore_params(self, step: int | None = None, *, params_like):
        """Only the parameters (evaluation and export need no optimizer state)."""
        step = self._resolve(step)
        _, record = self._read_meta(step)
        return self._restore_arrays(step, record, params=params_like)["params"]

    def restore_arrays(self, step: int, item: str, *, like):
        """The item ``item`` (one of ``STATE_ITEMS``) of ``step`` into ``like``
        (ShapeDtypeStructs with shardings), verified against its checksums."""
        step = self._resolve(step)
        _, record = self._read_meta(step)
        return self._restore_arrays(step, record, **{item: like})[item]

    def restore_meta(self, step: int | None = None) -> dict:
        """The meta of ``step`` (the latest when None), verified against its checksum."""
        return self._read_meta(self._resolve(step))[0]

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
        with self._saving(self._pending):
            self._manager.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        """Waits for the last save (a failure raises, unless one was reported already)."""
        try:
            if self._failed:
                with contextlib.suppress(Exception):
                    self._manager.wait_until_finished()
            else:
                self.wait()
        finally:
            try:
                self._manager.close()
            finally:
                logging.getLogger("absl").removeFilter(self._quiet)


def _in_dtypes(abstract, dtypes: Mapping[str, str]):
    """``abstract`` with each leaf in the dtype ``dtypes`` gives for its path (if any)."""

    def one(path, x):
        dtype = dtypes.get(jax.tree_util.keystr(path))
        if dtype is None or dtype == str(x.dtype):
            return x
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)

    return jax.tree_util.tree_map_with_path(one, abstract)


def _cast_like(tree, abstract):
    """``tree`` with each array cast to its ``abstract`` leaf's dtype where they differ."""
    return jax.tree.map(lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype), tree, abstract)


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
    # A key the saved config lacks is a setting its version of grpo_jax did not have: that
    # version did what its default does. Keys neither side can say are left out.
    old = {**{k: v for k, v in section_defaults_of(type(run)).items() if k in new}, **old}
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
