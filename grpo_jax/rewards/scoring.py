"""Scoring a rollout batch with several weighted rewards, robust to failures.

A reward that raises, runs past its time budget, returns something other than one number per
completion, or returns an infinite value never stops a run: the completions it affects get
NaN (advantage 0) and are counted in ``RewardResult.errors``; NaN returned by a reward is
"unscored", not an error; finite values beyond ``REWARD_LIMIT`` are clipped and counted. A
batch is one call, then one completion at a time if that call fails. docs/rewards.md,
"Scoring a batch, robust to failures", has the whole contract.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

import grpo_jax.rewards.isolation as isolation
import grpo_jax.rewards.registry as registry
from grpo_jax.core.errors import ConfigError

log = logging.getLogger(__name__)

REWARD_LIMIT = 1e6  # |reward| above this is clipped to it (and counted)


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
      errors: name -> number of completions whose reward raised, timed out,
        was malformed or infinite (each also NaN in ``per_reward``), weight 0
        included.
      clipped: name -> number of completions whose finite reward exceeded
        ``REWARD_LIMIT`` in magnitude and was clipped to +-``REWARD_LIMIT``.
    """

    total: np.ndarray
    per_reward: dict[str, np.ndarray]
    errors: dict[str, int]
    clipped: dict[str, int] = dataclasses.field(default_factory=dict)

    def metrics(self, prefix: str = "rewards") -> dict[str, float]:
        """Scalars to log: mean (over scored completions), errors, clipped, unscored share.

        ``<prefix>/total/unscored_frac`` is the share of completions with no
        usable total reward (advantage 0).
        """
        out = {}
        items = list(self.per_reward.items()) + [("total", self.total)]
        for name, v in items:
            finite = np.isfinite(v)
            out[f"{prefix}/{name}/mean"] = float(v[finite].mean()) if finite.any() else math.nan
            out[f"{prefix}/{name}/unscored_frac"] = float(1.0 - finite.mean()) if v.size else 0.0
            if name in self.errors:
                out[f"{prefix}/{name}/errors"] = float(self.errors[name])
            if name in self.clipped:
                out[f"{prefix}/{name}/clipped"] = float(self.clipped[name])
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
    """A returned value as float (None -> NaN: cannot score); None if malformed.

    An integer too large for a float becomes +-1e308 (clipped afterwards).
    """
    if x is None:
        return math.nan
    if isinstance(x, BaseException) or isinstance(x, (str, bytes)):
        return None
    try:
        return float(x)
    except OverflowError:
        try:
            return math.copysign(1e308, 1 if x > 0 else -1)
        except Exception:  # noqa: BLE001
            return None
    except (TypeError, ValueError):
        return None


def _to_array(name: str, out, n: int) -> tuple[np.ndarray, int]:
    """Checks a batch output: ``n`` numbers -> (float64[n], malformed count)."""
    try:
        values = list(out)
    except TypeError:
        values = None
    if values is None or len(values) != n:
        got = f"{len(values)} values" if values is not None else f"{type(out).__name__}"
        log.warning("reward %r returned %s for %d completions; all set to NaN", name, got, n)
        return np.full(n, np.nan), n
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
    arr = np.array([math.nan if f is None else f for f in floats], np.float64)
    return arr, len(bad)


def _subset(seq_fields: Mapping[str, list], i: int) -> dict[str, list]:
    return {k: v[i : i + 1] for k, v in seq_fields.items()}


def _row_value(value) -> float | None:
    """A one-completion call's output as a float; None if it is not one number."""
    try:
        values = list(value)
    except TypeError:
        values = []
    return _as_float(values[0]) if len(values) == 1 else None


def _run_one_by_one(name, fn, prompts, completions, fields, timeout_s) -> tuple[np.ndarray, int]:
    n = len(completions)
    deadline = time.monotonic() + timeout_s
    calls = [
        _Call(fn, prompts[i : i + 1], completions[i : i + 1], **_subset(fields, i))
        for i in range(n)
    ]
    out = np.full(n, np.nan)
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
        v = _row_value(call.value)
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


def _private_fields(fields: Mapping[str, list]) -> dict[str, list]:
    """A copy of the fields that a reward may change freely (deep where possible)."""
    try:
        return copy.deepcopy(dict(fields))
    except Exception:  # noqa: BLE001 -- an uncopyable value: fresh lists at least
        return {k: list(v) for k, v in fields.items()}


def _run_in_process(name, fn, prompts, completions, fields, timeout_s) -> tuple[np.ndarray, int]:
    n = len(completions)
    prompts, completions = list(prompts), list(completions)
    fields = _private_fields(fields)
    if getattr(fn, "manages_timeout", False):
        try:
            out = fn(prompts, completions, **fields)
        except Exception as e:  # noqa: BLE001
            log.warning("reward %r raised %r; its %d completions set to NaN", name, e, n)
            return np.full(n, np.nan), n
        return _to_array(name, out, n)

    call = _Call(fn, prompts, completions, **fields)
    if call.wait(time.monotonic() + timeout_s) and call.error is None:
        return _to_array(name, call.value, n)
    why = f"raised {call.error!r}" if call.error is not None else f"ran past {timeout_s}s"
    log.warning("reward %r %s on a batch of %d; re-scoring one by one", name, why, n)
    return _run_one_by_one(name, fn, prompts, completions, fields, timeout_s)


