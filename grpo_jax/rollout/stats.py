"""Rollout statistics: rewards, pass rate, lengths, duplicates and unscored shares of a step.

Host-side numpy over what the trainer already fetched. Shapes: B prompts, G completions
per prompt, N = B*G rows grouped contiguously (rows b*G .. b*G+G-1 belong to prompt b).
Metric keys are slash-separated (``rewards/mean``, ``rollout/pass_rate``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


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
