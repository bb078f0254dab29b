"""Rollout statistics, the pass@k estimator and the metric writers.

Everything here runs on the host over numpy arrays that the trainer already
fetched: rewards, completion texts, lengths. Metric keys are slash-separated
(``rewards/mean``, ``rollout/pass_rate``, ``eval/pass_at_1``) and one JSON
object per step goes to ``<workdir>/metrics.jsonl``; the same scalars go to
TensorBoard event files under ``<workdir>/tensorboard``. Only process 0 writes.

Shapes: B prompts, G completions per prompt, N = B*G rows grouped
contiguously (rows b*G .. b*G+G-1 belong to prompt b).
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

# ---------------------------------------------------------------------------
# pass@k.


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1).

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that at least one of k samples drawn without replacement
    from the n is correct. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), the
    numerically stable product form of the paper's reference code.
    """
    if not (isinstance(n, (int, np.integer)) and isinstance(c, (int, np.integer))):
        raise TypeError(f"n and c must be integers, got n={n!r}, c={c!r}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct_PxS: np.ndarray, k: int) -> float:
    """Mean of :func:`pass_at_k` over P problems, each with S samples (bool [P, S])."""
    correct_PxS = np.asarray(correct_PxS, dtype=bool)
    if correct_PxS.ndim != 2 or correct_PxS.shape[0] == 0:
        raise ValueError(f"correct must be [problems, samples], got shape {correct_PxS.shape}")
    n = correct_PxS.shape[1]
    return float(np.mean([pass_at_k(n, int(c), k) for c in correct_PxS.sum(1)]))


# ---------------------------------------------------------------------------
# Rollout statistics.


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, dtype=np.float64)
    finite = x[np.isfinite(x)]
    if finite.size == 0:
        return {f"{prefix}/mean": float("nan"), f"{prefix}/std": float("nan")}
    return {f"{prefix}/mean": float(finite.mean()), f"{prefix}/std": float(finite.std())}


def _unscored_frac(x: np.ndarray) -> float:
    return float(np.mean(~np.isfinite(x))) if x.size else 0.0


def duplicate_flags(completions: Sequence[str], G: int) -> np.ndarray:
    """bool per completion: it repeats an earlier completion of its group of G."""
    n = len(completions)
    if n % G:
        raise ValueError(f"{n} completions do not form whole groups of G={G}")
    flags = np.zeros(n, dtype=np.bool_)
    for b in range(n // G):
        seen = set()
        for i in range(b * G, (b + 1) * G):
            flags[i] = completions[i] in seen
            seen.add(completions[i])
    return flags


def duplicate_fraction(completions: Sequence[str], G: int) -> float:
    """Share of completions that repeat an earlier completion of the same group.

    0 when all G completions of every group differ, (G-1)/G when each group
    holds one text G times: a collapsed, non-exploring policy.
    """
    return float(np.mean(duplicate_flags(completions, G))) if completions else 0.0


def rollout_metrics(
    *,
    total_N: np.ndarray,
    per_reward: Mapping[str, np.ndarray],
    errors: Mapping[str, int],
    correct_N: np.ndarray,
    lengths_N: np.ndarray,
    truncated_N: np.ndarray,
    duplicate_N: np.ndarray,
    G: int,
    invalid_N: np.ndarray | None = None,
    clipped: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """The per-step statistics of one rollout batch of N = B*G completions.

    Besides mean and std, ``rewards/<name>/errors`` counts the completions
    each reward failed on (raised, timed out, malformed or infinite);
    ``rewards/unscored_frac`` is the share of completions with no usable total
    reward (NaN: advantage 0), ``rewards/<name>/unscored_frac`` a reward's
    share of NaN values, and ``rewards/<name>/clipped`` the completions whose
    value was clipped to +-``REWARD_LIMIT`` (:mod:`grpo_jax.rewards.scoring`).

    Args:
      total_N: weighted total reward per completion (NaN where unscored).
      per_reward: each reward function's raw score per completion.
      errors: number of completions each reward function failed to score.
      correct_N: bool, the completion's answer is right (pass rate).
      lengths_N: completion lengths in tokens (EOS included).
      truncated_N: bool, the completion hit max_new_tokens without EOS.
      duplicate_N: bool, the completion repeats an earlier one of its group
        (:func:`duplicate_flags`; per row, so hosts can each flag their own).
      G: group size.
      invalid_N: bool, no answer could be parsed (invalid format); omitted if None.
      clipped: number of completions each reward's value was clipped for.
    """
    total_N = np.asarray(total_N, dtype=np.float64)
    out = _stats("rewards", total_N)
    out["rewards/unscored_frac"] = _unscored_frac(total_N)
    for name, r_N in per_reward.items():
        r_N = np.asarray(r_N, dtype=np.float64)
        out.update(_stats(f"rewards/{name}", r_N))
        out[f"rewards/{name}/errors"] = float(errors.get(name, 0))
        out[f"rewards/{name}/unscored_frac"] = _unscored_frac(r_N)
        out[f"rewards/{name}/clipped"] = float((clipped or {}).get(name, 0))
    out["rollout/pass_rate"] = float(np.mean(correct_N))
    out["rollout/length_mean"] = float(np.mean(lengths_N))
    out["rollout/length_max"] = float(np.max(lengths_N))
    out["rollout/truncated_frac"] = float(np.mean(truncated_N))
    if invalid_N is not None:
        out["rollout/invalid_format_frac"] = float(np.mean(invalid_N))
    out["rollout/duplicate_frac"] = float(np.mean(duplicate_N))
    # Within-group variance over the finite rewards: zero variance, zero signal.
    r_BxG = total_N.reshape(-1, G)
    var_B = np.array(
        [np.var(row[np.isfinite(row)]) if np.isfinite(row).any() else 0.0 for row in r_BxG]
    )
    out["rollout/group_reward_var"] = float(var_B.mean())
    out["rollout/frac_zero_var_groups"] = float(np.mean(var_B <= 1e-12))
    return out


# ---------------------------------------------------------------------------
# Writers.


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
    """

    def __init__(
        self, workdir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True
    ):
        self.workdir = pathlib.Path(workdir)
        self.enabled = enabled
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

    def close(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        try:
            self._file.close()
        finally:
            if self._tb is not None:
                try:
                    self._tb.close()
                finally:
                    self._tb_closed()


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
