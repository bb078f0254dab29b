"""Bin packing on the host (grpo_jax.core.packing): first fit decreasing and balanced bins."""

import numpy as np
import pytest

from grpo_jax.core.packing import balance, first_fit_decreasing, next_power_of_two, round_up


def test_first_fit_decreasing_fills_bins_within_capacity_and_places_every_item():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 60).tolist()
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(60))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # Within 11/9 of the lower bound plus one (and not one item a bin).
    assert len(bins) <= 11 / 9 * np.ceil(sum(lengths) / 64) + 1 < len(lengths)
    assert first_fit_decreasing(lengths, 64) == bins  # a function of the lengths alone
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([65], 64)


def test_balance_evens_the_bins_totals_and_respects_their_room():
    sizes = [9, 8, 7, 6, 5, 4, 3, 2, 1, 1]
    bins = balance(sizes, 4, 3)
    assert sorted(i for b in bins for i in b) == list(range(10))
    assert all(len(b) <= 3 for b in bins)
    totals = [sum(sizes[i] for i in b) for b in bins]
    assert max(totals) - min(totals) <= 1  # 46 over 4 bins: 11 or 12 each
    with pytest.raises(ValueError, match="do not fit"):
        balance(sizes, 3, 3)


def test_rounding():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 8, 9)] == [1, 1, 2, 4, 8, 16]
    assert [round_up(n, 8) for n in (0, 1, 8, 9)] == [0, 8, 8, 16]
