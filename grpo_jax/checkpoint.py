"""Orbax checkpoints of a training run: save every N steps, keep the last K, resume.

A checkpoint at step s holds three items:

  params     the policy parameter pytree (sharded arrays, restored in place)
  opt_state  the optax state
  meta       JSON: step, PRNG key data, data-iterator state, the run config,
             counters (skipped updates, ...) needed for an exact resume.

Saves are asynchronous (the host writes while the device trains) and atomic:
orbax writes into a temporary directory and renames it when complete, so a run
killed mid-save resumes from the previous checkpoint.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp


def _abstract(tree):
    """ShapeDtypeStructs (with shardings) for a pytree of arrays or of structs."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


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
            self.directory, options=options, item_names=("params", "opt_state", "meta")
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, *, params, opt_state, meta: Mapping[str, Any]) -> bool:
        """Starts saving step ``step`` (returns at once when asynchronous)."""
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(dict(meta, step=int(step))),
        )
        return self._manager.save(int(step), args=args, force=True)

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

    def wait(self) -> None:
        """Blocks until every pending asynchronous save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
