"""Rollout statistics of a step: duplicates, rewards, pass rate, lengths."""

import numpy as np
import pytest

from grpo_jax.rollout import stats as metrics


def test_duplicate_fraction():
    assert metrics.duplicate_fraction(["a", "b", "a", "a"], 2) == pytest.approx(1 / 4)
    assert metrics.duplicate_fraction(["x"] * 4, 4) == pytest.approx(3 / 4)
    assert metrics.duplicate_fraction(["a", "b", "c", "d"], 2) == 0.0
    with pytest.raises(ValueError, match="whole groups of G=2"):
        metrics.duplicate_fraction(["a", "b", "c"], 2)
    # Only repeats within a group count, each after its first occurrence.
    flags = metrics.duplicate_flags(["a", "b", "a", "a", "b", "a"], 3)
    assert flags.tolist() == [False, False, True, False, False, True]


def test_rollout_metrics_values():
    total = np.array([1.1, 0.1, 0.1, 0.1, np.nan, 1.1, 1.1, 0.0])
    out = metrics.rollout_metrics(
        total_N=total,
        per_reward={"exact_match": np.array([1, 0, 0, 0, 0, 1, 1, 0.0])},
        errors={"exact_match": 1},
        correct_N=np.array([1, 0, 0, 0, 0, 1, 1, 0], bool),
        lengths_N=np.array([3, 4, 5, 6, 7, 8, 9, 10]),
        truncated_N=np.array([0, 0, 0, 0, 0, 0, 1, 1], bool),
        duplicate_N=metrics.duplicate_flags(["a", "b", "b", "b", "c", "d", "d", "d"], 4),
        G=4,
        invalid_N=np.array([0, 0, 0, 1, 0, 0, 0, 0], bool),
    )
    finite = total[np.isfinite(total)]
    assert out["rewards/mean"] == pytest.approx(finite.mean())
    assert out["rewards/std"] == pytest.approx(finite.std())
    assert out["rewards/exact_match/mean"] == pytest.approx(3 / 8)
    assert out["rewards/exact_match/errors"] == 1.0
    assert out["rollout/pass_rate"] == pytest.approx(3 / 8)
    assert out["rollout/length_mean"] == pytest.approx(6.5)
    assert out["rollout/length_max"] == 10
    assert out["rollout/truncated_frac"] == pytest.approx(0.25)
    assert out["rollout/invalid_format_frac"] == pytest.approx(1 / 8)
    assert out["rollout/duplicate_frac"] == pytest.approx(4 / 8)
    v0 = np.var([1.1, 0.1, 0.1, 0.1])
    v1 = np.var([1.1, 1.1, 0.0])
    assert out["rollout/group_reward_var"] == pytest.approx((v0 + v1) / 2)
    assert out["rollout/frac_zero_var_groups"] == 0.0
