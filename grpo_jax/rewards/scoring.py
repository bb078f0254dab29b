"""Scoring a rollout batch with several weighted rewards, robust to failures.

A reward that raises, runs past its time budget, or returns something other
than one number per completion must never stop a training run: the affected
completions get NaN (which :func:`grpo_jax.advantages.group_advantages` leaves
out of their group's statistics and gives advantage 0) and are counted in
``RewardResult.errors`` (logged as ``rewards/<name>/errors``).

How a reward runs (N completions):

1. one call on the whole batch, in a daemon thread joined with a deadline of
   ``timeout_s`` seconds (cheap rewards stay one Python call per batch);
2. if that call raises or times out, the completions are re-scored one at a
   time, each in its own daemon thread, all under one further deadline of
   ``timeout_s``, so that only the completions that raise or hang get NaN.

A thread past its deadline is abandoned, not stopped (Python cannot stop a
thread). That is enough for code that eventually returns or blocks without the
GIL; a verifier that can spin forever in C (sympy) must run in a process it can
kill, as the ``math_verify`` reward does. Such a reward sets the attribute
``manages_timeout = True`` on its function: it is then called directly, with
exceptions still caught, and may report per-completion failures by returning
an ``Exception`` instance in place of a float.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from grpo_jax.config import ConfigError
from grpo_jax.rewards import registry

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One reward of the objective: registry ``name`` (options allowed) and its ``weight``."""

    name: str
    weight: float = 1.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"reward name must be a non-empty string, got {self.name!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"reward {self.name!r}: weight {w!r} must be a finite number")


@dataclasses.dataclass
class RewardResult:
    """Rewards of N completions.

    Attributes:
      total: float32[N], sum over the rewards of non-zero weight of
        weight_k * per_reward[k]; NaN where any of those is NaN (that
        completion then gets advantage 0). A reward of weight 0 is left out of
        the sum, so its failures never make the total NaN.
      per_reward: name -> float32[N], each reward unweighted.
      errors: name -> number of completions whose reward raised, timed out or
        was malformed (each also NaN in ``per_reward``), weight 0 included.
    """

    total: np.ndarray
    per_reward: dict[str, np.ndarray]
    errors: dict[str, int]

    def metrics(self, prefix: str = "rewards") -> dict[str, float]:
        """Scalars to log: mean (over scored completions), errors and unscored share."""
        out = {}
        items = list(self.per_reward.items()) + [("total", self.total)]
        for name, v in items:
            finite = np.isfinite(v)
            out[f"{prefix}/{name}/mean"] = float(v[finite].mean()) if finite.any() else math.nan
            out[f"{prefix}/{name}/unscored_frac"] = float(1.0 - finite.mean()) if v.size else 0.0
            if name in self.errors:
                out[f"{prefix}/{name}/errors"] = float(self.errors[name])
        return out


class _Call:
    """Runs fn(*args, **kwargs) in a daemon thread; ``wait(deadline)`` joins with a deadline."""

    def __init__(self, fn, /, *args, **kwargs):
        self.value = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, fn, args, kwargs):
        try:
            self.value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- any failure costs only this reward
            self.error = e

    def wait(self, deadline: float) -> bool:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


def _as_float(x) -> float | None:
    """A returned value as float (None -> NaN: cannot score); None if malformed."""
    if x is None:
        return math.nan
    if isinstance(x, BaseException) or isinstance(x, (str, bytes)):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _to_array(name: str, out, n: int) -> tuple[np.ndarray, int]:
    """Checks a batch output: ``n`` numbers -> (float32[n], malformed count)."""
    try:
        values = list(out)
    except TypeError:
        values = None
    if values is None or len(values) != n:
        got = f"{len(values)} values" if values is not None else f"{type(out).__name__}"
        log.warning("reward %r returned %s for %d completions; all set to NaN", name, got, n)
        return np.full(n, np.nan, np.float32), n
    floats = [_as_float(x) for x in values]
    bad = [i for i, f in enumerate(floats) if f is None]
    if bad:
        first = values[bad[0]]
        log.warning(
            "reward %r failed on %d of %d completions (first, #%d: %r)",
            name,
            len(bad),
            n,
            bad[0],
            first,
        )
    arr = np.array([math.nan if f is None else f for f in floats], np.float32)
    return arr, len(bad)


def _subset(seq_fields: Mapping[str, list], i: int) -> dict[str, list]:
    return {k: v[i : i + 1] for k, v in seq_fields.items()}


