"""The W&B writer: a run's metrics, sample tables and alarms as a Weights & Biases run.

``train.wandb`` selects it: "off" (the default), "offline" (under ``<workdir>/wandb/``, no
network; ``wandb sync`` uploads it later) or "online". README.md, "In a few commands" (its
"Weights & Biases" paragraph), has what it logs and how a rerun continues the same W&B run.
``wandb`` is an optional dependency: ``pip install -e ".[wandb]"``.
"""

from __future__ import annotations

import math
import os
import pathlib
import secrets
from collections.abc import Mapping, Sequence

import numpy as np

from grpo_jax.core.errors import ConfigError
from grpo_jax.run import record as record_lib

MODES = ("off", "offline", "online")
MISSING = (
    "config key 'train.wandb' = {mode!r} needs the wandb package, an optional dependency: "
    "pip install -e '.[wandb]' in the grpo_jax checkout (or pip install 'wandb>=0.17,<1')"
)


def _scalar(v):
    """A finite number as a float (W&B's history), else None."""
    if isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


class WandbWriter:
    """A W&B run fed by :class:`grpo_jax.run.writers.MetricsWriter` (its ``extra`` writers):
    ``write``, ``write_samples``, ``flush`` and ``close`` as the JSONL writer's."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        mode: str,
        config: Mapping,
        record: Mapping | None = None,
        project: str | None = None,
    ):
        if mode not in MODES[1:]:
            raise ConfigError(f"config key 'train.wandb' = {mode!r}: one of {MODES}")
        try:
            import wandb  # Optional and slow to import: only a run that asks for it.
        except ImportError:
            raise ConfigError(MISSING.format(mode=mode)) from None
        self._wandb = wandb
        self.workdir = pathlib.Path(workdir)
        root = self.workdir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or "grpo_jax",
            name=self.workdir.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(self.workdir),
            mode=mode,
            config={**dict(config), "record": dict(record or {})},
            settings=wandb.Settings(silent=True, console="off", save_code=False),
        )
        # Steps go on W&B's own x axis grpo/step: a resumed run logs steps again.
        self.run.define_metric("grpo/step")
        self.run.define_metric("*", step_metric="grpo/step")
        self._alarms: list[list] = []

    @property
    def run_dir(self) -> pathlib.Path:
        """The run's directory (``wandb sync`` takes it)."""
        return pathlib.Path(self.run.dir).parent

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {k: x for k, v in metrics.items() if (x := _scalar(v)) is not None}
        self.run.log({"grpo/step": int(step), **row})

    def write_samples(
        self,
        step: int,
        samples: Sequence[Mapping[str, object]],
        *,
        name: str = "step",
        header: str | None = None,
    ) -> None:
        columns = list(dict.fromkeys(k for s in samples for k in s))
        table = self._wandb.Table(
            columns=columns or ["sample"],
            data=[[_cell(s.get(c)) for c in columns] for s in samples] or [[""]],
        )
        row = {"grpo/step": int(step), f"samples/{name}": table}
        if name.startswith("alarm_") and header is not None:
            alarm = name[len("alarm_") :].removesuffix("_step")
            self._alarms.append([int(step), alarm, header])
            row["alarms"] = self._wandb.Table(
                columns=["step", "alarm", "message"], data=list(self._alarms)
            )
        self.run.log(row)

    def flush(self) -> None:
        pass  # W&B writes in its own process; finish() waits for it

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish()


def _cell(v):
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def writers_for(run, workdir, eval_examples: Sequence[Mapping] = (), enabled=True) -> tuple:
    """The extra writers ``run``'s config asks for: a :class:`WandbWriter` with the run's
    config and record when ``train.wandb`` is not "off" (and ``enabled``: process 0)."""
    mode = run.train.wandb
    if mode == "off" or not enabled:
        return ()
    rec = record_lib.run_record(run, eval_examples)
    return (WandbWriter(workdir, mode=mode, config=run.raw, record=rec),)
