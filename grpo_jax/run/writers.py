"""The run's metric writers: metrics.jsonl, TensorBoard events, samples and the progress line.

One JSON object per step goes to ``<workdir>/metrics.jsonl``; the same scalars go to
TensorBoard event files under ``<workdir>/tensorboard`` and to any extra writers, such as
the W&B run of ``train.wandb`` (``grpo_jax.run.wandb_writer``). Only process 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np


def _jsonable(v):
    if isinstance(v, (np.generic, np.ndarray)):
        v = v.item() if np.ndim(v) == 0 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf; null marks "not a number this step".
    return v


# The OSError (a full disk) that ended a TensorBoard writer thread, by thread: the
# MetricsWriter that started the thread raises it on the main thread, instead of a
# traceback from the thread.
_TB_ERRORS: dict[threading.Thread, OSError] = {}


def _tensorboard_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if type(t).__module__.startswith("tensorboardX")}


def _tensorboard_errors_to_writer() -> None:
    """Routes an OSError that ends tensorboardX's writer thread to ``_TB_ERRORS`` (once)."""
    if getattr(threading.excepthook, "grpo_jax_tensorboard", False):
        return
    previous = threading.excepthook

    def hook(args):
        if issubclass(args.exc_type, OSError) and args.thread in _tensorboard_threads():
            _TB_ERRORS[args.thread] = args.exc_value
        else:
            previous(args)

    hook.grpo_jax_tensorboard = True
    threading.excepthook = hook


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl and mirrors scalars to TensorBoard.

    Sample completions go to ``<workdir>/samples/step_XXXXXXX.txt``. A writer
    built with ``enabled=False`` (processes other than 0) does nothing. A write that
    fails (a full disk), TensorBoard's in its thread too, raises its OSError here.
    ``extra``: more writers that get every ``write``, ``write_samples``, ``flush`` and
    ``close`` (the W&B run, ``grpo_jax.run.wandb_writer``).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        extra: Sequence = (),
    ):
        self.workdir = pathlib.Path(workdir)
        self.enabled = enabled
        self.extra = tuple(extra) if enabled else ()
        self.path = self.workdir / "metrics.jsonl"
        self._tb, self._tb_threads = None, set()
        if not enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close().
        if tensorboard:
            from tensorboardX import SummaryWriter  # Imported lazily: it is slow to import.

            _tensorboard_errors_to_writer()
            before = _tensorboard_threads()
            self._tb = SummaryWriter(str(self.workdir / "tensorboard"), flush_secs=30)
            self._tb_threads = _tensorboard_threads() - before

    def _tensorboard_ok(self) -> None:
        """Raises the OSError that ended TensorBoard's writer thread, if one did: its queue
        would fill and block the run."""
        failed = [_TB_ERRORS[t] for t in self._tb_threads if t in _TB_ERRORS]
        if self._tb is not None and failed:
            e = failed[0]
            self._tb_closed()
            raise OSError(e.errno, e.strerror, str(self.workdir / "tensorboard")) from e

    def _tb_closed(self) -> None:
        """Marks the TensorBoard writer closed (tensorboardX's atexit handler would flush it
        again), whether or not its close went through."""
        event_writer = getattr(getattr(self._tb, "file_writer", None), "event_writer", None)
        if event_writer is not None and hasattr(event_writer, "_closed"):
            event_writer._closed = True
        self._tb = None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        self._tensorboard_ok()
        record = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
        try:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk: named (a file object's error names no file)
            raise OSError(e.errno, e.strerror, str(self.path)) from e
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, int(step))
        for w in self.extra:
            w.write(step, metrics)

    def write_samples(
        self,
        step: int,
        samples: Sequence[Mapping[str, object]],
        *,
        name: str = "step",
        header: str | None = None,
    ) -> None:
        """Writes prompt / completion / reward triples as readable text.

        To ``samples/<name>_<step:07d>.txt``, under a first line ``header`` when given.
        """
        if not self.enabled:
            return
        self._tensorboard_ok()
        d = self.workdir / "samples"
        d.mkdir(exist_ok=True)
        lines = [] if header is None else [header]
        for i, s in enumerate(samples):
            lines.append(f"--- sample {i} ---")
            for k, v in s.items():
                lines.append(f"[{k}] {v}")
        text = "\n".join(lines) + "\n"
        (d / f"{name}_{int(step):07d}.txt").write_text(text)
        if self._tb is not None:
            self._tb.add_text("samples", "    " + text.replace("\n", "\n    "), int(step))
        for w in self.extra:
            w.write_samples(step, samples, name=name, header=header)

    def truncate(self, last_step: int) -> None:
        """Drops the records after ``last_step`` (resume), reopening the file."""
        if not self.enabled:
            return
        self._file.close()
        truncate_metrics(self.path, last_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close().

    def flush(self) -> None:
        if self.enabled:
            self._tensorboard_ok()
            self._file.flush()
            if self._tb is not None:
                self._tb.flush()
            for w in self.extra:
                w.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        try:
            self._file.close()
        finally:
            try:
                if self._tb is not None:
                    try:
                        self._tb.close()
                    finally:
                        self._tb_closed()
            finally:
                for w in self.extra:
                    w.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics.jsonl file (skipping a torn last line from a kill)."""
    records = []
    p = pathlib.Path(path)
    if not p.exists():
        return records
    for line in p.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_metrics(path: str | os.PathLike, last_step: int) -> None:
    """Drops records after ``last_step``: on resume they are recomputed exactly.

    Records without a step-derived key survive; a torn line is dropped.
    """
    p = pathlib.Path(path)
    if not p.exists():
        return
    keep = [r for r in read_metrics(p) if int(r.get("step", 0)) <= last_step]
    tmp = p.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))
    os.replace(tmp, p)


class ProgressLine:
    """A one-line console status refreshed in place (a plain log line when not a TTY)."""

    KEYS = (
        ("rewards/mean", "reward", "{:.3f}"),
        ("rollout/pass_rate", "pass", "{:.2f}"),
        ("train/kl", "kl", "{:.4f}"),
        ("rollout/length_mean", "len", "{:.1f}"),
        ("train/entropy", "ent", "{:.3f}"),
        ("perf/sample_tokens_per_s", "sample tok/s", "{:.0f}"),
        ("perf/train_tokens_per_s", "train tok/s", "{:.0f}"),
        ("eval/pass_at_1", "eval pass@1", "{:.3f}"),
    )

    def __init__(self, total_steps: int, *, stream=None, enabled: bool = True, every: int = 1):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.every = max(1, every)
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.first = True  # the next update is this process's first step

    def format(self, step: int, metrics: Mapping[str, float], *, timed: bool = True) -> str:
        """The line for ``step``; without ``timed`` no tokens/s (a step that compiled)."""
        parts = [f"step {step}/{self.total}"]
        for key, label, fmt in self.KEYS:
            v = metrics.get(key)
            if key.startswith("perf/") and not timed:
                continue
            if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
                parts.append(f"{label} {fmt.format(v)}")
        parts.append(f"elapsed {time.perf_counter() - self.start:.0f}s")
        return " | ".join(parts)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        # The first step's times include compiling the sampler and the update: its
        # tokens/s (a few, on a CPU) would read as the run's speed. metrics.jsonl has them.
        timed, self.first = not self.first, False
        if not self.enabled or (step % self.every and step != self.total):
            return
        line = self.format(step, metrics, timed=timed)
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """Prints a full line without clobbering the progress line."""
        if not self.enabled:
            return
        self.stream.write(("\n" if self.tty else "") + text + "\n")
        self.stream.flush()