def _run_one_by_one(name, fn, prompts, completions, fields, timeout_s) -> tuple[np.ndarray, int]:
    n = len(completions)
    deadline = time.monotonic() + timeout_s
    calls = [
        _Call(fn, prompts[i : i + 1], completions[i : i + 1], **_subset(fields, i))
        for i in range(n)
    ]
    out = np.full(n, np.nan, np.float32)
    errors, first_error = 0, None
    for i, call in enumerate(calls):
        if not call.wait(deadline):
            errors += 1
            first_error = first_error or f"#{i} timed out after {timeout_s}s"
            continue
        if call.error is not None:
            errors += 1
            first_error = first_error or f"#{i} raised {call.error!r}"
            continue
        try:
            values = list(call.value)
        except TypeError:
            values = []
        v = _as_float(values[0]) if len(values) == 1 else None
        if v is None:
            errors += 1
            first_error = first_error or f"#{i} returned {call.value!r}"
        else:
            out[i] = v
    if errors:
        log.warning(
            "reward %r failed on %d of %d completions (first: %s)", name, errors, n, first_error
        )
    return out, errors


def run_reward(
    name: str,
    fn,
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, list],
    *,
    timeout_s: float = 10.0,
) -> tuple[np.ndarray, int]:
    """One reward on N completions -> (float32[N] with NaN where failed, error count)."""
    n = len(completions)
    prompts, completions = list(prompts), list(completions)
    if getattr(fn, "manages_timeout", False):
        try:
            out = fn(prompts, completions, **fields)
        except Exception as e:  # noqa: BLE001
            log.warning("reward %r raised %r; its %d completions set to NaN", name, e, n)
            return np.full(n, np.nan, np.float32), n
        return _to_array(name, out, n)

    call = _Call(fn, prompts, completions, **fields)
    if call.wait(time.monotonic() + timeout_s) and call.error is None:
        return _to_array(name, call.value, n)
    why = f"raised {call.error!r}" if call.error is not None else f"ran past {timeout_s}s"
    log.warning("reward %r %s on a batch of %d; re-scoring one by one", name, why, n)
    return _run_one_by_one(name, fn, prompts, completions, fields, timeout_s)


def score(
    specs: Sequence[RewardSpec],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, list] | None = None,
    *,
    timeout_s: float = 10.0,
    completion_lengths: Sequence[int] | None = None,
) -> RewardResult:
    """Scores N completions with each reward of ``specs`` and their weighted sum.

    Args:
      specs: the rewards and weights; names may carry options, "overlong(max_len=64)".
      prompts: N prompt strings (the prompt of each completion, repeated G times).
      completions: N completion strings.
      fields: dataset columns, each a list of N values aligned with completions.
      timeout_s: time budget of one reward on the batch (and again for its
        one-by-one re-scoring after a failure).
      completion_lengths: N token counts; passed to rewards as the
        ``completion_lengths`` field (the over-length penalty needs it).

    Returns:
      RewardResult with ``total = sum_{k: w_k != 0} w_k r_k`` (NaN where any
      r_k of non-zero weight is NaN; a weight-0 reward is scored and its
      errors counted, but it adds nothing to the total).
    """
    n = len(completions)
    fields = dict(fields or {})
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    if completion_lengths is not None:
        fields["completion_lengths"] = [int(x) for x in completion_lengths]
    for key, col in fields.items():
        if len(col) != n:
            raise ValueError(f"reward field {key!r} has {len(col)} values for {n} completions")
    if not specs:
        raise ConfigError("no rewards given: at least one RewardSpec is needed")
    names = [s.name for s in specs]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ConfigError(f"reward(s) {dup} listed more than once")
    fns = [registry.get(s.name) for s in specs]  # unknown names fail before any work

    total = np.zeros(n, np.float32)
    per_reward, errors = {}, {}
    for spec, fn in zip(specs, fns):
        values, n_err = run_reward(spec.name, fn, prompts, completions, fields, timeout_s=timeout_s)
        per_reward[spec.name] = values
        errors[spec.name] = n_err
        if spec.weight != 0:  # 0 * NaN is NaN: a weight-0 reward adds nothing, failed or not.
            total = total + np.float32(spec.weight) * values
    return RewardResult(total=total.astype(np.float32), per_reward=per_reward, errors=errors)


def fields_from_examples(
    examples: Sequence[Mapping], repeat: int = 1, *, exclude: Sequence[str] = ("prompt",)
) -> dict[str, list]:
    """Dataset columns of a batch as reward fields, each example repeated ``repeat`` times.

    With ``repeat = G`` the layout matches completions ordered prompt-major
    (the G completions of prompt b at rows b*G .. b*G+G-1). Columns missing
    from some examples are filled with None.
    """
    keys = sorted({k for ex in examples for k in ex if k not in exclude})
    return {k: [ex.get(k) for ex in examples for _ in range(repeat)] for k in keys}