def _describe(reply: isolation.Reply, timeout_s: float) -> str:
    if reply.kind == "raised":
        return f"raised {reply.value!r}"
    if reply.kind == "timeout":
        return f"ran past {timeout_s}s (worker killed)"
    if reply.kind == "died":
        return "ended its worker process"
    if reply.kind == "malformed":
        return f"returned a {reply.value} that cannot be sent back"
    if reply.kind == "skipped":
        return "was not tried: too many completions hung"
    return f"returned {reply.value!r}"


def _run_in_worker(name, prompts, completions, fields, timeout_s) -> tuple[np.ndarray, int]:
    """The two steps of the module docstring in worker processes; raises isolation.Unavailable."""
    n = len(completions)
    prompts, completions, fields = list(prompts), list(completions), dict(fields)
    reply = isolation.call_batch(name, prompts, completions, fields, timeout_s=timeout_s)
    if reply.kind == "ok":
        return _to_array(name, reply.value, n)
    if reply.kind == "malformed" or n == 1:
        log.warning("reward %r %s on %d completion(s)", name, _describe(reply, timeout_s), n)
        return np.full(n, np.nan), n
    why = _describe(reply, timeout_s)
    log.warning("reward %r %s on a batch of %d; re-scoring one by one", name, why, n)
    replies = isolation.call_rows(name, prompts, completions, fields, timeout_s=timeout_s)
    out = np.full(n, np.nan)
    errors, first_error = 0, None
    for i, r in enumerate(replies):
        v = _row_value(r.value) if r.kind == "ok" else None
        if v is None:
            errors += 1
            first_error = first_error or f"#{i} {_describe(r, timeout_s)}"
        else:
            out[i] = v
    if errors:
        log.warning(
            "reward %r failed on %d of %d completions (first: %s)", name, errors, n, first_error
        )
    skipped = sum(r.kind == "skipped" for r in replies)
    if skipped:
        lost = sum(r.kind in ("timeout", "died") for r in replies)
        log.warning(
            "reward %r: %d completions not tried: too many completions hung "
            "(%d cost their worker); all counted as errors",
            name,
            skipped,
            lost,
        )
    return out, errors


def limit_rewards(name: str, values: np.ndarray, errors: int) -> tuple[np.ndarray, int, int]:
    """-> (float32 values, errors, clipped): infinite -> NaN and an error, huge -> clipped.

    Every reward of a rollout passes here, a reward function's and an episode's
    (``grpo_jax.rollout.episodes``) alike, so that none is infinite in float32.
    """
    values = np.array(values, np.float64)
    inf = np.isinf(values)
    if inf.any():
        log.warning(
            "reward %r returned an infinite value for %d completion(s); set to NaN",
            name,
            int(inf.sum()),
        )
        values[inf] = np.nan
    big = np.abs(np.nan_to_num(values)) > REWARD_LIMIT
    if big.any():
        log.warning(
            "reward %r returned %d value(s) beyond +-%g (largest %g); clipped",
            name,
            int(big.sum()),
            REWARD_LIMIT,
            float(np.abs(values[big]).max()),
        )
        values[big] = np.clip(values[big], -REWARD_LIMIT, REWARD_LIMIT)
    return values.astype(np.float32), errors + int(inf.sum()), int(big.sum())


def _run(name, fn, prompts, completions, fields, timeout_s) -> tuple[np.ndarray, int]:
    why = isolation.why_in_process(name)
    if why is None:
        try:
            return _run_in_worker(name, prompts, completions, fields, timeout_s)
        except isolation.Unavailable as e:
            why = str(e)
    if why not in ("built-in", "workers=0"):
        isolation.warn_in_process(name, why)
    return _run_in_process(name, fn, prompts, completions, fields, timeout_s)


def run_reward(
    name: str,
    fn,
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, list],
    *,
    timeout_s: float = 10.0,
) -> tuple[np.ndarray, int]:
    """One reward function on N completions, in this process -> (float32[N], error count).

    NaN where it failed; infinite values count as errors, finite ones beyond
    ``REWARD_LIMIT`` are clipped. :func:`score` runs user rewards in worker
    processes instead.
    """
    values, errors = _run_in_process(name, fn, prompts, completions, fields, timeout_s)
    values, errors, _ = limit_rewards(name, values, errors)
    return values, errors


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
        Never modified: each reward gets its own copy.
      timeout_s: time budget of one reward on the batch, and again of each
        completion (in a worker) or of all of them together (in this
        process) when a failure makes it re-score them one by one.
      completion_lengths: N token counts; passed to rewards as the
        ``completion_lengths`` field (the over-length penalty needs it).

    Returns:
      RewardResult with ``total = sum_{k: w_k != 0} w_k r_k`` (NaN where any
      r_k of non-zero weight is NaN; a weight-0 reward is scored and its
      errors counted, but it adds nothing to the total); every r_k within
      +-``REWARD_LIMIT``.
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
    per_reward, errors, clipped = {}, {}, {}
    for spec, fn in zip(specs, fns):
        values, n_err = _run(spec.name, fn, prompts, completions, fields, timeout_s)
        values, n_err, n_clip = limit_rewards(spec.name, values, n_err)
        per_reward[spec.name] = values
        errors[spec.name] = n_err
        clipped[spec.name] = n_clip
        if spec.weight != 0:  # 0 * NaN is NaN: a weight-0 reward adds nothing, failed or not.
            total = total + np.float32(spec.weight) * values
    return RewardResult(
        total=total.astype(np.float32), per_reward=per_reward, errors=errors, clipped=clipped
    )


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
